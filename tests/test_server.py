"""``kvgen serve`` through the official ``openai`` client, on a tiny random model (SmolLM2's vocabulary) served
by a subprocess on a free loopback port: completions and chat, streamed or not, ``n``, stop strings, logprobs,
every error as OpenAI's error body, auth, 429, disconnects, SIGTERM drain, and 64 concurrent requests."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import hypothesis
import openai
import pytest
import torch

import kvgen
from kvgen import LlamaForCausalLM, PretrainedConfig
from kvgen.cli import serving_kv_dtype
from kvgen.loading.checkpoint import save_safetensors_checkpoint
from kvgen.loading.default_model import default_gguf_path
from kvgen.models.decode_blocks import eager_blocks
from kvgen.tokenizer import fill_in_the_middle_tokens

KEY = "test-key"
FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
CONTEXT = 1024
WORDS = "the a little cat dog sea sky ran over under big red green house tree river song old new light".split()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random 2-layer Llama with SmolLM2's tokenizer and chat template (peaked logits: greedy is far from ties),
    and Qwen2.5-Coder's three fill-in-the-middle tokens added to its vocabulary."""
    tokenizer = kvgen.AutoTokenizer.from_pretrained(default_gguf_path())
    tokenizer.backend_tokenizer.add_special_tokens(list(FIM))
    config = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=CONTEXT, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                  hidden_act="silu", eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(PretrainedConfig(**config)).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    folder = tmp_path_factory.mktemp("tiny-serve")
    save_safetensors_checkpoint(folder, model.state_dict(), config, {"eos_token_id": tokenizer.eos_token_id})
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reference(tiny):
    """Expected replies: ``generate()`` on the same checkpoint, greedy, with a cache of the server's KV precision
    (the engine's contract: its tokens are generate()'s with keys and values stored alike)."""
    model = kvgen.AutoModelForCausalLM.from_pretrained(tiny)
    tokenizer = kvgen.AutoTokenizer.from_pretrained(tiny)
    kv = {"dtype": serving_kv_dtype(model)}

    def expected(prompt: str | list[dict], max_tokens: int) -> str:
        ids = (tokenizer(prompt)["input_ids"] if isinstance(prompt, str)
               else tokenizer.apply_chat_template(prompt, add_generation_prompt=True))
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # a tiny model: one thread, no spinning against the server's
        try:
            with eager_blocks():
                out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                     cache_implementation="static", cache_config=kv)
        finally:
            torch.set_num_threads(threads)
        return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)

    expected.tokenizer, expected.model, expected.kv_dtype = tokenizer, model, kv["dtype"]
    return expected


class Server:
    """``kvgen serve`` in a subprocess on a free port."""

    def __init__(self, folder, *args: str, name: str = "tiny"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "kvgen.cli", "serve", "-m", str(folder), "--served-model-name", name,
                   "--port", str(self.port), "--kv-cache-memory", "4MB", "-t", "1", *args]  # (llama-server's -m, -t)
        self.log = tempfile.TemporaryFile("w+")
        env = {**os.environ, "KVGEN_DISABLE_COMPILE": "1", "OMP_NUM_THREADS": "1"}  # a tiny model: one thread
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                if urllib.request.urlopen(f"{self.url}/health", timeout=1).status == 200:
                    break
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                pytest.fail(f"kvgen serve did not start:\n{self.output()}")
            time.sleep(0.2)
        # the first request may build kvgen's CPU kernels (once per machine): not timed by the tests
        self.client().completions.create(model=name, prompt="Hi", max_tokens=1, timeout=600)

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"{self.url}/metrics", timeout=5).read().decode()
        return {name: float(value) for name, value in re.findall(r"^(\S+) (\S+)$", text, re.MULTILINE)
                if not name.startswith("#")}

    def wait_idle(self, blocks_free: float, timeout: float = 10) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            busy = m["kvgen_requests_running"] + m["kvgen_requests_waiting"]
            if busy == 0 and m["kvgen_kv_blocks_free"] == blocks_free:
                return m
            assert time.monotonic() < deadline, f"the server did not go idle: {m}"
            time.sleep(0.05)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.log.close()


