"""SlidingWindowLayer (ring buffer), SlidingWindowCache and HybridCache.

Unit tests on synthetic tensors (keys hold their own absolute position, so what a layer
returns can be read back), a differential test of ring + mask against full attention with
the window mask, and parity with transformers on random Mistral and mixed-layer Qwen2
checkpoints, eager and compiled.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers

import kvgen
from kvgen import DynamicCache, HybridCache, SlidingWindowCache, SlidingWindowLayer
from kvgen.cache import create_cache
from kvgen.cache.dynamic import DynamicLayer, DynamicSlidingWindowLayer
from kvgen.cache.static import StaticLayer
from kvgen.config import PretrainedConfig
from kvgen.masks import attention_mask
from test_parity import ATOL, left_padded_batch, positions

B, H, D = 2, 2, 8
MISTRAL = PretrainedConfig(model_type="mistral", hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                           num_hidden_layers=2, vocab_size=50, intermediate_size=64, sliding_window=4)
# Gemma-like: layer 0 is a sliding layer (the reference read its length and got it wrong)
MIXED = PretrainedConfig(model_type="llama", hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=4, vocab_size=50, intermediate_size=64, sliding_window=4,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
LLAMA = PretrainedConfig(model_type="llama", hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                         vocab_size=50, intermediate_size=64)


def kv(t, start=0, batch=B):
    """Keys whose every entry is its absolute position (+1000 per batch row), values their negative."""
    pos = torch.arange(start, start + t, dtype=torch.float32).view(1, 1, t, 1)
    k = pos.expand(batch, H, t, D).clone() + torch.arange(batch).view(batch, 1, 1, 1) * 1000
    return k, -k


def feed(layer, start, t):
    """key_positions, then update, as a model does; checks that the two agree. Returns the positions."""
    cache_position = torch.arange(start, start + t)
    layer.check_cache_position(cache_position)
    predicted = layer.key_positions(cache_position)
    keys, values = layer.update(*kv(t, start), cache_position)
    filled = predicted >= 0
    assert keys.shape[2] == predicted.shape[0]
    assert keys[0, 0, filled, 0].tolist() == predicted[filled].tolist()  # each slot holds what it claims
    assert values[1, 1, filled, 0].tolist() == (-(predicted[filled] + 1000)).tolist()
    return predicted


# -- the ring buffer ----------------------------------------------------------------------------------

def test_ring_wraps_around_and_keeps_the_window():
    layer = SlidingWindowLayer(4)
    for t in range(11):
        positions = feed(layer, t, 1)
        assert sorted(positions[positions >= 0].tolist()) == list(range(max(t - 3, 0), t + 1))
        assert layer.get_seq_length() == t + 1
    assert layer._k.shape[2] == 4 and layer.get_max_cache_shape() == 4
    assert layer._pos.tolist() == [8, 9, 10, 7]  # position p lives in slot p % 4
    assert layer.keys[0, 0, :, 0].tolist() == [7, 8, 9, 10]  # the property is oldest first
    assert layer.values[0, 0, :, 0].tolist() == [-7, -8, -9, -10]
    keys, _ = layer.update(*kv(1, 11), torch.tensor([11]))
    assert keys.data_ptr() == layer._k.data_ptr()  # a decode step returns the ring itself, no copy


def test_prompt_longer_than_window_attends_to_all_of_itself_then_keeps_the_window():
    layer = SlidingWindowLayer(4)
    assert feed(layer, 0, 10).tolist() == list(range(10))  # the mask applies the window within the prompt
    assert layer.keys[0, 0, :, 0].tolist() == [6, 7, 8, 9]
    assert sorted(feed(layer, 10, 1).tolist()) == [7, 8, 9, 10]


def test_chunk_that_wraps_returns_old_slots_and_the_whole_chunk():
    layer = SlidingWindowLayer(4)
    feed(layer, 0, 2)
    assert feed(layer, 2, 5).tolist() == [0, 1, 2, 3, 4, 5, 6]  # position 2 still needs 0 and 1
    assert layer.keys[0, 0, :, 0].tolist() == [3, 4, 5, 6]
    assert feed(layer, 7, 3).tolist() == [4, 5, 6, 3, 7, 8, 9]  # slot order, then the chunk
    assert layer.keys[0, 0, :, 0].tolist() == [6, 7, 8, 9]


def test_chunk_that_fits_is_written_in_place():
    layer = SlidingWindowLayer(8)
    feed(layer, 0, 2)
    keys, _ = layer.update(*kv(3, 2), torch.arange(2, 5))
    assert keys.data_ptr() == layer._k.data_ptr() and keys.shape[2] == 5  # a view, no copy


@pytest.mark.parametrize("window", [1, 3, 5])
def test_ring_and_mask_equal_full_attention_with_window_mask(window):
    """Any chunk schedule: attention over what the ring returns == attention over the whole sequence."""
    g = torch.Generator().manual_seed(window)
    total = 23
    q_all, k_all, v_all = (torch.randn(B, H, total, D, generator=g) for _ in range(3))
    padding = torch.ones(B, total, dtype=torch.long)
    padding[0, :3] = 0  # left padding on row 0
    ref_mask, _ = attention_mask(torch.arange(total), torch.arange(total), padding, window)
    ref = F.scaled_dot_product_attention(q_all, k_all, v_all, attn_mask=ref_mask)
    layer = SlidingWindowLayer(window)
    start = 0
    for t in [2, 1, 1, 7, 1, 3, 1, 1, 5, 1]:
        pos = torch.arange(start, start + t)
        layer.check_cache_position(pos)
        mask, _ = attention_mask(pos, layer.key_positions(pos), padding[:, : start + t], window)
        keys, values = layer.update(k_all[:, :, pos], v_all[:, :, pos], pos)
        out = F.scaled_dot_product_attention(q_all[:, :, pos], keys, values, attn_mask=mask)
        torch.testing.assert_close(out, ref[:, :, pos], atol=1e-6, rtol=0)
        start += t
    assert start == total


def test_layer_compiles_fullgraph_once_for_every_decode_step():
    """Static shapes and tensor bookkeeping: no graph break, no recompile as the ring wraps; chunks too."""
    layer = SlidingWindowLayer(4)

    def step(q, k, v, pos, padding):
        mask, _ = attention_mask(pos, layer.key_positions(pos), padding, 4, static=True)
        keys, values = layer.update(k, v, pos)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, 15, D, generator=g) for _ in range(3))
    ref_mask, _ = attention_mask(torch.arange(15), torch.arange(15), None, 4)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=ref_mask)
    padding = torch.ones(1, 32, dtype=torch.long)
    step(q[:, :, :5], k[:, :, :5], v[:, :, :5], torch.arange(5), padding)  # eager prefill
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(5, 12):
            s = slice(t, t + 1)
            out = compiled(q[:, :, s].clone(), k[:, :, s].clone(), v[:, :, s].clone(), torch.tensor([t]), padding)
            torch.testing.assert_close(out, ref[:, :, s], atol=1e-6, rtol=0, msg=f"position {t}")
    s = slice(12, 15)  # a 3-token chunk under compile: old slots + the chunk
    out = compiled(q[:, :, s].clone(), k[:, :, s].clone(), v[:, :, s].clone(), torch.arange(12, 15), padding)
    torch.testing.assert_close(out, ref[:, :, s], atol=1e-6, rtol=0)
    assert layer.get_seq_length() == 15 and sorted(layer._pos.tolist()) == [11, 12, 13, 14]


def test_key_positions_before_the_first_update():
    layer = SlidingWindowLayer(4)
    assert layer.key_positions(torch.arange(6)).tolist() == list(range(6))
    assert layer.key_positions(torch.tensor([0])).tolist() == [0]


def test_crop_within_the_window_and_one_token_back_after_wrapping():
    layer = SlidingWindowLayer(8)
    feed(layer, 0, 5)
    layer.crop(3)
    assert layer.get_seq_length() == 3 and layer.keys[0, 0, :, 0].tolist() == [0, 1, 2]
    feed(layer, 3, 1)
    layer = SlidingWindowLayer(4)
    feed(layer, 0, 10)
    layer.crop(9)  # generate() does this to re-feed the prompt's last token
    assert layer.get_seq_length() == 9 and layer.keys[0, 0, :, 0].tolist() == [6, 7, 8]
    assert sorted(feed(layer, 9, 1).tolist()) == [6, 7, 8, 9]
    layer.crop(20)  # past the end: nothing to do
    assert layer.get_seq_length() == 10


def test_crop_that_needs_overwritten_positions_raises():
    layer = SlidingWindowLayer(4)
    feed(layer, 0, 10)
    with pytest.raises(ValueError, match="cannot crop .* to 7 tokens.*reset"):
        layer.crop(7)
    assert layer.get_seq_length() == 10  # unchanged


def test_cache_crop_that_fails_changes_no_layer():
    cfg = PretrainedConfig(**{**MIXED.to_dict(), "layer_types": ["full_attention", "sliding_attention"] * 2})
    cache = HybridCache(config=cfg, max_cache_len=32)
    for i in range(4):
        cache.update(*kv(10), i, {"cache_position": torch.arange(10)})
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(5)
    assert [layer.get_seq_length() for layer in cache.layers] == [10] * 4  # the static layer 0 too


def test_cache_crop_negative_counts_from_the_end():
    cache = SlidingWindowCache(config=MISTRAL, max_cache_len=32)
    for i in range(2):
        cache.update(*kv(10), i, {"cache_position": torch.arange(10)})
    cache.crop(-1)
    assert cache.get_seq_length() == 9 and cache.layers[1].get_seq_length() == 9


def test_batch_select_and_repeat_interleave():
    layer = SlidingWindowLayer(4, batch_size=B)
    feed(layer, 0, 6)
    layer.batch_select_indices(torch.tensor([1, 0]))
    assert layer.keys[:, 0, :, 0].tolist() == [[1002, 1003, 1004, 1005], [2, 3, 4, 5]]
    layer.batch_select_indices(torch.tensor([1]))
    assert layer.keys.shape[0] == 1 and layer.keys[0, 0, 0, 0] == 2
    layer.batch_repeat_interleave(3)
    assert layer.keys.shape[0] == 3 and layer.batch_size == 3
    layer.update(*kv(1, 6, batch=3), torch.tensor([6]))
    assert layer.keys[0, 0, :, 0].tolist() == [3, 4, 5, 6] and layer.keys[2, 0, -1, 0] == 2006


def test_deepcopy_is_independent():
    cache = HybridCache(config=MIXED, max_cache_len=32)
    for i in range(4):
        cache.update(*kv(6), i, {"cache_position": torch.arange(6)})
    clone = copy.deepcopy(cache)
    for i in range(4):
        cache.update(*kv(1, 6), i, {"cache_position": torch.tensor([6])})
    assert clone.get_seq_length() == 6 and cache.get_seq_length() == 7
    assert clone.layers[0].keys[0, 0, :, 0].tolist() == [2, 3, 4, 5]
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [3, 4, 5, 6]


def test_reset_keeps_the_buffers():
    layer = SlidingWindowLayer(4)
    feed(layer, 0, 6)
    ptr = layer._k.data_ptr()
    layer.reset()
    assert layer.get_seq_length() == 0 and layer._pos.tolist() == [-1] * 4 and layer.keys.shape[2] == 0
    assert layer._k.data_ptr() == ptr and not layer._k.any()
    assert feed(layer, 0, 2).tolist() == [0, 1]


def test_nbytes_counts_window_slots_only():
    cache = HybridCache(config=MIXED, max_batch_size=B, max_cache_len=64, dtype=torch.float32)
    per_slot = 2 * B * H * D * 4  # keys and values, float32
    assert cache.nbytes() == 2 * per_slot * 4 + 2 * per_slot * 64
    assert SlidingWindowLayer(4).nbytes() == 0  # lazy until the first update


def test_fewer_slots_than_the_window_when_the_sequence_is_short():
    layer = SlidingWindowLayer(16, max_cache_len=6)
    assert layer.get_max_cache_shape() == 6
    feed(layer, 0, 6)
    with pytest.raises(ValueError, match="max_cache_len >= 7"):
        layer.check_cache_position(torch.tensor([6]))


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="sliding_window must be a positive"):
        SlidingWindowLayer(0)
    layer = SlidingWindowLayer(4)
    feed(layer, 0, 5)
    with pytest.raises(ValueError, match="has seen 5 tokens, so the next positions must be 5..5"):
        layer.check_cache_position(torch.tensor([3]))
    with pytest.raises(ValueError, match="next positions must be 5..6"):
        layer.check_cache_position(torch.tensor([6, 7]))
    with pytest.raises(ValueError, match="max_batch_size=1"):
        SlidingWindowCache(config=MISTRAL, max_batch_size=1, max_cache_len=8).update(
            *kv(2), 0, {"cache_position": torch.arange(2)})


# -- the caches --------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [SlidingWindowCache, HybridCache])
def test_cache_for_a_model_without_sliding_window_raises(cls):
    with pytest.raises(ValueError, match="only for models with sliding-window attention.*'static'"):
        cls(config=LLAMA, max_cache_len=16)
    with pytest.raises(ValueError, match="needs the model's config"):
        cls(max_cache_len=16)


@pytest.mark.parametrize("name", ["sliding_window", "hybrid"])
def test_registered_names(name):
    cache = create_cache(name, config=MIXED, batch_size=1, max_cache_len=16, device="cpu", dtype=torch.float32)
    assert type(cache) is {"sliding_window": SlidingWindowCache, "hybrid": HybridCache}[name]
    assert cache.is_compileable
    with pytest.raises(ValueError, match="only for models with sliding-window"):
        create_cache(name, config=LLAMA, batch_size=1, max_cache_len=16, device="cpu", dtype=torch.float32)


def test_hybrid_layers_follow_layer_types_and_report_the_true_length():
    cache = HybridCache(config=MIXED, max_cache_len=40)
    assert [type(layer) for layer in cache.layers] == [SlidingWindowLayer, StaticLayer] * 2
    for i in range(4):
        cache.update(*kv(30), i, {"cache_position": torch.arange(30)})
    assert [cache.get_seq_length(i) for i in range(4)] == [30] * 4  # layer 0 is a 4-slot ring
    assert cache.get_max_cache_shape() == cache.get_max_length() == 40  # the sequence limit generate() pads to
    assert [cache.get_max_cache_shape(i) for i in range(4)] == [4, 40, 4, 40]
    legacy = cache.to_legacy_cache()
    assert [k.shape[2] for k, _ in legacy] == [4, 30, 4, 30]
    assert cache.mask_group(0) != cache.mask_group(1) and cache.mask_group(0) == cache.mask_group(2)


def test_mistral_config_gives_rings_on_every_layer():
    cache = SlidingWindowCache(config=MISTRAL, max_batch_size=1, max_cache_len=100)
    assert all(isinstance(layer, SlidingWindowLayer) and layer.slots == 4 for layer in cache.layers)


def test_dynamic_cache_keeps_sliding_layers_of_a_hybrid_config_bounded():
    cache = DynamicCache(config=MIXED)
    assert [type(layer) for layer in cache.layers] == [DynamicSlidingWindowLayer, DynamicLayer] * 2
    for start in range(0, 300, 10):
        for i in range(4):
            cache.update(*kv(10, start), i, {"cache_position": torch.arange(start, start + 10)})
    assert cache.get_seq_length() == 300 and cache.layers[0].get_seq_length() == 300
    assert cache.layers[0].keys.shape[2] <= 4 - 1 + 10  # window - 1 old tokens + the last chunk
    assert cache.layers[0]._k.shape[2] <= 256
    assert cache.layers[1].keys.shape[2] == 300


# -- parity with transformers ---------------------------------------------------------------------------

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, initializer_range=0.2)
MODELS = {
    "mistral": (transformers.MistralConfig, dict(num_hidden_layers=2, sliding_window=6)),
    # Gemma-like layout on a Qwen2 body: layer 0 sliding, then global, sliding, global
    "qwen2-mixed": (transformers.Qwen2Config, dict(
        num_hidden_layers=4, use_sliding_window=True, sliding_window=5, max_window_layers=0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request, tmp_path_factory):
    config_cls, extra = MODELS[request.param]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config_cls(**BASE, **extra)).eval()
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    ours = kvgen.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    expected = getattr(hf.config, "layer_types", None) or ["sliding_attention"] * hf.config.num_hidden_layers
    assert ours.config.layer_types == expected
    return request.param, hf, ours


@torch.no_grad()
def test_logits_prompt_longer_than_window_then_decode(pair):
    """Ring cache == transformers' static sliding cache == kvgen without a cache, prefill and 12 steps."""
    _, hf, ours = pair
    ids, mask = left_padded_batch(1, 17)
    total = 17 + 12
    hf_cache = transformers.StaticCache(config=hf.config, max_cache_len=total)
    cache = kvgen.HybridCache(config=ours.config, max_batch_size=3, max_cache_len=total)
    pos = positions(mask)
    ref = hf(ids, attention_mask=mask, position_ids=pos, past_key_values=hf_cache).logits
    got = ours(ids, attention_mask=mask, position_ids=pos, past_key_values=cache).logits
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], atol=ATOL, rtol=0)
    g = torch.Generator().manual_seed(2)
    for step in range(12):
        new = torch.randint(3, 128, (3, 1), generator=g)
        ids, mask = torch.cat([ids, new], 1), torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
        cache_position = torch.tensor([mask.shape[1] - 1])
        ref = hf(new, attention_mask=mask, position_ids=positions(mask)[:, -1:], past_key_values=hf_cache,
                 cache_position=cache_position).logits
        got = ours(new, attention_mask=mask, position_ids=positions(mask)[:, -1:], past_key_values=cache,
                   cache_position=cache_position).logits
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0, msg=f"decode step {step}")
    assert cache.get_seq_length() == total
    full = ours(ids, attention_mask=mask, position_ids=positions(mask), use_cache=False).logits
    torch.testing.assert_close(got[:, -1], full[:, -1], atol=ATOL, rtol=0)


