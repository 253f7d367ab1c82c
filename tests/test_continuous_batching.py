"""Continuous batching on a paged KV cache: every request as exact as generate() alone, under
preemption, prefix-cache hits, chunked prefill, cancellation; the block pool; clear errors."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

import kvgen
from kvgen import LlamaForCausalLM, PretrainedConfig
from kvgen.cache.paged import PagedAttentionCache, parse_memory
from kvgen.masks import attention_mask
from kvgen.models.decode_blocks import eager_blocks
from kvgen.serving import ContinuousBatchingConfig, QueueFull, RequestStatus
from kvgen.serving.blocks import BlockPool, prefix_keys

CONFIG = dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
              rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu", eos_token_id=None)


@pytest.fixture(autouse=True)
def _eager():
    with eager_blocks():  # compiled CPU blocks would only add compile time here
        yield


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = LlamaForCausalLM(PretrainedConfig(**CONFIG)).eval().requires_grad_(False)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)  # peaked distributions: greedy choices are far from ties
    return m


def random_prompts(n: int, lo: int, hi: int, seed: int = 1, vocab: int = 96) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g)
    return [torch.randint(0, vocab, (int(length),), generator=g).tolist() for length in lengths]


def alone(model, prompt: list[int], new: int) -> list[int]:
    return model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)[0, len(prompt):].tolist()


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def assert_same_as_alone(model, prompts, outputs, new: int, tie: float = 0.0) -> None:
    """Each output equals generate() on its prompt alone. With ``tie > 0`` a difference is accepted only where
    generate()'s two best logits were within ``tie`` (float32 summation order decides such a near-tie)."""
    for i, prompt in enumerate(prompts):
        ref, got = alone(model, prompt, new), outputs[f"req_{i}"].generated_tokens
        at = first_difference(ref, got)
        if at is None:
            continue
        logits = model(torch.tensor([prompt + ref[:at]])).logits[0, -1]
        top2 = logits.topk(2).values
        assert float(top2[0] - top2[1]) < tie, f"request {i} (prompt {len(prompt)} tokens) differs at new token {at}"


def cb(**kwargs) -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(**{"num_blocks": 64, "max_batch_tokens": 64, "max_num_seqs": 8, **kwargs})


# -- exactness ------------------------------------------------------------------------------------------


def test_batch_with_chunked_prefill_equals_generate_alone(model):
    prompts = random_prompts(12, 1, 150)
    outputs = model.generate_batch(prompts, max_new_tokens=16, continuous_batching_config=cb(num_blocks=200))
    assert sorted(outputs) == sorted(f"req_{i}" for i in range(len(prompts)))
    assert all(o.status == RequestStatus.FINISHED and o.finish_reason == "length" for o in outputs.values())
    assert_same_as_alone(model, prompts, outputs, 16)


def test_staggered_arrivals_equal_generate_alone(model):
    prompts = random_prompts(8, 5, 120, seed=2)
    manager = model.init_continuous_batching(continuous_batching_config=cb(num_blocks=200))
    with manager:
        ids = []
        for prompt in prompts:  # each joins while the earlier ones are decoding
            ids.append(manager.add_request(prompt, max_new_tokens=12))
            time.sleep(0.02)
        outputs = {rid: manager.get_result(rid, timeout=120) for rid in ids}
    assert manager.steps > 12  # the requests overlapped instead of running one after another
    assert_same_as_alone(model, prompts, outputs, 12)


def test_preemption_under_a_small_budget_gives_the_same_outputs(model):
    prompts = random_prompts(10, 40, 90, seed=3)
    config = cb(num_blocks=24, max_num_seqs=8, prefix_caching=False)  # 8 sequences need ~48 blocks
    manager = model.init_continuous_batching(continuous_batching_config=config)
    with manager:
        ids = manager.add_requests(prompts, max_new_tokens=20)
        outputs = {rid: manager.get_result(rid, timeout=300) for rid in ids}
    assert manager.scheduler.preemptions > 0
    assert_same_as_alone(model, prompts, outputs, 20)
    assert manager.stats()["blocks_free"] == 24