@pytest.fixture(scope="module")
def server(tiny):
    s = Server(tiny, "--api-key", KEY, "--max-num-seqs", "16", "--max-queue", "128", "--max-batch-tokens", "48")
    yield s
    s.close()


@pytest.fixture(scope="module")
def small(tiny):
    """One running sequence and one waiting request at most."""
    s = Server(tiny, "--max-num-seqs", "1", "--max-queue", "1")
    yield s
    s.close()


def stream_text(stream, chat: bool = False, chunks: int | None = None) -> tuple[str, str | None]:
    """Joined text and last finish_reason of a stream; with ``chunks``, close it after that many."""
    text, finish = "", None
    for i, chunk in enumerate(stream):
        for choice in chunk.choices:
            text += (choice.delta.content or "") if chat else choice.text
            finish = choice.finish_reason or finish
        if chunks is not None and i + 1 >= chunks:
            stream.close()
            break
    return text, finish


def prompt_text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))).capitalize()


# -- the routes -----------------------------------------------------------------------------------------


def test_completions_and_chat_match_generate(server, reference):
    client = server.client()
    prompt, chat = "Once upon a time, there was a", [{"role": "user", "content": "Tell me a story."}]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert out.choices[0].text == reference(prompt, 12) and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(reference.tokenizer(prompt)["input_ids"]), 12)
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True)
    assert stream_text(streamed) == (reference(prompt, 12), "length")
    reply = client.chat.completions.create(model="tiny", messages=chat, max_tokens=10, temperature=0)
    assert reply.choices[0].message.content == reference(chat, 10) and reply.choices[0].message.role == "assistant"
    streamed = client.chat.completions.create(model="tiny", messages=chat, max_completion_tokens=10, temperature=0,
                                              stream=True, stream_options={"include_usage": True})
    assert stream_text(streamed, chat=True) == (reference(chat, 10), "length")
    client.completions.create(model="tiny", prompt=prompt * 8, max_tokens=2, temperature=0)
    again = client.completions.create(model="tiny", prompt=prompt * 8, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # the prefix cache served full blocks


def test_n_stop_strings_and_logprobs(server, reference):
    client = server.client()
    prompt = "The river ran under the old"
    sampled = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, n=2, temperature=1.0, seed=7)
    assert sorted(c.index for c in sampled.choices) == [0, 1] and sampled.usage.completion_tokens == 16
    assert sampled.choices[0].text != sampled.choices[1].text
    full = reference(prompt, 20)
    stop = full[10:13]
    cut = full.index(stop)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, stop=[stop, "zzzz"])
    assert (out.choices[0].text, out.choices[0].finish_reason) == (full[:cut], "stop")
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, stop=stop,
                                         stream=True)
    assert stream_text(streamed) == (full[:cut], "stop")
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text and len(lp.token_logprobs) == 5
    assert all(len(top) == 2 and max(top.values()) == value for top, value in zip(lp.top_logprobs, lp.token_logprobs))
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=3)
    assert [len(t.top_logprobs) for t in chat.choices[0].logprobs.content] == [3, 3, 3]


