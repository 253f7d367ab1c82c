"""Time to first token with a saved prompt cache against a cold prefill (what ``--prompt-cache`` buys).

SmolLM2-135M (float32). The prompt is a ``--prefix``-token KJV passage (a long system prompt
or few-shot prefix) followed by a short question. Cold: ``generate(max_new_tokens=1)`` with an
empty cache, prefilling the whole prompt. Warm: ``kvgen.load_cache`` of the prefix's cache
saved to disk beforehand (checksums verified, fingerprint checked) plus the same ``generate``,
which prefills only the question. The two alternate ``--repeats`` times in one process; the
medians and their ratio go to ``benchmarks/results/prompt_cache.json``. Both give the same token.

    python benchmarks/prompt_cache.py                   # 2048-token prefix, 2 threads
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantized_quality import kjv_ids  # noqa: E402

import kvgen  # noqa: E402
from kvgen.loading.default_model import default_model_dir  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "prompt_cache.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    folder = default_model_dir()
    model = kvgen.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = kvgen.AutoTokenizer.from_pretrained(folder)
    prefix = kjv_ids(tokenizer, args.prefix)[None]  # (1, P)
    question = tokenizer("\nQuestion: who is speaking in this passage? Answer:", return_tensors="pt")["input_ids"]
    prompt = torch.cat([prefix, question], dim=1)

    path = Path(tempfile.mkdtemp()) / "prefix.safetensors"
    cache = kvgen.DynamicCache()
    model(prefix, past_key_values=cache)
    cache.save(path, model=model)
    file_mb = path.stat().st_size / 2**20
    del cache

    def cold():
        return model.generate(prompt, max_new_tokens=1, do_sample=False)

    def warm():
        return model.generate(prompt, past_key_values=kvgen.load_cache(path, model=model), max_new_tokens=1,
                              do_sample=False)

    times = {"cold": [], "warm": []}
    tokens = {}
    for _ in range(args.repeats):
        for name, run in (("cold", cold), ("warm", warm)):
            start = time.perf_counter()
            tokens[name] = int(run()[0, -1])
            times[name].append(time.perf_counter() - start)
    assert tokens["cold"] == tokens["warm"], tokens
    cold_s, warm_s = statistics.median(times["cold"]), statistics.median(times["warm"])
    result = {"model": "SmolLM2-135M-Instruct float32", "prefix_tokens": args.prefix,
              "question_tokens": question.shape[1], "threads": args.threads, "cache_file_mb": round(file_mb, 1),
              "cold_ttft_s": round(cold_s, 3), "warm_ttft_s": round(warm_s, 3), "speedup": round(cold_s / warm_s, 2),
              "all_times_s": {k: [round(t, 3) for t in v] for k, v in times.items()},
              "load_average": os.getloadavg()[0]}
    print(json.dumps(result, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    path.unlink()
    return result


if __name__ == "__main__":
    main()
