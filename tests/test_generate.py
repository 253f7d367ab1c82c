"""``generate()`` against transformers: sampling, lengths, EOS/padding, outputs, configs, caches, streaming.

Small random checkpoints are built and saved by transformers and loaded by kvgen; the
expected ids come from transformers' ``generate`` on the same weights (sampling under the
same ``torch.manual_seed``, as kvgen mirrors transformers' processor order and arithmetic)
or from an independent computation. The last tests run the real default model and compare
with transformers on the same GGUF file.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch
import transformers

import kvgen
from kvgen import DynamicCache, GenerationConfig, StaticCache, TextStreamer
from reference import transformers_gguf_model, transformers_gguf_tokenizer

transformers.logging.set_verbosity_error()

ATOL = 1e-4
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2)
# ids for the random models: no EOS (so lengths are fixed) and 0 as padding
FIXED = dict(eos_token_id=None, pad_token_id=0)


def make_pair(folder, **overrides):
    """A random Llama checkpoint saved by transformers to ``folder``; (transformers model, kvgen model)."""
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**BASE, **overrides})).eval()
    hf.save_pretrained(folder)
    return hf, kvgen.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    hf, ours = make_pair(folder)
    return hf, ours, folder


def prompt(batch=2, length=6, seed=1):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def left_padded(seed=2, length=7):
    ids = prompt(3, length, seed)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    ids[mask == 0] = 0
    return ids, mask


def sample(model, seed, ids, **kwargs):
    torch.manual_seed(seed)
    return model.generate(ids, do_sample=True, **kwargs)


@pytest.fixture
def fed_lengths(pair):
    """Records the number of tokens of every forward call of the kvgen model."""
    _, ours, _ = pair
    lengths = []

    def hook(module, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        lengths.append(ids.shape[1])

    handle = ours.register_forward_pre_hook(hook, with_kwargs=True)
    yield lengths
    handle.remove()


# -- sampling ---------------------------------------------------------------------------------------------

SAMPLING = {
    "plain": {},
    "temperature": dict(temperature=0.6),
    "top_k": dict(top_k=5),
    "top_p": dict(top_p=0.7),
    "min_p": dict(min_p=0.2),
    "repetition_penalty": dict(repetition_penalty=1.5),
    "combined": dict(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.2),
    "combined_min_p": dict(temperature=1.3, top_k=40, min_p=0.1),
    "typical_p": dict(typical_p=0.4),
    "epsilon_cutoff": dict(epsilon_cutoff=0.02),
    "eta_cutoff": dict(eta_cutoff=0.05),
}


@pytest.mark.parametrize("name", sorted(SAMPLING))
def test_sampling_equals_transformers_under_the_same_seed(pair, name):
    hf, ours, _ = pair
    ids = prompt()
    kwargs = dict(max_new_tokens=15, **FIXED, **SAMPLING[name])
    ref = sample(hf, 7, ids, **kwargs)
    got = sample(ours, 7, ids, **kwargs)
    assert got.shape == (2, 6 + 15)
    assert torch.equal(got, ref)
    if name != "plain":  # the setting matters: ignoring it would give other draws
        assert not torch.equal(ref, sample(hf, 7, ids, max_new_tokens=15, **FIXED))


class _Bias:
    """A custom logits processor: raises the scores of tokens 10..19 (before the temperature divides them)."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, 10:20] += 3.0
        return scores


class _MultipleOfFive:
    """A custom stopping criterion: a row stops once its newest token is a multiple of 5."""

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] % 5 == 0


@pytest.mark.parametrize("sampling", [None, dict(temperature=0.5, top_k=10)])
@pytest.mark.parametrize("eos", [None, 16])
def test_custom_logits_processor_and_stopping_criteria_as_in_transformers(pair, sampling, eos):
    """transformers' ``logits_processor`` and ``stopping_criteria`` lists (any callables): processors run before the
    sampling ones; criteria finish rows, padded after where there is an EOS (without one, as in transformers, a
    finished row runs on until every row has finished). Ids equal transformers' under the same seed."""
    hf, ours, _ = pair
    ids = prompt()
    kwargs = dict(max_new_tokens=15, **{**FIXED, "eos_token_id": eos})

    def run(model, **custom):
        return model.generate(ids, **kwargs, **custom) if sampling is None else sample(model, 3, ids, **kwargs,
                                                                                        **sampling, **custom)

    custom = dict(logits_processor=transformers.LogitsProcessorList([_Bias()]),
                  stopping_criteria=transformers.StoppingCriteriaList([_MultipleOfFive()]))
    got = run(ours, **custom)
    assert torch.equal(got, run(hf, **custom))
    plain = run(ours)
    assert got.shape[1] < plain.shape[1] and not torch.equal(got, plain[:, :got.shape[1]])  # both took effect