def test_penalties_and_logit_bias(server, reference):
    """The body's penalties reach the engine (whose arithmetic tests/test_continuous_batching.py checks): a bias of
    100 makes every token the biased one, a presence penalty of 2 changes a greedy reply that repeats itself."""
    client = server.client()
    prompt = "The river ran under the old"
    token = reference.tokenizer(" sea")["input_ids"][-1]
    forced = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                       logit_bias={str(token): 100})
    assert forced.choices[0].text == reference.tokenizer.decode([token] * 4)
    plain = reference(prompt, 16)
    assert len(set(reference.tokenizer(plain)["input_ids"])) < 16  # it repeats: a presence penalty acts
    for stream in (False, True):
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                        presence_penalty=2.0, frequency_penalty=0.5, stream=stream)
        text = stream_text(out)[0] if stream else out.choices[0].text
        assert text != plain
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logit_bias={str(token): 100})
    assert chat.choices[0].message.content == reference.tokenizer.decode([token] * 3)
    for settings, param in [(dict(presence_penalty=2.5), "presence_penalty"),
                            (dict(frequency_penalty=-3), "frequency_penalty"),
                            (dict(logit_bias={"x": 1}), "logit_bias"), (dict(logit_bias={"5": 300}), "logit_bias"),
                            (dict(logit_bias={str(10 ** 7): 1}), "logit_bias")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny", prompt=prompt, max_tokens=2, **settings)
        assert info.value.body["param"] == param, settings


def test_echo_scores_the_prompt(server, reference):
    """``echo`` puts the prompt before the answer, and with ``logprobs`` its tokens' log-probabilities (None for
    the first) as a full forward pass gives them; ``max_tokens: 0`` scores the prompt alone (what evaluation
    harnesses send)."""
    client, tokenizer = server.client(), reference.tokenizer
    prompt = "The river ran under the old"
    ids = tokenizer(prompt)["input_ids"]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert out.choices[0].text == prompt + reference(prompt, 4)
    assert stream_text(client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                                 echo=True, stream=True))[0] == prompt + reference(prompt, 4)
    with torch.no_grad():
        cache = kvgen.StaticCache(config=reference.model.config, max_cache_len=len(ids), dtype=reference.kv_dtype)
        logits = reference.model(torch.tensor([ids]), past_key_values=cache).logits  # (1, len, V)
        expected = torch.log_softmax(logits[0, :-1], dim=-1)  # (len - 1, V)
    scored = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert (choice.text, choice.finish_reason, scored.usage.completion_tokens) == (prompt, "length", 0)
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in ids] and lp.token_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]), expected.gather(1, torch.tensor(ids[1:])[:, None])[:, 0],
                               atol=1e-4, rtol=0)
    assert lp.top_logprobs[0] is None and all(len(top) == 1 for top in lp.top_logprobs[1:])
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]
    both = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=0)
    assert len(both.choices[0].logprobs.tokens) == len(ids) + 3
    assert both.choices[0].logprobs.token_logprobs[:len(ids)] == pytest.approx(lp.token_logprobs, abs=1e-4)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=0)
    assert info.value.body["param"] == "max_tokens"


