"""Beam search: parity with transformers, group beam search against a recorded reference, every cache.

* plain beam search (and its options) against transformers 5.23 live, on random checkpoints;
* group (diverse) beam search against outputs recorded from transformers 4.52.4, the last
  release with it in the library (``tests/reference/make_group_beam_reference.py``);
* the same beam search with every cache type: lossless caches give exactly the dynamic
  cache's result; for lossy ones (sink eviction, quantization) every returned beam's score is
  recomputed by replaying its tokens through a fresh cache of the same kind, which fails if a
  part of the cache was not reordered with the beams;
* the seeds' out-of-memory fallback (40 beams in 40 groups, retried with an offloaded cache).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

import kvgen
from kvgen import QuantizedCacheConfig, SinkCache

from test_offload import resilient_generate  # the seeds' example, as written there

REFERENCE = Path(__file__).parent / "reference"
EOS, PAD = 46, 2


@pytest.fixture(autouse=True)
def eager_decode(monkeypatch):
    monkeypatch.setenv("KVGEN_DISABLE_COMPILE", "1")  # compiled decode is covered in test_decode_blocks


def random_pair(tmp_path_factory, config_cls=transformers.LlamaConfig, **extra):
    torch.manual_seed(0)
    config = config_cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                        bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD, **extra)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # a peaked output layer: beams disagree less randomly and EOS is sometimes chosen
        hf.get_output_embeddings().weight.mul_(8.0)
    folder = tmp_path_factory.mktemp(config.model_type)
    hf.save_pretrained(folder)
    return hf, kvgen.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return random_pair(tmp_path_factory)


def prompts(length=6):
    ids = torch.tensor([[PAD, PAD, 17, 40, 9, 33, 12, 5], [11, 5, 60, 21, 8, 45, 30, 19]])[:, -length:]
    return ids, (ids != PAD).long()


BEAM_SETTINGS = [
    {"num_beams": 4},
    {"num_beams": 4, "num_return_sequences": 3},
    {"num_beams": 3, "early_stopping": True, "length_penalty": 0.5},
    {"num_beams": 4, "early_stopping": "never", "length_penalty": -1.0},
    {"num_beams": 5, "early_stopping": "never", "length_penalty": 2.0},
    {"num_beams": 2, "eos_token_id": [EOS, 38]},
    {"num_beams": 3, "repetition_penalty": 1.5, "min_new_tokens": 4},
]


@pytest.mark.parametrize("settings", BEAM_SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_beam_search_equals_transformers(llama, settings):
    hf, ours = llama
    ids, mask = prompts()
    common = dict(attention_mask=mask, max_new_tokens=12, return_dict_in_generate=True, output_scores=True)
    expected = hf.generate(ids, **common, **settings)
    got = ours.generate(ids, **common, **settings)
    assert got.sequences.tolist() == expected.sequences.tolist()
    torch.testing.assert_close(got.sequences_scores, expected.sequences_scores, atol=1e-4, rtol=0)
    # processed log-probs of the running beams (after an item has finished, transformers 5 goes on
    # extending its beams while kvgen, like the beam scorer of transformers 4, feeds them padding)
    torch.testing.assert_close(got.scores[0], expected.scores[0], atol=1e-4, rtol=0)


def test_step_scores_equal_transformers_when_no_beam_finishes(llama):
    hf, ours = llama
    ids, mask = prompts()
    common = dict(attention_mask=mask, max_new_tokens=12, num_beams=4, eos_token_id=None,
                  return_dict_in_generate=True, output_scores=True)
    expected, got = hf.generate(ids, **common), ours.generate(ids, **common)
    assert got.sequences.tolist() == expected.sequences.tolist()
    assert len(got.scores) == len(expected.scores) == 12
    for step_got, step_expected in zip(got.scores, expected.scores):
        torch.testing.assert_close(step_got, step_expected, atol=1e-4, rtol=0)


def test_finished_beams_are_found(llama):
    """The parity settings above do exercise EOS: some returned beams end with it before max length."""
    _, ours = llama
    ids, mask = prompts()
    out = ours.generate(ids, attention_mask=mask, max_new_tokens=12, num_beams=4, num_return_sequences=4)
    generated = out[:, ids.shape[1]:]
    assert (generated == EOS).any(dim=1).any() and (generated != EOS).all(dim=1).any()


@pytest.mark.parametrize("config_cls,extra", [(transformers.Qwen2Config, {}),
                                              (transformers.MistralConfig, {"sliding_window": 5})],
                         ids=["qwen2", "mistral-sliding"])
def test_beam_search_equals_transformers_on_other_families(tmp_path_factory, config_cls, extra):
    hf, ours = random_pair(tmp_path_factory, config_cls, **extra)
    ids, mask = prompts()
    common = dict(attention_mask=mask, max_new_tokens=10, num_beams=3, num_return_sequences=2,
                  return_dict_in_generate=True, output_scores=True)
    expected, got = hf.generate(ids, **common), ours.generate(ids, **common)
    assert got.sequences.tolist() == expected.sequences.tolist()
    torch.testing.assert_close(got.sequences_scores, expected.sequences_scores, atol=1e-4, rtol=0)


GROUP_REFERENCE = json.loads((REFERENCE / "group_beam.json").read_text())


@pytest.fixture(scope="module")
def reference_model():
    return kvgen.AutoModelForCausalLM.from_pretrained(REFERENCE / "tiny_llama", dtype=torch.float32)


@pytest.mark.parametrize("case", GROUP_REFERENCE["cases"],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c["settings"].items()))
def test_group_beam_search_equals_transformers_4_52(reference_model, case):
    assert GROUP_REFERENCE["transformers"] == "4.52.4"
    ids = torch.tensor(GROUP_REFERENCE["prompts"])
    out = reference_model.generate(ids, attention_mask=torch.tensor(GROUP_REFERENCE["attention_mask"]),
                                   max_new_tokens=GROUP_REFERENCE["max_new_tokens"], return_dict_in_generate=True,
                                   output_scores=True, **case["settings"])
    assert out.sequences.tolist() == case["sequences"]
    torch.testing.assert_close(out.sequences_scores, torch.tensor(case["sequences_scores"]), atol=1e-4, rtol=0)


def test_diversity_penalty_makes_groups_differ(reference_model):
    ids = torch.tensor(GROUP_REFERENCE["prompts"])[1:]
    common = dict(max_new_tokens=8, num_beams=4, num_return_sequences=4, eos_token_id=None)
    plain = reference_model.generate(ids, **common)[:, ids.shape[1]:]
    diverse = reference_model.generate(ids, num_beam_groups=4, diversity_penalty=5.0, **common)[:, ids.shape[1]:]
    distinct = lambda out: sum(len(set(column.tolist())) for column in out.T)  # noqa: E731  (per position)
    assert distinct(diverse) > distinct(plain)


# -- every cache type ------------------------------------------------------------------------------

def run_beams(model, cache_kwargs, ids, mask=None, **settings):
    settings = {"max_new_tokens": 10, "num_beams": 3, "num_return_sequences": 3, "return_dict_in_generate": True,
                "output_scores": True, **settings}
    return model.generate(ids, attention_mask=mask, **cache_kwargs, **settings)


LOSSLESS = {  # every token kept as computed (or, for kivi's residual, at 16 bits)
    "static": {"cache_implementation": "static"},
    "offloaded": {"cache_implementation": "offloaded"},
    "offloaded_static": {"cache_implementation": "offloaded_static"},
    "quantized-in-residual": {"cache_implementation": "quantized",
                              "cache_config": {"backend": "kivi", "nbits": 4, "residual_length": 64}},
    "sink-without-eviction": {"past_key_values": lambda: SinkCache(window_length=64, num_sink_tokens=4)},
}


@pytest.mark.parametrize("name", sorted(LOSSLESS))
def test_lossless_caches_give_the_dynamic_result(llama, name):
    _, ours = llama
    ids, mask = prompts()
    kwargs = {k: v() if callable(v) else v for k, v in LOSSLESS[name].items()}
    expected = run_beams(ours, {}, ids, mask)
    got = run_beams(ours, kwargs, ids, mask)
    assert got.sequences.tolist() == expected.sequences.tolist()
    # (kivi keeps its unquantized tokens at 16 bits, as its scales: keys/values within float16 rounding, so
    # summed log-probabilities within 1e-4; the other caches hold the float32 values themselves)
    atol = 1e-4 if name == "quantized-in-residual" else 1e-5
    torch.testing.assert_close(got.sequences_scores, expected.sequences_scores, atol=atol, rtol=0)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return random_pair(tmp_path_factory, transformers.MistralConfig, sliding_window=5)[1]


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    return random_pair(tmp_path_factory, transformers.Gemma2Config, head_dim=8, sliding_window=4)[1]


@pytest.mark.parametrize("model_name,cache", [("mistral", "sliding_window"), ("gemma2", "hybrid"),
                                              ("gemma2", "static")])
def test_windowed_caches_give_the_dynamic_result(request, model_name, cache):
    model = request.getfixturevalue(model_name)
    ids, _ = prompts(8)
    ids = ids[1:]
    expected = run_beams(model, {}, ids)
    got = run_beams(model, {"cache_implementation": cache}, ids)
    assert got.sequences.tolist() == expected.sequences.tolist()
    torch.testing.assert_close(got.sequences_scores, expected.sequences_scores, atol=1e-5, rtol=0)


def replayed_score(model, make_cache, prompt, sequence, length_penalty=1.0):
    """Length-penalised log-probability of ``sequence``'s new tokens, fed one by one through a fresh cache."""
    cache = make_cache()
    out = model(prompt[None], past_key_values=cache)
    total, new = 0.0, sequence[prompt.shape[0]:]
    for i, token in enumerate(new.tolist()):
        total += float(torch.log_softmax(out.logits[0, -1].float(), -1)[token])
        if i + 1 < len(new):
            out = model(torch.tensor([[token]]), past_key_values=cache)
    return total / len(new) ** length_penalty


