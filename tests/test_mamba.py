"""Mamba: parity with transformers on a small random checkpoint, the selective scan against a naive
token-by-token recurrence, and the state-space cache layers (MambaCache, SSMLayer).

transformers builds and saves the checkpoint (its constant-initialised parameters randomised);
kvgen loads the folder. Logits must match within 1e-4 (float32) with and without padding, cached
decoding must equal an uncached forward over the whole sequence, and greedy ids (dynamic, static
and mamba caches) and beam-search ids must equal transformers'.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

import kvgen
from kvgen import DynamicCache, MambaCache, StaticCache
from kvgen.cache.ssm import SSMLayer
from kvgen.kernels import kernels_available, unavailable_reason
from kvgen.models.selective_scan import selective_ssm

ATOL = 1e-4
VOCAB = 128
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, state_size=8, expand=2, conv_kernel=4,
              pad_token_id=0, eos_token_id=0, bos_token_id=0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These tiny models gain nothing from threads; on a shared host each parallel op can wait for a busy core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.MambaForCausalLM(transformers.MambaConfig(**CONFIG)).eval()
    randomise_constant_parameters(hf)
    folder = tmp_path_factory.mktemp("mamba")
    hf.save_pretrained(folder)
    return hf, kvgen.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), folder


@torch.no_grad()
def randomise_constant_parameters(model):
    """transformers starts norms at 1, conv biases at 0, D at 1 and A the same in every channel, which would
    hide a mistake (e.g. padding that leaks through a zero conv bias): give them random values."""
    for name, param in model.named_parameters():
        if "norm" in name or name.endswith(".D"):
            param.normal_(1.0, 0.3)
        elif "conv1d.bias" in name:
            param.normal_(0.0, 0.5)
        elif name.endswith("A_log"):
            param.add_(0.3 * torch.randn_like(param))


def tokens(seed, batch, length):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def left_padded_batch(seed=1, length=12):
    ids = tokens(seed, 3, length)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


# -- the scan --------------------------------------------------------------------------------------------


def naive_ssm(state, x, dt, z, A, B, C, D, dt_bias):
    """The recurrence token by token, as the Mamba paper writes it."""
    ys = []
    for t in range(x.shape[1]):
        step = F.softplus(dt[:, t] + dt_bias)  # (B, D)
        state = state * torch.exp(step[..., None] * A) + (step * x[:, t])[..., None] * B[:, t, None, :]
        ys.append(((state * C[:, t, None, :]).sum(-1) + D * x[:, t]) * F.silu(z[:, t]))
    return torch.stack(ys, 1), state


@pytest.mark.parametrize("native", [False, True], ids=["blocked", "c++"])
@pytest.mark.parametrize("length,n", [(1, 4), (5, 4), (70, 16), (300, 19)])
@torch.no_grad()
def test_scan_matches_token_by_token_recurrence(native, length, n, monkeypatch):
    """Both scans of a prompt (and a decode step's) against the recurrence in float64: 24 channels (the C++ scan's
    runs of a register's channels: three of 8 with AVX2, 16 and a padded 8 with AVX-512), 4, 16 and 19 states."""
    from kvgen.models import native as fused_ops

    if not native:  # the scan takes kvgen's C++ op where native._native says the kernels apply
        monkeypatch.setattr(fused_ops, "kernels_available", lambda: False)
    elif not kernels_available():  # only where there is no compiler: a build error in kvgen's source fails
        assert "no C++ compiler" in unavailable_reason(), unavailable_reason()
        pytest.skip("no C++ compiler to build kvgen's kernels")
    g = torch.Generator().manual_seed(length)
    batch, d = 2, 24
    A = -torch.exp(torch.randn(d, n, generator=g)) * 3
    dt = torch.randn(batch, length, d, generator=g) - 1
    if length > 100:  # steps that wipe the state (decay e^-100 and more) and steps that keep it
        dt[0, 100, :] = 60.0
        dt[1, 10:40, :] = -30.0
    x, z = torch.randn(batch, length, d, generator=g), torch.randn(batch, length, d, generator=g)
    B, C = torch.randn(batch, length, n, generator=g), torch.randn(batch, length, n, generator=g)
    D, dt_bias = torch.randn(d, generator=g), 0.1 * torch.randn(d, generator=g)
    h0 = torch.randn(batch, d, n, generator=g)
    want_y, want_h = naive_ssm(*(v.double() for v in (h0, x, dt, z, A, B, C, D, dt_bias)))
    y, h = selective_ssm(x, dt, A, B, C, D, z, dt_bias, h0)
    scale = want_y.abs().max()
    torch.testing.assert_close(y.double(), want_y, atol=1e-6 * scale, rtol=0)
    torch.testing.assert_close(h.double(), want_h, atol=1e-5, rtol=1e-5)


# -- parity with transformers ---------------------------------------------------------------------------


def test_checkpoint_loads_as_mamba(pair):
    _, ours, _ = pair
    assert type(ours) is kvgen.MambaForCausalLM
    assert ours.config.layer_types == ["mamba"] * 3
    assert ours.lm_head.weight is ours.backbone.embeddings.weight  # tied, as the config says


@torch.no_grad()
def check_left_padded_logits(hf, ours, length):
    """Uncached logits of a left-padded batch equal transformers' on the real tokens; returns (ids, logits)."""
    ids, mask = left_padded_batch(length=length)
    ref = hf(ids, attention_mask=mask, use_cache=False).logits
    got = ours(ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], atol=ATOL, rtol=0)
    return ids, got