def test_best_of_answers_the_likeliest_sequences(server):
    """``best_of=3, n=1`` answers the one of the 3 sequences ``n=3`` gives (same seed) of the highest mean
    log-probability per token."""
    client = server.client()
    settings = dict(model="tiny", prompt="The river ran under the old", max_tokens=6, temperature=1.0, seed=11,
                    logprobs=0)
    three = client.completions.create(n=3, **settings).choices
    mean = lambda c: sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs)  # noqa: E731
    best = client.completions.create(n=1, best_of=3, **settings).choices
    assert [c.text for c in best] == [max(three, key=mean).text]
    assert len({c.text for c in three}) > 1  # the choice mattered
    for extra, param in [(dict(n=2, best_of=1), "best_of"), (dict(n=1, best_of=2, stream=True), "best_of")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(**{**settings, **extra})
        assert info.value.body["param"] == param


def test_suffix_fills_in_the_middle(server, reference):
    """``suffix``: the prompt becomes ``<|fim_prefix|>prompt<|fim_suffix|>suffix<|fim_middle|>`` (the model's
    fill-in-the-middle tokens, as Qwen2.5-Coder and StarCoder name them)."""
    client, tokenizer = server.client(), reference.tokenizer
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))"
    fim = [tokenizer.convert_tokens_to_ids(name) for name in FIM]
    ids = [fim[0], *tokenizer.encode(prefix, add_special_tokens=False), fim[1],
           *tokenizer.encode(suffix, add_special_tokens=False), fim[2]]
    filled = client.completions.create(model="tiny", prompt=prefix, suffix=suffix, max_tokens=6, temperature=0)
    as_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    plain = client.completions.create(model="tiny", prompt=prefix, max_tokens=6, temperature=0)
    assert filled.choices[0].text == as_ids.choices[0].text != plain.choices[0].text
    assert filled.usage.prompt_tokens == len(ids)
    assert fill_in_the_middle_tokens(kvgen.AutoTokenizer.from_pretrained(default_gguf_path())) is None  # SmolLM2
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=[ids], suffix=suffix, max_tokens=2)
    assert info.value.body["param"] == "suffix"


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "pet": {"enum": ["cat", "dog"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}


def test_response_format_constrains_every_choice_to_the_schema(server):
    """``response_format`` json_schema on chat and completions, streamed or not, ``n=3`` sampled: every choice of
    the random model is JSON valid for the schema and ends by itself; json_object gives an object; a bad schema
    or type is a 400 naming response_format."""
    import jsonschema

    client = server.client()
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    messages = [{"role": "user", "content": "Who are you?"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=64, n=3, temperature=1.0,
                                          seed=5, response_format=schema_format)
    texts = [c.message.content for c in chat.choices]
    assert [c.finish_reason for c in chat.choices] == ["stop"] * 3 and len(set(texts)) > 1
    streamed = stream_text(client.chat.completions.create(model="tiny", messages=messages, max_tokens=64,
                                                          temperature=0, stream=True, response_format=schema_format),
                           chat=True)
    completion = client.completions.create(model="tiny", prompt="A person:", max_tokens=64, temperature=0,
                                           extra_body={"response_format": schema_format})
    for text in [*texts, streamed[0], completion.choices[0].text]:
        jsonschema.validate(json.loads(text), PERSON)
    assert streamed[1] == "stop" and completion.choices[0].finish_reason == "stop"
    free = client.chat.completions.create(model="tiny", messages=messages, max_tokens=64, temperature=0)
    assert not free.choices[0].message.content.startswith('{"name": ')  # the schema, not the model, made the JSON
    obj = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")
    for bad in ({"type": "xml"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strang"}}}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, response_format=bad)
        assert info.value.body["param"] == "response_format"


WEATHER = {"type": "function", "function": {
    "name": "weather", "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def test_tool_calls_forced_by_tool_choice_and_a_conversation_with_their_results(server):
    """A named ``tool_choice`` and ``"required"`` hold the random model to the tools' parameters: its reply comes
    back as ``tool_calls`` (arguments valid for the schema, finish_reason "tool_calls"), streamed or not; the
    conversation goes on with the call and the tool's answer in the messages; ``"auto"`` with a reply that calls
    nothing is plain content."""
    import jsonschema

    client = server.client()
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    named = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0,
                                           tools=[WEATHER, TIME],
                                           tool_choice={"type": "function", "function": {"name": "weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    required = client.chat.completions.create(model="tiny", messages=messages, max_tokens=80, temperature=1.0,
                                              seed=2, n=2, tools=[WEATHER, TIME], tool_choice="required",
                                              parallel_tool_calls=False)
    for c in required.choices:
        (one,) = c.message.tool_calls
        schema = {"weather": WEATHER, "time": TIME}[one.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(one.function.arguments), schema)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0,
                                            tools=[WEATHER], tool_choice={"type": "function",
                                                                          "function": {"name": "weather"}},
                                            stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    streamed = [t for d in deltas for t in d.delta.tool_calls or []]
    assert [t.function.arguments for t in streamed] == [call.function.arguments]  # greedy: the same call
    assert deltas[-1].finish_reason == "tool_calls" and not "".join(d.delta.content or "" for d in deltas)
    follow_up = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                            {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}]
    answer = client.chat.completions.create(model="tiny", messages=follow_up, max_tokens=6, temperature=0,
                                            tools=[WEATHER])
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None
    assert answer.usage.prompt_tokens > named.usage.prompt_tokens  # the call and its answer are in the prompt
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "launch"}})
    assert info.value.body["param"] == "tool_choice"


@pytest.fixture(scope="module")
def coder():
    """``kvgen serve`` of the real Qwen2.5-Coder-0.5B-Instruct GGUF (its own chat template and FIM tokens)."""
    from kvgen.loading.default_model import coder_gguf_path

    s = Server(coder_gguf_path(), "--kv-cache-memory", "96MB", "-t", "2")  # (the later flags win)
    yield s
    s.close()


def test_a_tool_round_trip_and_fill_in_the_middle_on_qwen2_5_coder(coder):
    """Qwen2.5-Coder-0.5B-Instruct with its own template (Hermes-style tools): asked the weather with
    ``tool_choice`` auto, it writes a ``<tool_call>``, which comes back as ``tool_calls``; the call and the tool's
    answer go back through its template and it answers in words. ``suffix`` fills in the middle of code."""
    client = coder.client()
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                       "required": ["city"]}}}]
    messages = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    asked = client.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=64,
                                           temperature=0)
    choice = asked.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "sunny"}'}]
    answered = client.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=48,
                                              temperature=0)
    reply = answered.choices[0].message
    assert reply.tool_calls is None and answered.choices[0].finish_reason in ("stop", "length")
    assert "21" in reply.content or "sunny" in reply.content.lower(), reply.content
    filled = client.completions.create(model="tiny", prompt="def fib(n):\n    if n < 2:\n        return n\n    return ",
                                       suffix="\n\nprint(fib(10))", max_tokens=12, temperature=0)
    assert filled.choices[0].text.replace(" ", "").startswith("fib(n-1)+fib(n-2)"), filled.choices[0].text