@torch.no_grad()
def test_chunked_prefill_equals_one_forward(pair):
    """Chunks that wrap the ring (3, 9, 1, 6 tokens) give the logits of one uncached forward."""
    _, _, ours = pair
    ids = torch.randint(3, 128, (1, 19), generator=torch.Generator().manual_seed(5))
    full = ours(ids, use_cache=False).logits
    for cache in (SlidingWindowCache(config=ours.config, max_cache_len=19), DynamicCache(config=ours.config)):
        start, got = 0, []
        for t in (3, 9, 1, 6):
            got.append(ours(ids[:, start:start + t], past_key_values=cache).logits)
            start += t
        torch.testing.assert_close(torch.cat(got, 1), full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("cache_implementation", ["sliding_window", "hybrid", "dynamic"])
def test_greedy_generate_ids_equal_transformers(pair, cache_implementation):
    _, hf, ours = pair
    ids, mask = left_padded_batch(3, 14)
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None)
    ref = hf.generate(ids, cache_implementation="static" if cache_implementation != "dynamic" else "dynamic",
                      **kwargs)
    got = ours.generate(ids, cache_implementation=cache_implementation, disable_compile=True, **kwargs)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("cache_implementation", ["sliding_window", "hybrid"])
def test_compiled_generate_compiles_once_and_equals_eager(pair, cache_implementation):
    """The ring buffer's decode step has static shapes: one graph for all steps (and a second call)."""
    _, hf, ours = pair
    ids, mask = left_padded_batch(4, 9)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    eager = ours.generate(ids, cache_implementation=cache_implementation, disable_compile=True, **kwargs)
    torch._dynamo.reset()
    ours._compiled_forward = None
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = ours.generate(ids, cache_implementation=cache_implementation, **kwargs)
        again = ours.generate(ids, cache_implementation=cache_implementation, **kwargs)
    assert ours._compiled_forward is not None  # the compiled path ran
    assert torch.equal(got, eager) and torch.equal(again, eager)
    assert torch.equal(eager, hf.generate(ids, cache_implementation="static", **kwargs))


