"""The seeds' examples, run on the real default model.

Each snippet is the seed's code with only the import (``transformers`` -> ``kvgen``), the
model id and the device changed. Each test also checks that the result is right: cached
and uncached paths, reused and fresh caches must agree.
"""

from __future__ import annotations

import copy

import torch

import kvgen
from kvgen import AutoModelForCausalLM, AutoTokenizer, DynamicCache, StaticCache

DEVICE = "cpu"


def greedy_reference(model, ids, n):
    """Greedy continuation computed without any cache: one full forward per token."""
    with torch.no_grad():
        for _ in range(n):
            next_id = model(ids, use_cache=False).logits[:, -1:].argmax(-1)
            ids = torch.cat([ids, next_id], dim=-1)
    return ids


def test_custom_generation_loop_with_cache_position(default_model_dir):
    # seed 000 / 003: "Under the Hood", the hand-written loop
    model_id = default_model_dir
    model = AutoModelForCausalLM.from_pretrained(model_id, torch_dtype=torch.float32, device_map=DEVICE)
    tokenizer = AutoTokenizer.from_pretrained(model_id)

    past_key_values = DynamicCache()
    messages = [{"role": "user", "content": "Hello, what's your name."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True).to(DEVICE)

    generated_ids = inputs.input_ids
    cache_position = torch.arange(inputs.input_ids.shape[1], dtype=torch.int64, device=DEVICE)
    max_new_tokens = 10

    for _ in range(max_new_tokens):
        outputs = model(**inputs, cache_position=cache_position, past_key_values=past_key_values, use_cache=True)
        # Greedily sample one next token
        next_token_ids = outputs.logits[:, -1:].argmax(-1)
        generated_ids = torch.cat([generated_ids, next_token_ids], dim=-1)
        # Prepare inputs for the next generation step by leaaving unprocessed tokens, in our case we have only one
        # new token and expanding attn mask for the new token, as explained above
        attention_mask = inputs["attention_mask"]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=-1)
        inputs = {"input_ids": next_token_ids, "attention_mask": attention_mask}
        cache_position = cache_position[-1:] + 1  # add one more position for the next token

    text = tokenizer.batch_decode(generated_ids, skip_special_tokens=True)[0]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    assert torch.equal(generated_ids, greedy_reference(model, prompt, max_new_tokens))
    assert past_key_values.get_seq_length() == generated_ids.shape[1] - 1
    assert text.startswith("system")


def test_legacy_cache_format(smollm):
    # seeds 000 and 001: "Legacy cache format"
    model, tokenizer = smollm
    inputs = tokenizer("Hello, my name is", return_tensors="pt").to(model.device)
    generation_outputs = model.generate(**inputs, return_dict_in_generate=True, return_legacy_cache=True,
                                        max_new_tokens=5)
    cache = DynamicCache.from_legacy_cache(generation_outputs.past_key_values)
    legacy_format_cache = cache.to_legacy_cache()

    assert isinstance(generation_outputs.past_key_values, tuple)
    assert len(legacy_format_cache) == model.config.num_hidden_layers
    n = generation_outputs.sequences.shape[1] - 1  # the last token is generated, not yet fed
    assert legacy_format_cache[0][0].shape == (1, model.config.num_key_value_heads, n, model.config.head_dim)
    # the legacy cache continues generation exactly like the cache object
    seq = generation_outputs.sequences
    again = model.generate(seq, past_key_values=legacy_format_cache, max_new_tokens=3, do_sample=False)
    fresh = model.generate(seq, max_new_tokens=3, do_sample=False)
    assert torch.equal(again, fresh)
    # a legacy tuple in forward() comes back as a legacy tuple
    out = model(seq[:, -1:], past_key_values=legacy_format_cache)
    assert isinstance(out.past_key_values, tuple) and out.past_key_values[0][0].shape[2] == n + 1