def test_a_prefix_cache_hit_gives_the_same_output_as_a_miss(model):
    shared = random_prompts(1, 100, 101, seed=4)[0]
    prompts = [shared + tail for tail in random_prompts(3, 3, 20, seed=5)]
    manager = model.init_continuous_batching(continuous_batching_config=cb(num_blocks=100))
    with manager:
        first = manager.get_result(manager.add_request(prompts[0], max_new_tokens=10), timeout=60)
        rest = [manager.get_result(manager.add_request(p, max_new_tokens=10), timeout=60) for p in prompts[1:]]
        again = manager.get_result(manager.add_request(prompts[0], max_new_tokens=10), timeout=60)
    assert first.cached_prompt_tokens == 0
    assert [o.cached_prompt_tokens for o in rest] == [96, 96]  # the 6 full blocks of the shared 100 tokens
    assert again.cached_prompt_tokens == 16 * ((len(prompts[0]) - 1) // 16)
    assert again.generated_tokens == first.generated_tokens
    outputs = {f"req_{i}": o for i, o in enumerate([first, *rest])}
    assert_same_as_alone(model, prompts, outputs, 10)
    stats = manager.stats()
    assert stats["prefix_cache_hit_tokens"] == 96 * 2 + again.cached_prompt_tokens
    assert 0 < stats["prefix_cache_hit_rate"] < 1


def test_gemma2_sliding_layers_match_generate(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=256, initializer_range=0.2, sliding_window=24,
                                       query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                                       final_logit_softcapping=3.0, eos_token_id=None)
    torch.manual_seed(0)
    hf = transformers.Gemma2ForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("gemma2_cb")
    hf.save_pretrained(folder)
    gemma = kvgen.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompts = random_prompts(5, 10, 80, seed=6, vocab=128)  # most longer than the window
    outputs = gemma.generate_batch(prompts, max_new_tokens=12, continuous_batching_config=cb(num_blocks=80))
    assert_same_as_alone(gemma, prompts, outputs, 12)
    # blocks out of the window go back to the sliding layers' pool; full layers keep theirs
    with gemma.init_continuous_batching(continuous_batching_config=cb(num_blocks=80)) as manager:
        prompt = random_prompts(1, 100, 101, seed=7, vocab=128)[0]
        rid = manager.add_request(prompt, max_new_tokens=40, streaming=True)
        used = []
        for output in manager.request_id_iter(rid):
            if not output.is_finished():
                used.append({kind: pool.num_used for kind, (pool, _) in manager.pools.items()})
        again = manager.get_result(manager.add_request(prompt, max_new_tokens=40), timeout=60)
    # the pools are read while the engine runs on: a read after the request ended (its blocks freed) sees 0, which
    # happened once in a full run for the last read, so the full layers' most blocks held are checked
    held = [u["full_attention"] for u in used if u["full_attention"]]
    assert 9 <= max(held) <= 9 + 3  # 139 positions (in runs of up to 4 blocks)
    assert max(u["sliding_attention"] for u in used) <= 3  # a window of 24 spans at most 3 blocks of 16
    assert manager.stats()["blocks_free"] == 160
    assert output.generated_tokens == alone(gemma, prompt, 40)
    assert again.cached_prompt_tokens == 96 and again.generated_tokens == output.generated_tokens


# -- sampling, n, stops ---------------------------------------------------------------------------------


def test_sampling_with_a_seed_does_not_depend_on_the_other_requests(model):
    prompt = random_prompts(1, 30, 31, seed=7)[0]
    settings = dict(max_new_tokens=15, do_sample=True, temperature=0.8, top_p=0.9, seed=123)
    with model.init_continuous_batching(continuous_batching_config=cb(num_blocks=100)) as manager:
        lone = manager.get_result(manager.add_request(prompt, **settings), timeout=60).generated_tokens
        others = [manager.add_request(p, max_new_tokens=15) for p in random_prompts(4, 5, 60, seed=8)]
        mine = manager.add_request(prompt, **settings)
        other_seed = manager.add_request(prompt, **{**settings, "seed": 124})
        crowded = manager.get_result(mine, timeout=60).generated_tokens
        different = manager.get_result(other_seed, timeout=60).generated_tokens
        for rid in others:
            manager.get_result(rid, timeout=60)
    assert crowded == lone
    assert different != lone


def test_n_siblings_share_the_prompt_blocks(model):
    prompt = random_prompts(1, 70, 71, seed=9)[0]
    outputs = model.generate_batch([prompt], max_new_tokens=10, do_sample=True, seed=5, num_return_sequences=3,
                                   continuous_batching_config=cb(num_blocks=100))
    assert sorted(outputs) == ["req_0", "req_0__child#0", "req_0__child#1"]
    assert [outputs[k].cached_prompt_tokens for k in sorted(outputs)] == [0, 64, 64]  # 4 full blocks shared
    assert len({tuple(o.generated_tokens) for o in outputs.values()}) == 3


def penalized_alone(model, prompt: list[int], new: int, frequency: float, presence: float,
                    bias: dict[int, float], repetition: float = 1.0) -> list[int]:
    """Greedy tokens under vLLM's repetition penalty, then OpenAI's penalties and bias, written out here (one full
    forward a token): a logit of a token of the prompt or the reply divided by the repetition penalty where
    positive, multiplied where negative; each logit minus frequency x its count in the generated tokens, minus
    presence if it occurs there, plus its bias."""
    tokens: list[int] = []
    for _ in range(new):
        logits = model(torch.tensor([prompt + tokens])).logits[0, -1]
        for token in set(prompt + tokens):
            logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
        for token in set(tokens):
            logits[token] -= frequency * tokens.count(token) + presence
        for token, value in bias.items():
            logits[token] += value
        tokens.append(int(logits.argmax()))
    return tokens


def test_penalties_and_logit_bias_change_greedy_choices_as_openai_defines_them(model):
    prompts = random_prompts(3, 5, 40, seed=12)
    plain = model.generate_batch(prompts, max_new_tokens=12, continuous_batching_config=cb())
    banned = plain["req_0"].generated_tokens[0]
    cases = [dict(frequency_penalty=1.5), dict(presence_penalty=2.0), dict(frequency_penalty=-0.5, presence_penalty=1.0),
             dict(logit_bias={banned: -100.0, 7: 3.0}), dict(repetition_penalty=1.8, presence_penalty=0.5)]
    with model.init_continuous_batching(continuous_batching_config=cb(num_blocks=100)) as manager:
        for case in cases:  # beside requests without penalties: each sequence has its own
            ids = [manager.add_request(p, max_new_tokens=12, **case) for p in prompts]
            others = [manager.add_request(p, max_new_tokens=12) for p in prompts]
            changed = 0
            for prompt, rid, other in zip(prompts, ids, others):
                got = manager.get_result(rid, timeout=60).generated_tokens
                expected = penalized_alone(model, prompt, 12, case.get("frequency_penalty", 0.0),
                                           case.get("presence_penalty", 0.0), case.get("logit_bias", {}),
                                           case.get("repetition_penalty", 1.0))
                assert got == expected, case
                assert manager.get_result(other, timeout=60).generated_tokens == alone(model, prompt, 12)
                changed += expected != alone(model, prompt, 12)
            assert changed, f"{case} changed no reply: the test would not see them ignored"
    with model.init_continuous_batching(continuous_batching_config=cb()) as manager:
        forced = manager.get_result(manager.add_request(prompts[0], max_new_tokens=5, logit_bias={42: 100.0}),
                                    timeout=60)
    assert forced.generated_tokens == [42] * 5
    with model.init_continuous_batching(continuous_batching_config=cb()) as manager:  # min_p 1: the likeliest only
        only_best = manager.get_result(manager.add_request(prompts[1], max_new_tokens=8, do_sample=True, seed=4,
                                                           temperature=1.5, min_p=1.0), timeout=60)
        top_1 = manager.get_result(manager.add_request(prompts[2], max_new_tokens=8, do_sample=True, seed=4,
                                                       temperature=1.5, top_k=1), timeout=60)
    assert only_best.generated_tokens == alone(model, prompts[1], 8)
    assert top_1.generated_tokens == alone(model, prompts[2], 8)
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        manager.add_request([1], repetition_penalty=0.0)
    with pytest.raises(ValueError, match="presence_penalty must be between -2 and 2"):
        manager.add_request([1], presence_penalty=2.5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        manager.add_request([1], logit_bias={96: 1.0})
    with pytest.raises(ValueError, match="between -100 and 100"):
        manager.add_request([1], logit_bias={5: 101.0})


def test_prompt_logprobs_score_every_prompt_token_across_chunks_cache_hits_and_siblings(model):
    """``prompt_logprobs=k``: each prompt token's log-probability given those before it (None for the first), as a
    full forward pass gives them (within float32 summation error: chunked prefill over the paged cache sums in
    another order), its k likeliest alternatives; computed even where the prefix cache holds the prompt (a second
    request), across prefill chunks (max_batch_tokens 16 < the prompts), and handed to ``n`` siblings."""
    prompts = random_prompts(3, 20, 60, seed=13)
    with model.init_continuous_batching(continuous_batching_config=cb(num_blocks=100, max_batch_tokens=16)) as manager:
        ids = [manager.add_request(p, max_new_tokens=2, prompt_logprobs=3) for p in prompts]
        outputs = [manager.get_result(rid, timeout=60) for rid in ids]
        again = manager.add_request(prompts[0], max_new_tokens=2, prompt_logprobs=0, num_return_sequences=2)
        repeats = [manager.get_result(rid, timeout=60) for rid in (again, f"{again}__child#0")]
        without = manager.get_result(manager.add_request(prompts[1], max_new_tokens=2), timeout=60)
    for prompt, out in zip(prompts, outputs):
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1], dim=-1)  # (prompt - 1, V)
        assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(prompt)
        torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]),
                                   expected.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0], atol=1e-4, rtol=0)
        for top, row in zip(out.prompt_top_logprobs[1:], expected):
            values, indices = row.topk(3)
            assert len(top) == 3
            torch.testing.assert_close(torch.tensor(sorted(top.values())), values.sort().values, atol=1e-4, rtol=0)
            if float(values[1] - values[2]) > 1e-3:  # no near-tie deciding the order
                assert set(top) == set(indices.tolist())
    for repeat in repeats:
        torch.testing.assert_close(torch.tensor(repeat.prompt_logprobs[1:]), torch.tensor(outputs[0].prompt_logprobs[1:]),
                                   atol=1e-4, rtol=0)
        assert all(top == {} for top in repeat.prompt_top_logprobs[1:])
    assert without.prompt_logprobs == [] and without.cached_prompt_tokens > 0  # the prefix cache still serves others
    with pytest.raises(ValueError, match="prompt_logprobs must be None or 0 to 20"):
        manager.add_request([1], prompt_logprobs=21)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                          "pet": {"enum": ["cat", "dog", "none"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}


def test_a_grammar_makes_every_reply_valid_json_for_its_schema(smollm):
    """SmolLM2-135M-Instruct, asked in its chat template, with llguidance's grammar of a schema (and of any JSON
    object): every reply, greedy or sampled, n siblings, beside an unconstrained request, parses and validates, and
    ends by itself (finish_reason "stop"); the unconstrained reply to the same prompt is not such JSON."""
    import jsonschema

    from kvgen.grammar import response_grammar

    model, tokenizer = smollm
    ask = lambda text: tokenizer.apply_chat_template([{"role": "user", "content": text}],  # noqa: E731
                                                    add_generation_prompt=True)
    person = response_grammar({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    anything = response_grammar({"type": "json_object"})
    with model.init_continuous_batching(tokenizer=tokenizer, continuous_batching_config=cb(num_blocks=200)) as manager:
        prompt = ask("Who is Ada Lovelace?")
        free = manager.add_request(prompt, max_new_tokens=48)
        greedy = manager.add_request(prompt, max_new_tokens=48, grammar=person)
        sampled = manager.add_request(prompt, max_new_tokens=48, grammar=person, do_sample=True, temperature=1.0,
                                      seed=3, num_return_sequences=2)
        objects = manager.add_request(ask("Describe a cat as a JSON object."), max_new_tokens=96, grammar=anything)
        replies = {rid: manager.get_result(rid, timeout=120) for rid in (greedy, sampled, f"{sampled}__child#0")}
        any_object = manager.get_result(objects, timeout=120)
        unconstrained = tokenizer.decode(manager.get_result(free, timeout=120).generated_tokens, skip_special_tokens=True)
    for rid, out in replies.items():
        text = tokenizer.decode(out.generated_tokens, skip_special_tokens=True)
        assert out.finish_reason == "stop", (rid, text)
        jsonschema.validate(json.loads(text), PERSON)
    assert any_object.finish_reason == "stop"
    assert isinstance(json.loads(tokenizer.decode(any_object.generated_tokens, skip_special_tokens=True)), dict)
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(unconstrained), PERSON)


def test_response_formats_that_name_no_grammar_are_refused():
    from kvgen.grammar import GrammarError, response_grammar

    assert response_grammar(None) is None and response_grammar({"type": "text"}) is None
    for bad, message in [({"type": "xml"}, "text, json_object or json_schema"),
                         ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, "schema a JSON object"),
                         ({"type": "json_schema", "json_schema": {"schema": {"type": "strang"}}}, "strang")]:
        with pytest.raises(GrammarError, match=message):
            response_grammar(bad)


def test_eos_stops_one_request_and_not_the_others(model):
    prompts = random_prompts(3, 10, 40, seed=10)
    free_run = model.generate_batch(prompts, max_new_tokens=12, continuous_batching_config=cb())
    eos = free_run["req_0"].generated_tokens[4]
    stopped = model.generate_batch(prompts, max_new_tokens=12, eos_token_id=eos, continuous_batching_config=cb())
    tokens = stopped["req_0"].generated_tokens
    assert tokens == free_run["req_0"].generated_tokens[: tokens.index(eos) + 1]
    assert stopped["req_0"].finish_reason == "stop"
    for rid in ("req_1", "req_2"):
        expected = free_run[rid].generated_tokens
        cut = expected.index(eos) + 1 if eos in expected else len(expected)
        assert stopped[rid].generated_tokens == expected[:cut]


def test_stop_strings_on_the_real_model(smollm):
    smollm, tokenizer = smollm
    prompt = tokenizer("The capital of France is")["input_ids"]
    free_run = smollm.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):]
    text = tokenizer.decode(free_run)
    stop = text.strip().split()[2]  # the third word of the continuation
    out = smollm.generate_batch([prompt], max_new_tokens=20, stop_strings=stop, tokenizer=tokenizer,
                                continuous_batching_config=cb(num_blocks=20))["req_0"]
    assert out.finish_reason == "stop"
    assert stop in tokenizer.decode(out.generated_tokens)
    assert stop not in tokenizer.decode(out.generated_tokens[:-1])
    assert out.generated_tokens == free_run[: len(out.generated_tokens)].tolist()


