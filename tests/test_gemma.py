"""Gemma 2 and Gemma 3: parity with transformers on random checkpoints and on the real Gemma 3 270M GGUF.

Random checkpoints: transformers builds and saves them (norm weights randomised, since they
start at 0 and would hide a wrong ``1 + weight``); kvgen loads the folder. Logits match
within 1e-4 (float32) for a left-padded batch longer than the sliding window, with and
without a cache, over a prefill and 20 decode steps; greedy ids are equal for the dynamic,
static and hybrid caches. The real model: greedy output for a 600-token prompt (past its
512-token window) equals transformers' on the same weights for the same three caches.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import kvgen
from kvgen import HybridCache
from reference import transformers_gguf, transformers_gguf_model, transformers_gguf_tokenizer
from test_parity import ATOL, check_logits_without_cache, check_prefill_and_decode, left_padded_batch
WINDOW = 5
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, initializer_range=0.2,
            sliding_window=WINDOW)

VARIANTS = {
    # softcapping of attention scores and logits, query_pre_attn_scalar != head_dim, alternating layers
    "gemma2": (transformers.Gemma2Config, {"query_pre_attn_scalar": 24, "attn_logit_softcapping": 5.0,
                                           "final_logit_softcapping": 3.0}),
    # q/k norm, one global layer in 2, linear-scaled global rope and a separate local base
    "gemma3": (transformers.Gemma3TextConfig, {"sliding_window_pattern": 2, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
}


def make_pair(name, tmp_path_factory):
    config_cls, extra = VARIANTS[name]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config_cls(**{**BASE, **extra})).eval()
    with torch.no_grad():
        for param_name, param in hf.named_parameters():
            if "norm" in param_name:
                param.normal_(0, 0.5)
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder)
    return hf, kvgen.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), folder


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    hf, ours, _ = make_pair(request.param, tmp_path_factory)
    return request.param, hf, ours


# -- configs --------------------------------------------------------------------------------------------


def test_layer_types_and_rope_follow_transformers():
    for cls, model_type, extra in [(transformers.Gemma2Config, "gemma2", {}),
                                   (transformers.Gemma3TextConfig, "gemma3_text", {"sliding_window_pattern": 3})]:
        ref = cls(num_hidden_layers=7, **extra)
        ours = kvgen.PretrainedConfig(model_type=model_type, num_hidden_layers=7, hidden_size=64,
                                      num_attention_heads=4, **extra)
        assert ours.layer_types == ref.layer_types
        assert (ours.head_dim, ours.query_pre_attn_scalar, ours.tie_word_embeddings) == (256, 256, True)
    ours = kvgen.PretrainedConfig(model_type="gemma3_text", num_hidden_layers=2, hidden_size=64,
                                  num_attention_heads=4)
    assert ours.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
    assert ours.local_rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}


def test_gemma3_old_config_format_loads_the_same(tmp_path_factory):
    """``rope_theta`` + ``rope_scaling`` + ``rope_local_base_freq`` + ``sliding_window_pattern`` (older
    transformers, the published Gemma 3 configs) equal the per-layer-type ``rope_parameters``."""
    hf, new_form, folder = make_pair("gemma3", tmp_path_factory)
    path = folder / "config.json"
    data = json.loads(path.read_text())
    params = data.pop("rope_parameters")
    del data["layer_types"]
    data.update(rope_theta=params["full_attention"]["rope_theta"], rope_scaling={"type": "linear", "factor": 2.0},
                rope_local_base_freq=params["sliding_attention"]["rope_theta"], sliding_window_pattern=2)
    path.write_text(json.dumps(data))
    old_form = kvgen.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert old_form.config.layer_types == hf.config.layer_types
    assert old_form.config.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(old_form(ids).logits, new_form(ids).logits, atol=0, rtol=0)
    # a config saved by kvgen reloads to the same config
    old_form.config.save_pretrained(tmp_path_factory.mktemp("resaved"))
    assert kvgen.PretrainedConfig.from_dict(old_form.config.to_dict()) == old_form.config


# -- random checkpoints against transformers ------------------------------------------------------------


def test_loaded_model_is_the_gemma_class(pair):
    name, hf, ours = pair
    assert type(ours) is {"gemma2": kvgen.Gemma2ForCausalLM, "gemma3": kvgen.Gemma3ForCausalLM}[name]
    assert ours.lm_head.weight is ours.model.embed_tokens.weight  # tied


def test_logits_without_cache(pair):
    check_logits_without_cache(*pair[1:])


def test_logits_prefill_and_20_decode_steps_with_cache(pair):
    _, hf, ours = pair
    cache, mask = check_prefill_and_decode(hf, ours)
    # the true length, though layer 0 is a sliding layer that keeps only its window
    assert cache.get_seq_length() == mask.shape[1] == 32
    for kind, (keys, _) in zip(ours.config.layer_types, cache):  # sliding layers stay bounded
        assert keys.shape[2] == (WINDOW if kind == "sliding_attention" else 32)


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static", "hybrid"])
def test_greedy_generate_ids_equal(pair, cache_implementation):
    _, hf, ours = pair
    ids, mask = left_padded_batch(seed=3, length=8)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
    ref = hf.generate(ids, cache_implementation="dynamic", **kwargs)
    got = ours.generate(ids, cache_implementation=cache_implementation, disable_compile=True, **kwargs)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("cache_implementation", ["dynamic", "hybrid"])
def test_compiled_decode_equals_transformers(tmp_path_factory, cache_implementation):
    """Compiled decode: per-layer blocks (dynamic cache) or the whole static-shape step (hybrid),
    each compiling once for every step and layer kind."""
    hf, ours, _ = make_pair("gemma3", tmp_path_factory)
    ids, mask = left_padded_batch(seed=4, length=8)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    ref = hf.generate(ids, **kwargs)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = ours.generate(ids, cache_implementation=cache_implementation, **kwargs)
        again = ours.generate(ids, cache_implementation=cache_implementation, **kwargs)
    assert torch.equal(got, ref) and torch.equal(again, ref)


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
def test_sink_cache_re_rotates_with_each_layer_types_rope(tmp_path, layer_type):
    """A SinkCache on Gemma 3 re-rotates global keys with the (linear-scaled) global rope and local
    keys with the local one: streaming equals a fresh forward over [sinks + window] (one layer, so
    the kept keys carry nothing of evicted tokens)."""
    from kvgen.cache.sink import SinkCache

    pattern = 1 if layer_type == "full_attention" else 2  # every layer global / layer 0 local
    config = transformers.Gemma3TextConfig(**{**BASE, "num_hidden_layers": 1, "sliding_window": 64},
                                           sliding_window_pattern=pattern, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = kvgen.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.config.layer_types == [layer_type]
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(6))
    cache = SinkCache(window_length=8, num_sink_tokens=2)
    with torch.no_grad():
        model(ids[:, :7], past_key_values=cache)
        for t in range(7, 20):
            got = model(ids[:, t:t + 1], past_key_values=cache).logits
        fresh = model(torch.cat([ids[:, :2], ids[:, 14:]], dim=1), use_cache=False).logits  # positions 0..7
    torch.testing.assert_close(got, fresh[:, -1:], atol=ATOL, rtol=0)


def test_seeds_gemma2_example_reuses_the_cache_with_forward(tmp_path_factory):
    """Seed 002, "Hybrid Cache": generate, then forward() on the returned cache with an explicit
    ``cache_position`` (the seed passes the whole sequence's positions, ``arange(len)``, and only
    the last token). The seed's tokenizer and hub id are replaced by token ids and a random Gemma 2."""
    from kvgen import GemmaForCausalLM

    _, _, folder = make_pair("gemma2", tmp_path_factory)
    model = GemmaForCausalLM.from_pretrained(folder)
    inputs = {"input_ids": torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(5))}

    for cache_implementation in (None, "hybrid"):  # the model's default cache, and the seed's HybridCache
        extra = {"cache_implementation": cache_implementation} if cache_implementation else {}
        generate_out = model.generate(inputs["input_ids"], max_length=30, return_dict_in_generate=True,
                                      disable_compile=True, **extra)
        # the seed's code from here on
        past_key_values = generate_out.past_key_values
        cache_position = torch.arange(generate_out.sequences.shape[1], dtype=torch.int64, device=model.device)
        new_input_ids = generate_out.sequences[:, -1:]

        out = model(new_input_ids, past_key_values=past_key_values, cache_position=cache_position)
        logits = out.logits

        if cache_implementation:
            assert isinstance(past_key_values, HybridCache)
        assert past_key_values.get_seq_length() == 30
        with torch.no_grad():
            expected = model(generate_out.sequences, use_cache=False).logits[:, -1:]
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_gemma2_gguf_names_norms_and_config(tmp_path):
    """llama.cpp's Gemma names (ffn_norm is the norm *before* the MLP), norms stored as 1 + weight."""
    import gguf
    import numpy as np

    from kvgen.loading.gguf import load_gguf

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(tmp_path / "g2.gguf"), "gemma2")
    writer.add_block_count(1)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_length(16)
    writer.add_sliding_window(7)
    writer.add_float32("gemma2.attn_logit_softcapping", 40.0)
    writer.add_float32("gemma2.final_logit_softcapping", 20.0)
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
             "blk.0.post_attention_norm.weight": "model.layers.0.post_attention_layernorm.weight",
             "blk.0.ffn_norm.weight": "model.layers.0.pre_feedforward_layernorm.weight",
             "blk.0.post_ffw_norm.weight": "model.layers.0.post_feedforward_layernorm.weight",
             "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight"}
    written = {name: rng.standard_normal((100, 64) if name == "token_embd.weight" else (64, 64) if "attn_q" in name
                                         else (64,), dtype=np.float32) for name in names}
    rest = {"blk.0.attn_k.weight": (32, 64), "blk.0.attn_v.weight": (32, 64), "blk.0.attn_output.weight": (64, 64),
            "blk.0.ffn_gate.weight": (96, 64), "blk.0.ffn_up.weight": (96, 64), "blk.0.ffn_down.weight": (64, 96)}
    for name, array in written.items():
        writer.add_tensor(name, array)
    for name, shape in rest.items():  # the rest of the layer (4 heads and 2 key/value heads of 16)
        writer.add_tensor(name, rng.standard_normal(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    config, state = load_gguf(tmp_path / "g2.gguf")
    assert (config["model_type"], config["sliding_window"], config["hidden_activation"]) == ("gemma2", 7,
                                                                                             "gelu_pytorch_tanh")
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (40.0, 20.0)
    assert config["rope_theta"] == 10000.0 and config["tie_word_embeddings"]
    for gguf_name, hf_name in names.items():
        offset = 1 if gguf_name.endswith("norm.weight") else 0
        assert torch.equal(state[hf_name], torch.from_numpy(written[gguf_name]) - offset), hf_name


# -- the real Gemma 3 270M (GGUF) against transformers -------------------------------------------------

PROMPT_TOKENS, NEW_TOKENS = 600, 10


@pytest.fixture(scope="session")
def gemma3_gguf():
    from kvgen.loading.default_model import gemma3_gguf_path

    return gemma3_gguf_path()  # installed by scripts/setup.sh --test: missing is a failure


@pytest.fixture(scope="session")
def gemma3(gemma3_gguf):
    model = kvgen.AutoModelForCausalLM.from_pretrained(gemma3_gguf, dtype=torch.float32)
    return model, kvgen.AutoTokenizer.from_pretrained(gemma3_gguf)


@pytest.fixture(scope="session")
def gemma3_prompt(gemma3):
    """A 600-token prompt of English documentation: longer than the 512-token window."""
    import pydoc_data.topics

    _, tokenizer = gemma3
    text = "\n".join(pydoc_data.topics.topics[name] for name in ("assert", "assignment", "augassign"))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :PROMPT_TOKENS]
    assert ids.shape[1] == PROMPT_TOKENS
    return ids


@pytest.fixture(scope="session")
def gemma3_transformers(gemma3, gemma3_gguf, gemma3_prompt):
    """transformers' Gemma 3 on the config and tensors its own GGUF loader reads (tests/reference.py), its
    tensors and its greedy ids."""
    model, (_, tensors) = transformers_gguf_model(gemma3_gguf), transformers_gguf(gemma3_gguf)
    with torch.no_grad():
        greedy = model.generate(gemma3_prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    return model, tensors, greedy


def test_real_gemma3_gguf_loads_like_transformers(gemma3, gemma3_transformers):
    model, _ = gemma3
    ref_model, ref_tensors, _ = gemma3_transformers
    config = model.config
    assert type(model) is kvgen.Gemma3ForCausalLM and config.model_type == "gemma3_text"
    assert config.layer_types == ref_model.config.layer_types and config.layer_types.count("full_attention") == 3
    for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim",
                "intermediate_size", "vocab_size", "sliding_window", "query_pre_attn_scalar", "tie_word_embeddings"):
        assert config.get(key) == getattr(ref_model.config, key), key
    assert config.rope_parameters["rope_theta"] == ref_model.config.rope_parameters["full_attention"]["rope_theta"]
    assert config.rope_local_base_freq == ref_model.config.rope_parameters["sliding_attention"]["rope_theta"]
    # bit for bit, once transformers' tensors are fused as kvgen runs them (q/k/v, gate/up)
    expected = kvgen.Gemma3ForCausalLM.convert_checkpoint(dict(ref_tensors), config)
    ours = model.state_dict()
    assert ours.keys() - {"lm_head.weight"} == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name


def test_real_gemma3_tokenizer_matches_transformers(gemma3, gemma3_gguf):
    _, tokenizer = gemma3
    ref = transformers_gguf_tokenizer(gemma3_gguf)
    for text in ["Once upon a time, there was a little", "  two  spaces,\ttabs\nand newlines  ",
                 "héllo 日本語 🙂 <start_of_turn>user\n", "    def f(x):\n        return x ** 2\n"]:
        assert tokenizer(text).input_ids == ref(text).input_ids, text
        assert tokenizer.decode(tokenizer(text).input_ids) == ref.decode(ref(text).input_ids)


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static", "hybrid"])
def test_real_gemma3_greedy_past_the_window_equals_transformers(gemma3, gemma3_prompt, gemma3_transformers,
                                                               cache_implementation):
    model, _ = gemma3
    _, _, expected = gemma3_transformers
    out = model.generate(gemma3_prompt, max_new_tokens=NEW_TOKENS, do_sample=False, disable_compile=True,
                         cache_implementation=cache_implementation, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    cache = out.past_key_values
    assert cache.get_seq_length() == PROMPT_TOKENS + NEW_TOKENS - 1  # layer 0 is a sliding layer
    if cache_implementation != "static":  # sliding layers keep about a window, global layers everything
        stored = [keys.shape[2] for keys, _ in cache]
        assert max(stored[i] for i, kind in enumerate(model.config.layer_types) if kind == "sliding_attention") <= 512
        assert stored[5] == PROMPT_TOKENS + NEW_TOKENS - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_embedding_scale_multiplies_as_transformers_rounded_tensor(dtype):
    from kvgen.models.gemma import _embedding_scale

    x = (torch.randn(2, 5, 640, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    expected = x * torch.tensor(640 ** 0.5, dtype=torch.float32).to(dtype)  # transformers' Gemma scaling
    assert torch.equal(x * _embedding_scale(640, dtype), expected)