LOSSY = {
    "sink-evicting": lambda: SinkCache(window_length=8, num_sink_tokens=2),
    "kivi-2bit": lambda: kvgen.QuantizedCache(config=None, cache_config=QuantizedCacheConfig(
        backend="kivi", nbits=2, q_group_size=4, residual_length=4, num_sink_tokens=0)),
}


@pytest.mark.parametrize("name", sorted(LOSSY))
def test_lossy_caches_reorder_every_part_with_the_beams(llama, name):
    _, ours = llama
    ids, _ = prompts(8)
    prompt = ids[1]
    out = run_beams(ours, {"past_key_values": LOSSY[name]()}, prompt[None], max_new_tokens=24, num_beams=4,
                    num_return_sequences=4)
    dense = run_beams(ours, {}, prompt[None], max_new_tokens=24, num_beams=4, num_return_sequences=4)
    assert out.sequences.tolist() != dense.sequences.tolist() or \
        not torch.allclose(out.sequences_scores, dense.sequences_scores, atol=1e-4)  # the cache does lose something
    for sequence, score in zip(out.sequences, out.sequences_scores):
        sequence = sequence[: int((sequence != PAD).nonzero().max()) + 1]
        assert replayed_score(ours, LOSSY[name], prompt, sequence) == pytest.approx(float(score), abs=1e-4)