# -- the real model -------------------------------------------------------------------------------------


def test_smollm_batch_equals_generate_alone(smollm):
    from pydoc_data.topics import topics

    smollm, tokenizer = smollm
    names = ["assert", "assignment", "async", "atom-identifiers", "attribute-access", "augassign"]
    prompts = [tokenizer(topics[n][: 150 + 120 * i])["input_ids"] for i, n in enumerate(names)]
    outputs = smollm.generate_batch(prompts, max_new_tokens=24,
                                    continuous_batching_config=cb(num_blocks=120, max_batch_tokens=128))
    assert_same_as_alone(smollm, prompts, outputs, 24, tie=1e-3)



def test_prompt_logprobs_add_up_to_the_library_loglikelihood(smollm):
    """What lm-eval's loglikelihood sums (a continuation's prompt logprobs, the engine's pack_weights on) equals the
    library's ``model(ids).logits`` log-softmax in float64 within 1e-4. The logits agree; float32 ``log_softmax``'s
    normalizer moved every logprob alike and this 33-token verse's sum 4.2e-4 away."""
    smollm, tokenizer = smollm
    verse = ("And the earth was without form, and void; and darkness was upon the face of the deep. And the Spirit of "
             "God moved upon the face of the waters.")
    ids = tokenizer(verse)["input_ids"]
    with smollm.init_continuous_batching(continuous_batching_config=cb(num_blocks=32)) as manager:
        out = manager.get_result(manager.add_request(ids, max_new_tokens=1, prompt_logprobs=0), timeout=60)
    with torch.no_grad():
        logprobs = torch.log_softmax(smollm(torch.tensor([ids])).logits[0].double(), dim=-1)  # (T, V)
    expected = [float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))]
    half = len(ids) // 2  # a continuation, as the harness cuts one
    assert abs(sum(out.prompt_logprobs[half:]) - sum(expected[half - 1:])) < 1e-4
    assert max(abs(a - b) for a, b in zip(out.prompt_logprobs[1:], expected)) < 1e-5

