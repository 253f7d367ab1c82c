"""Cache unit tests on synthetic tensors: every method of the dynamic, sliding and static caches,
and batch row selection on every cache type."""

from __future__ import annotations

import copy

import pytest
import torch

import kvgen
from kvgen import DynamicCache, EncoderDecoderCache, StaticCache
from kvgen.cache import create_cache
from kvgen.cache.dynamic import DynamicLayer, DynamicSlidingWindowLayer
from kvgen.cache.ssm import SSMLayer
from kvgen.config import PretrainedConfig
from kvgen.masks import attention_mask
from kvgen.rope import RotaryEmbedding

CONFIG = PretrainedConfig(model_type="llama", hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                          num_hidden_layers=3, vocab_size=50, intermediate_size=64)
B, H, D = 2, 2, 8


def kv(t, start=0, batch=B):
    """Keys whose every entry is its absolute position, values its negative: easy to read back."""
    pos = torch.arange(start, start + t, dtype=torch.float32).view(1, 1, t, 1)
    k = pos.expand(batch, H, t, D).clone() + torch.arange(batch).view(batch, 1, 1, 1) * 1000
    return k, -k


def fill(cache, t, start=0, layers=3):
    for i in range(layers):
        k, v = kv(t, start)
        cache.update(k, v, i, {"cache_position": torch.arange(start, start + t)})


def caches():
    return {
        "dynamic": DynamicCache(),
        "dynamic-config": DynamicCache(config=CONFIG),
        "static": StaticCache(config=CONFIG, max_batch_size=B, max_cache_len=64),
        "static-lazy": StaticCache(config=CONFIG, max_cache_len=64),
    }


@pytest.fixture(params=sorted(caches()))
def cache(request):
    return caches()[request.param]


def stored_positions(cache, layer=0):
    return cache.layers[layer].keys[0, 0, :, 0].tolist()


def test_update_returns_everything_to_attend(cache):
    k, v = kv(5)
    keys, values = cache.update(k, v, 0, {"cache_position": torch.arange(5)})
    assert keys[:, :, :5].equal(k) and values[:, :, :5].equal(v)
    k2, v2 = kv(3, start=5)
    keys, values = cache.update(k2, v2, 0, {"cache_position": torch.arange(5, 8)})
    assert keys[0, 0, :8, 0].tolist() == list(range(8))
    assert cache.get_seq_length() == 8


def test_seq_length_and_max_shape(cache):
    assert cache.get_seq_length() == 0
    fill(cache, 7)
    assert cache.get_seq_length() == 7
    expected = 64 if isinstance(cache, StaticCache) else None
    assert cache.get_max_cache_shape() == expected
    assert cache.get_max_length() == expected


def test_growth_is_amortised():
    layer = DynamicLayer()
    reallocations, last = 0, None
    for t in range(2000):
        k, v = kv(1, start=t)
        layer.update(k, v, torch.tensor([t]))
        if layer._k.data_ptr() != last:
            reallocations, last = reallocations + 1, layer._k.data_ptr()
    assert layer.get_seq_length() == 2000
    assert layer.keys[0, 0, :, 0].tolist() == list(range(2000))
    assert reallocations <= 12  # geometric growth, not one copy per token
    assert layer.nbytes() <= 2 * 1.5 * 2000 * B * H * D * 4 + 2 * 128 * B * H * D * 4


def test_update_returns_views_not_copies():
    layer = DynamicLayer()
    k, v = kv(4)
    layer.update(k, v, torch.arange(4))
    keys, _ = layer.update(*kv(1, start=4), torch.tensor([4]))
    assert keys.data_ptr() == layer._k.data_ptr()


def test_reset(cache):
    fill(cache, 6)
    cache.reset()
    assert cache.get_seq_length() == 0
    fill(cache, 2)
    assert stored_positions(cache) == [0, 1]


def test_crop(cache):
    fill(cache, 10)
    cache.crop(6)
    assert cache.get_seq_length() == 6
    assert stored_positions(cache) == list(range(6))
    cache.crop(-2)
    assert cache.get_seq_length() == 4
    fill(cache, 1, start=4)
    assert stored_positions(cache) == [0, 1, 2, 3, 4]


def test_reorder_and_batch_select(cache):
    fill(cache, 4)
    cache.reorder_cache(torch.tensor([1, 0]))
    assert cache.layers[2].keys[0, 0, 0, 0].item() == 1000  # batch row 1 moved to row 0
    assert cache.layers[2].keys[1, 0, 0, 0].item() == 0
    cache.batch_select_indices(torch.tensor([1]))
    assert cache.layers[0].keys.shape[0] == 1 and cache.layers[0].keys[0, 0, 0, 0].item() == 0