# -- the seeds' out-of-memory fallback ---------------------------------------------------------------

def test_seeds_oom_fallback_with_forty_diverse_beams(llama, monkeypatch, capsys):
    _, ours = llama
    calls = []
    real_forward = type(ours).forward

    def forward_that_runs_out_of_memory(self, *args, past_key_values=None, **kwargs):
        calls.append(type(past_key_values).__name__)
        if len(calls) == 1:  # the first attempt's prefill, with the default (dynamic) cache
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.83 GiB.")
        return real_forward(self, *args, past_key_values=past_key_values, **kwargs)

    monkeypatch.setattr(type(ours), "forward", forward_that_runs_out_of_memory)
    prompt = torch.tensor([[17, 40] * 100 + [9, 33, 12]])
    beams = {"num_beams": 40, "num_beam_groups": 40, "num_return_sequences": 40, "diversity_penalty": 1.0,
             "max_new_tokens": 23, "early_stopping": True}
    out = resilient_generate(ours, prompt, **beams)
    assert "retrying with cache_implementation='offloaded'" in capsys.readouterr().out
    assert calls[0] == "DynamicCache" and set(calls[1:]) == {"OffloadedCache"}
    assert out.shape[0] == 40 and out.shape[1] <= prompt.shape[1] + 23
    monkeypatch.undo()
    assert out.tolist() == ours.generate(prompt, **beams).tolist()  # the offloaded retry lost nothing