def _iterative_chat(model, tokenizer, past_key_values, user_prompts, max_new_tokens=24):
    """Seeds 000/003/004: "Iterative Generation with Cache" (max_new_tokens shortened for the test)."""
    max_cache_length = past_key_values.get_max_length()  # noqa: F841 (used by the seed's SinkCache branch)
    messages = []
    for prompt in user_prompts:
        messages.append({"role": "user", "content": prompt})
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True).to(model.device)
        input_length = inputs["input_ids"].shape[1]
        outputs = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens,
                                 past_key_values=past_key_values)
        completion = tokenizer.decode(outputs[0, input_length:], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": completion})
    return messages


def test_iterative_generation_reuses_the_cache(smollm):
    model, tokenizer = smollm
    user_prompts = ["Hello, what's your name?", "Btw, yesterday I was on a rock concert."]
    for cache in (DynamicCache(), DynamicCache(config=model.config)):
        messages = _iterative_chat(model, tokenizer, cache, user_prompts)
        assert [m["role"] for m in messages] == ["user", "assistant"] * 2
        # the second answer equals the one computed from scratch (no stale or missing cache entries)
        inputs = tokenizer.apply_chat_template(messages[:3], add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
        fresh = model.generate(**inputs, do_sample=False, max_new_tokens=24)
        assert tokenizer.decode(fresh[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True) == messages[3]["content"]
        assert cache.get_seq_length() >= inputs["input_ids"].shape[1]  # prompt + reply, last token unfed


def test_prefix_reuse_with_deepcopy_static_cache(default_model_dir):
    # seed 000 / 003: "Re-use Cache to continue generation" (StaticCache with every argument)
    model_id = default_model_dir
    model = AutoModelForCausalLM.from_pretrained(model_id, torch_dtype=torch.float32, device_map=DEVICE)
    tokenizer = AutoTokenizer.from_pretrained(model_id)

    prompt_cache = StaticCache(config=model.config, max_batch_size=1, max_cache_len=1024, device=DEVICE,
                               dtype=torch.float32)
    INITIAL_PROMPT = "You are a helpful assistant. "
    inputs_initial_prompt = tokenizer(INITIAL_PROMPT, return_tensors="pt").to(DEVICE)
    with torch.no_grad():
        prompt_cache = model(**inputs_initial_prompt, past_key_values=prompt_cache).past_key_values

    prompts = ["Help me to write a blogpost about travelling.", "What is the capital of France?"]
    responses = []
    for prompt in prompts:
        new_inputs = tokenizer(INITIAL_PROMPT + prompt, return_tensors="pt").to(DEVICE)
        past_key_values = copy.deepcopy(prompt_cache)
        outputs = model.generate(**new_inputs, past_key_values=past_key_values, max_new_tokens=20)
        response = tokenizer.batch_decode(outputs)[0]
        responses.append(response)
        fresh = model.generate(**new_inputs, max_new_tokens=20)
        assert torch.equal(outputs, fresh)
    assert prompt_cache.get_seq_length() == inputs_initial_prompt["input_ids"].shape[1]  # the prefix is untouched
    assert all(r.startswith(INITIAL_PROMPT) for r in responses)


def test_prefix_reuse_static_cache_newest_spelling(smollm):
    # seed 004: StaticCache(config=model.config, max_cache_len=1024), batch/device/dtype inferred
    model, tokenizer = smollm
    prompt_cache = StaticCache(config=model.config, max_cache_len=1024)
    inputs_initial_prompt = tokenizer("You are a helpful assistant. ", return_tensors="pt").to(model.device.type)
    with torch.no_grad():
        prompt_cache = model(**inputs_initial_prompt, past_key_values=prompt_cache).past_key_values
    new_inputs = tokenizer("You are a helpful assistant. What is the capital of France?", return_tensors="pt")
    outputs = model.generate(**new_inputs, past_key_values=copy.deepcopy(prompt_cache), max_new_tokens=12)
    assert torch.equal(outputs, model.generate(**new_inputs, max_new_tokens=12))


def test_static_cache_implementation_and_use_cache_false(smollm):
    # seeds 000/004: cache_implementation="static"; seed 004: use_cache=False; DynamicCache(config=...)
    model, tokenizer = smollm
    inputs = tokenizer("Hello, my name is", return_tensors="pt").to(model.device)
    static = model.generate(**inputs, do_sample=False, max_new_tokens=20, cache_implementation="static")
    uncached = model.generate(**inputs, do_sample=False, max_new_tokens=20, use_cache=False)
    past_key_values = DynamicCache(config=model.config)
    dynamic = model.generate(**inputs, do_sample=False, max_new_tokens=20, past_key_values=past_key_values)
    assert torch.equal(static, uncached) and torch.equal(dynamic, uncached)
    assert tokenizer.batch_decode(static, skip_special_tokens=True)[0].startswith("Hello, my name is")