def test_no_repeat_ngram_size_bad_words_ids_and_sequence_bias_as_in_transformers(pair):
    hf, ours, _ = pair
    ids = prompt()
    kwargs = dict(max_new_tokens=30, **FIXED)
    plain = ours.generate(ids, **kwargs)  # (it repeats bigrams: 84 60, 15 54, ...)
    first, pair_of_tokens = int(plain[0, 7]), plain[1, 8:10].tolist()  # a token and a bigram the plain run makes
    for settings in (dict(no_repeat_ngram_size=2), dict(no_repeat_ngram_size=1),
                     dict(bad_words_ids=[[first], pair_of_tokens]),
                     dict(no_repeat_ngram_size=3, bad_words_ids=[[first]], repetition_penalty=1.3),
                     dict(sequence_bias={(first,): -4.0, tuple(pair_of_tokens): -8.0, (60, 84): 2.5}),
                     dict(sequence_bias=[[[first], -4.0], [pair_of_tokens, 3.0]], repetition_penalty=1.3)):
        got = ours.generate(ids, **kwargs, **settings)
        assert torch.equal(got, hf.generate(ids, **kwargs, **settings)), settings
        assert not torch.equal(got, plain), settings  # the setting took effect
    with pytest.raises(ValueError, match="bad_words_ids must be a non-empty list"):
        ours.generate(ids, **kwargs, bad_words_ids=[[]])
    with pytest.raises(ValueError, match="sequence_bias must be a non-empty"):
        ours.generate(ids, **kwargs, sequence_bias={(): 1.0})
    with pytest.raises(ValueError, match="no_repeat_ngram_size must be >= 0"):
        ours.generate(ids, **kwargs, no_repeat_ngram_size=-1)