# -- the manager ----------------------------------------------------------------------------------------


def test_streaming_yields_every_token_then_the_final_output(model):
    prompt = random_prompts(1, 20, 21, seed=11)[0]
    with model.init_continuous_batching(continuous_batching_config=cb()) as manager:
        rid = manager.add_request(prompt, max_new_tokens=6, streaming=True)
        outputs = list(manager.request_id_iter(rid))
    assert [len(o.generated_tokens) for o in outputs] == [1, 2, 3, 4, 5, 6]
    assert outputs[-1].is_finished() and not outputs[-2].is_finished()
    assert outputs[-1].generated_tokens == alone(model, prompt, 6)


def test_cancel_frees_the_blocks_at_once(model):
    with model.init_continuous_batching(continuous_batching_config=cb(num_blocks=40)) as manager:
        rid = manager.add_request(random_prompts(1, 60, 61)[0], max_new_tokens=400, streaming=True)
        next(manager.request_id_iter(rid))  # running
        assert manager.stats()["blocks_free"] < 40
        manager.cancel_request(rid)
        outputs = list(manager.request_id_iter(rid))
        assert outputs[-1].finish_reason == "cancelled"
        assert len(outputs[-1].generated_tokens) < 400
        assert manager.stats()["blocks_free"] == 40 and manager.stats()["running"] == 0


