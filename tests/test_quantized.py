"""QuantizedCache: the KIVI backend against an independent reference quantizer, the residual and
sink policy, every editing operation on both the quantized and the full-precision parts,
configuration errors, memory, the optional quanto/HQQ backends, and the real model."""

from __future__ import annotations

import copy
import importlib.util
import sys

import pytest
import torch

from kvgen import DynamicCache, HQQQuantizedCache, QuantizedCache, QuantizedCacheConfig, QuantoQuantizedCache
from kvgen.cache import create_cache
from kvgen.cache.dynamic import DynamicSlidingWindowLayer
from kvgen.cache.quantized import QuantizedLayer
from kvgen.cache.quantizers import KiviStore, pack, unpack
from kvgen.config import PretrainedConfig
from kvgen.masks import attention_mask

CONFIG = PretrainedConfig(model_type="llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                          num_hidden_layers=3, vocab_size=50, intermediate_size=64)
HAS_QUANTO = importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.quanto") is not None
HAS_HQQ = importlib.util.find_spec("hqq") is not None
needs_quanto = pytest.mark.skipif(not HAS_QUANTO, reason="optimum-quanto is not installed")
needs_hqq = pytest.mark.skipif(not HAS_HQQ, reason="hqq is not installed")

# backend settings for the tests that run on every backend
BACKENDS = [
    pytest.param({"backend": "kivi", "nbits": 4}, id="kivi4"),
    pytest.param({"backend": "kivi", "nbits": 2}, id="kivi2"),
    pytest.param({"backend": "quanto", "nbits": 4}, id="quanto4", marks=needs_quanto),
    pytest.param({"backend": "hqq", "nbits": 4, "axis_key": 1, "axis_value": 1}, id="hqq4", marks=needs_hqq),
]
SMALL = {"q_group_size": 16, "residual_length": 32, "num_sink_tokens": 4}


def ref_dequantized(x: torch.Tensor, dim: int, nbits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain float32 min/max quantizer, one group per slice along ``dim``: (dequantized x, step per group)."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    step = (hi - lo) / (2**nbits - 1)
    codes = torch.round((x - lo) / torch.where(step > 0, step, torch.ones_like(step)))
    return codes * step + lo, step


def per_channel(x, group):
    """(B, H, T, D) -> (B, H, T // group, group, D): groups of tokens, one per channel (reduce dim 3)."""
    b, h, t, d = x.shape
    return x.reshape(b, h, t // group, group, d)


def per_token(x, group):
    """(B, H, T, D) -> (B, H, T, D // group, group): groups of channels, one per token (reduce dim 4)."""
    b, h, t, d = x.shape
    return x.reshape(b, h, t, d // group, group)


def dequantized(store, like):
    out = torch.empty_like(like)
    store.dequantize_into(out)
    return out


# -- packing -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("nbits", [2, 4, 8])
def test_pack_unpack_is_exact_and_dense(nbits):
    codes = torch.randint(0, 2**nbits, (2, 3, 5, 8 // nbits, 48), dtype=torch.uint8)
    packed = pack(codes, nbits)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 5, 48)  # 8 // nbits codes per byte
    assert unpack(packed, nbits).equal(codes)
    # the bit layout: slot p of a byte sits at bits p*nbits..
    byte = int(packed[0, 0, 0, 0])
    assert [(byte >> (nbits * p)) & (2**nbits - 1) for p in range(8 // nbits)] == codes[0, 0, 0, :, 0].tolist()


@pytest.mark.parametrize("width", [5, 6, 12, 16])
def test_unpack_with_rows_that_do_not_fill_wide_words(width):
    codes = torch.randint(0, 16, (3, 2, width), dtype=torch.uint8)
    assert unpack(pack(codes, 4), 4).equal(codes)


# -- the KIVI quantizer against the reference ------------------------------------------------------------
@pytest.mark.parametrize("nbits", [2, 4, 8])
def test_kivi_keys_match_a_per_channel_reference(nbits):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 128, 32) * torch.linspace(0.5, 3, 32)
    store = KiviStore(nbits, 32, per_channel=True)
    store.append(x)
    got = dequantized(store, x)
    ref, step = ref_dequantized(per_channel(x, 32), 3, nbits)
    ref, step = ref.reshape(x.shape), step.expand(-1, -1, -1, 32, -1).reshape(x.shape)
    err = (got - x).abs()
    if nbits == 2:  # 2-bit keys search a (clipped) range per channel with less squared error than min/max
        by_group = lambda e: e.square().reshape(2, 3, 4, 32, 32).sum(3)  # noqa: E731  (B, H, groups, D)
        assert (by_group(got - x) <= by_group(ref - x) * 1.01 + 1e-4).all()
        assert by_group(got - x).sum() < by_group(ref - x).sum()
        return
    assert (err <= 0.5 * step * 1.01 + 2e-3 * step.amax()).all()  # half a step, plus float16 scale rounding
    assert (got - ref).abs().max() <= step.max() * 1.01  # at most one code apart from the reference
    assert err.mean() <= (ref - x).abs().mean() * 1.05


@pytest.mark.parametrize("nbits", [2, 4, 8])
def test_kivi_values_match_a_per_token_reference(nbits):
    torch.manual_seed(1)
    x = torch.randn(2, 3, 64, 32) * torch.linspace(0.1, 4, 64)[:, None]  # scale varies by token
    store = KiviStore(nbits, 16, per_channel=False)
    store.append(x)
    got = dequantized(store, x)
    ref, step = ref_dequantized(per_token(x, 16), 4, nbits)
    ref, step = ref.reshape(x.shape), step.expand(-1, -1, -1, -1, 16).reshape(x.shape)
    err = (got - x).abs()
    assert (err <= 0.5 * step * 1.01 + 2e-3 * step.amax()).all()
    assert (got - ref).abs().max() <= step.max() * 1.01
    assert err.mean() <= (ref - x).abs().mean() * 1.05


def test_error_shrinks_with_bits():
    torch.manual_seed(2)
    x = torch.randn(1, 2, 64, 32)
    errors = []
    for nbits in (2, 4, 8):
        store = KiviStore(nbits, 32, per_channel=True)
        store.append(x)
        errors.append((dequantized(store, x) - x).abs().mean().item())
    assert errors[0] > 3 * errors[1] > 9 * errors[2]


def test_keys_are_grouped_per_channel_and_values_per_token():
    """One outlier channel in the keys only hurts that channel; one outlier token in the values only that token."""
    torch.manual_seed(3)
    x = torch.randn(1, 2, 64, 32)
    keys = x.clone()
    keys[..., 5] *= 100  # an outlier channel, as in real keys
    k_store = KiviStore(4, 32, per_channel=True)
    k_store.append(keys)
    k_err = (dequantized(k_store, keys) - keys).abs()
    normal = torch.ones(32, dtype=torch.bool)
    normal[5] = False
    per_token_ref, _ = ref_dequantized(per_token(keys, 32), 4, 4)  # what per-token grouping would give
    per_token_err = (per_token_ref.reshape(keys.shape) - keys).abs()
    assert k_err[..., normal].mean() < per_token_err[..., normal].mean() / 10
    assert k_err[..., normal].max() < 0.3

    values = x.clone()
    values[:, :, 7] *= 100  # an outlier token
    v_store = KiviStore(4, 32, per_channel=False)
    v_store.append(values)
    v_err = (dequantized(v_store, values) - values).abs()
    others = torch.ones(64, dtype=torch.bool)
    others[7] = False
    per_channel_ref, _ = ref_dequantized(per_channel(values, 32), 3, 4)
    per_channel_err = (per_channel_ref.reshape(values.shape) - values).abs()
    assert v_err[:, :, others].mean() < per_channel_err[:, :, others].mean() / 10
    assert v_err[:, :, others].max() < 0.3


def test_constant_groups_are_exact():
    store = KiviStore(2, 16, per_channel=True)
    x = torch.full((1, 1, 32, 8), 1.5)
    store.append(x)
    assert dequantized(store, x).equal(x)


def test_odd_head_dim_values_need_a_dividing_group():
    store = KiviStore(4, 16, per_channel=False)
    with pytest.raises(ValueError, match="must divide head_dim=24"):
        store.append(torch.randn(1, 1, 16, 24))


# -- the layer: residual, sinks, positions --------------------------------------------------------------
def kv(t, start=0, batch=2, heads=2, dim=16, seed=None):
    g = torch.Generator().manual_seed(start if seed is None else seed)
    k = torch.randn(batch, heads, t, dim, generator=g)
    return k, torch.randn(batch, heads, t, dim, generator=g)


def layer(**settings):
    return QuantizedLayer({"backend": "kivi", "nbits": 2, **SMALL, **settings})


def exact(t: torch.Tensor, settings=None) -> torch.Tensor:
    """What the unquantized buffer holds of float32 ``t``: kivi keeps 16 bits (as its scales), others 32."""
    return t.half().float() if (settings or {"backend": "kivi"})["backend"] == "kivi" else t


def test_prefill_keeps_the_latest_tokens_and_the_sinks_exact():
    q = layer()
    k, v = kv(100)
    keys, values = q.update(k, v, torch.arange(100))
    # 4 sinks, then whole 16-token blocks while at least residual_length=32 tokens stay exact
    assert (q.quantized_length, q.residual_length_now) == (64, 32)
    assert keys[:, :, :4].equal(exact(k[:, :, :4])) and values[:, :, :4].equal(exact(v[:, :, :4]))
    assert keys[:, :, 68:].equal(exact(k[:, :, 68:])) and values[:, :, 68:].equal(exact(v[:, :, 68:]))
    assert keys.dtype == torch.float32  # (the model's dtype)
    assert not keys[:, :, 4:68].equal(k[:, :, 4:68])  # really quantized (2 bits)
    assert (keys - k).abs().max() < 2.5


def test_a_short_prefill_is_not_quantized():
    q = layer()
    k, v = kv(4 + 32 + 15)  # one token short of a block beyond the residual
    keys, _ = q.update(k, v, torch.arange(k.shape[2]))
    assert q.quantized_length == 0 and keys.equal(exact(k)) and keys.dtype == torch.float32


@pytest.mark.parametrize("chunk", [1, 5, 16, 40])
def test_decoding_quantizes_block_by_block(chunk):
    q = layer()
    seen_k, seen_v, start = [], [], 0
    while start < 200:
        k, v = kv(chunk, start)
        keys, values = q.update(k, v, torch.arange(start, start + chunk))
        seen_k.append(k)
        seen_v.append(v)
        start += chunk
        all_k, all_v = torch.cat(seen_k, 2), torch.cat(seen_v, 2)
        assert keys.shape == all_k.shape and q.get_seq_length() == start
        n_exact = min(32, start - 4)
        if n_exact > 0:  # the last residual_length tokens are exact
            assert keys[:, :, -n_exact:].equal(exact(all_k[:, :, -n_exact:]))
            assert values[:, :, -n_exact:].equal(exact(all_v[:, :, -n_exact:]))
        assert q.quantized_length % 16 == 0
        assert q.residual_length_now == max(start - 4, 0) - q.quantized_length
        if start - 4 >= 32:  # the residual holds residual_length tokens and less than one more block
            assert 32 <= q.residual_length_now < 32 + 16
        assert (keys - all_k).abs().max() < 2.5 and (values - all_v).abs().max() < 2.5
    assert q.quantized_length >= 200 - 4 - 32 - 15


def test_quantized_part_does_not_change_once_written():
    """Blocks are quantized once: older tokens read back the same at every later step (no re-quantization)."""
    q = layer()
    k, v = kv(120)
    first, _ = q.update(k, v, torch.arange(120))
    n = 4 + q.quantized_length
    first = first[:, :, :n].clone()
    for t in range(120, 200):
        keys, _ = q.update(*kv(1, t), torch.tensor([t]))
    assert q.quantized_length > n and keys[:, :, :n].equal(first)


def test_key_positions_describe_the_returned_slots():
    q = layer()
    q.update(*kv(90), torch.arange(90))
    pos = q.key_positions(torch.tensor([90]))
    keys, _ = q.update(*kv(1, 90), torch.tensor([90]))
    assert pos.tolist() == list(range(91)) and keys.shape[2] == 91
    assert attention_mask(torch.tensor([91]), q.key_positions(torch.tensor([91]))) == (None, False)
    mask, _ = attention_mask(torch.arange(91, 94), q.key_positions(torch.arange(91, 94)))
    assert mask[0, 0].sum(-1).tolist() == [92, 93, 94]  # causal over every slot, quantized ones included
    with pytest.raises(ValueError, match="next positions must be 91"):
        q.check_cache_position(torch.tensor([95]))


def test_without_sinks_it_is_plain_kivi():
    q = layer(num_sink_tokens=0)
    k, v = kv(100)
    keys, _ = q.update(k, v, torch.arange(100))
    assert (q.quantized_length, q.residual_length_now) == (64, 36)
    assert not keys[:, :, :4].equal(k[:, :, :4])


def test_residual_length_zero_quantizes_all_whole_blocks():
    q = layer(residual_length=0, num_sink_tokens=0)
    q.update(*kv(40), torch.arange(40))
    assert (q.quantized_length, q.residual_length_now) == (32, 8)


def test_shared_workspace_and_nbytes_count_every_part():
    cache = QuantizedCache(cache_config={"backend": "kivi", "nbits": 4, **SMALL})
    for i in range(2):
        cache.update(*kv(100), i, {"cache_position": torch.arange(100)})
    q = cache.layers[0]
    b, h, d = 2, 2, 16
    n_quantized = 64
    codes = 2 * b * h * n_quantized * d // 2  # 4 bits, keys and values
    key_scales = 2 * b * h * (n_quantized // 16) * d * 2  # scale and zero, float16, per block and channel
    value_scales = 2 * b * h * n_quantized * (d // 16) * 2  # per token and channel group
    unquantized = 2 * b * h * (4 + 32 + 16) * d * 2  # sinks + residual buffers, float16
    assert q.nbytes() == codes + key_scales + value_scales + unquantized
    assert cache.nbytes() == 2 * q.nbytes()
    assert cache.workspace_nbytes() > 0 and cache.layers[1].workspace is cache.workspace


# -- editing: both parts ----------------------------------------------------------------------------------
def filled(settings, t=150, batch=3):
    cache = QuantizedCache(cache_config={**settings, **SMALL})
    for i in range(2):
        cache.update(*kv(t, batch=batch, seed=i), i, {"cache_position": torch.arange(t)})
    return cache


@pytest.mark.parametrize("settings", BACKENDS)
def test_reorder_moves_quantized_and_residual_parts(settings):
    cache = filled(settings)
    before = [cache.layers[i].keys.clone() for i in range(2)]
    before_v = [cache.layers[i].values.clone() for i in range(2)]
    assert cache.layers[0].quantized_length > 0 and cache.layers[0].residual_length_now > 0
    beam_idx = torch.tensor([2, 0, 0])
    cache.reorder_cache(beam_idx)
    for i in range(2):
        assert cache.layers[i].keys.equal(before[i][beam_idx])  # every slot, quantized ones included
        assert cache.layers[i].values.equal(before_v[i][beam_idx])
    # later tokens land in the reordered rows
    k, v = kv(1, 150, batch=3)
    keys, _ = cache.update(k, v, 0, {"cache_position": torch.tensor([150])})
    assert keys[:, :, :150].equal(before[0][beam_idx]) and keys[:, :, 150:].equal(exact(k, settings))
    cache.batch_select_indices(torch.tensor([1]))
    assert cache.layers[1].keys.equal(before[1][beam_idx][1:2])


@pytest.mark.parametrize("settings", BACKENDS)
def test_batch_repeat_interleave_repeats_both_parts(settings):
    cache = filled(settings, batch=2)
    before = cache.layers[0].keys.clone()
    cache.batch_repeat_interleave(3)
    assert cache.layers[0].keys.equal(before.repeat_interleave(3, dim=0))
    keys, _ = cache.update(*kv(20, 150, batch=6), 0, {"cache_position": torch.arange(150, 170)})
    assert keys.shape == (6, 2, 170, 16)


@pytest.mark.parametrize("settings", BACKENDS)
@pytest.mark.parametrize("length", [2, 30, 60, 95, 140])
def test_crop_keeps_a_prefix_of_both_parts(settings, length):
    cache = filled(settings)
    before = [(cache.layers[i].keys.clone(), cache.layers[i].values.clone()) for i in range(2)]
    cache.crop(length)
    assert cache.get_seq_length() == length
    for i in range(2):  # (a dequantized tail back in kivi's 16-bit buffer: within float16 rounding, |x| < 8)
        keys, values = cache.layers[i].keys, cache.layers[i].values
        atol = 4e-3 if settings["backend"] == "kivi" else 1e-6
        assert torch.allclose(keys, before[i][0][:, :, :length], atol=atol)
        assert torch.allclose(values, before[i][1][:, :, :length], atol=atol)
    k, v = kv(60, length, batch=3)
    keys, values = cache.update(k, v, 0, {"cache_position": torch.arange(length, length + 60)})
    assert keys.shape[2] == length + 60 and keys[:, :, -32:].equal(exact(k[:, :, -32:], settings))
    original = kv(150, batch=3, seed=0)[0]
    assert (keys[:, :, :length] - original[:, :, :length]).abs().max() < 2.5  # still the same tokens


@pytest.mark.parametrize("settings", BACKENDS)
def test_deepcopy_is_independent(settings):
    cache = filled(settings)
    twin = copy.deepcopy(cache)
    assert twin.layers[0].keys.equal(cache.layers[0].keys)
    assert twin.layers[0].workspace is twin.workspace is not cache.workspace
    before = cache.layers[0].keys.clone()
    twin.update(*kv(70, 150, batch=3), 0, {"cache_position": torch.arange(150, 220)})
    twin.reorder_cache(torch.tensor([1, 1, 0]))
    twin.crop(40)
    assert cache.get_seq_length() == 150 and cache.layers[0].keys.equal(before)


def test_a_copy_decodes_into_its_own_workspace():
    cache = filled({"backend": "kivi", "nbits": 4})
    cache.update(*kv(1, 150, batch=3), 0, {"cache_position": torch.tensor([150])})  # views prepared
    twin = copy.deepcopy(cache)
    token = kv(1, 151, batch=3)
    mine = cache.update(*token, 0, {"cache_position": torch.tensor([151])})[0].clone()
    theirs = twin.update(*token, 0, {"cache_position": torch.tensor([151])})[0]
    assert theirs.equal(mine)
    assert theirs.untyped_storage().data_ptr() == twin.workspace._buffers["keys"].untyped_storage().data_ptr()
    twin.update(*kv(10, batch=3), 2, {"cache_position": torch.arange(10)})  # a layer made after the copy
    assert twin.layers[2].workspace is twin.workspace and len(cache.layers) == 2


def test_returned_tensors_share_one_workspace_across_layers():
    """What a layer returns stays valid until the next update of any layer (attention uses it at once)."""
    cache = filled({"backend": "kivi", "nbits": 4})
    k0, _ = cache.update(*kv(1, 150, batch=3), 0, {"cache_position": torch.tensor([150])})
    k1, _ = cache.update(*kv(1, 150, batch=3, seed=9), 1, {"cache_position": torch.tensor([150])})
    assert k0.untyped_storage().data_ptr() == k1.untyped_storage().data_ptr()
    assert cache.layers[0].keys.untyped_storage().data_ptr() != k0.untyped_storage().data_ptr()  # .keys: a copy


def test_reset():
    cache = filled({"backend": "kivi", "nbits": 4})
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.nbytes() == 0
    keys, _ = cache.update(*kv(10), 0, {"cache_position": torch.arange(10)})
    assert keys.shape[2] == 10


# -- configuration ---------------------------------------------------------------------------------------
def test_config_defaults_are_the_seeds():
    c = QuantizedCacheConfig()
    assert (c.backend, c.nbits, c.axis_key, c.axis_value, c.q_group_size, c.residual_length, c.compute_dtype,
            c.device) == ("quanto", 4, 0, 0, 64, 128, torch.float16, "cpu")
    assert QuantizedCacheConfig.cache_implementation == "quantized"
    assert QuantizedCacheConfig.from_dict({"backend": "kivi", "nbits": 2}).to_dict()["nbits"] == 2
    assert QuantizedCacheConfig(backend="kivi", compute_dtype="bfloat16").compute_dtype == torch.bfloat16


def test_unset_group_size_is_64_except_kivi_two_bit_which_takes_the_papers_32():
    assert QuantizedCacheConfig(backend="kivi", nbits=2).q_group_size == 32
    assert QuantizedCacheConfig(backend="kivi", nbits=4).q_group_size == 64
    assert QuantizedCacheConfig(backend="quanto", nbits=2).q_group_size == 64
    assert QuantizedCacheConfig(backend="kivi", nbits=2, q_group_size=64).q_group_size == 64  # explicit wins
    config = QuantizedCacheConfig(backend="kivi")
    config.update(nbits=2)
    assert config.q_group_size == 32
    assert QuantizedCache(cache_config=config, nbits=4).cache_config.q_group_size == 64
    assert QuantizedCache("kivi", CONFIG, nbits=2).cache_config.q_group_size == 32
    explicit = QuantizedCacheConfig(backend="kivi", q_group_size=64)
    assert QuantizedCache(cache_config=explicit, nbits=2).cache_config.q_group_size == 64
    layer = QuantizedLayer({"backend": "kivi", "nbits": 2, "residual_length": 0, "num_sink_tokens": 0})
    layer.update(torch.randn(1, 1, 64, 32), torch.randn(1, 1, 64, 32), torch.arange(64))
    assert layer.quantized_length == 64 and layer.block == 32


@pytest.mark.parametrize("settings, message", [
    ({"backend": "quanto", "nbits": 8}, r"nbits=8 is not supported by the 'quanto' backend; it supports 2, 4"),
    ({"backend": "kivi", "nbits": 3}, r"nbits=3 .*'kivi' backend; it supports 2, 4, 8"),
    ({"backend": "hqq", "nbits": 5}, r"supports 1, 2, 3, 4, 8"),
    ({"backend": "quanto", "axis_key": 1}, r"axis_key=1 is not valid for the 'quanto' backend; allowed: 0, -1"),
    ({"backend": "hqq", "axis_value": -1}, r"axis_value=-1 .*allowed: 0, 1"),
    ({"backend": "kivi", "axis_key": 1}, r"kivi always quantizes keys per channel"),
    ({"backend": "tensorrt"}, r"unknown quantization backend 'tensorrt'; valid backends are: hqq, kivi, quanto"),
    ({"q_group_size": 0}, r"q_group_size must be a positive integer"),
    ({"backend": "kivi", "nbits": 2, "q_group_size": 6}, r"q_group_size must be a multiple of 4"),
    ({"residual_length": -1}, r"residual_length must be a non-negative integer"),
    ({"num_sink_tokens": -2}, r"num_sink_tokens must be a non-negative integer"),
    ({"compute_dtype": torch.int8}, r"compute_dtype must be a floating torch dtype"),
    ({"compute_dtype": "float17"}, r"'float17' is not a torch dtype name"),
    ({"nbit": 4}, r"unknown quantized cache_config keys \['nbit'\]; valid keys are: axis_key"),
])
def test_bad_settings_say_what_is_allowed(settings, message):
    with pytest.raises(ValueError, match=message):
        QuantizedCacheConfig.from_dict(settings)
    with pytest.raises(ValueError, match=message):
        QuantizedCache(cache_config=settings)


def test_every_constructor_spelling():
    kivi = QuantizedCacheConfig(backend="kivi", nbits=2)
    for cache in (QuantizedCache(kivi), QuantizedCache(cache_config=kivi),
                  QuantizedCache(cache_config={"backend": "kivi", "nbits": 2}),
                  QuantizedCache({"backend": "kivi", "nbits": 2}), QuantizedCache(backend="kivi", nbits=2),
                  QuantizedCache("kivi", CONFIG, nbits=2), QuantizedCache(config=CONFIG, cache_config=kivi),
                  create_cache("quantized", config=CONFIG, batch_size=1, max_cache_len=10, device="cpu",
                               dtype=torch.float32, cache_config={"backend": "kivi", "nbits": 2})):
        assert (cache.cache_config.backend, cache.cache_config.nbits) == ("kivi", 2)
    assert len(QuantizedCache("kivi", CONFIG).layers) == 3
    assert QuantizedCache(cache_config=kivi, residual_length=8).cache_config.residual_length == 8
    with pytest.raises(TypeError, match="dict or a QuantizedCacheConfig"):
        QuantizedCache(cache_config=["kivi"])


@needs_quanto
def test_quanto_spellings():
    for cache in (QuantoQuantizedCache(cache_config=QuantizedCacheConfig(nbits=2)),
                  QuantoQuantizedCache(QuantizedCacheConfig(nbits=2)), QuantoQuantizedCache(CONFIG, nbits=2),
                  QuantoQuantizedCache(config=CONFIG, nbits=2)):
        assert (cache.cache_config.backend, cache.cache_config.nbits) == ("quanto", 2)
    with pytest.raises(ValueError, match="nbits=8 is not supported by the 'quanto' backend"):
        QuantoQuantizedCache(config=CONFIG, nbits=8)
    assert isinstance(create_cache("quantized", config=CONFIG, batch_size=1, max_cache_len=10, device="cpu",
                                   dtype=torch.float32, cache_config=None), QuantizedCache)  # seeds' default


@needs_hqq
def test_hqq_spellings():
    cache = HQQQuantizedCache(cache_config=QuantizedCacheConfig(backend="hqq", nbits=8, axis_key=1, axis_value=1))
    assert (cache.cache_config.backend, cache.cache_config.nbits) == ("hqq", 8)
    assert HQQQuantizedCache(CONFIG, nbits=3, axis_key=1).cache_config.axis_key == 1


@pytest.mark.parametrize("backend, module, pip", [("quanto", "optimum.quanto", "pip install optimum-quanto"),
                                                  ("hqq", "hqq.core.quantize", "pip install hqq")])
def test_missing_backend_package_names_the_pip_command(monkeypatch, backend, module, pip):
    monkeypatch.setitem(sys.modules, module, None)  # makes the import fail
    with pytest.raises(ImportError, match=pip):
        QuantizedCache(backend=backend)


def test_a_backend_package_that_fails_to_import_says_why(monkeypatch, tmp_path):
    (tmp_path / "hqq").mkdir()
    (tmp_path / "hqq" / "__init__.py").write_text("import a_dependency_that_is_not_installed\n")
    for name in [m for m in sys.modules if m == "hqq" or m.startswith("hqq.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="installed, but importing it failed: No module named "
                                          "'a_dependency_that_is_not_installed'"):
        QuantizedCache(backend="hqq")


def test_sliding_layers_keep_a_full_precision_window():
    cfg = PretrainedConfig(model_type="mistral", hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                           layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    cache = QuantizedCache("kivi", cfg)
    assert isinstance(cache.layers[0], DynamicSlidingWindowLayer) and isinstance(cache.layers[1], QuantizedLayer)


# -- memory ----------------------------------------------------------------------------------------------
def kivi_ratio(nbits, tokens=4096, heads=3, dim=64, grow=False):
    q = QuantizedLayer({"backend": "kivi", "nbits": nbits, "q_group_size": 64})
    k = torch.randn(1, heads, tokens, dim, dtype=torch.float16)
    if grow:  # a short prompt, then token by token
        q.update(k[:, :, :16], k[:, :, :16], torch.arange(16))
        for t in range(16, tokens):
            q.update(k[:, :, t:t + 1], k[:, :, t:t + 1], torch.tensor([t]))
    else:
        q.update(k, k, torch.arange(tokens))
    dense = 2 * heads * tokens * dim * 2  # float16 keys and values
    return q.nbytes() / dense


def test_memory_per_token_against_float16():
    ratios = {nbits: kivi_ratio(nbits) for nbits in (2, 4, 8)}
    # theory per token and head (D=64, group 64): codes 2*64*nbits/8 bytes; float16 scale and zero point:
    # 4 bytes per key block channel / 64 tokens + 4 bytes per value token; 4 sinks + 192 residual slots exact
    for nbits, ratio in ratios.items():
        quantized = (4096 - 4 - 128) // 64 * 64
        theory = (quantized * (16 * nbits + 8) + (4 + 128 + 64) * 256) / (4096 * 256)
        assert ratio == pytest.approx(theory, rel=0.01)
    assert ratios[4] <= 0.33
    assert ratios[2] < 0.21 and ratios[8] < 0.57


def test_memory_after_token_by_token_growth_stays_close():
    assert kivi_ratio(4, tokens=2048, grow=True) <= kivi_ratio(4, tokens=2048) * 1.1


def test_bfloat16_keys_get_bfloat16_scales():
    q = QuantizedLayer({"backend": "kivi"})
    k = torch.randn(1, 1, 400, 64, dtype=torch.bfloat16)
    keys, _ = q.update(k, k, torch.arange(400))
    assert keys.dtype == torch.bfloat16 and q._kq.scale.dtype == torch.bfloat16
    assert (keys.float() - k.float()).abs().max() < 0.5


# -- the real model --------------------------------------------------------------------------------------
def test_generate_with_kivi_matches_the_dynamic_cache(smollm):
    model, tokenizer = smollm
    inputs = tokenizer("I like rock music because", return_tensors="pt")
    dynamic = model.generate(**inputs, do_sample=False, max_new_tokens=20)
    quantized = model.generate(**inputs, do_sample=False, max_new_tokens=20, cache_implementation="quantized",
                               cache_config={"backend": "kivi", "nbits": 4})
    assert quantized.equal(dynamic)  # with the default residual of 128 tokens nothing is quantized yet
    # no residual and groups of 8: all but the 4 sink tokens and the newest partial group are 4-bit codes
    out = model.generate(**inputs, do_sample=False, max_new_tokens=20, cache_implementation="quantized",
                         cache_config={"backend": "kivi", "nbits": 4, "residual_length": 0, "q_group_size": 8},
                         return_dict_in_generate=True)
    assert out.past_key_values.layers[0].quantized_length == 16 and out.sequences.equal(dynamic)


@needs_quanto
def test_generate_with_the_seeds_quanto_example(smollm):
    model, tokenizer = smollm
    inputs = tokenizer("I like rock music because", return_tensors="pt")
    dynamic = model.generate(**inputs, do_sample=False, max_new_tokens=20)
    out = model.generate(**inputs, do_sample=False, max_new_tokens=20, cache_implementation="quantized",
                         cache_config={"nbits": 4, "backend": "quanto"})
    assert out.equal(dynamic)  # the prompt and the newest tokens stay exact (the reference quantized them)


def test_long_prompt_through_a_quantized_cache(smollm):
    """A prompt long enough that most of it is quantized: 4-bit logits stay close to full precision."""
    model, tokenizer = smollm
    text = "The quick brown fox jumps over the lazy dog. " * 40
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :400]
    with torch.no_grad():
        ref = model(input_ids=ids, past_key_values=DynamicCache()).logits[0, -1].log_softmax(-1)
        cache = QuantizedCache("kivi", model.config, nbits=4)
        model(input_ids=ids[:, :-1], past_key_values=cache)
        assert cache.layers[0].quantized_length > 200
        got = model(input_ids=ids[:, -1:], past_key_values=cache).logits[0, -1].log_softmax(-1)
    kl = (ref.exp() * (ref - got)).sum()
    assert got.argmax() == ref.argmax() and kl < 0.05


def test_two_bit_keys_search_their_range_and_values_keep_min_max():
    """2-bit keys: per-channel ranges chosen by least squared error among narrowed ranges (never worse than
    min/max; the same error as a brute-force search); values keep the min/max range (clipping them cost more
    perplexity than it saved)."""
    from kvgen.cache.quantizers import KEY_RANGE_CUTS, minmax_quantize, scale_dtype

    x = torch.randn(1, 2, 4, 32, 16, generator=torch.Generator().manual_seed(0))
    x[..., 0, :] *= 8  # an outlier token in every group

    def reconstruct(t, dim, cuts):
        codes, scale, zero = minmax_quantize(t, dim, 2, scale_dtype(t.dtype), cuts)
        return codes.float() * scale.float() + zero.float()

    plain = (reconstruct(x, 3, ((0.0, 0.0),)) - x).square().sum(3)
    searched = (reconstruct(x, 3, KEY_RANGE_CUTS) - x).square().sum(3)
    assert (searched <= plain + 1e-5).all() and searched.sum() < 0.8 * plain.sum()

    # brute force, one slice (32 tokens of one channel) at a time: every cut pair, codes by rounding
    for slice_ in x.permute(0, 1, 2, 4, 3).reshape(-1, 32)[:16]:
        errors = []
        for a, b in KEY_RANGE_CUTS:
            lo, hi = slice_.min().item(), slice_.max().item()
            low, high = lo + a * (hi - lo), hi - b * (hi - lo)
            scale = float(torch.tensor((high - low) / 3).half())
            zero = float(torch.tensor(low).half())
            codes = ((slice_ - zero) / scale).round().clamp(0, 3)
            errors.append((codes * scale + zero - slice_).square().sum().item())
        got = (reconstruct(slice_.view(32, 1), 0, KEY_RANGE_CUTS).view(32) - slice_).square().sum().item()
        assert got == pytest.approx(min(errors), rel=1e-4, abs=1e-6)

    layer = QuantizedLayer({"backend": "kivi", "nbits": 2, "q_group_size": 32, "residual_length": 32,
                            "num_sink_tokens": 0})
    keys = torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(1))
    values = torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(2))
    keys[:, :, 3] *= 8
    layer.update(keys, values, torch.arange(64))
    assert layer.quantized_length == 32
    expected_keys = reconstruct(keys[:, :, :32].reshape(1, 2, 1, 32, 16), 3, KEY_RANGE_CUTS).reshape(1, 2, 32, 16)
    expected_values = reconstruct(values[:, :, :32].reshape(1, 2, 32, 1, 16), 4, ((0.0, 0.0),)).reshape(1, 2, 32, 16)
    torch.testing.assert_close(layer.keys[:, :, :32], expected_keys)
    torch.testing.assert_close(layer.values[:, :, :32], expected_values)