def test_ignore_eos_goes_on_past_the_end_of_sequence_token(tiny, reference, tmp_path):
    """The tiny checkpoint again, with its end-of-sequence token set to the third token it answers with."""
    prompt = "Once upon a time, there was a"
    eos = reference.tokenizer(reference(prompt, 3))["input_ids"][-1]
    for name in ("config.json", "generation_config.json"):
        settings = json.loads((tiny / name).read_text())
        (tmp_path / name).write_text(json.dumps({**settings, "eos_token_id": eos}))
    for name in os.listdir(tiny):
        if not (tmp_path / name).exists():
            os.symlink(tiny / name, tmp_path / name)
    server = Server(tmp_path)
    try:
        client = server.client()
        stopped = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens <= 3
        full = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert (full.choices[0].text, full.choices[0].finish_reason) == (reference(prompt, 12), "length")
        assert full.usage.completion_tokens == 12
    finally:
        server.close()


def test_models_health_and_metrics(server):
    assert [m.id for m in server.client().models.list().data] == ["tiny"]
    assert json.loads(urllib.request.urlopen(f"{server.url}/health").read()) == {"status": "ok"}
    m = server.metrics()
    for name in ("requests_running", "requests_waiting", "kv_blocks_used", "kv_blocks_free", "prefix_cache_hit_rate",
                 "generation_tokens_per_second", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count"):
        assert f"kvgen_{name}" in m, name


# -- errors ---------------------------------------------------------------------------------------------


def raw(server, path: str, data: bytes | None = None, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(f"{server.url}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize("settings, error, param", [
    (dict(max_tokens="many"), openai.UnprocessableEntityError, "max_tokens"),
    (dict(n="two"), openai.UnprocessableEntityError, "n"),
    (dict(model="gpt-4"), openai.NotFoundError, "model"),
    (dict(temperature=-0.5), openai.BadRequestError, "temperature"),
    (dict(max_tokens=0), openai.BadRequestError, "max_tokens"),
    (dict(n=100), openai.BadRequestError, "n"),
    (dict(prompt=[5] * (CONTEXT + 10)), openai.BadRequestError, "prompt"),
    (dict(prompt=[5] * 1000, max_tokens=100), openai.BadRequestError, "prompt"),
    (dict(key="wrong"), openai.AuthenticationError, None),
])
def test_errors_are_openai_error_bodies(server, settings, error, param):
    settings = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, **settings}
    client = server.client(settings.pop("key", KEY))
    with pytest.raises(error) as info:
        client.completions.create(**settings)
    assert set(info.value.body) == {"message", "type", "param", "code"} and info.value.body["param"] == param
    assert info.value.body["message"]