# -- settings ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("settings,message", [
    ({"num_beams": 2, "num_return_sequences": 3}, "must be <= num_beams"),
    ({"num_beams": 4, "num_beam_groups": 3, "diversity_penalty": 1.0}, "multiple of num_beam_groups"),
    ({"num_beams": 4, "diversity_penalty": 1.0}, "num_beam_groups > 1"),
    ({"num_beams": 4, "num_beam_groups": 2}, "diversity_penalty > 0"),
    ({"num_beams": 2, "early_stopping": "sometimes"}, "early_stopping"),
])
def test_bad_beam_settings_raise(llama, settings, message):
    _, ours = llama
    with pytest.raises(ValueError, match=message):
        ours.generate(prompts()[0], max_new_tokens=3, **settings)


def test_streamer_with_beams_raises(llama):
    _, ours = llama
    with pytest.raises(ValueError, match="streamer"):
        ours.generate(prompts()[0], max_new_tokens=3, num_beams=2, streamer=object())


# -- state-space caches: Mamba and Jamba (their SSM states follow the beams too) -----------------------

@pytest.mark.parametrize("config_cls,extra", [
    (transformers.MambaConfig, {"hidden_size": 32, "num_hidden_layers": 2, "state_size": 8, "expand": 2}),
    (transformers.JambaConfig, {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "attn_layer_period": 2,
                                "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 0,
                                "num_experts": 4, "num_experts_per_tok": 2, "mamba_d_state": 8, "mamba_d_conv": 4,
                                "mamba_expand": 2, "initializer_range": 0.2}),
], ids=["mamba", "jamba"])
def test_ssm_caches_reorder_their_states_with_the_beams(tmp_path_factory, config_cls, extra):
    """A cached beam search equals an uncached one (which recomputes every beam from its tokens), and
    transformers' on the same weights: a state left in place by the reorder would change the beams."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config_cls(vocab_size=64, pad_token_id=PAD, eos_token_id=EOS,
                                                                  bos_token_id=1, **extra)).eval()
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(8.0)
    folder = tmp_path_factory.mktemp(config_cls.model_type)
    hf.save_pretrained(folder)
    ours = kvgen.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = prompts(8)[0]
    common = dict(max_new_tokens=14, num_beams=4, num_return_sequences=4, return_dict_in_generate=True,
                  output_scores=True)
    cached, uncached = ours.generate(ids, **common), ours.generate(ids, use_cache=False, **common)
    assert cached.sequences.tolist() == uncached.sequences.tolist()
    torch.testing.assert_close(cached.sequences_scores, uncached.sequences_scores, atol=1e-4, rtol=0)
    expected = hf.generate(ids, **common)
    assert cached.sequences.tolist() == expected.sequences.tolist()