def test_requests_from_many_threads(model):
    prompts = random_prompts(6, 5, 50, seed=12)
    results = {}
    with model.init_continuous_batching(continuous_batching_config=cb()) as manager:
        def client(i):
            rid = manager.add_request(prompts[i], max_new_tokens=8)
            results[i] = manager.get_result(rid, timeout=120)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert_same_as_alone(model, prompts, {f"req_{i}": results[i] for i in results}, 8)


def test_bad_requests_get_clear_errors(model):
    manager = model.init_continuous_batching(continuous_batching_config=cb(num_blocks=8, max_queue=1))
    with pytest.raises(ValueError, match="empty"):
        manager.add_request([])
    with pytest.raises(ValueError, match="more than the model's context of 512"):
        manager.add_request([1] * 600)
    with pytest.raises(ValueError, match="lower max_new_tokens to at most 12"):
        manager.add_request([1] * 500, max_new_tokens=20)
    with pytest.raises(ValueError, match="needs 9 blocks but the whole KV cache holds 8"):
        manager.add_request([1] * 100, max_new_tokens=40)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        manager.add_request([1, 96])
    with pytest.raises(ValueError, match="one prompt"):
        manager.add_request([[1, 2], [3]])
    manager.add_request([1, 2, 3])  # not started: it waits
    with pytest.raises(QueueFull):
        manager.add_request([1, 2, 3])
    with pytest.raises(ValueError, match="holds no block"):
        PagedAttentionCache(model.config, max_memory="1KB")
    with pytest.raises(ValueError, match="cannot read the memory size"):
        parse_memory("lots")