def check_greedy_generate(hf, ours, cache_implementation, seed):
    ids, mask = left_padded_batch(seed=seed, length=8)
    kwargs = dict(attention_mask=mask, max_new_tokens=15, do_sample=False, pad_token_id=0, eos_token_id=None)
    ref = hf.generate(ids, **kwargs)
    got = ours.generate(ids, cache_implementation=cache_implementation, disable_compile=True, **kwargs)
    assert torch.equal(got, ref)


def check_beam_search(hf, ours):
    """Beams reorder the cache every step: its SSM states must follow their rows."""
    ids = tokens(11, 2, 7)
    for extra in ({"num_beams": 3}, {"num_beams": 2, "num_return_sequences": 2}):
        kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0, **extra)
        assert torch.equal(ours.generate(ids, disable_compile=True, **kwargs), hf.generate(ids, **kwargs))


@torch.no_grad()
def check_reorder_repeat_and_deepcopy(ours, ids):
    """Cache rows swapped, repeated and deep-copied after 11 of ``ids``' 12 tokens (B=2): the next logits
    equal an uncached forward. Returns the copied-from cache (12 tokens) and the uncached logits."""
    full = ours(ids, use_cache=False).logits

    def next_logits(cache, new, position):
        return ours(new, past_key_values=cache, cache_position=torch.tensor([position])).logits[:, 0]

    cache = ours(ids[:, :11]).past_key_values
    cache.reorder_cache(torch.tensor([1, 0]))  # beams swap: every state follows its row
    torch.testing.assert_close(next_logits(cache, ids.flip(0)[:, 11:], 11), full.flip(0)[:, 11], atol=ATOL, rtol=0)

    cache = ours(ids[:1, :11]).past_key_values
    cache.batch_repeat_interleave(2)
    torch.testing.assert_close(next_logits(cache, ids[[0, 0], 11:], 11), full[[0, 0], 11], atol=ATOL, rtol=0)

    cache = ours(ids[:, :11]).past_key_values
    snapshot = copy.deepcopy(cache)
    next_logits(cache, ids[:, 11:], 11)
    assert (cache.get_seq_length(), snapshot.get_seq_length()) == (12, 11)
    torch.testing.assert_close(next_logits(snapshot, ids[:, 11:], 11), full[:, 11], atol=ATOL, rtol=0)
    return cache, full