def test_batch_repeat_interleave(cache):
    fill(cache, 3)
    cache.batch_repeat_interleave(3)
    keys = cache.layers[1].keys
    assert keys.shape[0] == 6
    assert keys[:, 0, 0, 0].tolist() == [0, 0, 0, 1000, 1000, 1000]


def test_deepcopy_is_independent(cache):
    fill(cache, 5)
    twin = copy.deepcopy(cache)
    fill(twin, 2, start=5)
    twin.layers[0].keys.mul_(0)
    assert cache.get_seq_length() == 5 and twin.get_seq_length() == 7
    assert stored_positions(cache) == list(range(5))


def test_legacy_round_trip():
    cache = DynamicCache()
    fill(cache, 4)
    legacy = cache.to_legacy_cache()
    assert isinstance(legacy, tuple) and len(legacy) == 3 and all(len(pair) == 2 for pair in legacy)
    back = DynamicCache.from_legacy_cache(legacy)
    assert back.get_seq_length() == 4
    for (k1, v1), (k2, v2) in zip(legacy, back.to_legacy_cache()):
        assert k1.equal(k2) and v1.equal(v2)
    assert cache[1][0].equal(legacy[1][0]) and len(cache) == 3


def test_legacy_rejects_malformed_input():
    with pytest.raises(ValueError, match="legacy cache layer 0"):
        DynamicCache.from_legacy_cache(((torch.zeros(2, 3),),))


def test_sliding_window_layer_stops_growing():
    window = 4
    layer = DynamicSlidingWindowLayer(window)
    for t in range(50):
        k, v = kv(1, start=t)
        pos = layer.key_positions(torch.tensor([t]))
        keys, _ = layer.update(k, v, torch.tensor([t]))
        assert keys[0, 0, :, 0].tolist() == pos.tolist()  # key_positions predicts the returned slots
        assert keys.shape[2] <= window
    assert layer.get_seq_length() == 50
    assert layer._k.shape[2] <= 256  # bounded allocation


def test_sliding_window_prefill_longer_than_window():
    layer = DynamicSlidingWindowLayer(4)
    k, v = kv(10)
    keys, _ = layer.update(k, v, torch.arange(10))
    assert keys.shape[2] == 10  # the chunk attends to all of itself (the mask applies the window)
    keys, _ = layer.update(*kv(1, start=10), torch.tensor([10]))
    assert keys[0, 0, :, 0].tolist() == [7, 8, 9, 10]


def test_dynamic_cache_from_sliding_config_has_bounded_layers():
    cfg = PretrainedConfig(model_type="mistral", hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                           sliding_window=8)
    cache = DynamicCache(config=cfg)
    assert all(isinstance(layer, DynamicSlidingWindowLayer) for layer in cache.layers)
    fill(cache, 30, layers=2)
    assert cache.get_seq_length() == 30
    assert cache.get_max_cache_shape() == 8


def test_static_cache_writing_past_end_raises():
    cache = StaticCache(config=CONFIG, max_batch_size=B, max_cache_len=8)
    fill(cache, 8)
    with pytest.raises(ValueError, match="max_cache_len=8"):
        cache.check_cache_position(torch.tensor([8]))


def test_static_cache_batch_mismatch_raises():
    cache = StaticCache(config=CONFIG, max_batch_size=1, max_cache_len=8)
    with pytest.raises(ValueError, match="max_batch_size=1"):
        fill(cache, 2)


def test_static_cache_needs_config():
    with pytest.raises(ValueError, match="config"):
        StaticCache(max_cache_len=8)


def test_dynamic_cache_position_must_follow_the_cache():
    cache = DynamicCache()
    fill(cache, 5)
    with pytest.raises(ValueError, match="holds 5 tokens"):
        cache.check_cache_position(torch.tensor([3]))
    cache.check_cache_position(torch.tensor([5, 6]))


def test_registry_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match="valid names are: .*dynamic.*static"):
        create_cache("nope", config=CONFIG, batch_size=1, max_cache_len=8, device="cpu", dtype=torch.float32,
                     cache_config=None)


def test_nbytes_counts_allocations():
    cache = StaticCache(config=CONFIG, max_batch_size=B, max_cache_len=16, dtype=torch.float32)
    assert cache.nbytes() == 3 * 2 * B * H * 16 * D * 4


