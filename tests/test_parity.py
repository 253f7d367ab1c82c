"""Parity with Hugging Face transformers on small random checkpoints of every Llama-family variant.

transformers builds and saves each checkpoint; kvgen loads the folder. Logits must match
within 1e-4 (float32) for a left-padded batch with and without a cache, for the prefill
and 20 decode steps; greedy ``generate`` ids must be equal for dynamic and static caches.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import kvgen

ATOL = 1e-4
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2)

VARIANTS = {
    "llama-gqa": (transformers.LlamaConfig, {}),
    "llama-mha-tied": (transformers.LlamaConfig, {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama-mqa-linear": (transformers.LlamaConfig, {"num_key_value_heads": 1,
                                                    "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                        "rope_theta": 10000.0}}),
    "llama-dynamic": (transformers.LlamaConfig, {"max_position_embeddings": 16,
                                                 "rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                                                     "rope_theta": 10000.0}}),
    "llama3-rope": (transformers.LlamaConfig, {"rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16, "rope_theta": 500000.0}}),
    "mistral-sliding": (transformers.MistralConfig, {"sliding_window": 6}),
    "qwen2-bias": (transformers.Qwen2Config, {}),
    "qwen3-qknorm": (transformers.Qwen3Config, {"head_dim": 32}),
    "phi3-partial": (transformers.Phi3Config, {"num_key_value_heads": 4, "pad_token_id": 0, "eos_token_id": 2,
                                               "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                                   "partial_rotary_factor": 0.5}}),
}


def make_pair(name, tmp_path_factory):
    config_cls, extra = VARIANTS[name]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config_cls(**{**BASE, **extra})).eval()
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder)
    return hf, kvgen.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), folder


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    hf, ours, _ = make_pair(request.param, tmp_path_factory)
    return request.param, hf, ours


def left_padded_batch(seed=1, length=12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (3, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :1] = 0
    ids[mask == 0] = 0
    return ids, mask


def positions(mask):
    return (mask.cumsum(-1) - 1).clamp(min=0)


def test_loaded_model_is_the_family_class(pair):
    name, hf, ours = pair
    assert ours.config.model_type == hf.config.model_type
    assert type(ours).__name__.lower().startswith(hf.config.model_type[:4])


@torch.no_grad()
def check_logits_without_cache(hf, ours) -> None:
    """A left-padded batch without a cache: kvgen's logits equal transformers' on the real tokens."""
    ids, mask = left_padded_batch()
    ref = hf(ids, attention_mask=mask, position_ids=positions(mask), use_cache=False).logits
    got = ours(ids, attention_mask=mask, position_ids=positions(mask), use_cache=False).logits
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], atol=ATOL, rtol=0)


@torch.no_grad()
def check_prefill_and_decode(hf, ours, steps: int = 20):
    """A left-padded prefill, then ``steps`` random tokens, through each library's DynamicCache(config=):
    logits equal at every step. Returns kvgen's cache and the final attention mask."""
    ids, mask = left_padded_batch()
    hf_cache, cache = transformers.DynamicCache(config=hf.config), kvgen.DynamicCache(config=ours.config)
    pos = positions(mask)
    ref = hf(ids, attention_mask=mask, position_ids=pos, past_key_values=hf_cache).logits
    got = ours(ids, attention_mask=mask, position_ids=pos, past_key_values=cache).logits
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], atol=ATOL, rtol=0)
    g = torch.Generator().manual_seed(2)
    for step in range(steps):
        new = torch.randint(3, 128, (3, 1), generator=g)
        mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], dim=-1)
        pos = pos[:, -1:] + 1
        cache_position = torch.tensor([mask.shape[1] - 1])
        ref = hf(new, attention_mask=mask, position_ids=pos, past_key_values=hf_cache,
                 cache_position=cache_position).logits
        got = ours(new, attention_mask=mask, position_ids=pos, past_key_values=cache,
                   cache_position=cache_position).logits
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0, msg=f"decode step {step}")
    return cache, mask


def test_logits_without_cache(pair):
    check_logits_without_cache(*pair[1:])


def test_logits_prefill_and_20_decode_steps_with_cache(pair):
    cache, mask = check_prefill_and_decode(*pair[1:])
    assert cache.get_seq_length() == mask.shape[1]


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_greedy_generate_ids_equal(pair, cache_implementation):
    _, hf, ours = pair
    ids, mask = left_padded_batch(seed=3, length=8)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
    ref = hf.generate(ids, cache_implementation=cache_implementation, **kwargs)
    got = ours.generate(ids, cache_implementation=cache_implementation, disable_compile=True, **kwargs)
    assert torch.equal(got, ref)


def test_old_rope_config_format_loads_the_same(tmp_path_factory):
    """config.json with ``rope_theta`` + ``rope_scaling`` (older transformers) equals ``rope_parameters``."""
    hf, new_form, folder = make_pair("llama-mqa-linear", tmp_path_factory)
    path = folder / "config.json"
    data = json.loads(path.read_text())
    params = data.pop("rope_parameters")
    data["rope_theta"] = params["rope_theta"]
    data["rope_scaling"] = {"type": params["rope_type"], "factor": params["factor"]}
    path.write_text(json.dumps(data))
    old_form = kvgen.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    assert old_form.config.rope_parameters["rope_type"] == "linear"
    ids = torch.randint(0, 128, (1, 30))
    with torch.no_grad():
        torch.testing.assert_close(old_form(ids).logits, new_form(ids).logits, atol=0, rtol=0)
        torch.testing.assert_close(old_form(ids).logits, hf(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("batch", [1, 3])
def test_static_generate_compiled_equals_transformers(tmp_path_factory, batch):
    """The compiled static decode step gives the same ids and compiles once for all steps."""
    hf, ours, _ = make_pair("llama-gqa", tmp_path_factory)
    ids, mask = left_padded_batch(seed=4, length=8)
    ids, mask = ids[:batch], mask[:batch]
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    ref = hf.generate(ids, **kwargs)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):  # one graph for every step and both calls
        got = ours.generate(ids, cache_implementation="static", **kwargs)
        again = ours.generate(ids, cache_implementation="static", **kwargs)
    assert torch.equal(got, ref) and torch.equal(again, ref)
