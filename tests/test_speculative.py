"""Speculative decoding: prompt lookup, an assistant model and early exit, with every cache type.

Greedy decoding with drafts must give plain greedy decoding's tokens, and leave the cache
as plain decoding does; each case checks that drafts were both accepted and rejected (so
the crop / checkpoint paths ran). Sampling is checked statistically against probabilities
computed another way: a Markov chain's exact joint distribution, and a small model's own
next-token probabilities. Drafts match transformers' prompt lookup, and greedy outputs
match transformers' assisted generation on the same weights.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers

from kvgen import AutoModelForCausalLM, JambaConfig, MambaConfig, PretrainedConfig
from kvgen.cache.registry import create_cache
from kvgen.generation.speculative import PromptLookup, accept, early_exit_model

VOCAB = 64
PROMPT = torch.tensor([[5, 9, 13, 22, 5, 9, 13, 40, 41, 5, 9]])
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None, pad_token_id=None)


@pytest.fixture(autouse=True)
def eager_blocks(monkeypatch):
    monkeypatch.setenv("KVGEN_DISABLE_COMPILE", "1")


def tiny(kind: str, std: float, seed: int = 0):
    """A random 4-layer model (weights drawn N(0, std): chosen so greedy output repeats itself in part)."""
    torch.manual_seed(seed)
    if kind == "mamba":
        config = MambaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, state_size=8, expand=2,
                             conv_kernel=4, eos_token_id=None, pad_token_id=None)
    elif kind == "jamba":
        config = JambaConfig(**{**LLAMA, "max_position_embeddings": None}, attn_layer_period=2, attn_layer_offset=1,
                             expert_layer_period=2, expert_layer_offset=0, num_experts=4, num_experts_per_tok=2,
                             mamba_d_state=8, mamba_d_conv=4, mamba_expand=2)
    else:
        extra = {"llama": {}, "mistral": dict(sliding_window=8),
                 "gemma2": dict(sliding_window=8, head_dim=16, query_pre_attn_scalar=16),
                 "gemma3_text": dict(sliding_window=8, head_dim=16, query_pre_attn_scalar=16, sliding_window_pattern=2)}
        config = PretrainedConfig(model_type=kind, **LLAMA, **extra[kind])
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, std)
    return model.eval()


def perturbed(model, std=0.01, seed=1):
    """An assistant: ``model`` with noise on its weights (agrees often, not always)."""
    assistant = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in assistant.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * std)
    return assistant


MODELS = {  # kind, std, seed
    "llama": ("llama", 0.1, 0), "mistral": ("mistral", 0.05, 0), "gemma2": ("gemma2", 0.02, 0),
    "gemma3": ("gemma3_text", 0.02, 1), "mamba": ("mamba", 0.15, 0), "jamba": ("jamba", 0.3, 0),
}
CASES = [("llama", "dynamic"), ("llama", "static"), ("llama", "offloaded"), ("llama", "offloaded_static"),
         ("llama", "quantized"), ("llama", "sink"), ("mistral", "dynamic"), ("mistral", "sliding_window"),
         ("gemma2", "dynamic"), ("gemma2", "hybrid"), ("gemma3", "hybrid"), ("mamba", "mamba"), ("jamba", "dynamic")]
CACHE_CONFIGS = {"quantized": {"backend": "kivi", "nbits": 4, "residual_length": 8, "q_group_size": 16},
                 "sink": {"window_length": 32, "num_sink_tokens": 2}}
_models: dict = {}


def model_named(name):
    if name not in _models:
        _models[name] = tiny(*MODELS[name])
    return _models[name]


@pytest.mark.parametrize("name,cache_name", CASES, ids=[f"{m}-{c}" for m, c in CASES])
def test_greedy_drafts_give_plain_greedy_tokens_and_cache(name, cache_name):
    model = model_named(name)

    def cache():
        return create_cache(cache_name, config=model.config, batch_size=1, max_cache_len=64, device="cpu",
                            dtype=torch.float32, cache_config=CACHE_CONFIGS.get(cache_name))

    plain_cache = cache()
    plain = model.generate(PROMPT, max_new_tokens=40, past_key_values=plain_cache, do_sample=False)
    probe = torch.tensor([[7]])

    @torch.no_grad()
    def next_logits(c):  # what the cache holds decides the logits after one more token
        seen = c.get_seq_length()
        return model(torch.cat([plain[:, seen:], probe], dim=1), past_key_values=c, use_cache=True,
                     cache_position=torch.arange(seen, plain.shape[1] + 1)).logits[0, -1]

    plain_length = plain_cache.get_seq_length()
    expected = next_logits(plain_cache)
    accepted = rejected = 0
    for drafting in (dict(prompt_lookup_num_tokens=4), dict(assistant_early_exit=2),
                     dict(assistant_model=perturbed(model))):
        speculative_cache = cache()
        out = model.generate(PROMPT, max_new_tokens=40, past_key_values=speculative_cache, do_sample=False,
                             return_dict_in_generate=True, num_assistant_tokens_schedule="constant", **drafting)
        assert torch.equal(out.sequences, plain), drafting
        assert speculative_cache.get_seq_length() == plain_length
        torch.testing.assert_close(next_logits(speculative_cache), expected, atol=1e-4, rtol=1e-4)
        stats = out.speculation
        accepted += stats.accepted
        rejected += stats.drafted - stats.accepted
    assert accepted > 0 and rejected > 0  # both the keeping and the dropping of drafts ran


def test_compiled_static_cache(monkeypatch):
    """Steps without drafts take the compiled static decode step; verifying passes run the model eagerly."""
    monkeypatch.delenv("KVGEN_DISABLE_COMPILE")
    model = model_named("llama")

    def static():
        return create_cache("static", config=model.config, batch_size=1, max_cache_len=64, device="cpu",
                            dtype=torch.float32)

    plain = model.generate(PROMPT, max_new_tokens=30, past_key_values=static(), do_sample=False)
    out = model.generate(PROMPT, max_new_tokens=30, past_key_values=static(), do_sample=False,
                         prompt_lookup_num_tokens=3, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert 0 < out.speculation.drafted and out.speculation.steps < 29 + out.speculation.drafted


def test_sink_cache_stops_drafting_once_its_window_is_full():
    """Each token shifts a full sink window, so drafts cannot be checked together: decoding goes on plainly."""
    model = model_named("llama")
    cache = create_cache("sink", config=model.config, batch_size=1, max_cache_len=64, device="cpu",
                         dtype=torch.float32, cache_config={"window_length": 16, "num_sink_tokens": 2})
    out = model.generate(PROMPT, max_new_tokens=30, past_key_values=cache, do_sample=False,
                         prompt_lookup_num_tokens=4, return_dict_in_generate=True)
    assert out.speculation.drafted <= 4 * (16 - PROMPT.shape[1])
    assert out.speculation.steps >= 30 - 16


def test_adaptive_schedule_stops_drafting_while_drafts_fail_and_probes_again():
    drafter = PromptLookup(7, schedule="adaptive")
    assert drafter.length(100, max_rows=8) == 7  # optimistic at first, within the 8 rows that cost about one
    assert drafter.length(3, max_rows=8) == 3 and drafter.length(100, max_rows=None) == 7
    steps_without = []
    for step in range(200):
        k = drafter.length(100, max_rows=8)
        if k == 0:
            steps_without.append(step)
        drafter.update(0, k)  # every draft fails
    assert len(steps_without) > 150  # mostly plain decoding...
    assert 2 < 200 - len(steps_without) < 30  # ...with a probe now and then
    for _ in range(20):
        k = drafter.length(100, max_rows=8)
        drafter.update(k, k)  # drafts start to work
    assert drafter.length(100, max_rows=8) == 7
    dear = PromptLookup(7, schedule="adaptive")
    dear.cost = 0.9  # a drafter almost as dear as the model: one token probes it
    assert dear.length(100, max_rows=8) == 1
    dear.update(0, 1)
    assert [dear.length(100, max_rows=8) for _ in range(2)] == [0, 1]
    assert PromptLookup(7, schedule="constant").length(100, max_rows=8) == 7


def test_adaptive_drafting_on_text_that_never_repeats_costs_few_verifying_rows():
    model = model_named("llama")
    prompt = torch.arange(1, 40)[None]  # no n-gram comes back in the prompt
    out = model.generate(prompt, max_new_tokens=40, do_sample=False, prompt_lookup_num_tokens=7,
                         return_dict_in_generate=True)
    constant = model.generate(prompt, max_new_tokens=40, do_sample=False, prompt_lookup_num_tokens=7,
                              num_assistant_tokens_schedule="constant", return_dict_in_generate=True)
    assert torch.equal(out.sequences, constant.sequences)
    assert constant.speculation.accepted < constant.speculation.drafted / 4  # drafts mostly fail here
    assert out.speculation.drafted < constant.speculation.drafted / 2


def test_prompt_lookup_drafts_as_transformers():
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        ids = torch.randint(0, 6, (1, int(torch.randint(2, 30, (1,), generator=generator))), generator=generator)
        num, ngram = 1 + trial % 5, 1 + trial % 3
        theirs, _ = PromptLookupCandidateGenerator(num_output_tokens=num, max_matching_ngram_size=ngram,
                                                   max_length=1000).get_candidates(ids)
        ours, _ = PromptLookup(num, ngram).draft(ids, limit=num)
        assert ours.tolist() == theirs[0, ids.shape[1]:].tolist(), ids


def test_prompt_lookup_stops_after_eos_and_before_forbidden_tokens():
    ids = torch.tensor([[1, 2, 3, 4, 5, 1, 2]])
    assert PromptLookup(5, eos_ids=[4]).draft(ids, 10)[0].tolist() == [3, 4]
    forbid_five = lambda input_ids, scores: scores.index_fill(1, torch.tensor([5]), -float("inf"))  # noqa: E731
    assert PromptLookup(5, processors=[forbid_five], vocab_size=8).draft(ids, 10)[0].tolist() == [3, 4]
    assert PromptLookup(5).draft(ids, 2)[0].tolist() == [3, 4]  # the limit
    assert PromptLookup(5).draft(torch.tensor([[1, 2, 3]]), 10)[0].numel() == 0  # no earlier occurrence


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**LLAMA, "initializer_range": 0.1})
    hf = transformers.LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(folder)
    ours = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(1)
    hf_assistant = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**LLAMA, "num_hidden_layers": 2, "initializer_range": 0.1})).eval()
    hf_assistant.save_pretrained(folder / "assistant")
    return hf, ours, hf_assistant, AutoModelForCausalLM.from_pretrained(folder / "assistant", dtype=torch.float32)


@pytest.mark.parametrize("drafting", ["prompt_lookup", "assistant"])
def test_greedy_output_matches_transformers_assisted_generation(hf_pair, drafting):
    hf, ours, hf_assistant, assistant = hf_pair
    theirs_kw = dict(prompt_lookup_num_tokens=3) if drafting == "prompt_lookup" else dict(assistant_model=hf_assistant)
    ours_kw = dict(prompt_lookup_num_tokens=3) if drafting == "prompt_lookup" else dict(assistant_model=assistant)
    expected = hf.generate(PROMPT, max_new_tokens=30, do_sample=False, **theirs_kw)
    out = ours.generate(PROMPT, max_new_tokens=30, do_sample=False, return_dict_in_generate=True, **ours_kw)
    assert torch.equal(out.sequences, expected)
    assert out.speculation.drafted > 0


def test_scores_logits_and_streamer_follow_plain_decoding():
    model = model_named("llama")
    plain = model.generate(PROMPT, max_new_tokens=20, do_sample=False, return_dict_in_generate=True,
                           output_scores=True, output_logits=True, repetition_penalty=1.3)
    seen = []

    class Collect:
        def put(self, value):
            seen.extend(value.flatten().tolist())

        def end(self):
            seen.append("end")

    out = model.generate(PROMPT, max_new_tokens=20, do_sample=False, return_dict_in_generate=True,
                         output_scores=True, output_logits=True, repetition_penalty=1.3, streamer=Collect(),
                         prompt_lookup_num_tokens=3)
    assert torch.equal(out.sequences, plain.sequences)
    assert out.speculation.drafted > 0
    for ours, theirs in ((out.scores, plain.scores), (out.logits, plain.logits)):
        assert len(ours) == len(theirs) == 20
        torch.testing.assert_close(torch.cat(ours), torch.cat(theirs), atol=1e-4, rtol=1e-4)
    assert seen == out.sequences[0].tolist() + ["end"]


def test_eos_ends_generation_inside_accepted_drafts():
    model = model_named("llama")
    plain = model.generate(PROMPT, max_new_tokens=40, do_sample=False)
    eos = int(plain[0, PROMPT.shape[1] + 12])  # a token the model produces mid-way
    expected = model.generate(PROMPT, max_new_tokens=40, do_sample=False, eos_token_id=eos, pad_token_id=0)
    out = model.generate(PROMPT, max_new_tokens=40, do_sample=False, eos_token_id=eos, pad_token_id=0,
                         prompt_lookup_num_tokens=4)
    assert torch.equal(out, expected) and int(out[0, -1]) == eos


def test_heuristic_schedule_adapts_and_persists():
    model = model_named("llama")
    assistant = perturbed(model)
    model.generate(PROMPT, max_new_tokens=30, do_sample=False, assistant_model=assistant, num_assistant_tokens=5,
                   num_assistant_tokens_schedule="heuristic")
    assert assistant.generation_config.num_assistant_tokens not in (None, 5)
    before = assistant.generation_config.num_assistant_tokens
    model.generate(PROMPT, max_new_tokens=30, do_sample=False, assistant_model=assistant,
                   num_assistant_tokens_schedule="constant")
    assert assistant.generation_config.num_assistant_tokens == before


def test_early_exit_view_shares_weights_and_runs_the_first_layers():
    model = model_named("llama")
    view = early_exit_model(model, 2)
    assert len(view.model.layers) == 2 and len(model.model.layers) == 4
    assert view.lm_head.weight is model.lm_head.weight and view.model.layers[1] is model.model.layers[1]
    x = model.model.embed_tokens(PROMPT)
    cos, sin = model.model.rotary_emb(torch.arange(PROMPT.shape[1])[None], x.dtype)
    expected = view(PROMPT).logits
    from kvgen.models.base import LayerMasks  # the first two layers by hand
    cache = create_cache("dynamic", config=view.config, batch_size=1, max_cache_len=0, device="cpu",
                         dtype=torch.float32)
    masks = LayerMasks(cache, torch.arange(PROMPT.shape[1]), None)
    kwargs = {"cache_position": torch.arange(PROMPT.shape[1]), "rotary_emb": model.model.rotary_emb}
    for layer in model.model.layers[:2]:
        x = layer(x, cos, sin, masks, cache, kwargs)
    torch.testing.assert_close(expected, model.lm_head(model.model.norm(x)))


def test_bad_settings_raise_clear_errors():
    model = model_named("llama")
    cases = [
        (dict(input_ids=PROMPT.repeat(2, 1), prompt_lookup_num_tokens=3), "one sequence at a time"),
        (dict(input_ids=PROMPT, prompt_lookup_num_tokens=3, num_beams=2), "num_beams=1"),
        (dict(input_ids=PROMPT, prompt_lookup_num_tokens=3, do_sample=True, num_return_sequences=2),
         "num_return_sequences=1"),
        (dict(input_ids=PROMPT, prompt_lookup_num_tokens=3, use_cache=False), "use_cache=True"),
        (dict(input_ids=PROMPT, prompt_lookup_num_tokens=3, assistant_early_exit=2), "one way at a time"),
        (dict(input_ids=PROMPT, assistant_early_exit=4), "between 1 and 3"),
        (dict(input_ids=PROMPT, prompt_lookup_num_tokens=0), "prompt_lookup_num_tokens must be > 0"),
        (dict(input_ids=PROMPT, assistant_model=AutoModelForCausalLM.from_config(
            PretrainedConfig(model_type="llama", **{**LLAMA, "vocab_size": 32}))), "vocabulary of 32"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            model.generate(max_new_tokens=5, **kwargs)


# -- sampling: the output distribution is the model's ----------------------------------------------


def chi2_bound(df: int, z: float = 3.7) -> float:
    """Upper quantile of chi-square(df) at about 1e-4 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the cells with enough expected counts, and its degrees of freedom."""
    expected = probs * counts.sum()
    keep = expected >= 5
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat, int(keep.sum()) - 1


@pytest.mark.parametrize("with_draft_distribution", [True, False])
def test_accepting_drafts_keeps_a_markov_chain_distribution(with_draft_distribution):
    """Three tokens from a Markov chain p(next | previous), drafted from another chain q: the joint frequency
    over 15,000 runs matches the exact p(x1) p(x2 | x1) p(x3 | x2)."""
    torch.manual_seed(0)
    v, k, runs = 4, 2, 15000
    p_logits, q_logits = torch.randn(v, v) * 1.5, torch.randn(v, v) * 1.5  # row: the previous token
    counts = torch.zeros(v, v, v)
    for _ in range(runs):
        tokens = [0]
        while len(tokens) < 4:
            drafts, previous = [], tokens[-1]
            for _ in range(k):  # q's draft (or a fixed guess, as prompt lookup makes)
                previous = int(torch.multinomial(q_logits[previous].softmax(-1), 1)) if with_draft_distribution \
                    else (previous + 1) % v
                drafts.append(previous)
            context = [tokens[-1]] + drafts
            scores = p_logits[context]  # (k + 1, V): after the last token and after each draft
            new = accept(scores, torch.tensor(drafts), q_logits[context[:-1]] if with_draft_distribution else None,
                         do_sample=True)
            tokens += new.tolist()
        counts[tokens[1], tokens[2], tokens[3]] += 1
    p = p_logits.softmax(-1)
    exact = torch.einsum("a,ab,bc->abc", p[0], p, p)
    stat, df = chi2(counts.flatten(), exact.flatten())
    assert stat < chi2_bound(df), (stat, df)


def test_sampling_with_an_assistant_follows_the_model_distribution():
    """The first two sampled tokens after a prompt (the second drafted by an assistant): their joint frequency
    over 1,500 runs matches the model's own p(x1 | prompt) p(x2 | prompt, x1), computed by forward passes."""
    torch.manual_seed(3)
    config = PretrainedConfig(model_type="llama", **{**LLAMA, "vocab_size": 6, "num_hidden_layers": 2})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    assistant = perturbed(model, std=0.1)
    prompt = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        first = model(prompt).logits[0, -1].softmax(-1)  # (6,)
        second = torch.stack([model(torch.cat([prompt, torch.tensor([[t]])], 1)).logits[0, -1].softmax(-1)
                              for t in range(6)])  # (6, 6)
    exact = first[:, None] * second
    counts = torch.zeros(6, 6)
    torch.manual_seed(4)
    drafted = 0
    for _ in range(1500):
        out = model.generate(prompt, max_new_tokens=3, do_sample=True, top_k=0, assistant_model=assistant,
                             num_assistant_tokens=2, assistant_confidence_threshold=0.0,
                             return_dict_in_generate=True)
        drafted += out.speculation.drafted
        counts[out.sequences[0, 3], out.sequences[0, 4]] += 1
    assert drafted >= 1500
    stat, df = chi2(counts.flatten(), exact.flatten())
    assert stat < chi2_bound(df), (stat, df)