# -- batch_select_indices on every cache type -----------------------------------------------------

ROWS = 3  # batch of the filled caches below
SLIDING = PretrainedConfig(model_type="llama", hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                           num_hidden_layers=2, vocab_size=50, intermediate_size=64, sliding_window=4,
                           max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"])
MAMBA = kvgen.MambaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, state_size=4, conv_kernel=4,
                          num_hidden_layers=2)
JAMBA = kvgen.JambaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4,
                          mamba_d_conv=4, mamba_expand=2)
QUANTIZED = dict(nbits=4, q_group_size=8, residual_length=8)  # 40 tokens: some quantized, some residual


def every_cache_type():
    """Name -> a function building an empty cache of each kind that kvgen exports (batch ``ROWS``)."""
    return {
        "dynamic": lambda: DynamicCache(),
        "static": lambda: StaticCache(config=CONFIG, max_batch_size=ROWS, max_cache_len=64),
        "offloaded": lambda: kvgen.OffloadedCache(),
        "offloaded_static": lambda: kvgen.OffloadedStaticCache(config=CONFIG, max_batch_size=ROWS, max_cache_len=64),
        "quantized-kivi": lambda: kvgen.QuantizedCache(backend="kivi", **QUANTIZED),
        "quantized-offloaded": lambda: kvgen.QuantizedCache(backend="kivi", config=CONFIG, offloading=True,
                                                            **QUANTIZED),
        "quanto": lambda: kvgen.QuantoQuantizedCache(**QUANTIZED),
        "hqq": lambda: kvgen.HQQQuantizedCache(axis_key=1, axis_value=1, **QUANTIZED),
        "sliding_window": lambda: kvgen.SlidingWindowCache(config=SLIDING, max_batch_size=ROWS, max_cache_len=64),
        "hybrid": lambda: kvgen.HybridCache(config=SLIDING, max_batch_size=ROWS, max_cache_len=64),
        "sink": lambda: kvgen.SinkCache(window_length=16, num_sink_tokens=2),
        "static_sink": lambda: kvgen.StaticSinkCache(config=CONFIG, window_length=16, num_sink_tokens=2,
                                                     max_batch_size=ROWS),
        "mamba": lambda: kvgen.MambaCache(MAMBA, batch_size=ROWS, dtype=torch.float32),
        "jamba": lambda: kvgen.HybridMambaAttentionDynamicCache(JAMBA, batch_size=ROWS, dtype=torch.float32),
        "encoder_decoder": lambda: EncoderDecoderCache(DynamicCache(), DynamicCache()),
        "forked": lambda: DynamicCache(),  # filled, then forked: copy-on-write layers
    }


def filled(name: str, t: int = 40):
    """A cache of kind ``name`` after ``t`` tokens of random keys/values (or states) in every layer, batch ``ROWS``."""
    torch.manual_seed(0)
    cache = every_cache_type()[name]()
    target = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
    for i in range(len(target.layers) or 2):
        layer = target.layer(i)
        if isinstance(layer, SSMLayer):
            layer.write_ssm_states(torch.randn_like(layer.conv_state), torch.randn_like(layer.ssm_state),
                                   torch.arange(t))
        else:
            target.update(torch.randn(ROWS, H, t, D), torch.randn(ROWS, H, t, D), i,
                          {"cache_position": torch.arange(t), "rotary_emb": RotaryEmbedding(CONFIG)})
        if isinstance(cache, EncoderDecoderCache):
            cache.update_cross_attention(torch.randn(ROWS, H, 5, D), torch.randn(ROWS, H, 5, D), i)
    return cache.fork(1)[0] if name == "forked" else cache


def stored(cache) -> list[torch.Tensor]:
    """Every tensor the cache stores, layer by layer: keys and values, or conv and SSM states."""
    if isinstance(cache, EncoderDecoderCache):
        return stored(cache.self_attention_cache) + stored(cache.cross_attention_cache)
    return [t for layer in cache.layers for t in ((layer.conv_state, layer.ssm_state) if isinstance(layer, SSMLayer)
                                                   else (layer.keys, layer.values))]