@pytest.mark.parametrize("settings", [dict(), dict(num_beams=3, num_return_sequences=2), dict(do_sample=True)])
def test_prefix_allowed_tokens_fn_as_in_transformers(pair, settings):
    hf, ours, _ = pair
    ids = prompt()

    def allowed(batch_id, row):  # odd last token: a window that depends on the prompt; even: another
        return list(range(10 + 7 * batch_id, 40 + 7 * batch_id)) if int(row[-1]) % 2 else list(range(60, 90))

    kwargs = dict(max_new_tokens=8, **FIXED, prefix_allowed_tokens_fn=allowed, **settings)
    torch.manual_seed(5)
    got = ours.generate(ids, **kwargs)
    torch.manual_seed(5)
    assert torch.equal(got, hf.generate(ids, **kwargs))
    rows = got.shape[0] // ids.shape[0]
    for row, seq in enumerate(got.tolist()):  # every new token was allowed after what came before it
        assert all(seq[i] in allowed(row // rows, torch.tensor(seq[:i])) for i in range(6, len(seq)))
    with pytest.raises(ValueError, match="prefix_allowed_tokens_fn allowed no token for batch id 0"):
        ours.generate(ids, max_new_tokens=2, prefix_allowed_tokens_fn=lambda b, row: [], **FIXED)


def test_max_time_stops_every_row_as_in_transformers(pair):
    hf, ours, _ = pair
    ids = prompt()
    kwargs = dict(max_new_tokens=10, **FIXED)
    got = ours.generate(ids, max_time=0.0, **kwargs)  # past after the first step: one new token
    assert got.shape == (2, 7) and torch.equal(got, hf.generate(ids, max_time=0.0, **kwargs))
    assert ours.generate(ids, max_time=600.0, **kwargs).shape == (2, 16)
    with pytest.raises(ValueError, match="max_time must be a number of seconds >= 0"):
        ours.generate(ids, max_time=-1.0, **kwargs)


def test_forced_tokens_and_renormalized_scores_as_in_transformers(pair):
    hf, ours, _ = pair
    ids = prompt()
    for settings in (dict(forced_eos_token_id=5), dict(forced_eos_token_id=[5, 7]),
                     dict(forced_bos_token_id=9, max_new_tokens=4)):
        start = ids[:, :1] if "forced_bos_token_id" in settings else ids  # (forced only after a one-token prompt)
        kwargs = {"max_new_tokens": 8, **FIXED, **settings}
        got = ours.generate(start, **kwargs)
        assert torch.equal(got, hf.generate(start, **kwargs)), settings
        assert int(got[0, -1 if "forced_eos_token_id" in settings else 1]) in (5, 9)  # (5 and 7 tie: argmax takes 5)
    kwargs = dict(max_new_tokens=6, **FIXED, top_k=10, renormalize_logits=True,
                  return_dict_in_generate=True, output_scores=True)
    got, ref = sample(ours, 4, ids, **kwargs), sample(hf, 4, ids, **kwargs)
    assert torch.equal(got.sequences, ref.sequences)
    for mine, theirs in zip(got.scores, ref.scores, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine.logsumexp(-1), torch.zeros(2), atol=1e-5, rtol=0)  # log-probabilities


def test_exponential_decay_length_penalty_and_remove_invalid_values_as_in_transformers(pair):
    hf, ours, _ = pair
    ids = prompt()
    eos = 40  # a token the plain run doesn't make: the penalty makes it come, past 3 new tokens
    kwargs = dict(max_new_tokens=20, eos_token_id=eos, pad_token_id=0, return_dict_in_generate=True,
                  output_scores=True)
    plain = ours.generate(ids, **kwargs).sequences
    assert plain.shape == (2, 26) and (plain[:, 6:] != eos).all()
    for settings in (dict(exponential_decay_length_penalty=(3, 1.6)),
                     dict(exponential_decay_length_penalty=(0, 0.5), bad_words_ids=[[7]], remove_invalid_values=True)):
        got, ref = ours.generate(ids, **kwargs, **settings), hf.generate(ids, **kwargs, **settings)
        assert torch.equal(got.sequences, ref.sequences), settings
        for mine, theirs in zip(got.scores, ref.scores, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    decayed = ours.generate(ids, **kwargs, exponential_decay_length_penalty=(3, 1.6)).sequences
    assert decayed.shape[1] < 26 and (decayed[:, 6:] == eos).any(dim=1).all()  # every row ended, early
    cleaned = got.scores[0]  # bad_words_ids' -inf became float32's smallest number
    assert torch.isfinite(cleaned).all() and float(cleaned[:, 7].max()) == torch.finfo(torch.float32).min
    for bad in ((3,), (3, 0.0), (-1, 1.5), [2.5, 1.5]):
        with pytest.raises(ValueError, match="exponential_decay_length_penalty must be"):
            ours.generate(ids, max_new_tokens=2, eos_token_id=eos, exponential_decay_length_penalty=bad)
    with pytest.raises(ValueError, match="exponential_decay_length_penalty favours .* set eos_token_id"):
        ours.generate(ids, max_new_tokens=2, exponential_decay_length_penalty=(1, 1.5), **FIXED)


@pytest.mark.parametrize("settings", [dict(), dict(num_beams=3, num_return_sequences=2, length_penalty=0.5)])
def test_compute_transition_scores_as_in_transformers(pair, settings):
    hf, ours, _ = pair
    ids = prompt()
    eos = 16 if settings else None  # (beam hypotheses that end early leave -1 in beam_indices)
    # pad 1, not 0: transformers' beam search pads with `pad_token_id or eos_token_id[0]`, the EOS for pad 0
    kwargs = dict(max_new_tokens=8, return_dict_in_generate=True, output_scores=True, eos_token_id=eos, pad_token_id=1,
                  **settings)
    got, ref = ours.generate(ids, **kwargs), hf.generate(ids, **kwargs)
    assert torch.equal(got.sequences, ref.sequences)
    beams = dict(beam_indices=got.beam_indices) if settings else {}
    for normalize in (False, True):
        mine = ours.compute_transition_scores(got.sequences, got.scores, normalize_logits=normalize, **beams)
        theirs = hf.compute_transition_scores(ref.sequences, ref.scores, normalize_logits=normalize,
                                              **({"beam_indices": ref.beam_indices} if settings else {}))
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    if not settings:  # greedy: the picks' own scores, the largest of each step
        torch.testing.assert_close(mine, torch.stack(got.scores, 1).log_softmax(-1).amax(-1))


def test_sampling_is_reproducible_by_seed(pair):
    _, ours, _ = pair
    ids = prompt()
    kwargs = dict(max_new_tokens=15, top_k=20, **FIXED)
    first, again = sample(ours, 3, ids, **kwargs), sample(ours, 3, ids, **kwargs)
    other = sample(ours, 4, ids, **kwargs)
    assert torch.equal(first, again)
    assert not torch.equal(first[:, 6:], other[:, 6:])


# -- lengths ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, length", [(dict(max_new_tokens=9), 6 + 9), (dict(max_length=11), 11),
                                            (dict(max_length=11, max_new_tokens=3), 6 + 3)])
def test_max_new_tokens_and_max_length(pair, kwargs, length):
    hf, ours, _ = pair
    ids = prompt()
    ref = hf.generate(ids, **kwargs, **FIXED)
    got = ours.generate(ids, **kwargs, **FIXED)
    assert got.shape == ref.shape == (2, length)
    assert torch.equal(got, ref)


def test_default_length_when_neither_is_given(pair, tmp_path):
    """transformers generates 20 new tokens by default, capped at max_position_embeddings."""
    hf, ours, _ = pair
    ids = prompt()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = hf.generate(ids, **FIXED)
        got = ours.generate(ids, **FIXED)
    assert ref.shape == (2, 6 + 20)
    assert torch.equal(got, ref)

    hf_short, ours_short = make_pair(tmp_path, max_position_embeddings=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = hf_short.generate(ids, **FIXED)
        got = ours_short.generate(ids, **FIXED)
    assert ref.shape == (2, 16)
    assert torch.equal(got, ref)


def first_fresh_token(row: list[int], start: int = 1) -> int:
    """Index (>= start) of the first token in ``row`` that does not occur before it."""
    return next(i for i in range(start, len(row)) if row[i] not in row[:i])


def test_min_new_tokens_suppresses_eos(pair):
    hf, ours, _ = pair
    ids = prompt(1)
    greedy = hf.generate(ids, max_new_tokens=20, **FIXED)[0, 6:].tolist()
    at = first_fresh_token(greedy)
    eos = greedy[at]
    kwargs = dict(max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
    stopped = ours.generate(ids, **kwargs)
    assert stopped.shape[1] == 6 + at + 1 and int(stopped[0, -1]) == eos  # greedy makes EOS early

    min_new = at + 4
    ref = hf.generate(ids, min_new_tokens=min_new, **kwargs)
    got = ours.generate(ids, min_new_tokens=min_new, **kwargs)
    assert torch.equal(got, ref)
    assert got.shape[1] > 6 + min_new - 1
    assert eos not in got[0, 6:6 + min_new].tolist()


def test_eos_and_padding_in_a_left_padded_batch(pair):
    hf, ours, _ = pair
    ids, mask = left_padded()
    greedy = hf.generate(ids, attention_mask=mask, max_new_tokens=20, **FIXED)[:, 7:].tolist()
    # one EOS id per row, each first produced at a different step and never before in any row
    eos, finish = [], []
    for start, row in zip((1, 4, 7), greedy):
        at = next(i for i in range(start, 20)
                  if row[i] not in row[:i] and all(row[i] not in other[:i + 1] for other in greedy if other is not row))
        eos.append(row[at])
        finish.append(at)
    # independent expectation: each row's greedy tokens up to its EOS, then padding, until every row is done
    steps = max(finish) + 1
    expected = torch.tensor([row[:at + 1] + [0] * (steps - at - 1) for row, at in zip(greedy, finish)])

    kwargs = dict(attention_mask=mask, max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
    ref = hf.generate(ids, **kwargs)
    got = ours.generate(ids, **kwargs)
    assert torch.equal(got, ref)
    assert torch.equal(got[:, 7:], expected)
    assert got.shape[1] == 7 + steps < 7 + 20


def test_use_cache_false_equals_cached(pair):
    hf, ours, _ = pair
    ids, mask = left_padded()
    kwargs = dict(attention_mask=mask, max_new_tokens=12, **FIXED)
    ref = hf.generate(ids, **kwargs)
    cached = ours.generate(ids, **kwargs)
    uncached = ours.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(cached, ref)
    assert torch.equal(uncached, ref)


def test_num_return_sequences_with_sampling(pair):
    hf, ours, _ = pair
    ids = prompt()
    kwargs = dict(max_new_tokens=10, num_return_sequences=3, top_k=30, **FIXED)
    ref = sample(hf, 11, ids, **kwargs)
    got = sample(ours, 11, ids, **kwargs)
    assert got.shape == (6, 6 + 10)
    assert torch.equal(got, ref)
    assert torch.equal(got[:, :6], ids.repeat_interleave(3, dim=0))
    assert len({tuple(r) for r in got[:3, 6:].tolist()}) > 1  # the copies are sampled independently


# -- outputs -----------------------------------------------------------------------------------------------

def test_return_dict_with_scores_logits_and_cache(pair):
    hf, ours, _ = pair
    ids, mask = left_padded()
    kwargs = dict(attention_mask=mask, max_new_tokens=8, temperature=0.7, top_k=10, return_dict_in_generate=True,
                  output_scores=True, output_logits=True, **FIXED)
    ref = sample(hf, 5, ids, **kwargs)
    got = sample(ours, 5, ids, **kwargs)
    assert torch.equal(got.sequences, ref.sequences)
    assert len(got.scores) == len(got.logits) == 8
    for step in range(8):
        torch.testing.assert_close(got.scores[step], ref.scores[step], atol=ATOL, rtol=0)
        torch.testing.assert_close(got.logits[step], ref.logits[step], atol=ATOL, rtol=0)
    assert bool(torch.isinf(got.scores[0]).any())  # the processed scores, not the raw logits
    cache = got.past_key_values
    assert isinstance(cache, kvgen.Cache) and cache.get_seq_length() == got.sequences.shape[1] - 1
    real = torch.cat([mask, torch.ones(3, 7, dtype=mask.dtype)], dim=1).bool()  # padding slots are never read
    for layer in range(BASE["num_hidden_layers"]):
        for got_kv, ref_kv in [(cache.layers[layer].keys, ref.past_key_values.layers[layer].keys),
                               (cache.layers[layer].values, ref.past_key_values.layers[layer].values)]:
            assert got_kv.shape == ref_kv.shape
            torch.testing.assert_close(got_kv.transpose(1, 2)[real], ref_kv.transpose(1, 2)[real], atol=ATOL, rtol=0)


def test_returned_cache_is_the_one_passed(pair):
    _, ours, _ = pair
    cache = DynamicCache()
    out = ours.generate(prompt(), past_key_values=cache, max_new_tokens=4, return_dict_in_generate=True, **FIXED)
    assert out.past_key_values is cache
    assert out.scores is None and out.logits is None
    assert cache.get_seq_length() == 6 + 4 - 1


def test_return_legacy_cache(pair):
    hf, ours, _ = pair
    ids = prompt()
    ref = hf.generate(ids, max_new_tokens=5, return_dict_in_generate=True, **FIXED).past_key_values
    out = ours.generate(ids, max_new_tokens=5, return_dict_in_generate=True, return_legacy_cache=True, **FIXED)
    legacy = out.past_key_values
    assert isinstance(legacy, tuple) and len(legacy) == BASE["num_hidden_layers"]
    for layer, (k, v) in enumerate(legacy):
        assert k.shape == v.shape == (2, BASE["num_key_value_heads"], 6 + 5 - 1, 16)
        torch.testing.assert_close(k, ref.layers[layer].keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(v, ref.layers[layer].values, atol=ATOL, rtol=0)


# -- generation configs --------------------------------------------------------------------------------------

def test_generation_config_argument(pair):
    hf, ours, _ = pair
    ids = prompt()
    ref = sample(hf, 2, ids, generation_config=transformers.GenerationConfig(
        max_new_tokens=7, do_sample=True, top_k=8, temperature=0.9, **FIXED))
    torch.manual_seed(2)
    got = ours.generate(ids, generation_config=GenerationConfig(max_new_tokens=7, do_sample=True, top_k=8,
                                                                temperature=0.9, **FIXED))
    assert got.shape == (2, 6 + 7)
    assert torch.equal(got, ref)
    # keyword arguments override the config's settings
    shorter = ours.generate(ids, generation_config=GenerationConfig(max_new_tokens=7, **FIXED), max_new_tokens=3)
    assert shorter.shape == (2, 6 + 3)


@pytest.fixture(scope="module")
def folder_with_generation_config(pair, tmp_path_factory):
    """The random checkpoint with a generation_config.json: max_new_tokens and an EOS that greedy makes early."""
    hf, _, folder = pair
    ids = prompt(1)
    greedy = hf.generate(ids, max_new_tokens=20, **FIXED)[0, 6:].tolist()
    at = first_fresh_token(greedy, start=2)
    target = tmp_path_factory.mktemp("with-generation-config")
    for name in os.listdir(folder):
        shutil.copy(folder / name, target / name)
    settings = {"max_new_tokens": 12, "eos_token_id": greedy[at], "pad_token_id": 0, "bos_token_id": 1}
    (target / "generation_config.json").write_text(json.dumps(settings))
    return target, ids, at


def test_generation_config_json_sets_the_defaults(folder_with_generation_config):
    folder, ids, at = folder_with_generation_config
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ours = kvgen.AutoModelForCausalLM.from_pretrained(folder)
    assert ours.generation_config.max_new_tokens == 12
    assert ours.generation_config.eos_token_id == hf.generation_config.eos_token_id
    ref, got = hf.generate(ids), ours.generate(ids)
    assert torch.equal(got, ref)
    assert got.shape[1] == 6 + at + 1  # stopped at the file's EOS
    ref, got = hf.generate(ids, eos_token_id=None), ours.generate(ids, eos_token_id=None)
    assert torch.equal(got, ref)
    assert got.shape[1] == 6 + 12  # the file's max_new_tokens


def test_generation_config_argument_keeps_the_model_defaults(folder_with_generation_config):
    """Settings that a passed GenerationConfig leaves unset come from model.generation_config (as in transformers)."""
    folder, ids, at = folder_with_generation_config
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ours = kvgen.AutoModelForCausalLM.from_pretrained(folder)
    ref = hf.generate(ids, generation_config=transformers.GenerationConfig(do_sample=False))
    got = ours.generate(ids, generation_config=GenerationConfig(do_sample=False))
    assert torch.equal(got, ref)
    assert got.shape[1] == 6 + at + 1


# -- caches passed by the user ----------------------------------------------------------------------------------

def test_empty_dynamic_and_static_caches(pair):
    hf, ours, _ = pair
    ids, mask = left_padded()
    kwargs = dict(attention_mask=mask, max_new_tokens=10, **FIXED)
    ref = hf.generate(ids, **kwargs)
    dynamic = DynamicCache()
    assert torch.equal(ours.generate(ids, past_key_values=dynamic, **kwargs), ref)
    assert dynamic.get_seq_length() == 7 + 10 - 1
    static = StaticCache(config=ours.config, max_batch_size=3, max_cache_len=32, dtype=torch.float32)
    assert torch.equal(ours.generate(ids, past_key_values=static, disable_compile=True, **kwargs), ref)
    assert static.get_seq_length() == 7 + 10 - 1 and static.get_max_cache_shape() == 32


@pytest.mark.parametrize("make_cache", [lambda model: DynamicCache(),
                                        lambda model: StaticCache(config=model.config, max_cache_len=40)],
                         ids=["dynamic", "static"])
def test_filled_cache_feeds_only_unseen_tokens(pair, fed_lengths, make_cache):
    hf, ours, _ = pair
    ids = prompt(1, 12, seed=5)
    ref = hf.generate(ids, max_new_tokens=6, **FIXED)
    cache = make_cache(ours)
    with torch.no_grad():
        ours(ids[:, :8], past_key_values=cache)
    fed_lengths.clear()
    got = ours.generate(ids, past_key_values=cache, max_new_tokens=6, disable_compile=True, **FIXED)
    assert torch.equal(got, ref)
    assert fed_lengths == [12 - 8] + [1] * 5


def test_filled_cache_from_a_previous_generate(pair, fed_lengths):
    hf, ours, _ = pair
    ids = prompt(1, 6, seed=6)
    cache = DynamicCache()
    first = ours.generate(ids, past_key_values=cache, max_new_tokens=4, **FIXED)
    follow_up = torch.cat([first, prompt(1, 3, seed=7)], dim=1)  # the last generated token was never fed
    fed_lengths.clear()
    got = ours.generate(follow_up, past_key_values=cache, max_new_tokens=5, **FIXED)
    assert fed_lengths == [1 + 3] + [1] * 4
    assert torch.equal(got, hf.generate(follow_up, max_new_tokens=5, **FIXED))


def test_filled_cache_that_differs_from_the_prompt_is_cropped(pair, fed_lengths):
    hf, ours, _ = pair
    ids = prompt(1, 12, seed=5)
    stale = ids[:, :8].clone()
    stale[0, -1] = (stale[0, -1] + 1) % 128  # the cache's last token is not the prompt's
    cache = DynamicCache()
    with torch.no_grad():
        ours(stale, past_key_values=cache)
    fed_lengths.clear()
    got = ours.generate(ids, past_key_values=cache, max_new_tokens=6, **FIXED)
    assert fed_lengths == [12 - 7] + [1] * 5  # cropped to the 7 shared tokens
    assert torch.equal(got, hf.generate(ids, max_new_tokens=6, **FIXED))


# -- the real default model -----------------------------------------------------------------------------------

class Chunks(TextStreamer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.chunks = []

    def on_finalized_text(self, text, stream_end=False):
        self.chunks.append(text)
        super().on_finalized_text(text, stream_end)


class ReferenceChunks(transformers.TextStreamer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.chunks = []

    def on_finalized_text(self, text, stream_end=False):
        self.chunks.append(text)


def test_text_streamer_prints_the_continuation(smollm, default_model_dir, capsys):
    model, tokenizer = smollm
    inputs = tokenizer("The best thing about summer is", return_tensors="pt")
    n = inputs["input_ids"].shape[1]
    streamer = Chunks(tokenizer, skip_prompt=True)
    out = model.generate(**inputs, max_new_tokens=12, streamer=streamer)
    printed = capsys.readouterr().out
    assert printed == tokenizer.decode(out[0, n:]) + "\n"
    assert len([c for c in streamer.chunks if c]) > 1  # words came out one by one, not all at the end
    # transformers' streamer, fed the same ids, prints the same pieces
    reference = ReferenceChunks(transformers.AutoTokenizer.from_pretrained(default_model_dir), skip_prompt=True)
    reference.put(out[:, :n])
    for token in out[0, n:]:
        reference.put(token[None])
    reference.end()
    assert streamer.chunks == reference.chunks

    streamer = TextStreamer(tokenizer)  # with the prompt
    model.generate(**inputs, max_new_tokens=4, streamer=streamer)
    again = model.generate(**inputs, max_new_tokens=4)
    assert capsys.readouterr().out == tokenizer.decode(again[0]) + "\n"


def test_left_padded_batch_equals_rows_alone(smollm, default_model_dir):
    model, _ = smollm
    tokenizer = kvgen.AutoTokenizer.from_pretrained(default_model_dir, padding_side="left")
    prompts = ["The capital of France is", "Once upon a time, in a faraway kingdom, there lived a", "Water boils at"]
    batch = tokenizer(prompts, padding=True, return_tensors="pt")
    assert int(batch["attention_mask"][2].sum()) < batch["input_ids"].shape[1]  # rows really are padded
    out = model.generate(**batch, max_new_tokens=10, do_sample=False)
    width = batch["input_ids"].shape[1]
    for row, text in enumerate(prompts):
        alone = tokenizer(text, return_tensors="pt")
        single = model.generate(**alone, max_new_tokens=10, do_sample=False)[0, alone["input_ids"].shape[1]:]
        got = out[row, width:]
        assert torch.equal(got[: len(single)], single), text
        assert bool((got[len(single):] == tokenizer.pad_token_id).all())  # a row that stopped early is padded


@pytest.fixture(scope="module")
def gguf_reference():
    """transformers' model and tokenizer from the default GGUF (tests/reference.py)."""
    from kvgen.loading.default_model import default_gguf_path

    path = default_gguf_path()
    return transformers_gguf_model(path), transformers_gguf_tokenizer(path), str(path.parent), path.name


def test_default_model_story_equals_transformers(gguf_reference, smollm):
    hf, hf_tokenizer, d, f = gguf_reference
    model, tokenizer = smollm
    text = "Once upon a time, there was a little"
    inputs = tokenizer(text, return_tensors="pt")
    assert torch.equal(inputs["input_ids"], hf_tokenizer(text, return_tensors="pt")["input_ids"])
    ref = hf.generate(**hf_tokenizer(text, return_tensors="pt"), max_new_tokens=30, do_sample=False)
    from_folder = model.generate(**inputs, max_new_tokens=30, do_sample=False)
    from_gguf = kvgen.AutoModelForCausalLM.from_pretrained(d, gguf_file=f).generate(
        **inputs, max_new_tokens=30, do_sample=False)
    assert ref.shape[1] == inputs["input_ids"].shape[1] + 30
    assert torch.equal(from_folder, ref)
    assert torch.equal(from_gguf, ref)
    n = inputs["input_ids"].shape[1]
    assert tokenizer.decode(from_folder[0, n:]) == hf_tokenizer.decode(ref[0, n:])


def test_default_model_chat_answer_equals_transformers(gguf_reference, smollm):
    hf, hf_tokenizer, _, _ = gguf_reference
    model, tokenizer = smollm
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    hf_inputs = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                 return_dict=True)
    assert torch.equal(inputs["input_ids"], hf_inputs["input_ids"])
    ref = hf.generate(**hf_inputs, max_new_tokens=20, do_sample=False)
    got = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    assert torch.equal(got, ref)
    answer = tokenizer.decode(got[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


# the default story: " girl named Emma who loved to play in the sun. She would often go to the beach ..."; the
# other prompt's: " Paris.\n\nThe answer is: 2018-01-22 ...". "mm" lies inside a token, "e answer" begins in an
# earlier one, the others end a token; each row stops on its own, and "<|im_end|>" never comes
@pytest.mark.parametrize("stops", ["sun", "mm", "e answer", ["\n", "beach"], "<|im_end|>"])
def test_stop_strings_stop_where_transformers_stops(gguf_reference, smollm, stops):
    """transformers' StopStringCriteria: a row stops at the token that completes a stop string (which may run on
    past it, or begin in earlier tokens); a stop that never comes runs to max_new_tokens. Two prompts, left-padded,
    each row stopping on its own."""
    hf, hf_tokenizer, _, _ = gguf_reference
    model, tokenizer = smollm
    prompts = ["Once upon a time, there was a little", "The capital of France is"]
    sides = tokenizer.padding_side, hf_tokenizer.padding_side
    tokenizer.padding_side = hf_tokenizer.padding_side = "left"
    try:  # (the first prompt is the longer: its row has no padding, as a prompt alone)
        inputs = tokenizer(prompts, return_tensors="pt", padding=True)
        assert inputs["attention_mask"][0].all() and not inputs["attention_mask"][1].all()
        ref = hf.generate(**hf_tokenizer(prompts, return_tensors="pt", padding=True), max_new_tokens=24,
                          do_sample=False, stop_strings=stops, tokenizer=hf_tokenizer)
        got = model.generate(**inputs, max_new_tokens=24, do_sample=False, stop_strings=stops, tokenizer=tokenizer)
        assert torch.equal(got, ref), (tokenizer.batch_decode(got), hf_tokenizer.batch_decode(ref))
    finally:
        tokenizer.padding_side, hf_tokenizer.padding_side = sides


def test_stop_strings_need_a_tokenizer_and_work_without_beams_or_drafts(smollm):
    model, tokenizer = smollm
    inputs = tokenizer("Once upon a time", return_tensors="pt")
    with pytest.raises(ValueError, match="needs the tokenizer"):
        model.generate(**inputs, max_new_tokens=4, stop_strings=".")
    with pytest.raises(ValueError, match="non-empty string"):
        model.generate(**inputs, max_new_tokens=4, stop_strings=[""], tokenizer=tokenizer)
    for speculation in (dict(num_beams=2), dict(prompt_lookup_num_tokens=3)):
        with pytest.raises(ValueError, match="not with beam search or speculative decoding"):
            model.generate(**inputs, max_new_tokens=4, stop_strings=".", tokenizer=tokenizer, **speculation)
