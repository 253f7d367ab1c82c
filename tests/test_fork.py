"""Copy-free prefix forks: ``cache.fork(n)`` and shared prompt rows in ``generate()``.

Each fork must behave exactly like a ``copy.deepcopy`` of the cache (same logits, bit for
bit), while the prefix is stored once: the memory of n forks is measured as the distinct
storage behind all their tensors.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import kvgen
from kvgen import DynamicCache, SinkCache, StaticCache
from kvgen.cache.fork import ForkedLayer, unique_nbytes


@pytest.fixture(autouse=True)
def eager_decode(monkeypatch):
    monkeypatch.setenv("KVGEN_DISABLE_COMPILE", "1")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    folder = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return kvgen.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def filled(model, kind, prompt, max_cache_len=256):
    cache = DynamicCache() if kind == "dynamic" else StaticCache(config=model.config, max_cache_len=max_cache_len)
    model(prompt, past_key_values=cache)
    return cache


def continue_with(model, cache, tokens):
    """Feed ``tokens`` (T,) one at a time; return the logits of each step."""
    out = []
    for token in tokens.tolist():
        out.append(model(torch.tensor([[token]]), past_key_values=cache).logits[0, -1])
    return torch.stack(out)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_each_fork_equals_a_deepcopy(model, kind):
    prompt = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    cache = filled(model, kind, prompt)
    copies = [copy.deepcopy(cache) for _ in range(3)]
    forks = cache.fork(3)
    for i, (fork, twin) in enumerate(zip(forks, copies)):
        tokens = torch.randint(0, 96, (6,), generator=torch.Generator().manual_seed(10 + i))
        assert torch.equal(continue_with(model, fork, tokens), continue_with(model, twin, tokens))
        assert fork.get_seq_length() == 46
    assert cache.get_seq_length() == 40  # the original is untouched by its forks, and still usable
    tokens = torch.tensor([5, 6])
    fresh = filled(model, kind, prompt)
    assert torch.equal(continue_with(model, cache, tokens), continue_with(model, fresh, tokens))


def test_forks_share_the_prefix_storage(model):
    """The issue's shape: 8 forks of a 2,048-token prefix, 32 new tokens each, at most 1.2x one cache's memory."""
    prompt = torch.randint(0, 96, (1, 2048), generator=torch.Generator().manual_seed(1))
    single = filled(model, "dynamic", prompt)
    copies = [copy.deepcopy(single) for _ in range(8)]
    forks = single.fork(8)
    for i, (fork, twin) in enumerate(zip(forks, copies)):
        tokens = torch.randint(0, 96, (32,), generator=torch.Generator().manual_seed(i))
        continue_with(model, fork, tokens)
        continue_with(model, twin, tokens)
    one = copies[0]  # a single cache that went on for 32 tokens
    assert unique_nbytes(*forks) <= 1.2 * unique_nbytes(one)
    assert unique_nbytes(*copies) >= 8 * unique_nbytes(one)
    first = forks[0].layers[0]
    assert isinstance(first, ForkedLayer) and all(f.layers[0].prefix_keys is first.prefix_keys for f in forks)


def test_a_fork_that_crops_into_the_prefix_only_shortens_its_own_view(model):
    prompt = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(2))
    cache = filled(model, "dynamic", prompt)
    a, b = cache.fork(2)
    a.crop(20)
    tokens = torch.randint(0, 96, (5,), generator=torch.Generator().manual_seed(3))
    # the reference is a deep copy cropped the same way: it holds the very keys and values of the 30-token
    # prefill, so equality holds by construction (a fresh 20-token prefill runs a matmul of another shape,
    # whose rounding depends on the CPU's kernels)
    short = copy.deepcopy(cache)
    short.crop(20)
    from_fork = continue_with(model, a, tokens)
    assert torch.equal(from_fork, continue_with(model, short, tokens))
    fresh = filled(model, "dynamic", prompt[:, :20])  # and it is the cache of the shorter prompt, up to rounding
    torch.testing.assert_close(from_fork, continue_with(model, fresh, tokens), rtol=1e-5, atol=1e-5)
    assert b.get_seq_length() == 30
    assert torch.equal(continue_with(model, b, tokens), continue_with(model, filled(model, "dynamic", prompt), tokens))


def test_writing_into_the_shared_prefix_raises(model):
    prompt = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(4))
    (fork,) = filled(model, "dynamic", prompt).fork(1)
    with pytest.raises(ValueError, match="shared prefix .* read-only: crop"):
        model(torch.tensor([[1]]), past_key_values=fork, cache_position=torch.tensor([5]))


def test_unforkable_caches_raise_clear_errors(model):
    prompt = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(5))
    sink = SinkCache(window_length=8, num_sink_tokens=2)
    model(prompt, past_key_values=sink)
    with pytest.raises(ValueError, match="SinkLayer cannot share its tokens.*deepcopy"):
        sink.fork(2)
    with pytest.raises(ValueError, match="empty cache has nothing to share"):
        DynamicCache().fork(2)


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_generate_shares_the_prompt_between_beams_and_returned_sequences(model, cache_implementation):
    prompt = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(6))
    out = model.generate(prompt, max_new_tokens=6, num_beams=4, num_return_sequences=2,
                         cache_implementation=cache_implementation, return_dict_in_generate=True)
    layer = out.past_key_values.layers[0]
    assert isinstance(layer, ForkedLayer) and layer.prefix_keys.shape[0] == 2  # one stored row per prompt
    torch.manual_seed(0)
    sampled = model.generate(prompt, max_new_tokens=6, do_sample=True, num_return_sequences=3,
                             cache_implementation=cache_implementation, return_dict_in_generate=True)
    assert sampled.past_key_values.layers[0].prefix_keys.shape[0] == 2 and sampled.sequences.shape[0] == 6
