"""Speculative decoding on SmolLM2-135M-Instruct: prompt lookup and early exit against plain greedy decoding.

Three tasks with real text, greedy, up to 256 new tokens (EOS ends a reply, as in use):

* ``kjv_repeat``: continue Numbers 7 (the twelve princes' identical offerings) from verse 1 to 41;
* ``rewrite``: the chat model rewrites a paragraph that is in its prompt, with one change;
* ``plain``: the chat model writes a short story: no text to repeat, so drafts mostly fail.

For each weight format (float32, and the GGUF's stored Q8_0/Q4_1) and each method (plain;
prompt lookup of at most 3 or 7 tokens and early exit after 8, 16 and 24 of 30 layers, with
kvgen's adaptive schedule; lookup 7 and 10 drafting the full number every step, as
transformers does), one warm-up run, then ``--rounds`` timed runs taken in turn across the
methods (the host drifts): decode tokens/s (after the first token, median of the rounds),
acceptance rate, speedup over plain decoding, and whether the tokens equal plain decoding's.
Writes ``benchmarks/results/speculative.json`` and ``speculative.png``.

    python benchmarks/speculative.py            # ~25 minutes on 2 cores
    python benchmarks/speculative.py --quick    # 64 new tokens, plain, lookup 7 and early exit 16 only
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantized_quality import kjv_path  # noqa: E402
from vs_llamacpp import _cpu as cpu  # noqa: E402

from kvgen import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from kvgen.loading.default_model import default_gguf_path, default_model_dir  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PARAGRAPH = ("The lighthouse stood on a rock at the mouth of the bay, and every night its keeper climbed the one "
             "hundred and twelve steps to light the lamp. He had done so for thirty years, through storms that shook "
             "the glass and calm nights when the sea lay flat as a mirror. The ships that passed knew his light, and "
             "the fishermen of the village said that no boat had been lost on the rocks since he came. In the mornings "
             "he wrote the weather in a book, fed the gulls that waited on the railing, and slept until the afternoon, "
             "when the children of the village came to ask him for stories of the sea.")
CONSTANT = {"num_assistant_tokens_schedule": "constant"}  # transformers' behaviour: always the full number of drafts
METHODS = {"plain": {}, "lookup 3": dict(prompt_lookup_num_tokens=3), "lookup 7": dict(prompt_lookup_num_tokens=7),
           "lookup 7 constant": dict(prompt_lookup_num_tokens=7, **CONSTANT),
           "lookup 10 constant": dict(prompt_lookup_num_tokens=10, **CONSTANT),
           "early exit 8": dict(assistant_early_exit=8), "early exit 16": dict(assistant_early_exit=16),
           "early exit 24": dict(assistant_early_exit=24)}


def tasks(tokenizer) -> dict[str, torch.Tensor]:
    with open(kjv_path(), encoding="utf-8") as f:
        verses = [json.loads(line) for line in f]
    numbers7 = " ".join(v["text"] for v in verses if v["book"] == "Numbers" and v["chapter"] == 7 and v["verse"] <= 41)

    def chat(text):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"]

    return {
        "kjv_repeat": tokenizer(numbers7, return_tensors="pt")["input_ids"],
        "rewrite": chat("Rewrite the following paragraph exactly, but change the keeper's thirty years to forty "
                        "years. Change nothing else.\n\n" + PARAGRAPH),
        "plain": chat("Write a short story about a lighthouse keeper who finds a message in a bottle."),
    }


class Stamps:
    """A streamer that notes when tokens arrive."""

    def __init__(self):
        self.times, self.counts = [], []

    def put(self, value):
        self.times.append(time.perf_counter())
        self.counts.append(value.numel())

    def end(self):
        pass

    def decode_rate(self) -> float:  # tokens after the first one, over the time after the first one
        return sum(self.counts[2:]) / (self.times[-1] - self.times[1])


def run(model, ids, new_tokens, settings):
    stamps = Stamps()
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, streamer=stamps,
                         return_dict_in_generate=True, **settings)
    return out, stamps


@torch.no_grad()
def warm_up(model) -> None:
    """Compile the decode blocks for every row count a verifying pass may have (1-8 rows: once per process)."""
    from kvgen import DynamicCache

    cache = DynamicCache(config=model.config)
    model(torch.arange(16)[None], past_key_values=cache, use_cache=True)
    for rows in range(1, 9):
        model(torch.arange(rows)[None], past_key_values=cache, use_cache=True, logits_to_keep=rows,
              cache_position=torch.arange(16, 16 + rows))
        cache.crop(16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output", default=str(RESULTS / "speculative.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    new_tokens = 64 if args.quick else 256
    methods = {k: v for k, v in METHODS.items() if not args.quick or k in ("plain", "lookup 7", "early exit 16")}
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    prompts = tasks(tokenizer)
    rows = []
    for weights in ("float32", "gguf"):
        model = (AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32) if weights == "float32"
                 else AutoModelForCausalLM.from_pretrained(default_gguf_path()))
        warm_up(model)
        for name, settings in methods.items():
            run(model, prompts["rewrite"], 48, settings)
        for task, ids in prompts.items():
            timed = {name: [] for name in methods}
            for _ in range(args.rounds):
                for name, settings in methods.items():
                    out, stamps = run(model, ids, new_tokens, settings)
                    timed[name].append((out, stamps.decode_rate()))
            plain = timed["plain"][0][0].sequences, statistics.median(rate for _, rate in timed["plain"])
            for name, runs in timed.items():
                out = runs[0][0]
                rate = statistics.median(r for _, r in runs)
                row = {"weights": model.weight_format, "task": task, "method": name, "prompt_tokens": ids.shape[1],
                       "new_tokens": out.sequences.shape[1] - ids.shape[1], "decode_tok_s": round(rate, 2),
                       "speedup": round(rate / plain[1], 2),
                       "same_tokens_as_plain": all(torch.equal(o.sequences, plain[0]) for o, _ in runs)}
                if out.speculation is not None:
                    row.update(acceptance_rate=round(out.speculation.acceptance_rate, 3),
                               drafted=out.speculation.drafted, steps=out.speculation.steps)
                rows.append(row)
                print(json.dumps(row), flush=True)
        del model
    report = {"cpu": cpu(), "threads": args.threads, "rounds": args.rounds, "load_average": os.getloadavg(),
              "new_tokens": new_tokens, "torch": torch.__version__, "rows": rows}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    plot(report, Path(args.output).with_suffix(".png"))
    print(f"wrote {args.output}")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    weights = list(dict.fromkeys(r["weights"] for r in rows))
    task_names = list(dict.fromkeys(r["task"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, len(weights), figsize=(6 * len(weights), 4), sharey=True, squeeze=False)
    width = 0.8 / len(methods)
    for ax, weight in zip(axes[0], weights):
        for i, method in enumerate(methods):
            values = [next(r["speedup"] for r in rows if r["weights"] == weight and r["task"] == t
                           and r["method"] == method) for t in task_names]
            ax.bar([j + i * width for j in range(len(task_names))], values, width, label=method)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(task_names))], task_names)
        ax.set_title(f"SmolLM2-135M {weight}, greedy")
        ax.set_ylabel("decode speed / plain decoding")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Speculative decoding, {report['cpu']}, {report['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