@torch.no_grad()
def test_logits_match_transformers_with_left_padding(pair):
    hf, ours, _ = pair
    ids, got = check_left_padded_logits(hf, ours, length=40)
    # padding is zeroed in the mixers: the padded rows equal the same tokens alone, unpadded
    alone = ours(ids[:1, 4:]).logits
    torch.testing.assert_close(got[0, 4:], alone[0], atol=ATOL, rtol=0)


@torch.no_grad()
def test_long_prompt_matches_transformers(pair):
    hf, ours, _ = pair
    ids = tokens(5, 1, 200)  # kvgen's C++ scan (batch 1; Jamba's: 2)
    torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=ATOL, rtol=0)


@torch.no_grad()
def test_cached_decoding_equals_one_uncached_forward(pair):
    hf, ours, _ = pair
    ids = tokens(2, 2, 36)
    full = ours(ids, use_cache=False).logits
    torch.testing.assert_close(full, hf(ids, use_cache=False).logits, atol=ATOL, rtol=0)
    out = ours(ids[:, :20])
    cache = out.past_key_values
    assert cache.get_seq_length() == 20
    torch.testing.assert_close(out.logits, full[:, :20], atol=ATOL, rtol=0)
    for t in range(20, 30):  # one token at a time
        step = ours(ids[:, t:t + 1], past_key_values=cache, cache_position=torch.tensor([t])).logits
        torch.testing.assert_close(step[:, 0], full[:, t], atol=ATOL, rtol=0, msg=f"token {t}")
    # several tokens at once continue from the state too (transformers restarts its scan from zero here)
    more = ours(ids[:, 30:], past_key_values=cache, cache_position=torch.arange(30, 36)).logits
    torch.testing.assert_close(more, full[:, 30:], atol=ATOL, rtol=0)
    assert cache.get_seq_length() == 36