@pytest.mark.parametrize("name", sorted(every_cache_type()))
def test_batch_select_indices_takes_a_list_a_tuple_or_a_tensor(name):
    if name in ("quanto", "hqq"):
        pytest.importorskip({"quanto": "optimum.quanto", "hqq": "hqq"}[name])
    cache = filled(name)
    rows = stored(cache)
    for indices, kept in (([2, 0], [2, 0]), ((2, 0), [2, 0]), (torch.tensor([2, 0]), [2, 0]),
                          ((-1, 1, 1), [2, 1, 1]), (torch.tensor([1], dtype=torch.int32), [1]), ([], [])):
        twin = copy.deepcopy(cache)
        twin.batch_select_indices(indices)
        got = stored(twin)
        assert len(got) == len(rows) and all(g.equal(r[kept]) for g, r in zip(got, rows)), indices
        assert twin.get_seq_length() == cache.get_seq_length()
    twin = copy.deepcopy(cache)
    twin.reorder_cache((2, 1, 0))  # beams follow too
    assert all(g.equal(r.flip(0)) for g, r in zip(stored(twin), rows))
    with pytest.raises(IndexError, match="batch row index 3 is out of range: the cache holds 3 rows"):
        cache.batch_select_indices([0, 3])
    assert all(g.equal(r) for g, r in zip(stored(cache), rows))  # a refused selection changes nothing


@pytest.mark.parametrize("indices,error,match", [
    (torch.tensor([0.0, 1.0]), ValueError, "must be integers, got torch.float32"),
    ([0.5, 1], ValueError, "must be integers, got torch.float32"),
    ([[0, 1]], ValueError, r"must be 1-D, got shape \(1, 2\)"),
    ([[0], [1, 2]], ValueError, "must be a 1-D tensor, list or tuple of integers"),
    (1, ValueError, "must be a 1-D tensor, list or tuple of integers"),
    ("01", ValueError, "must be a 1-D tensor, list or tuple of integers"),
    ([True, False, True], ValueError, "boolean mask; pass mask.nonzero"),
    ((-4, 0), IndexError, r"index -4 is out of range: the cache holds 3 rows \(valid indices: -3..2\)"),
])
def test_batch_select_indices_refuses_what_is_not_a_row_index(indices, error, match):
    cache = filled("dynamic")
    rows = stored(cache)
    with pytest.raises(error, match=match):
        cache.batch_select_indices(indices)
    assert all(g.equal(r) for g, r in zip(stored(cache), rows))


# -- masks ----------------------------------------------------------------------------------------

def test_mask_shortcuts():
    q = torch.arange(5)
    assert attention_mask(q, torch.arange(5)) == (None, True)  # plain causal prefill
    assert attention_mask(torch.tensor([7]), torch.arange(8)) == (None, False)  # decode sees everything


def test_mask_rules_causal_window_padding_and_empty_slots():
    keys = torch.tensor([0, 1, 2, 3, -1])
    padding = torch.tensor([[0, 1, 1, 1, 1]])
    mask, causal = attention_mask(torch.tensor([2, 3]), keys, padding, sliding_window=2)
    assert not causal
    assert mask[0, 0].int().tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0]]


def test_mask_row_of_padding_attends_to_itself_only():
    mask, _ = attention_mask(torch.arange(3), torch.arange(3), torch.tensor([[0, 0, 1]]))
    assert mask[0, 0].int().tolist() == [[1, 0, 0], [0, 1, 0], [0, 0, 1]]


@pytest.mark.parametrize("layer", [DynamicLayer, lambda: DynamicSlidingWindowLayer(4)], ids=["dynamic", "sliding"])
def test_a_decode_step_mask_settled_from_integer_positions_is_the_built_one(layer, monkeypatch):
    """LayerMasks settles a one-token step's mask from the layer's key_range where the cache gives one; it must be
    what building the mask from key_positions gives, for a layer's own window and for windows that hide keys."""
    import kvgen.models.base as model_base

    built = []
    monkeypatch.setattr(model_base, "build_mask", lambda *args, **kw: built.append(args[-1]) or attention_mask(
        *args, **kw))
    cache = kvgen.cache.base.Cache(layers=[layer()])
    k, v = kv(7)
    cache.update(k, v, 0, {"cache_position": torch.arange(7)})
    for n in range(7, 12):
        position = torch.tensor([n])
        for window in (None, 3, 4, 5, 20):
            expected = attention_mask(position, cache.key_positions(0, position), None, window)
            got = model_base.LayerMasks(cache, position, None)(0, window)
            assert got[1] == expected[1] and (got[0] is None) == (expected[0] is None)
            if got[0] is not None:
                assert torch.equal(got[0], expected[0])
        k, v = kv(1, n)
        cache.update(k, v, 0, {"cache_position": position})
    assert built == []  # every step settled from integers, the windows that hide keys included