# -- the real model -------------------------------------------------------------------------------


KJV_REPEATS = ("And the LORD spake unto Moses, saying, Speak unto the children of Israel. " * 3
               + "On the first day offered Nahshon the son of Amminadab, of the tribe of Judah: and his offering "
               "was one silver charger, the weight thereof was an hundred and thirty shekels, one silver bowl of "
               "seventy shekels. On the second day Nethaneel the son of Zuar, prince of Issachar, did offer: he "
               "offered for his offering one silver charger, the weight whereof was an hundred and thirty shekels,")


@pytest.mark.parametrize("weights", ["float32", "gguf"])
def test_smollm_greedy_drafts_are_plain_greedy(weights, smollm, smollm_gguf, monkeypatch):
    monkeypatch.delenv("KVGEN_DISABLE_COMPILE")
    model, tokenizer = smollm if weights == "float32" else smollm_gguf
    ids = tokenizer(KJV_REPEATS, return_tensors="pt")["input_ids"]
    plain = model.generate(ids, max_new_tokens=32, do_sample=False)
    for drafting in (dict(prompt_lookup_num_tokens=6), dict(assistant_early_exit=24)):
        out = model.generate(ids, max_new_tokens=32, do_sample=False, return_dict_in_generate=True, **drafting)
        assert torch.equal(out.sequences, plain), (drafting, tokenizer.decode(out.sequences[0, ids.shape[1]:]))
        assert out.speculation.accepted > 0
    assert out.speculation.accepted < out.speculation.drafted
