"""Structured outputs outside the server: the grammar's bitmask applied to logits (kvgen's kernel and the plain
torch path, against bits unpacked here), and ``generate()`` held to a JSON schema by ``response_format`` or by a
:class:`JsonSchemaLogitsProcessor`, in kvgen and in transformers' own ``generate`` on the same weights."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch

import kvgen.grammar
from kvgen import GrammarError, JsonSchemaLogitsProcessor
from kvgen.grammar import mask_refused_

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("vocab", [1000, 49152, 262145])
def test_the_mask_sets_exactly_the_refused_tokens_to_minus_infinity(kernel, vocab, monkeypatch):
    if not kernel:
        monkeypatch.setattr(kvgen.grammar, "kernels_available", lambda: False)
    generator = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    bits = torch.randint(-2**31, 2**31 - 1, (2, words), dtype=torch.int32, generator=generator)
    bits[:, ::7], bits[:, 3::7] = 0, -1  # words all refused and all allowed, as free text and JSON punctuation give
    logits = torch.randn(2, vocab, generator=generator)
    for row in range(2):
        allowed = np.array([(int(bits[row, t // 32]) >> (t % 32)) & 1 for t in range(vocab)], dtype=bool)
        masked = mask_refused_(logits[row].clone(), bits[row])
        assert torch.equal(masked[torch.from_numpy(allowed)], logits[row][torch.from_numpy(allowed)])
        assert bool(torch.isneginf(masked[torch.from_numpy(~allowed)]).all())


def test_the_kernel_refuses_a_bitmask_shorter_than_the_logits():
    from kvgen.kernels import kernels_available

    if not kernels_available():
        pytest.skip("kvgen's kernels are not built here")
    with pytest.raises(RuntimeError, match="fewer than the 100 tokens"):
        torch.ops.kvgen.mask_refused_(torch.zeros(100), torch.zeros(3, dtype=torch.int32))


def person_prompt(tokenizer):
    return tokenizer.apply_chat_template([{"role": "user", "content": "Describe a person in JSON."}],
                                         add_generation_prompt=True, return_tensors="pt", return_dict=True)


@pytest.mark.parametrize("settings", [dict(do_sample=False), dict(do_sample=True, temperature=1.0, top_k=0),
                                      dict(num_beams=3), dict(do_sample=True, num_return_sequences=2)])
def test_generate_with_a_response_format_writes_valid_json(settings, smollm):
    """Greedy, sampled, beams (whose rows are reordered each step) and several sequences per prompt: every reply
    ends by itself and validates; without the format, the same greedy reply is not such JSON."""
    model, tokenizer = smollm
    inputs = person_prompt(tokenizer)
    prompt = inputs["input_ids"].shape[1]
    torch.manual_seed(0)
    out = model.generate(**inputs, max_new_tokens=60, response_format=FORMAT, tokenizer=tokenizer, **settings)
    for row in out:
        assert int(row[-1]) in (tokenizer.eos_token_id, model.generation_config.pad_token_id)
        jsonschema.validate(json.loads(tokenizer.decode(row[prompt:], skip_special_tokens=True)), PERSON)
    free = model.generate(**inputs, max_new_tokens=60, do_sample=False)
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(tokenizer.decode(free[0, prompt:], skip_special_tokens=True)), PERSON)


def test_the_processor_gives_transformers_and_kvgen_the_same_reply_and_the_engine_agrees(smollm, default_model_dir):
    """The same processor in transformers' ``generate`` on the same weights, kvgen's ``generate`` and the batching
    engine's masks (a separate path: llguidance's bitmask applied in its step) choose the same greedy tokens."""
    import transformers

    from kvgen.grammar import response_grammar

    model, tokenizer = smollm
    inputs = person_prompt(tokenizer)
    prompt = inputs["input_ids"].shape[1]
    ours = model.generate(**inputs, max_new_tokens=40, do_sample=False,
                          logits_processor=[JsonSchemaLogitsProcessor(PERSON, tokenizer)])[0, prompt:]
    reference = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    theirs = reference.generate(**inputs, max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.eos_token_id,
                                logits_processor=transformers.LogitsProcessorList(
                                    [JsonSchemaLogitsProcessor(PERSON, tokenizer)]))[0, prompt:]
    assert ours.tolist() == theirs.tolist()
    grammar = response_grammar(FORMAT)
    with model.init_continuous_batching(tokenizer=tokenizer) as manager:
        engine = manager.get_result(manager.add_request(inputs["input_ids"][0].tolist(), max_new_tokens=40,
                                                        grammar=grammar), timeout=120).generated_tokens
    assert engine == ours.tolist()
    jsonschema.validate(json.loads(tokenizer.decode(ours, skip_special_tokens=True)), PERSON)


def test_a_response_format_needs_the_tokenizer_and_a_schema_that_compiles(smollm):
    model, tokenizer = smollm
    inputs = person_prompt(tokenizer)
    with pytest.raises(ValueError, match="response_format needs the model's tokenizer"):
        model.generate(**inputs, max_new_tokens=4, response_format=FORMAT)
    with pytest.raises(GrammarError, match="cannot be compiled"):
        model.generate(**inputs, max_new_tokens=4, tokenizer=tokenizer,
                       response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}})
    with pytest.raises(GrammarError, match="cannot be compiled"):
        JsonSchemaLogitsProcessor({"type": "object", "minProperties": "two"}, tokenizer)
    plain = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(**inputs, max_new_tokens=4, do_sample=False, tokenizer=tokenizer,
                                      response_format={"type": "text"}), plain)


def test_matchers_of_a_grammar_seen_before_are_independent_copies_of_a_fresh_one(smollm, monkeypatch):
    """Grammars keeps the last KEPT grammars compiled and hands out copies: each copy starts where a freshly
    compiled matcher starts, allows what it allows, and moves on its own."""
    import llguidance

    _, tokenizer = smollm
    grammars = kvgen.grammar.Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    grammar = kvgen.grammar.response_grammar(FORMAT)
    others = [kvgen.grammar.schema_grammar({"type": "integer", "maximum": i}) for i in range(grammars.KEPT)]
    compiled = []
    real = llguidance.LLMatcher
    monkeypatch.setattr(llguidance, "LLMatcher", lambda *args, **kw: compiled.append(1) or real(*args, **kw))
    first, second = grammars.matcher(grammar), grammars.matcher(grammar)
    assert len(compiled) == 1 and first is not second
    fresh = real(grammars.tokenizer, grammar, log_level=0)

    def allowed(matcher):
        return torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)

    opening = tokenizer('{"name": "Ada", "age": 3', add_special_tokens=False).input_ids
    for token in opening:
        assert torch.equal(allowed(first), allowed(fresh))
        assert first.consume_token(token) and fresh.consume_token(token)
    assert torch.equal(allowed(first), allowed(fresh))
    assert not torch.equal(allowed(second), allowed(first))  # the copy handed out second has not moved
    assert torch.equal(allowed(second), allowed(real(grammars.tokenizer, grammar, log_level=0)))
    for other in others:  # older grammars make room for newer ones
        grammars.matcher(other)
    assert len(compiled) == 1 + grammars.KEPT and grammar not in grammars._compiled
    assert len(grammars._compiled) == grammars.KEPT
    with pytest.raises(GrammarError, match="cannot be used"):
        grammars.matcher('{"grammars": [{"lark_grammar": "start: undefined_rule"}]}')
