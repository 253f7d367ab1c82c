"""Structured outputs on real models: how many schema-constrained answers parse and validate, and what the grammar
costs the engine's decode.

For each model (GGUF, weights in their stored precision, through its own chat template):

* validity: ``--answers`` (50) answers to questions about people, products and weather, each held to its JSON
  schema by ``response_format``'s grammar (:mod:`kvgen.grammar`), half greedy and half sampled
  (temperature 0.8, a seed each); each must end by itself, parse, and validate (``jsonschema``);
* speed: decode tokens/s with and without the grammar, at batch 1 (one request; its rate from its first token to
  its last) and at 16 concurrent requests (the tokens they generate over the time from the first token to the
  last), each side ``--rounds`` (5) times, alternating, each side first in every other round; the constrained
  requests are held to a schema of long free-text fields so that they run as long as the free ones
  (``max_new_tokens`` 64 both).

Writes ``benchmarks/results/structured_outputs.json`` with the CPU, its vector extensions and the load.

    python benchmarks/structured_outputs.py                         # smollm2, gemma3, coder; 2 threads
    python benchmarks/structured_outputs.py --models coder --answers 10 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from vs_llamacpp import _cpu, _cpu_flags, model_path  # noqa: E402

RESULTS = Path(__file__).parent / "results"

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "born": {"type": "integer", "minimum": 0, "maximum": 2100},
        "occupation": {"type": "string", "maxLength": 60}, "alive": {"type": "boolean"}},
        "required": ["name", "born", "occupation", "alive"], "additionalProperties": False},
    "product": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "price": {"type": "integer", "minimum": 0, "maximum": 100000},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
        "in_stock": {"type": "boolean"}},
        "required": ["name", "price", "tags", "in_stock"], "additionalProperties": False},
    "weather": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}, "sky": {"enum": ["clear", "cloudy", "rain", "snow"]},
        "temperature_c": {"type": "integer", "minimum": -60, "maximum": 60}},
        "required": ["city", "sky", "temperature_c"], "additionalProperties": False},
}
QUESTIONS = {
    "person": ["Who was Ada Lovelace?", "Tell me about Isaac Newton.", "Who is Marie Curie?", "Describe Alan Turing.",
               "Who was Leonardo da Vinci?"],
    "product": ["Describe a good kitchen knife.", "Sell me a bicycle.", "What is a laptop for students?",
                "Describe a coffee mug.", "Recommend running shoes."],
    "weather": ["What is the weather in Oslo?", "Weather report for Cairo.", "Is it raining in London?",
                "Weather in Tokyo today?", "Describe the weather in Lima."],
}
#: long free-text fields: a constrained reply runs as long as a free one for the speed comparison
LONG = {"type": "object", "properties": {"story": {"type": "string", "minLength": 400, "maxLength": 800}},
        "required": ["story"], "additionalProperties": False}


def ask(tokenizer, text: str) -> list[int]:
    """``text`` as the model's user turn: through its chat template, or plain where it has none (Gemma 3's GGUF)."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer(f"Question: {text}\nAnswer:")["input_ids"]


def validity(manager, tokenizer, answers: int) -> dict:
    """``answers`` constrained answers (half greedy, half sampled): how many end by themselves, parse, validate."""
    import jsonschema

    from kvgen.grammar import response_grammar

    jobs = []
    for i in range(answers):
        kind = list(SCHEMAS)[i % len(SCHEMAS)]
        question = QUESTIONS[kind][(i // len(SCHEMAS)) % len(QUESTIONS[kind])]
        prompt = ask(tokenizer, f"{question} Answer in JSON.")
        grammar = response_grammar({"type": "json_schema", "json_schema": {"name": kind, "schema": SCHEMAS[kind]}})
        sampled = i >= answers // 2
        settings = dict(do_sample=True, temperature=0.8, seed=i) if sampled else dict(do_sample=False)
        jobs.append((kind, manager.add_request(prompt, max_new_tokens=160, grammar=grammar, **settings)))
    valid, failures = 0, []
    for kind, rid in jobs:
        out = manager.get_result(rid, timeout=600)
        text = tokenizer.decode(out.generated_tokens, skip_special_tokens=True)
        try:
            if out.finish_reason != "stop":
                raise ValueError(f"did not end: {out.finish_reason}")
            jsonschema.validate(json.loads(text), SCHEMAS[kind])
            valid += 1
        except (ValueError, jsonschema.ValidationError) as error:
            failures.append({"schema": kind, "text": text, "error": str(error)[:200]})
    return {"answers": answers, "valid": valid, "failures": failures}


def decode_rate(manager, prompts: list[list[int]], grammar: str | None) -> float:
    """Tokens/s of ``prompts`` decoded at once (64 new tokens each, greedy): generated tokens after each request's
    first over the time from the first first token to the last finish."""
    ids = [manager.add_request(p, max_new_tokens=64, grammar=grammar, eos_token_id=[]) for p in prompts]
    outs = [manager.get_result(rid, timeout=600) for rid in ids]
    end = time.perf_counter()
    first = min(o.first_token_time for o in outs)
    tokens = sum(len(o.generated_tokens) - 1 for o in outs)
    return tokens / (end - first) if end > first else float("nan")


def run_model(name: str, answers: int, rounds: int) -> dict:
    from kvgen import AutoModelForCausalLM, AutoTokenizer
    from kvgen.serving import ContinuousBatchingConfig
    from kvgen.grammar import response_grammar

    path = model_path(name)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    config = ContinuousBatchingConfig(max_memory="512MB", max_num_seqs=32, max_batch_tokens=512)
    long = response_grammar({"type": "json_schema", "json_schema": {"name": "story", "schema": LONG}})
    prompt = ask(tokenizer, "Tell me a long story about the sea.")
    result = {"model": name, "file": Path(path).name, "weight_format": model.weight_format}
    with model.init_continuous_batching(tokenizer=tokenizer, continuous_batching_config=config) as manager:
        result["validity"] = validity(manager, tokenizer, answers)
        decode_rate(manager, [prompt], long)  # warm-up: the tokenizer's vocabulary read by llguidance, caches
        for batch in (1, 16):
            rates = {"free": [], "constrained": []}
            for r in range(rounds):  # alternating, each side first in every other round
                for side in ("free", "constrained")[::1 if r % 2 == 0 else -1]:
                    rates[side].append(decode_rate(manager, [prompt] * batch, long if side == "constrained" else None))
            free, held = statistics.median(rates["free"]), statistics.median(rates["constrained"])
            result[f"batch_{batch}"] = {"free_tok_s": free, "constrained_tok_s": held, "ratio": held / free,
                                        "rounds": rates}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="smollm2,gemma3,coder")
    parser.add_argument("--answers", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "structured_outputs.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    rows = []
    for name in args.models.split(","):
        row = run_model(name, args.answers, args.rounds)
        v = row["validity"]
        print(f"{name}: {v['valid']}/{v['answers']} valid; decode with the grammar / without: batch 1 "
              f"{row['batch_1']['ratio']:.2f}x ({row['batch_1']['constrained_tok_s']:.1f} / "
              f"{row['batch_1']['free_tok_s']:.1f} tok/s), 16 concurrent {row['batch_16']['ratio']:.2f}x "
              f"({row['batch_16']['constrained_tok_s']:.1f} / {row['batch_16']['free_tok_s']:.1f})", flush=True)
        rows.append(row)
        out = {"cpu": _cpu(), "cpu_flags": _cpu_flags(), "threads": args.threads, "load_before": load_before,
               "load_after": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")  # after every model


if __name__ == "__main__":
    main()
