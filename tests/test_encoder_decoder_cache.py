"""EncoderDecoderCache on synthetic tensors, against transformers' EncoderDecoderCache doing the same edits.

The halves are filled with the same tensors on both sides; after every edit (reorder, batch
selection and repetition, crop, reset, legacy round trip, deepcopy) the stored keys and values
must be equal. Mixed halves (static self-attention with dynamic cross-attention and the reverse)
must hold what two dynamic halves hold.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from kvgen import DynamicCache, EncoderDecoderCache, StaticCache
from kvgen.cache import Cache
from kvgen.cache.encoder_decoder import as_encoder_decoder_cache
from kvgen.config import PretrainedConfig

LAYERS, B, H, D, S = 2, 3, 2, 4, 7  # S: encoder length
CONFIG = PretrainedConfig(model_type="whisper", d_model=H * D, decoder_attention_heads=H, decoder_layers=LAYERS,
                          encoder_layers=LAYERS, max_target_positions=32, max_source_positions=S)


def tensors(t, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, t, D, generator=g), torch.randn(B, H, t, D, generator=g)


def halves(kind):
    return {
        "dynamic": lambda: DynamicCache(),
        "static-self": lambda: StaticCache(config=CONFIG, max_cache_len=32),
        "static-cross": lambda: StaticCache(config=CONFIG, max_cache_len=S),
    }[kind]()


def fill(ours, theirs, steps=(5, 1, 1)):
    """Cross-attention once, then self-attention prompt + decode steps, on both caches."""
    for i in range(LAYERS):
        k, v = tensors(S, 100 + i)
        ours.update_cross_attention(k, v, i)
        theirs.cross_attention_cache.update(k, v, i)
    start = 0
    for step, t in enumerate(steps):
        for i in range(LAYERS):
            k, v = tensors(t, 10 * step + i)
            got = ours.update(k, v, i, {"cache_position": torch.arange(start, start + t)})
            want = theirs.self_attention_cache.update(k, v, i)
            assert torch.equal(got[0][:, :, :start + t], want[0]) and torch.equal(got[1][:, :, :start + t], want[1])
        start += t


def assert_same(ours, theirs):
    assert ours.get_seq_length() == theirs.get_seq_length()
    for i in range(LAYERS):
        for half in ("self_attention_cache", "cross_attention_cache"):
            got, want = getattr(ours, half).layers[i], getattr(theirs, half).layers[i]
            assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values), (half, i)


COMBOS = [("dynamic", "dynamic"), ("static-self", "dynamic"), ("dynamic", "static-cross"),
          ("static-self", "static-cross")]


@pytest.fixture(params=COMBOS, ids=["+".join(c) for c in COMBOS])
def pair(request):
    self_kind, cross_kind = request.param
    ours = EncoderDecoderCache(halves(self_kind), halves(cross_kind))
    theirs = transformers.EncoderDecoderCache(transformers.DynamicCache(), transformers.DynamicCache())
    fill(ours, theirs)
    return ours, theirs


def test_fill_and_lengths(pair):
    ours, theirs = pair
    assert_same(ours, theirs)
    assert ours.get_seq_length() == 7 and len(ours) == LAYERS
    assert all(ours.cross_attention_filled(i) for i in range(LAYERS)) and not ours.cross_attention_filled(LAYERS)
    assert ours.is_updated == {0: True, 1: True}
    k, v = ours.cross_attention_states(1)
    assert torch.equal(k, tensors(S, 101)[0]) and k.shape[2] == S
    assert isinstance(ours, Cache)
    assert ours.layers is ours.self_attention_cache.layers


def test_reorder_and_batch_ops_act_on_both_halves(pair):
    ours, theirs = pair
    beam_idx = torch.tensor([2, 0, 0])
    ours.reorder_cache(beam_idx)
    theirs.reorder_cache(beam_idx)
    assert_same(ours, theirs)
    keep = torch.tensor([1, 2])
    ours.batch_select_indices(keep)
    theirs.batch_select_indices(keep)
    assert_same(ours, theirs)
    ours.batch_repeat_interleave(2)
    theirs.batch_repeat_interleave(2)
    assert_same(ours, theirs)
    assert ours.cross_attention_cache.layers[0].keys.shape[0] == 4


def test_crop_touches_only_the_self_attention(pair):
    ours, theirs = pair
    ours.crop(5)
    theirs.crop(-2)  # transformers 5 crops dynamic layers with negative counts only
    assert_same(ours, theirs)
    assert ours.get_seq_length() == 5 and ours.cross_attention_cache.layers[0].keys.shape[2] == S
    ours.crop(-1)
    assert ours.get_seq_length() == 4


def test_reset_empties_both_halves(pair):
    ours, _ = pair
    ours.reset()
    assert ours.get_seq_length() == 0
    assert not any(ours.cross_attention_filled(i) for i in range(LAYERS))
    with pytest.raises(ValueError, match="not filled"):
        ours.cross_attention_states(0)
    k, v = tensors(S, 7)  # refilled for another clip
    got_k, _ = ours.update_cross_attention(k, v, 0)
    assert torch.equal(got_k, k) and ours.cross_attention_filled(0)


def test_deepcopy_is_independent(pair):
    ours, theirs = pair
    copied = copy.deepcopy(ours)
    assert_same(copied, theirs)
    k, v = tensors(1, 99)
    for i in range(LAYERS):
        copied.update(k, v, i, {"cache_position": torch.tensor([7])})
    copied.reorder_cache(torch.tensor([1, 1, 1]))
    assert_same(ours, theirs)  # the original did not change
    assert copied.get_seq_length() == 8 and copied.is_updated == ours.is_updated


def test_legacy_round_trip_matches_transformers(pair):
    ours, theirs = pair
    legacy = ours.to_legacy_cache()
    assert len(legacy) == LAYERS and all(len(entry) == 4 for entry in legacy)
    reference = transformers.EncoderDecoderCache(legacy)  # transformers' 4-tuple constructor
    for built in (EncoderDecoderCache.from_legacy_cache(legacy), EncoderDecoderCache(legacy)):
        assert_same(built, reference)
        assert built.is_updated == reference.is_updated == {0: True, 1: True}
        assert isinstance(built.self_attention_cache, DynamicCache)
    assert [tuple(t.shape) for t in ours[0]] == [(B, H, 7, D)] * 2 + [(B, H, S, D)] * 2
    assert [len(entry) for entry in ours] == [4, 4]


def test_generic_cache_interface_follows_the_self_attention_half():
    static = EncoderDecoderCache(StaticCache(config=CONFIG, max_cache_len=32), DynamicCache())
    assert static.is_compileable and static.get_max_cache_shape() == 32
    dynamic = EncoderDecoderCache(DynamicCache(), StaticCache(config=CONFIG, max_cache_len=S))
    assert not dynamic.is_compileable and dynamic.get_max_cache_shape() is None
    ids = torch.tensor([[5, 6, 7, 8]] * B)
    k, v = tensors(4, 0)
    dynamic.record_token_ids(ids, torch.arange(4))
    dynamic.update(k, v, 0, {"cache_position": torch.arange(4)})
    assert dynamic.token_ids is dynamic.self_attention_cache.token_ids
    assert dynamic.common_prefix_length(torch.tensor([[5, 6, 9, 9, 9]] * B)) == 2
    dynamic.token_ids = None
    assert dynamic.self_attention_cache.token_ids is None
    mask_positions = dynamic.key_positions(0, torch.tensor([4]))
    assert mask_positions.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="cache_position"):
        dynamic.check_cache_position(torch.tensor([9]))


def test_a_preallocated_cross_half_too_small_for_the_encoder_is_an_error():
    cache = EncoderDecoderCache(DynamicCache(), StaticCache(config=CONFIG, max_cache_len=S - 2))
    with pytest.raises(ValueError, match="max_cache_len"):
        cache.update_cross_attention(*tensors(S, 0), 0)


def test_bad_arguments():
    with pytest.raises(TypeError, match="cross_attention_cache must be a kvgen Cache"):
        EncoderDecoderCache(DynamicCache(), ((torch.zeros(1),),))
    with pytest.raises(TypeError, match="takes"):
        EncoderDecoderCache(DynamicCache(), DynamicCache(), DynamicCache())
    with pytest.raises(ValueError, match="4 tensors"):
        EncoderDecoderCache.from_legacy_cache([tensors(2, 0)])
    with pytest.raises(TypeError, match="past_key_values"):
        as_encoder_decoder_cache("cache")
    plain = DynamicCache()
    wrapped, legacy = as_encoder_decoder_cache(plain)
    assert wrapped.self_attention_cache is plain and not legacy
    assert as_encoder_decoder_cache(wrapped) == (wrapped, False)
