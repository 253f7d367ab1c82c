"""The ``kvgen`` command run in-process (``kvgen.cli.main``) on the real default model, and ``bench`` on a tiny one.

Expected texts are computed here with ``generate`` on fresh inputs (no cache reuse), so a
CLI that reuses or sizes its cache wrongly, or prints the wrong tokens, fails.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers

import kvgen.cli
from kvgen.cli import DEFAULT_PROMPT, main

STATS = re.compile(r"^\[kvgen\] cache=(\w+) prompt_tokens=(\d+) new_tokens=(\d+) prefill_s=(\d+\.\d+) "
                   r"prompt_tok_per_s=(\d+\.\d+) decode_tok_per_s=(\d+\.\d+) weights=([\w+/]+) "
                   r"peak_rss_mb=(\d+) cache_bytes=(\d+)$")


def continuation(model, tokenizer, inputs, max_new_tokens):
    """(reply text, number of new tokens) of a fresh greedy run."""
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:]
    return tokenizer.decode(new, skip_special_tokens=True), new.shape[0]


def chat_inputs(tokenizer, messages):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)


def parse_stats(line):
    match = STATS.match(line)
    assert match, f"not a stats line: {line!r}"
    cache, prompt_tokens, new_tokens, prefill_s, prompt_speed, decode, weights, rss, cache_bytes = match.groups()
    assert float(prefill_s) > 0 and float(decode) > 0 and int(rss) > 0
    assert float(prompt_speed) == pytest.approx(int(prompt_tokens) / float(prefill_s), rel=0.01, abs=0.1)
    assert weights == "Q8_0+Q4_1"  # the default GGUF runs in its stored types
    return cache, int(prompt_tokens), int(new_tokens), int(cache_bytes)


def test_generate_with_the_default_prompt(smollm_gguf, capsys):
    model, tokenizer = smollm_gguf
    assert main(["generate", "--max-new-tokens", "6"]) == 0
    text, stats = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)
    inputs = tokenizer(DEFAULT_PROMPT, return_tensors="pt")
    expected, new = continuation(model, tokenizer, inputs, 6)
    assert text == DEFAULT_PROMPT + expected  # the prompt, then the continuation
    cache, prompt_tokens, new_tokens, cache_bytes = parse_stats(stats)
    assert (cache, prompt_tokens, new_tokens) == ("DynamicCache", inputs["input_ids"].shape[1], new)
    config = model.config
    live = config.num_hidden_layers * 2 * config.num_key_value_heads * (prompt_tokens + 5) * config.head_dim * 4
    assert cache_bytes >= live  # at least the keys and values of every token fed


@pytest.mark.parametrize("flag", ["-p", "--prompt"])
def test_generate_takes_the_prompt_as_an_option_too(flag, smollm_gguf, capsys):
    """As llama.cpp (-p) and mlx-lm (--prompt) take it; --prompt once matched --prompt-cache by abbreviation and
    saved a cache file named after the prompt."""
    model, tokenizer = smollm_gguf
    prompt = "The capital of France is"
    assert main(["generate", flag, prompt, "--max-new-tokens", "4"]) == 0
    text = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)[0]
    expected, _ = continuation(model, tokenizer, tokenizer(prompt, return_tensors="pt"), 4)
    assert text == prompt + expected


@pytest.mark.parametrize("argv,message", [
    (["generate", "a prompt", "-p", "another"], "give the prompt once"),
    (["generate", "--prompt-c", "file"], "unrecognized arguments: --prompt-c"),  # no abbreviations
    (["generate", "--max-new", "3"], "unrecognized arguments: --max-new"),
])
def test_the_prompt_is_given_once_and_options_are_never_abbreviated(argv, message, capsys, tmp_path,
                                                                    monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code != 0 and err.startswith("kvgen: error: ") and message in err, err
    assert not list(tmp_path.iterdir())  # nothing written


def test_cache_config_option_parses_numbers_booleans_and_names():
    assert kvgen.cli.parse_cache_config("backend=kivi, nbits=2,q_group_size=64,axis_key=0,flag=true,scale=0.5") == {
        "backend": "kivi", "nbits": 2, "q_group_size": 64, "axis_key": 0, "flag": True, "scale": 0.5}
    with pytest.raises(SystemExit):
        main(["generate", "--cache", "quantized", "--cache-config", "nbits"])


def test_generate_with_a_quantized_cache_config(smollm_gguf, capsys):
    model, tokenizer = smollm_gguf
    argv = ["generate", "--cache", "quantized", "--cache-config", "backend=kivi,nbits=2,residual_length=4,q_group_size=4",
            "--max-new-tokens", "12"]
    assert main(argv) == 0
    text, stats = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)
    inputs = tokenizer(DEFAULT_PROMPT, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False, cache_implementation="quantized",
                         cache_config={"backend": "kivi", "nbits": 2, "residual_length": 4, "q_group_size": 4},
                         return_dict_in_generate=True)
    assert text == DEFAULT_PROMPT + tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1]:],
                                                     skip_special_tokens=True)
    cache, prompt_tokens, new_tokens, cache_bytes = parse_stats(stats)
    assert (cache, cache_bytes) == ("QuantizedCache", out.past_key_values.nbytes())  # the settings reached it


def test_generate_static_chat_stream(smollm_gguf, capsys, monkeypatch):
    model, tokenizer = smollm_gguf
    monkeypatch.setenv("KVGEN_DISABLE_COMPILE", "1")
    question = "What is the capital of France?"
    argv = ["generate", question, "--cache", "static", "--chat", "--stream", "--max-new-tokens", "8"]
    assert main(argv) == 0
    text, stats = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)
    inputs = chat_inputs(tokenizer, [{"role": "user", "content": question}])
    expected, new = continuation(model, tokenizer, inputs, 8)
    assert text == question + expected and "Paris" in expected
    cache, prompt_tokens, new_tokens, cache_bytes = parse_stats(stats)
    assert (cache, prompt_tokens, new_tokens) == ("StaticCache", inputs["input_ids"].shape[1], new)
    config = model.config  # preallocated: every layer's keys and values for prompt + max_new_tokens slots
    slots = prompt_tokens + 8
    assert cache_bytes == config.num_hidden_layers * 2 * config.num_key_value_heads * slots * config.head_dim * 4


def test_generate_stream_prints_as_it_goes(smollm_gguf, capsys, monkeypatch):
    model, tokenizer = smollm_gguf
    pieces = []
    real = kvgen.cli._text_streamer

    def recording(tok):
        streamer = real(tok)
        original = streamer.on_finalized_text
        streamer.on_finalized_text = lambda text, stream_end=False: (pieces.append(text), original(text, stream_end))
        return streamer

    monkeypatch.setattr(kvgen.cli, "_text_streamer", recording)
    assert main(["generate", "--max-new-tokens", "10"]) == 0  # streaming is the default
    text = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)[0]
    expected, _ = continuation(model, tokenizer, tokenizer(DEFAULT_PROMPT, return_tensors="pt"), 10)
    assert text == DEFAULT_PROMPT + expected
    assert len([p for p in pieces if p]) > 2  # printed word by word, not once at the end


def test_chat_reuses_the_cache_across_turns(smollm, capsys, monkeypatch):
    model, tokenizer = smollm
    turns = iter(["What is the capital of France?", "And of Italy?"])

    def fake_input(prompt=""):
        try:
            return next(turns)
        except StopIteration:
            raise EOFError from None

    fed = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: fed.append((args[0] if args else kwargs["input_ids"]).shape[1]),
        with_kwargs=True)
    monkeypatch.setattr("builtins.input", fake_input)
    monkeypatch.setattr(kvgen.cli, "load", lambda *args: (model, tokenizer))
    try:
        assert main(["chat", "--max-new-tokens", "12"]) == 0
    finally:
        hook.remove()
    captured = capsys.readouterr()

    # the expected answers, each from a fresh run of the whole conversation so far
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    first_inputs = chat_inputs(tokenizer, messages)
    first, first_new = continuation(model, tokenizer, first_inputs, 12)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "And of Italy?"}]
    second_inputs = chat_inputs(tokenizer, messages)
    second, second_new = continuation(model, tokenizer, second_inputs, 12)
    assert captured.out == f"{first}\n{second}\n"
    assert "Paris" in first and "Rome" in second

    lengths = [int(n) for n in re.findall(r"\[kvgen\] cache_tokens=(\d+) cache_bytes=\d+", captured.err)]
    p1, p2 = first_inputs["input_ids"].shape[1], second_inputs["input_ids"].shape[1]
    assert lengths == [p1 + first_new - 1, p2 + second_new - 1]  # the last token of each reply is not fed
    prefills = [n for n in fed if n > 1]
    assert prefills[0] == p1
    assert prefills[1] <= p2 - p1  # the second turn fed only what the cache had not seen


def test_a_system_prompt_goes_before_the_user_message_in_generate_and_chat(smollm_gguf, capsys, monkeypatch):
    model, tokenizer = smollm_gguf
    messages = [{"role": "system", "content": "You are a pirate who answers in one word."},
                {"role": "user", "content": "What is the capital of France?"}]
    inputs = chat_inputs(tokenizer, messages)
    prompt_tokens = inputs["input_ids"].shape[1]
    assert prompt_tokens != chat_inputs(tokenizer, messages[1:])["input_ids"].shape[1]  # (the template's own differs)
    expected, new = continuation(model, tokenizer, inputs, 8)
    text, stats = run_generate(capsys, "-sys", messages[0]["content"], "-p", messages[1]["content"], "-n", "8")
    assert text == messages[1]["content"] + expected and parse_stats(stats)[1:3] == (prompt_tokens, new)
    turns = iter([messages[1]["content"]])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(turns, ""))
    monkeypatch.setattr(kvgen.cli, "load", lambda *args: (model, tokenizer))
    assert main(["chat", "--system-prompt", messages[0]["content"], "-n", "8"]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{expected}\n" and f"cache_tokens={prompt_tokens + new - 1} " in captured.err


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    folder = tmp_path_factory.mktemp("tiny-bench")
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_bench_writes_rows_for_kvgen_and_transformers(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVGEN_DISABLE_COMPILE", "1")  # the workers inherit it: kvgen's static step runs eagerly
    output = tmp_path / "bench.json"
    # one cache: each worker that runs transformers spends ~12 s importing it here
    argv = ["bench", "--model", str(tiny_checkpoint), "--prompts", "16", "--batches", "1", "--new-tokens", "4",
            "--caches", "static", "--output", str(output)]
    assert main(argv) == 0
    assert f"wrote {output}" in capsys.readouterr().out
    assert output.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the chart beside the JSON
    rows = json.loads(output.read_text())["rows"]
    assert sorted((r["impl"], r["cache"]) for r in rows) == [("kvgen", "static"), ("transformers", "static")]
    for row in rows:
        assert "error" not in row, row
        assert (row["prompt"], row["batch"], row["new_tokens"]) == (16, 1, 4)
        assert row["decode_tok_s"] > 0 and row["prefill_s"] > 0
    static = next(r for r in rows if r["impl"] == "kvgen" and r["cache"] == "static")
    assert static["cache_bytes"] == 2 * 2 * 2 * (16 + 4) * 16 * 4  # layers, k+v, kv heads, slots, head_dim, fp32


def test_transcribe_prints_the_transcript_with_the_packaged_tiny_en(tmp_path, capsys):
    import shutil
    import subprocess

    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (bash scripts/setup.sh --test installs it)")
    wav = tmp_path / "fox.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), "the quick brown fox jumps over the lazy dog"], check=True)
    assert main(["transcribe", str(wav)]) == 0
    printed = capsys.readouterr().out.strip().lower()
    assert all(word in printed for word in ("quick", "brown", "fox", "lazy", "dog"))
    with pytest.raises(SystemExit):  # no file given
        main(["transcribe"])


def test_prompt_cache_is_saved_then_reused_by_a_prompt_with_the_same_prefix(smollm, capsys, monkeypatch, tmp_path):
    model, tokenizer = smollm
    monkeypatch.setattr(kvgen.cli, "load", lambda *args: (model, tokenizer))
    fed = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: fed.append((args[0] if args else kwargs["input_ids"]).shape[1]),
        with_kwargs=True)
    prefix = "The Lord is my shepherd; I shall not want. He maketh me to lie down in green pastures."
    file = tmp_path / "prefix.safetensors"
    try:
        assert main(["generate", prefix, "--prompt-cache", str(file), "--max-new-tokens", "4"]) == 0
        first = capsys.readouterr().out.splitlines()
        assert file.exists() and re.match(r"\[kvgen\] prompt_cache=saved reused_tokens=0 ", first[-1])
        fed.clear()
        prompt = prefix + " He leadeth me beside the still waters."
        assert main(["generate", prompt, "--prompt-cache", str(file), "--max-new-tokens", "6"]) == 0
    finally:
        hook.remove()
    lines = capsys.readouterr().out.splitlines()
    prefix_tokens = tokenizer(prefix, return_tensors="pt")["input_ids"].shape[1]
    reused = int(re.match(r"\[kvgen\] prompt_cache=loaded reused_tokens=(\d+) time_to_first_token_s=", lines[-1])[1])
    inputs = tokenizer(prompt, return_tensors="pt")
    assert prefix_tokens - 2 <= reused <= prefix_tokens  # (a word at the seam may tokenize differently)
    assert fed[0] == inputs["input_ids"].shape[1] - reused  # only the unseen tokens were prefilled
    expected, _ = continuation(model, tokenizer, inputs, 6)
    assert lines[0] == prompt + expected  # the same text as a run without the prompt cache


def test_prompt_cache_from_another_model_is_refused(smollm, tiny_checkpoint, capsys, monkeypatch, tmp_path):
    from kvgen.cache.fingerprint import CacheModelMismatchError

    model, tokenizer = smollm
    monkeypatch.setattr(kvgen.cli, "load", lambda *args: (model, tokenizer))
    file = tmp_path / "prefix.safetensors"
    assert main(["generate", "Hello there", "--prompt-cache", str(file), "--max-new-tokens", "2"]) == 0
    other = kvgen.AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    monkeypatch.setattr(kvgen.cli, "load", lambda *args: (other, tokenizer))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "Hello there", "--prompt-cache", str(file), "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert exit_info.value.code != 0 and err.startswith("kvgen: error: ") and err.count("\n") == 1
    with pytest.raises(CacheModelMismatchError):  # --verbose: the exception itself, with its traceback
        main(["generate", "Hello there", "--prompt-cache", str(file), "--max-new-tokens", "2", "--verbose"])


def run_chat(turns, argv, monkeypatch):
    replies = iter(turns)

    def fake_input(prompt=""):
        try:
            return next(replies)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    return main(["chat", "--max-new-tokens", "10", *argv])


def test_chat_save_then_load_resumes_the_conversation(smollm, capsys, monkeypatch, tmp_path):
    model, tokenizer = smollm
    monkeypatch.setattr(kvgen.cli, "load", lambda *args: (model, tokenizer))
    file = tmp_path / "chat.safetensors"
    assert run_chat(["What is the capital of France?"], ["--save", str(file)], monkeypatch) == 0
    first = capsys.readouterr().out.strip()
    assert run_chat(["And of Italy?"], ["--load", str(file)], monkeypatch) == 0
    captured = capsys.readouterr()
    assert "loaded 2 messages" in captured.err
    messages = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": first},
                {"role": "user", "content": "And of Italy?"}]
    expected, _ = continuation(model, tokenizer, chat_inputs(tokenizer, messages), 10)
    assert captured.out.strip() == expected


@pytest.mark.parametrize("cache,config", [("static", None), ("offloaded", None),
                                          ("quantized", "backend=kivi,nbits=4,residual_length=16"),
                                          ("sink", "window_length=48,num_sink_tokens=4")])
def test_chat_keeps_one_cache_of_every_kind_across_turns(smollm, capsys, monkeypatch, cache, config):
    model, tokenizer = smollm
    monkeypatch.setattr(kvgen.cli, "load", lambda *args: (model, tokenizer))
    turns = ["What is the capital of France?", "And of Italy?", "And of Spain?"]
    argv = ["--cache", cache, "-c", "256"] + (["--cache-config", config] if config else [])
    assert run_chat(turns, argv, monkeypatch) == 0
    captured = capsys.readouterr()
    replies = captured.out.strip().splitlines()
    lengths = [int(n) for n in re.findall(r"cache_tokens=(\d+)", captured.err)]
    assert len(replies) == 3 and lengths == sorted(lengths) and lengths[-1] > 48  # one cache, past a sink window
    if cache in ("static", "offloaded"):  # lossless: the replies of a dynamic-cache chat
        assert run_chat(turns, [], monkeypatch) == 0
        assert capsys.readouterr().out.strip().splitlines() == replies
    else:
        assert "Paris" in replies[0] and "Rome" in replies[1]


REPEATING = "The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog sat on the"


@pytest.mark.parametrize("drafting", [["--lookup", "4"], ["--draft-model", "FLOAT"], ["--early-exit", "20"]])
def test_generate_with_drafts_prints_plain_greedy_text_and_the_acceptance_rate(drafting, smollm_gguf,
                                                                               default_model_dir, capsys):
    model, tokenizer = smollm_gguf
    drafting = [default_model_dir if arg == "FLOAT" else arg for arg in drafting]
    assert main(["generate", REPEATING, "--max-new-tokens", "16", *drafting]) == 0
    text, stats = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)
    expected, new = continuation(model, tokenizer, tokenizer(REPEATING, return_tensors="pt"), 16)
    assert text == REPEATING + expected
    stats, drafts = stats.split(" drafted=")
    assert parse_stats(stats)[2] == new
    drafted, rate = re.fullmatch(r"(\d+) acceptance_rate=(\d\.\d\d)", drafts).groups()
    assert int(drafted) > 0 and 0 <= float(rate) <= 1
    if drafting[0] == "--lookup":  # the prompt repeats itself: lookup drafts are right at times
        assert float(rate) > 0


def run_generate(capsys, *argv):
    """(printed text, stats line) of ``kvgen generate *argv``."""
    assert main(["generate", *argv]) == 0
    return capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)


def test_llama_cpp_short_options_mean_the_long_ones(smollm_gguf, capsys):
    from kvgen.loading.default_model import default_gguf_path

    model, tokenizer = smollm_gguf
    threads = torch.get_num_threads()
    try:
        text, stats = run_generate(capsys, "-m", str(default_gguf_path()), "-n", "5", "-t", "1", "-p", "The sea")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    expected, new = continuation(model, tokenizer, tokenizer("The sea", return_tensors="pt"), 5)
    assert text == "The sea" + expected and parse_stats(stats)[2] == new


def test_the_prompt_from_a_file_on_the_device_asked_for(smollm_gguf, capsys, tmp_path):
    model, tokenizer = smollm_gguf
    (tmp_path / "prompt.txt").write_text("The sea is", encoding="utf-8")
    text, stats = run_generate(capsys, "-f", str(tmp_path / "prompt.txt"), "-n", "5", "--device", "cpu")
    expected, new = continuation(model, tokenizer, tokenizer("The sea is", return_tensors="pt"), 5)
    assert text == "The sea is" + expected and parse_stats(stats)[2] == new


@pytest.mark.parametrize("options, settings", [
    (["--temp", "0.7", "--top-p", "0.9"], dict(temperature=0.7, top_p=0.9)),
    (["--top-k", "20", "--repeat-penalty", "1.3"], dict(top_k=20, repetition_penalty=1.3)),
    (["--min-p", "0.05", "--temp", "1.2"], dict(min_p=0.05, temperature=1.2)),
    (["--do-sample", "--temperature", "1.5"], dict(temperature=1.5)),
])
def test_sampling_options_sample_as_generate_does_with_that_seed(options, settings, smollm_gguf, capsys):
    model, tokenizer = smollm_gguf
    text, stats = run_generate(capsys, "-n", "8", "-s", "123", *options)
    assert stats.endswith(" seed=123")
    inputs = tokenizer(DEFAULT_PROMPT, return_tensors="pt")
    torch.manual_seed(123)
    out = model.generate(**inputs, max_new_tokens=8, do_sample=True, **settings)
    new = out[0, inputs["input_ids"].shape[1]:]
    assert text == DEFAULT_PROMPT + tokenizer.decode(new, skip_special_tokens=True)


def test_a_sampled_run_prints_its_seed_which_repeats_it(smollm_gguf, capsys):
    first, stats = run_generate(capsys, "-n", "8", "--do-sample")
    seed = re.search(r" seed=(\d+)$", stats).group(1)
    again, stats = run_generate(capsys, "-n", "8", "--do-sample", "--seed", seed)
    assert again == first and stats.endswith(f" seed={seed}")


def test_temperature_zero_is_greedy_and_so_is_no_sampling_option(smollm_gguf, capsys):
    model, tokenizer = smollm_gguf
    expected, _ = continuation(model, tokenizer, tokenizer(DEFAULT_PROMPT, return_tensors="pt"), 8)
    for options in (["--temp", "0", "--top-k", "5", "--do-sample"], ["--seed", "7"]):
        text, stats = run_generate(capsys, "-n", "8", *options)
        assert text == DEFAULT_PROMPT + expected and " seed=" not in stats
        parse_stats(stats)  # (the greedy stats line, as before)


def test_stop_ends_the_text_where_generate_stop_strings_end_it(smollm_gguf, capsys):
    model, tokenizer = smollm_gguf
    inputs = tokenizer(DEFAULT_PROMPT, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=20, do_sample=False, stop_strings=["sun", "xyz"], tokenizer=tokenizer)
    stopped = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert stopped.endswith("sun") and len(out[0]) < inputs["input_ids"].shape[1] + 20
    text, stats = run_generate(capsys, "-n", "20", "--stop", "xyz", "--stop", "sun")
    assert text == DEFAULT_PROMPT + stopped


def test_json_schema_holds_the_reply_to_the_schema_as_generate_does(smollm_gguf, capsys, tmp_path):
    import jsonschema

    model, tokenizer = smollm_gguf
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    path = tmp_path / "person.json"
    path.write_text(json.dumps(schema))
    question = "Describe a person in JSON."
    inputs = chat_inputs(tokenizer, [{"role": "user", "content": question}])
    out = model.generate(**inputs, max_new_tokens=60, do_sample=False, tokenizer=tokenizer, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    expected = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    jsonschema.validate(json.loads(expected), schema)
    text, stats = run_generate(capsys, "--chat", "-n", "60", "--json-schema", str(path), "-p", question)
    assert text == question + expected


def test_repeat_penalty_applies_to_greedy_runs_too(smollm_gguf, capsys):
    model, tokenizer = smollm_gguf
    inputs = tokenizer(DEFAULT_PROMPT, return_tensors="pt")
    plain, _ = continuation(model, tokenizer, inputs, 20)
    out = model.generate(**inputs, max_new_tokens=20, do_sample=False, repetition_penalty=1.5)
    penalized = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert penalized != plain  # (the penalty changes this continuation)
    text, stats = run_generate(capsys, "-n", "20", "--repeat-penalty", "1.5")
    assert text == DEFAULT_PROMPT + penalized and " seed=" not in stats


@pytest.mark.parametrize("argv,message", [
    (["generate", "--model", "/nonexistent/model.gguf"], "/nonexistent/model.gguf does not exist"),
    (["generate", "--max-new-tokens", "0"], "--max-new-tokens: must be at least 1, not 0"),
    (["generate", "--temp", "-1"], "--temperature: must be 0 or more, not -1"),
    (["generate", "--top-p", "0"], "--top-p: must be above 0 and at most 1, not 0"),
    (["generate", "-t", "0"], "--threads: must be at least 1, not 0"),
    (["generate", "-f", "/nonexistent/prompt.txt"], "/nonexistent/prompt.txt"),
    (["generate", "-p", "x", "-f", "/nonexistent/prompt.txt"], "give the prompt once"),
    (["generate", "--device", "tpu9"], "'tpu9' is not a device"),
    (["generate", "-p", ""], "input_ids holds no tokens"),
    (["serve", "--device", "tpu9"], "'tpu9' is not a device"),
    *([] if torch.cuda.is_available() else [(["generate", "--device", "cuda"], "no CUDA GPU is available here"),
                                            (["serve", "--device", "cuda"], "no CUDA GPU is available here")]),
    (["generate", "--cache", "quantized", "--cache-config", "nbits=3"], "nbits"),
    (["generate", "--tp", "2", "--prompt-cache", "/nonexistent/cache"], "--prompt-cache keeps one process's cache"),
    (["serve", "--tp", "2", "--kv-store", "redis://127.0.0.1:1"], "--kv-store shares one process's blocks"),
    (["generate", "--json-schema", "/nonexistent/schema.json"], "--json-schema /nonexistent/schema.json: not a "),
    (["chat", "--load", "/nonexistent/chat.safetensors"], "is missing; --load takes a file written by --save"),
])
def test_errors_print_one_line_and_exit_non_zero(argv, message, capsys, monkeypatch):
    monkeypatch.setattr("builtins.input", lambda prompt="": "")
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code != 0
    assert err.startswith("kvgen: error: ") and err.count("\n") == 1 and message in err, err


def test_a_truncated_gguf_is_one_clear_line(tmp_path, capsys):
    from kvgen.loading.default_model import default_gguf_path

    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(default_gguf_path().read_bytes()[:5_000_000])
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(truncated)])
    lines = capsys.readouterr().err.splitlines()  # (a progress line may come first: indexing a new file)
    assert lines[-1].startswith("kvgen: error: ") and "cut.gguf: tensor token_embd.weight" in lines[-1] \
        and "the file at 5000000 (truncated?)" in lines[-1], lines
    assert sum(line.startswith("kvgen: error") for line in lines) == 1 and "Traceback" not in "\n".join(lines)


@pytest.mark.parametrize("flags, expected", [([], None), (["--dense-attention"], False)])
def test_serve_dense_attention_turns_off_the_gpu_path(flags, expected, monkeypatch):
    """``kvgen serve --dense-attention`` gives the engine dense masks and eager decode steps; without it the device
    decides (block-sparse and CUDA graphs on a GPU)."""
    import kvgen.serving.server as server

    seen = []
    monkeypatch.setattr(server, "create_app", lambda *args, engine_config, **_: seen.append(engine_config))
    monkeypatch.setattr(server, "serve", lambda app, **_: None)
    assert main(["serve", *flags]) == 0
    assert seen[0].block_sparse is expected and seen[0].decode_graphs is expected
