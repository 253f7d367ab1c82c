"""Decode speed of the quantized cache against kvgen's dynamic cache at a long context.

SmolLM2-135M (float32), a ``--context``-token KJV prompt prefilled into each cache, then
``--steps`` single-token decode steps, the caches taking turns step by step so that the
drift of this shared machine hits every cache alike. Reports the median step time as
tokens/s and the ratio to the dynamic cache; with ``--transformers``, transformers' own
``QuantizedCache(backend="quanto")`` on the same weights is measured the same way.
The whole measurement runs ``--runs`` times with fresh caches (the host drifts between runs)
and the medians of the ratios are reported. Writes ``benchmarks/results/quantized_speed.json``.

    python benchmarks/quantized_speed.py --transformers   # 4096 context, 2 threads, 3 runs
    python benchmarks/quantized_speed.py --context 1024 --steps 16 --out /tmp/s
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantized_quality import kjv_ids  # noqa: E402

from kvgen import AutoModelForCausalLM, AutoTokenizer, DynamicCache, QuantizedCache  # noqa: E402
from kvgen.loading.default_model import default_model_dir  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


class Runner:
    """One model + cache, prefilled, stepping one greedy token at a time."""

    def __init__(self, name, model, cache, ids):
        self.name, self.model, self.cache, self.times = name, model, cache, []
        with torch.no_grad():
            logits = model(input_ids=ids[None], past_key_values=cache, use_cache=True).logits
        self.next = logits[:, -1:].argmax(-1)

    @torch.no_grad()
    def step(self) -> None:
        start = time.perf_counter()
        logits = self.model(input_ids=self.next, past_key_values=self.cache, use_cache=True).logits
        self.next = logits[:, -1:].argmax(-1)
        self.times.append(time.perf_counter() - start)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--transformers", action="store_true", help="also time transformers' quanto cache")
    parser.add_argument("--runs", type=int, default=3, help="measurements with fresh caches, reported with medians")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    path = str(default_model_dir())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = kjv_ids(AutoTokenizer.from_pretrained(path), args.context)
    hf = None
    if args.transformers:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    runs = []
    for run in range(args.runs):  # fresh caches each run: the host's drift shows between runs
        rows = measure(model, hf, ids, args.steps)
        runs.append(rows)
        print(f"run {run + 1}: " + ", ".join(f"{name} {row['tokens_per_s']:.2f} tok/s ({row['vs_dynamic']:.2f}x)"
                                           for name, row in rows.items()), flush=True)
    summary = {name: {"vs_dynamic_median": statistics.median(r[name]["vs_dynamic"] for r in runs)}
               for name in runs[0]}
    if hf is not None:
        ratios = [r["kivi4"]["tokens_per_s"] / r["transformers-quanto4"]["tokens_per_s"] for r in runs]
        summary["kivi4"]["vs_transformers_quanto4_median"] = statistics.median(ratios)
        summary["kivi4"]["vs_transformers_quanto4_runs"] = ratios
    for name, row in summary.items():
        print(f"{name:22s} " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {[round(x, 2) for x in v]}"
                                         for k, v in row.items()))
    result = {"model": "SmolLM2-135M-Instruct (float32)", "context": args.context, "steps": args.steps,
              "threads": args.threads, "torch": torch.__version__, "summary": summary, "runs": runs,
              "results": runs[-1]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quantized_speed.json").write_text(json.dumps(result, indent=1))


def measure(model, hf, ids, steps: int) -> dict:
    """One run: every cache prefilled, then ``steps`` interleaved decode steps; medians per cache."""
    runners = [Runner("dynamic", model, DynamicCache(config=model.config), ids)]
    for nbits in (4, 2):
        runners.append(Runner(f"kivi{nbits}", model, QuantizedCache("kivi", model.config, nbits=nbits), ids))
    if hf is not None:
        import transformers

        runners.append(Runner("transformers-quanto4", hf, transformers.QuantizedCache("quanto", hf.config, nbits=4),
                              ids))
    for r in runners:  # warm-up
        r.step()
        r.times.clear()
    for _ in range(steps):
        for r in runners:
            r.step()
    medians = {r.name: statistics.median(r.times) for r in runners}
    return {r.name: {"tokens_per_s": 1 / medians[r.name], "median_step_s": medians[r.name],
                     "vs_dynamic": medians["dynamic"] / medians[r.name],
                     "cache_bytes": r.cache.nbytes() if hasattr(r.cache, "nbytes") else None} for r in runners}


if __name__ == "__main__":
    main()
