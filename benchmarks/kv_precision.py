"""KV precision: what storing keys and values as float16, bfloat16 or int8 rows (kvgen.cache.precision) costs in
perplexity and gives in the batching engine's decode, against float32, on the packaged SmolLM2 GGUF (weights in
their stored types, as ``kvgen serve`` runs it).

* perplexity: the first ``--tokens`` (4,096) KJV tokens through a static cache of each precision, a 512-token
  prefill then 512-token chunks, so that later chunks attend to the stored keys and values;
* decode: 16 requests of ``--context`` random prompt tokens each (20 and 600), their prompts prefilled and cached
  first, then 96 new tokens each in one engine (``generate_batch``'s engine, ``max_batch_tokens`` 256): output
  tok/s of the decode, each precision ``--rounds`` (3) times, alternating, in this one process.

Writes ``benchmarks/results/kv_precision.json`` with the CPU, its vector extensions and the load.

    python benchmarks/kv_precision.py
    python benchmarks/kv_precision.py --tokens 1024 --rounds 1
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

from kvgen.cache.precision import KV_DTYPES

sys.path.insert(0, str(Path(__file__).parent))
from quantized_quality import kjv_ids, perplexity  # noqa: E402
from vs_llamacpp import _cpu, _cpu_flags  # noqa: E402

RESULTS = Path(__file__).parent / "results"
DTYPES = tuple(KV_DTYPES)


def decode_rate(model, prompts: list[list[int]], dtype: str, new: int = 96) -> float:
    """Output tok/s of ``new`` tokens for each prompt, decoded together after their prompts were cached."""
    from kvgen.serving import ContinuousBatchingConfig

    config = ContinuousBatchingConfig(max_memory="2GiB", max_batch_tokens=256, max_num_seqs=len(prompts),
                                      kv_dtype=dtype)
    with model.init_continuous_batching(continuous_batching_config=config) as manager:
        for rid in manager.add_requests(prompts, max_new_tokens=1):  # the prompts' blocks cached
            manager.get_result(rid, timeout=3600)
        start = time.perf_counter()
        for rid in manager.add_requests(prompts, max_new_tokens=new, eos_token_id=[]):
            manager.get_result(rid, timeout=3600)
        return len(prompts) * new / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="KJV tokens of the perplexity")
    parser.add_argument("--context", type=int, nargs="+", default=[20, 600], help="prompt tokens of the decode runs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import kvgen
    from kvgen.loading.default_model import default_gguf_path

    path = default_gguf_path()
    model, tokenizer = kvgen.AutoModelForCausalLM.from_pretrained(path), kvgen.AutoTokenizer.from_pretrained(path)
    out = {"cpu": _cpu(), "cpu_flags": _cpu_flags(), "threads": args.threads, "load_before": os.getloadavg()[0],
           "model": "SmolLM2-135M-Instruct GGUF, stored types", "perplexity": {}, "decode_tok_per_s": {}}
    ids = kjv_ids(tokenizer, args.tokens)
    for dtype in DTYPES:
        with torch.no_grad():
            cache = kvgen.StaticCache(config=model.config, max_cache_len=args.tokens, dtype=getattr(torch, dtype))
            out["perplexity"][dtype] = round(perplexity(model, ids, cache, 512, 512)[0], 4)
        print(f"perplexity {dtype}: {out['perplexity'][dtype]}", flush=True)
    g = torch.Generator().manual_seed(0)
    for context in args.context:
        prompts = [torch.randint(100, 40000, (context,), generator=g).tolist() for _ in range(16)]
        rates: dict[str, list[float]] = {dtype: [] for dtype in DTYPES}
        for r in range(args.rounds):
            for dtype in DTYPES if r % 2 == 0 else DTYPES[::-1]:
                rates[dtype].append(round(decode_rate(model, prompts, dtype), 1))
                print(f"context {context}, {dtype}: {rates[dtype][-1]} tok/s", flush=True)
        out["decode_tok_per_s"][str(context)] = {
            dtype: {"runs": v, "median": round(statistics.median(v), 1),
                    "vs_float32": round(statistics.median(v) / statistics.median(rates["float32"]), 3)}
            for dtype, v in rates.items()}
    base = out["perplexity"]["float32"]
    out["perplexity_vs_float32"] = {dtype: round(p / base - 1, 5) for dtype, p in out["perplexity"].items()}
    out["load_after"] = os.getloadavg()[0]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kv_precision.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
