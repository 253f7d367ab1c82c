"""Jamba: parity with transformers on a small random checkpoint mixing attention, Mamba and
mixture-of-experts layers, and the HybridMambaAttentionDynamicCache.

transformers builds and saves the checkpoint (norms, conv biases, D and A randomised, so that a
tensor read from the wrong place, or padding that leaks, shows); kvgen loads the folder. Logits
must match within 1e-4 (float32) for a left-padded batch, with a cache passed by hand as in the
seeds' example; greedy ids (dynamic and static caches) and beam-search ids must equal transformers'.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import kvgen
from kvgen import DynamicCache, HybridMambaAttentionDynamicCache, StaticCache
from kvgen.cache.dynamic import DynamicLayer
from kvgen.cache.ssm import SSMLayer

from test_mamba import (ATOL, VOCAB, check_beam_search, check_greedy_generate, check_left_padded_logits,  # noqa: F401
                        check_reorder_repeat_and_deepcopy, left_padded_batch, one_thread,
                        randomise_constant_parameters, tokens)  # (one_thread: the same setup)

# layers: 0 mamba+experts, 1 attention+dense, 2 mamba+experts, 3 attention+dense, 4 mamba+experts
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
              num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
              expert_layer_offset=0, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4,
              mamba_expand=2, initializer_range=0.05, pad_token_id=0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.JambaForCausalLM(transformers.JambaConfig(**CONFIG)).eval()
    randomise_constant_parameters(hf)
    folder = tmp_path_factory.mktemp("jamba")
    hf.save_pretrained(folder)
    return hf, kvgen.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), folder


def test_layer_kinds_follow_transformers(pair):
    hf, ours, _ = pair
    assert type(ours) is kvgen.JambaForCausalLM
    kinds = ["full_attention" if kind == "attention" else "mamba" for kind in hf.config.layers_block_type]
    assert ours.config.layer_types == kinds == ["mamba", "full_attention"] * 2 + ["mamba"]
    moe = [n > 1 for n in hf.config.layers_num_experts]
    assert [hasattr(layer.feed_forward, "experts") for layer in ours.model.layers] == moe
    cfg = kvgen.JambaConfig(num_hidden_layers=8, attn_layer_period=4, attn_layer_offset=3)
    ref = transformers.JambaConfig(num_hidden_layers=8, attn_layer_period=4, attn_layer_offset=3)
    assert cfg.layer_types == [{"linear_attention": "mamba"}.get(kind, kind) for kind in ref.layer_types]
    with pytest.raises(ValueError, match="attn_layer_offset"):
        kvgen.JambaConfig(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=2)


def test_logits_match_transformers_with_left_padding(pair):
    check_left_padded_logits(*pair[:2], length=30)


@torch.no_grad()
def test_hand_made_cache_prefill_and_decode_match_transformers(pair):
    """The seeds' example: build the cache, pass it to forward, then decode one token at a time."""
    hf, ours, _ = pair
    ids, mask = left_padded_batch(seed=2, length=10)
    new = tokens(3, 3, 12)
    full_ids = torch.cat([ids, new], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(new)], dim=1)
    ref = hf(full_ids, attention_mask=full_mask, use_cache=False).logits
    uncached = ours(full_ids, attention_mask=full_mask, use_cache=False).logits
    cache = HybridMambaAttentionDynamicCache(ours.config, batch_size=3, dtype=ours.dtype, device=ours.device)
    out = ours(ids, attention_mask=mask, past_key_values=cache)
    assert out.past_key_values is cache and cache.get_seq_length() == 10
    real = mask.bool()
    torch.testing.assert_close(out.logits[real], ref[:, :10][real], atol=ATOL, rtol=0)
    for t in range(10, 22):
        step = ours(full_ids[:, t:t + 1], attention_mask=full_mask[:, :t + 1], past_key_values=cache,
                    cache_position=torch.tensor([t])).logits[:, 0]
        torch.testing.assert_close(step, ref[:, t], atol=ATOL, rtol=0, msg=f"token {t}")
        torch.testing.assert_close(step, uncached[:, t], atol=ATOL, rtol=0)
    assert cache.get_seq_length() == 22
    assert [type(layer) for layer in cache.layers] == [SSMLayer, DynamicLayer] * 2 + [SSMLayer]


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_greedy_generate_left_padded_equals_transformers(pair, cache_implementation):
    check_greedy_generate(*pair[:2], cache_implementation, seed=4)


@torch.no_grad()
def test_long_prompt_matches_transformers(pair):
    hf, ours, _ = pair
    ids = tokens(5, 2, 160)
    torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=ATOL, rtol=0)


def test_beam_search_equals_transformers(pair):
    check_beam_search(*pair[:2])


@torch.no_grad()
def test_reorder_repeat_reset_crop_and_deepcopy(pair):
    """Keys, values and SSM states all follow their rows."""
    _, ours, _ = pair
    ids = tokens(6, 2, 12)
    cache, full = check_reorder_repeat_and_deepcopy(ours, ids)
    cache.crop(12)
    with pytest.raises(ValueError, match="cannot crop a state-space"):
        cache.crop(4)
    assert cache.get_seq_length() == 12 and cache.layers[1].get_seq_length() == 12  # nothing was cropped
    cache.reset()
    assert cache.get_seq_length() == 0
    torch.testing.assert_close(ours(ids, past_key_values=cache).logits, full, atol=ATOL, rtol=0)


def test_caches_from_config_mix_layer_kinds(pair):
    _, ours, _ = pair
    kinds = [SSMLayer, DynamicLayer] * 2 + [SSMLayer]
    assert [type(layer) for layer in DynamicCache(config=ours.config).layers] == kinds
    static = StaticCache(config=ours.config, max_batch_size=1, max_cache_len=32, dtype=torch.float32)
    assert [type(layer).__name__ for layer in static.layers] == ["SSMLayer", "StaticLayer"] * 2 + ["SSMLayer"]
    hybrid = HybridMambaAttentionDynamicCache(ours.config, batch_size=2, dtype=torch.float32)
    assert tuple(hybrid.conv_states[0].shape) == (2, 128, 4) and hybrid.conv_states[1] is None


@torch.no_grad()
def test_fused_expert_tensors_load(pair, tmp_path):
    """transformers 5 keeps experts stacked (``experts.gate_up_proj``); older files have one tensor per expert."""
    hf, ours, folder = pair
    tensors = load_file(folder / "model.safetensors")
    assert "model.layers.0.feed_forward.experts.3.gate_proj.weight" in tensors  # what transformers saved
    fused = {name: t.contiguous() for name, t in ours.state_dict().items()}  # kvgen keeps them stacked
    save_file(fused, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    again = kvgen.AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = tokens(7, 1, 9)
    torch.testing.assert_close(again(ids).logits, hf(ids).logits, atol=ATOL, rtol=0)