def test_malformed_json_unknown_routes_and_no_key(server):
    status, body = raw(server, "/v1/completions", b'{"model": "tiny", "prompt": ')
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = raw(server, "/v1/chat/completions", b'{"model": "tiny", "messages": "hi"}')
    assert status == 422 and body["error"]["param"] == "messages"
    status, body = raw(server, "/v1/engines", None)
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}
    status, body = raw(server, "/v1/models", None, key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.BadRequestError, match="context"):
        server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x " * 1100}])


def test_tokenize_detokenize_and_refused_fields(server, reference):
    """vLLM's /tokenize (a prompt, or messages through the chat template) and /detokenize; OpenAI's fields that
    would change the answer and that kvgen does not serve are a 400 naming them, never ignored."""
    prompt = "The river ran under the old"
    status, body = raw(server, "/tokenize", json.dumps({"model": "tiny", "prompt": prompt}).encode())
    ids = reference.tokenizer(prompt)["input_ids"]
    assert status == 200 and body == {"count": len(ids), "max_model_len": CONTEXT, "tokens": ids}
    chat = [{"role": "user", "content": "Hi"}]
    status, body = raw(server, "/tokenize", json.dumps({"messages": chat}).encode())
    assert body["tokens"] == reference.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    status, body = raw(server, "/detokenize", json.dumps({"tokens": ids}).encode())
    assert status == 200 and body == {"prompt": prompt}
    status, body = raw(server, "/detokenize", json.dumps({"tokens": [10 ** 8]}).encode())
    assert status == 400 and body["error"]["param"] == "tokens"
    client = server.client()
    for field, value in [("functions", [{"name": "f"}]), ("function_call", "auto"), ("audio", {"voice": "x"}),
                         ("modalities", ["text", "audio"]), ("prediction", {"type": "content", "content": "x"})]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=chat, max_tokens=2, extra_body={field: value})
        assert info.value.body["param"] == field
    top_1 = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=1.5, seed=3,
                                      extra_body={"top_k": 1})
    assert top_1.choices[0].text == reference(prompt, 6)  # vLLM's top_k reaches the sampler