# -- pieces ---------------------------------------------------------------------------------------------


def test_block_pool_reuses_cached_prefixes_least_recently_used_first():
    pool = BlockPool(num_blocks=4, block_size=2)
    a, b = pool.allocate(2), pool.allocate(2)
    keys_a, keys_b = prefix_keys([1, 2, 3, 4], 2), prefix_keys([5, 6, 7, 8], 2)
    for blocks, keys in ((a, keys_a), (b, keys_b)):
        for block, key in zip(blocks, keys):
            pool.register(block, key)
    pool.free(a)
    pool.free(b)
    assert pool.num_free == 4
    assert pool.match_prefix(keys_b) == b  # a hit holds the blocks again
    assert pool.num_free == 2
    fresh = pool.allocate(1)  # evicts from a's chain, tail first
    assert fresh == [a[1]]
    assert pool.match_prefix(keys_a) == [a[0]]
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.free(fresh)
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(fresh)


def test_masks_take_per_row_key_positions():
    # two sequences side by side: rows 0-1 are positions 1-2 of sequence A (slots 0-2), row 2 position 0 of B (slot 3)
    keys = torch.tensor([[0, 1, 2, -1], [0, 1, 2, -1], [-1, -1, -1, 0]])
    mask, causal = attention_mask(torch.tensor([1, 2, 0]), keys)
    assert not causal
    assert mask[0, 0].tolist() == [[True, True, False, False], [True, True, True, False], [False, False, False, True]]
    windowed, _ = attention_mask(torch.tensor([1, 2, 0]), keys, sliding_window=2)
    assert windowed[0, 0, 1].tolist() == [False, True, True, False]