@torch.no_grad()
def test_states_match_transformers_cache(pair):
    hf, ours, _ = pair
    ids = tokens(3, 2, 17)
    ref = hf(ids, use_cache=True).cache_params
    got = ours(ids).past_key_values
    for i in range(3):
        conv, ssm = got.read_ssm_states(i)
        torch.testing.assert_close(conv, ref.layers[i].conv_states[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(ssm, ref.layers[i].recurrent_states[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static", "mamba"])
def test_greedy_generate_left_padded_equals_transformers(pair, cache_implementation):
    check_greedy_generate(*pair[:2], cache_implementation, seed=3)


def test_generate_returns_the_filled_state_cache(pair):
    _, ours, _ = pair
    ids = tokens(4, 1, 6)
    out = ours.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None, return_dict_in_generate=True)
    cache = out.past_key_values
    assert all(isinstance(layer, SSMLayer) for layer in cache.layers)
    assert cache.get_seq_length() == 10  # the last new token is not fed
    with pytest.raises(TypeError, match="legacy"):
        ours.generate(ids, max_new_tokens=2, return_dict_in_generate=True, return_legacy_cache=True)


def test_beam_search_equals_transformers(pair):
    check_beam_search(*pair[:2])


# -- the cache ------------------------------------------------------------------------------------------


@torch.no_grad()
def test_mamba_cache_by_hand(pair):
    hf, ours, _ = pair
    ids = tokens(6, 2, 10)
    cache = MambaCache(ours.config, batch_size=2, dtype=torch.float32, device="cpu")
    d_inner = 2 * CONFIG["hidden_size"]
    assert [tuple(s.shape) for s in cache.conv_states] == [(2, d_inner, 4)] * 3
    assert [tuple(s.shape) for s in cache.ssm_states] == [(2, d_inner, 8)] * 3
    buffer = cache.ssm_states[0]
    out = ours(ids, cache_params=cache)  # transformers' name for the argument and the output
    assert out.cache_params is cache and cache.get_seq_length() == 10
    assert cache.ssm_states[0] is buffer  # written in place
    torch.testing.assert_close(out.logits, hf(ids).logits, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="cache_position"):  # a filled cache needs cache_position
        ours(ids[:, :1], past_key_values=cache)
    with pytest.raises(ValueError, match="can only move forward"):
        ours(ids[:, :1], past_key_values=cache, cache_position=torch.tensor([4]))
    with pytest.raises(ValueError, match="batch size 1"):
        ours(ids[:1], past_key_values=MambaCache(ours.config, batch_size=2, dtype=torch.float32))


@torch.no_grad()
def test_reorder_repeat_reset_crop_and_deepcopy(pair):
    _, ours, _ = pair
    ids = tokens(7, 2, 12)
    cache, full = check_reorder_repeat_and_deepcopy(ours, ids)
    cache.crop(12)  # its own length: nothing to undo
    with pytest.raises(ValueError, match="cannot crop a state-space"):
        cache.crop(5)
    with pytest.raises(ValueError, match="cannot crop a state-space"):
        cache.crop(-1)
    assert cache.get_seq_length() == 12
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.read_ssm_states(0) == (None, None)
    torch.testing.assert_close(ours(ids, past_key_values=cache).logits, full, atol=ATOL, rtol=0)


def test_caches_from_config_hold_ssm_layers(pair):
    _, ours, _ = pair
    assert all(isinstance(layer, SSMLayer) for layer in DynamicCache(config=ours.config).layers)
    static = StaticCache(config=ours.config, max_batch_size=2, max_cache_len=16, dtype=torch.float32)
    assert all(isinstance(layer, SSMLayer) for layer in static.layers)
    assert tuple(static.ssm_states[2].shape) == (2, 128, 8)
    assert not static.is_compileable  # SSM layers run eagerly


def test_clear_errors(pair):
    _, ours, _ = pair
    ids = tokens(8, 1, 4)
    with pytest.raises(TypeError, match="config=model.config"):  # a cache without the config has no SSM layers
        ours(ids, past_key_values=DynamicCache())
    jamba = kvgen.PretrainedConfig(model_type="jamba", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                   attn_layer_period=2, attn_layer_offset=1)
    with pytest.raises(ValueError, match="HybridMambaAttentionDynamicCache"):
        MambaCache(jamba, batch_size=1, dtype=torch.float32)
    with pytest.raises(ValueError, match="not both"):
        ours(ids, past_key_values=DynamicCache(config=ours.config), cache_params=DynamicCache(config=ours.config))


@torch.no_grad()
def test_original_embedding_name_loads(pair, tmp_path):
    """state-spaces checkpoints name the embeddings ``backbone.embedding``; transformers renames them on load."""
    hf, _, folder = pair
    tensors = load_file(folder / "model.safetensors")
    tensors["backbone.embedding.weight"] = tensors.pop("backbone.embeddings.weight")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    ours = kvgen.AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = tokens(9, 1, 6)
    torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=ATOL, rtol=0)


def test_generate_continues_a_filled_cache(pair):
    """A cache filled by forward() is continued by generate(); one that saw the whole prompt is refilled."""
    hf, ours, _ = pair
    ids = tokens(10, 1, 9)
    kwargs = dict(max_new_tokens=6, do_sample=False, eos_token_id=None)
    ref = hf.generate(ids, **kwargs)
    cache = DynamicCache(config=ours.config)
    with torch.no_grad():
        ours(ids[:, :5], past_key_values=cache)
    assert torch.equal(ours.generate(ids, past_key_values=cache, **kwargs), ref)
    cache = DynamicCache(config=ours.config)
    with torch.no_grad():
        ours(ids, past_key_values=cache)
    assert torch.equal(ours.generate(ids, past_key_values=cache, **kwargs), ref)