def test_the_openapi_schema_documents_every_route(server):
    schema = json.loads(urllib.request.urlopen(f"{server.url}/openapi.json", timeout=10).read())
    for path, body in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatRequest")):
        operation = schema["paths"][path]["post"]
        assert operation["requestBody"]["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{body}"}
        assert {"200", "400", "401", "404", "422", "429", "503"} <= set(operation["responses"])
        assert set(operation["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert {"prompt", "suffix", "echo", "response_format"} <= set(schema["components"]["schemas"]["CompletionRequest"]
                                                                   ["properties"])
    assert {"messages", "tools", "tool_choice"} <= set(schema["components"]["schemas"]["ChatRequest"]["properties"])
    assert set(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(urllib.request.Request(f"{server.url}/v1/completions", method="GET"), timeout=10)
    assert info.value.code == 405 and info.value.headers["Allow"] == "POST"
    assert set(json.loads(info.value.read())["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_the_server_answers_as_its_openapi_schema_says(server, mode):
    """Schemathesis's requests to every route, valid (positive) and breaking the schema (negative): no server
    error; every status, content type, header and body as documented; schema-breaking bodies refused. Not
    checked: that every schema-valid request is accepted, as a prompt outside this model's vocabulary or longer
    than its context, or ``n`` over the server's ``--max-n``, is refused by limits of the server's own (400)."""
    import schemathesis
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    for result in schema.get_all_operations():
        operation = result.ok()
        if mode == "negative" and operation.method.upper() != "POST":
            continue  # the GET routes take nothing that could break a schema

        @hypothesis.given(case=operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
        @hypothesis.settings(max_examples=20, deadline=None, suppress_health_check=list(hypothesis.HealthCheck),
                             derandomize=True, database=None)
        def answers(case):
            case.call_and_validate(headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                                   excluded_checks=[positive_data_acceptance])

        answers()


# -- faults and load ------------------------------------------------------------------------------------


def test_a_client_gone_mid_request_frees_its_blocks(server):
    # ignore_eos: only the client's leaving ends them (a sampled end-of-sequence token can end one first: once seen)
    start = server.wait_idle(server.metrics()["kvgen_kv_blocks_total"])
    stream = server.client().completions.create(model="tiny", prompt="Hello there", max_tokens=1000, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
    stream_text(stream, chunks=3)
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:  # not streamed: the server polls the socket
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Length: {len(body)}"
        s.sendall(head.encode() + b"\r\n\r\n" + body)
        while server.metrics()["kvgen_requests_running"] < 1:
            time.sleep(0.01)
    after = server.wait_idle(start["kvgen_kv_blocks_free"])
    cancelled = 'kvgen_requests_finished_total{finish_reason="cancelled"}'
    assert after.get(cancelled, 0) == start.get(cancelled, 0) + 2
    assert after["kvgen_generation_tokens_total"] - start["kvgen_generation_tokens_total"] < 2000


def test_a_full_queue_answers_429_with_retry_after(small):
    client = small.client()
    running = client.completions.create(model="tiny", prompt="Hello", max_tokens=1000, stream=True)
    next(iter(running))  # decoding
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.completions.create, model="tiny", prompt="Hi", max_tokens=3)
        while small.metrics()["kvgen_requests_waiting"] < 1:
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model="tiny", prompt="Hi", max_tokens=3)
        assert info.value.response.headers["retry-after"] == "1" and info.value.body["code"] == "queue_full"
        running.close()
        assert waiting.result(timeout=30).usage.completion_tokens == 3


def test_sigterm_drains_running_requests_then_exits(small):
    client = small.client()
    results = {}

    def run(i):  # two requests: one running, one waiting (max-num-seqs 1)
        stream = client.completions.create(model="tiny", prompt=f"Story {i}:", max_tokens=300, temperature=0,
                                           stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        results[i] = (chunks[-1].usage.completion_tokens, [c.choices[0].finish_reason for c in chunks if c.choices][-1])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t, metric in zip(threads, ("kvgen_requests_running", "kvgen_requests_waiting")):
        t.start()  # one after the other: the queue holds one request, two at once could meet a 429
        deadline = time.monotonic() + 30
        while small.metrics()[metric] < 1:
            assert time.monotonic() < deadline, f"{metric} never reached 1"
            time.sleep(0.05)
    small.process.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert results == {0: (300, "length"), 1: (300, "length")}
    assert small.process.wait(30) == -signal.SIGTERM  # uvicorn re-raises the signal once drained
    assert "Waiting for connections to close" in small.output() and "Traceback" not in small.output()
    with pytest.raises(openai.APIConnectionError):
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2)


def test_64_concurrent_requests(server, reference):
    """Mixed streaming and not, some cancelled, some invalid: every valid request completes with generate()'s
    output, the free blocks come back, the server stays up."""
    rng = random.Random(14)
    client, intruder = server.client(), server.client("wrong")
    start = server.wait_idle(server.metrics()["kvgen_kv_blocks_total"])
    jobs = []  # (kind, chat, stream, prompt, max_tokens)
    for i in range(48):
        chat, stream = i % 8 >= 6, i % 2 == 1
        prompt = prompt_text(rng)
        jobs.append(("valid", chat, stream, [{"role": "user", "content": prompt}] if chat else prompt,
                     rng.randint(4, 24)))
    jobs += [("cancel", i % 2 == 0, True, [{"role": "user", "content": prompt_text(rng)}] if i % 2 == 0
              else prompt_text(rng), 800) for i in range(8)]
    jobs += [("invalid", False, i % 2 == 0, bad, 8)
             for i, bad in enumerate(["temperature", "model", "long", "key"] * 2)]
    rng.shuffle(jobs)

    def send(job):
        kind, chat, stream, prompt, max_tokens = job
        settings = dict(model="tiny", max_tokens=max_tokens, temperature=0, stream=stream)
        if kind == "invalid":
            settings.update({"temperature": dict(temperature=3.0), "model": dict(model="other"), "key": {},
                             "long": dict(max_tokens=CONTEXT)}[prompt])
            try:
                (intruder if prompt == "key" else client).completions.create(prompt="Hello", **settings)
            except openai.APIStatusError as error:
                return error.status_code
            return None
        if chat:
            out = client.chat.completions.create(messages=prompt, **settings)
        else:
            out = client.completions.create(prompt=prompt, **settings)
        if not stream:
            return (out.choices[0].message.content if chat else out.choices[0].text), out.choices[0].finish_reason
        return stream_text(out, chat=chat, chunks=2 if kind == "cancel" else None)

    began = time.monotonic()
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(send, jobs))
    elapsed = time.monotonic() - began
    end = server.wait_idle(start["kvgen_kv_blocks_free"])
    counts = {"valid": 0, "cancelled": 0, "invalid": 0}
    for (kind, chat, stream, prompt, max_tokens), result in zip(jobs, results):
        if kind == "valid":
            text, finish = result
            assert text == reference(prompt, max_tokens), (chat, stream, prompt)
            assert finish in ("length", "stop")
            counts["valid"] += 1
        elif kind == "cancel":
            assert result[0] and result[1] is None  # closed after two chunks, unfinished
            counts["cancelled"] += 1
        else:
            assert result == {"temperature": 400, "model": 404, "long": 400, "key": 401}[prompt]
            counts["invalid"] += 1
    assert elapsed < 60
    assert json.loads(urllib.request.urlopen(f"{server.url}/health").read()) == {"status": "ok"}
    finished = 'kvgen_requests_finished_total{finish_reason="cancelled"}'
    print(f"\nload: {len(jobs)} requests in {elapsed:.1f}s: {counts['valid']} valid all equal to generate(), "
          f"{counts['cancelled']} cancelled mid-stream ({end.get(finished, 0) - start.get(finished, 0):.0f} cancelled "
          f"in the engine), {counts['invalid']} rejected; KV blocks free {end['kvgen_kv_blocks_free']:.0f} of "
          f"{end['kvgen_kv_blocks_total']:.0f} (start {start['kvgen_kv_blocks_free']:.0f})")


@pytest.mark.parametrize("body", [{"model": "m", "tokens": [True]}, {"model": "m", "tokens": [1.0]}])
def test_token_ids_are_integers_not_booleans_or_floats(body):
    """JSON's true is no token id (pydantic's lax mode read it as 1): a 422 naming the field."""
    from kvgen.serving.schemas import APIError, DetokenizeRequest, parse_body

    with pytest.raises(APIError) as info:
        parse_body(DetokenizeRequest, json.dumps(body).encode(), max_n=8)
    assert info.value.status == 422 and str(info.value).startswith("tokens.0")


@pytest.mark.parametrize("field, value", [("max_tokens", True), ("n", True), ("echo", 1), ("temperature", True),
                                          ("prompt", [True])])
def test_fields_take_their_own_json_type(field, value):
    from kvgen.serving.schemas import APIError, CompletionRequest, parse_body

    body = {"model": "m", "prompt": "Hi", field: value}
    with pytest.raises(APIError) as info:
        parse_body(CompletionRequest, json.dumps(body).encode(), max_n=8)
    assert info.value.status == 422 and field in str(info.value)