def test_cancelling_n_siblings_before_the_first_token_ends_them_all(model):
    manager = model.init_continuous_batching(continuous_batching_config=cb())
    rid = manager.add_request([1, 2, 3], max_new_tokens=5, do_sample=True, num_return_sequences=3)
    manager.cancel_request(rid)  # queued behind the add: the loop sees both before any step
    with manager:
        finals = [manager.get_result(r, timeout=30) for r in (rid, f"{rid}__child#0", f"{rid}__child#1")]
        assert manager.get_result(None, timeout=0.01) is None  # nothing left, no error
    assert [o.finish_reason for o in finals] == ["cancelled"] * 3
    assert manager.stats()["blocks_free"] == 64


def test_a_fresh_pool_reads_as_zeros_and_takes_writes():
    """The CPU pool is lazily zeroed memory (never-written slots must be zeros: attention weighs excluded
    keys by 0, and 0 times a NaN is NaN); writes land in place."""
    cache = PagedAttentionCache(kvgen.PretrainedConfig(**CONFIG), num_blocks=8, block_size=4)
    layer = cache.layer(0)
    assert layer.pool_keys.shape == (1, 2, 32, 16) and layer.pool_keys.dtype == torch.float32
    assert torch.count_nonzero(layer.pool_keys) == 0 and torch.count_nonzero(layer.pool_values) == 0
    cache.begin_step({"full_attention": (torch.tensor([5, 6]), torch.full((2, 8), -1))})
    new = torch.randn(1, 2, 2, 16)
    keys, _ = cache.update(new, new, 0)
    assert torch.equal(layer.pool_keys[:, :, 5:7], new) and keys.shape == (1, 2, 8, 16)
    assert torch.count_nonzero(layer.pool_keys) == new.numel()


