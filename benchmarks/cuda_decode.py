"""Greedy decode on a CUDA GPU: kvgen (dynamic cache eager, static cache compiled, from a new cache per call
and from one cache passed to every call) against transformers, on the same random Llama weights, side by side
in one process.

Builds a random Llama with transformers, saves it, loads it in both libraries in ``--dtype``, and
times ``generate()`` of ``--new-tokens`` after a ``--prompt-length`` prompt at batch 1 (best of
``--repeats``, after a warm-up run that also compiles). Reports tokens/s and the largest difference
between the two libraries' prompt logits (random weights make greedy choices near-ties, so the tokens
themselves are not compared), and writes JSON to ``$OUT/cuda_decode.json`` or ``benchmarks/results/``.

    python benchmarks/cuda_decode.py                       # ~0.9B Llama, bfloat16, 512 + 128 tokens
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

import kvgen


def timed(fn, repeats: int) -> tuple[float, torch.Tensor]:
    out = fn()  # warm-up (compiles the static decode step)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--prompt-length", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import transformers

    dtype = getattr(torch, args.dtype)
    config = transformers.LlamaConfig(hidden_size=args.hidden_size, intermediate_size=args.hidden_size * 11 // 4,
                                      num_hidden_layers=args.layers, num_attention_heads=args.hidden_size // 128,
                                      num_key_value_heads=max(args.hidden_size // 512, 1), vocab_size=32000,
                                      max_position_embeddings=4096)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        transformers.LlamaForCausalLM(config).to(dtype).save_pretrained(folder)
        hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=dtype).cuda().eval()
        ours = kvgen.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map="cuda")
    ids = torch.randint(0, 32000, (1, args.prompt_length), device="cuda")
    common = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    # one StaticCache passed to every call (reset first): its buffers keep their addresses, so the CUDA graphs
    # recorded for them are replayed from call to call (a cache made by generate() records them again)
    one_cache = kvgen.StaticCache(config=ours.config, max_batch_size=1, max_cache_len=args.prompt_length
                                  + args.new_tokens, device="cuda", dtype=dtype)

    def reset(cache):
        cache.reset()
        return cache

    runs = {
        "transformers dynamic": lambda: hf.generate(ids, **common),
        "transformers static compiled": lambda: hf.generate(ids, cache_implementation="static", **common),
        "kvgen dynamic": lambda: ours.generate(ids, **common),
        "kvgen static compiled": lambda: ours.generate(ids, cache_implementation="static", **common),
        "kvgen static compiled, one cache": lambda: ours.generate(ids, past_key_values=reset(one_cache), **common),
    }
    with torch.no_grad():
        theirs, mine = hf(ids).logits.float(), ours(ids).logits.float()
    logits_difference = float((theirs - mine).abs().max() / theirs.abs().max())
    print(f"prompt logits: max |kvgen - transformers| = {logits_difference:.2e} of max |logit|")
    results = {}
    for name, fn in runs.items():
        with torch.no_grad():
            try:
                seconds, out = timed(fn, args.repeats)
            except Exception as error:  # noqa: BLE001 - a failing baseline is reported, not fatal
                results[name] = {"error": f"{type(error).__name__}: {error}"[:300]}
                print(f"{name:34s} failed: {results[name]['error']}")
                continue
        assert out.shape[1] == args.prompt_length + args.new_tokens
        results[name] = {"seconds": seconds, "tok_per_s": args.new_tokens / seconds}
        print(f"{name:34s} {args.new_tokens / seconds:8.1f} tok/s  ({seconds:.3f} s)")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "transformers": transformers.__version__, "args": vars(args),
              "prompt_logits_relative_difference": logits_difference, "results": results}
    folder = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cuda_decode.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