@torch.no_grad()
def test_generate_then_forward_with_the_returned_cache(pair):
    """The seeds' pattern: generate, then continue with forward() and an explicit cache_position."""
    _, _, ours = pair
    ids = torch.randint(3, 128, (1, 11), generator=torch.Generator().manual_seed(6))
    out = ours.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, cache_implementation="hybrid",
                        disable_compile=True, return_dict_in_generate=True)
    cache, seq = out.past_key_values, out.sequences
    assert isinstance(cache, HybridCache) and cache.get_seq_length() == seq.shape[1] - 1
    cache_position = torch.tensor([seq.shape[1] - 1])
    logits = ours(seq[:, -1:], past_key_values=cache, cache_position=cache_position).logits
    full = ours(seq, use_cache=False).logits
    torch.testing.assert_close(logits[:, -1], full[:, -1], atol=ATOL, rtol=0)


def test_iterative_generation_reuses_the_ring(pair):
    """The seeds' multi-turn pattern: one cache across generate() calls, each prompt extending the last output."""
    _, _, ours = pair
    g = torch.Generator().manual_seed(7)
    kwargs = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, disable_compile=True)
    cache = SlidingWindowCache(config=ours.config, max_batch_size=1, max_cache_len=64)
    prompt = torch.randint(3, 128, (1, 12), generator=g)
    for turn in range(3):
        out = ours.generate(prompt, past_key_values=cache, **kwargs)
        assert torch.equal(out, ours.generate(prompt, **kwargs)), f"turn {turn}"  # == a fresh dynamic cache
        assert cache.get_seq_length() == out.shape[1] - 1
        prompt = torch.cat([out, torch.randint(3, 128, (1, 5), generator=g)], dim=1)


def test_reusing_a_wrapped_ring_with_a_prompt_that_diverges_early_refills_it(pair):
    """A wrapped ring cannot be cropped back to an early common prefix: generate() refills it instead."""
    _, _, ours = pair
    g = torch.Generator().manual_seed(8)
    kwargs = dict(max_new_tokens=4, do_sample=False, eos_token_id=None, disable_compile=True)
    cache = SlidingWindowCache(config=ours.config, max_batch_size=1, max_cache_len=64)
    first = torch.randint(3, 128, (1, 16), generator=g)
    ours.generate(first, past_key_values=cache, **kwargs)
    other = torch.cat([first[:, :2], torch.randint(3, 128, (1, 14), generator=g)], dim=1)  # shares 2 tokens
    out = ours.generate(other, past_key_values=cache, **kwargs)
    assert torch.equal(out, ours.generate(other, **kwargs))
    assert cache.get_seq_length() == out.shape[1] - 1