def test_the_loop_thread_computes_after_the_caller_releases_its_openmp_threads():
    """release_openmp_threads() frees the caller's OpenMP workers (so the loop's thread is not throttled);
    parallel torch work in the caller and in another thread stays correct afterwards."""
    from kvgen.serving.engine import release_openmp_threads

    a, b = torch.randn(300, 200), torch.randn(200, 100)
    expected = a.double() @ b.double()
    results = []
    release_openmp_threads()
    worker = threading.Thread(target=lambda: results.append(a @ b))
    worker.start()
    worker.join()
    results.append(a @ b)
    for got in results:
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


def test_the_engine_packs_the_weights_while_it_runs(model):
    """Its linear layers read a packed copy of their weights while the engine runs, and drop it at stop;
    with pack_weights=False they are never packed. Outputs are the same either way (test above)."""
    layers = [m for m in model.modules() if isinstance(m, kvgen.models.linear.Linear)]
    with model.init_continuous_batching(continuous_batching_config=cb()) as manager:
        assert all(layer._onednn is not None for layer in layers) or kvgen.models.linear._ONEDNN_LINEAR is None
        manager.get_result(manager.add_request([1, 2, 3], max_new_tokens=2), timeout=60)
    assert all(layer._onednn is None for layer in layers)
    outputs = model.generate_batch([[1, 2, 3]], max_new_tokens=4, do_sample=False,
                                   continuous_batching_config=cb(pack_weights=False))
    assert outputs["req_0"].generated_tokens == alone(model, [1, 2, 3], 4)
    assert all(layer._onednn is None for layer in layers)


def test_a_pool_hands_out_the_blocks_after_a_sequence_s_last_one_first():
    """allocate(after=...) takes the free blocks that follow a sequence's last one (runs that attention reads
    faster), lowest free ones otherwise; the free count stays exact."""
    pool = BlockPool(num_blocks=8, block_size=4)
    a, b = pool.allocate(2), pool.allocate(1)
    assert (a, b) == ([0, 1], [2])
    assert pool.allocate(1, after=a[-1]) == [3]  # block 2 is taken: the lowest free one
    pool.free(b)
    assert pool.allocate(2, after=1) == [2, 4] and pool.num_free == 3
    pool.free([2, 4])
    assert pool.allocate(3) == [2, 4, 5] and pool.num_free == 2
    assert pool.allocate(2, after=6) == [7, 6] and pool.num_free == 0
    with pytest.raises(MemoryError):
        pool.allocate(1)


def test_growing_sequences_take_their_blocks_in_runs_while_the_pool_has_room(model):
    """Two sequences growing side by side: each one's blocks lie in runs of at least 4 (one block each in turn
    would interleave them one by one)."""
    with model.init_continuous_batching(continuous_batching_config=cb(num_blocks=200)) as manager:
        rids = [manager.add_request(random_prompts(1, 19, 20, seed=s)[0], max_new_tokens=90, streaming=True)
                for s in (1, 2)]
        tables = {}
        for output in manager.request_id_iter(rids[0]):
            for seq in manager.scheduler.running:
                tables[seq.request_id] = list(seq.tables["full_attention"])
        manager.get_result(rids[1], timeout=60)
    assert len(tables) == 2 and all(len(t) >= 7 for t in tables.values())  # 109 positions: 7 blocks
    for table in tables.values():
        starts = [i for i in range(len(table)) if i == 0 or table[i] != table[i - 1] + 1]
        runs = [b - a for a, b in zip(starts, starts[1:] + [len(table)])]
        assert min(runs) >= 4, table
