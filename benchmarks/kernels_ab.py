"""Two or more builds of kvgen's C++ kernels in one process, their products timed call by call.

Each tree (a git revision, or a folder of kernel sources) is built as its own library whose ops live in
``torch.ops.<name>`` (``ab0``, ``ab1``, ...), then one process calls their ``qmatmul`` in turn on the same
packed weights: a model's copies of one tensor in every layer (read from memory, placed as a model places them),
or ``--rows`` of one (from cache). Separate processes on a shared VM disagreed by up to 1.8x from run to run; calls
alternating in one process agree within a few percent over whole tensors (calls of tens of microseconds vary more).
Reports the best time of ``--reps`` calls of each build, its weights a second and its ratio to the first build;
checks that every build gives the first one's products (1e-5).

    python benchmarks/kernels_ab.py MODEL.gguf blk.0.ffn_gate.weight,blk.0.ffn_down.weight --trees HEAD~1,HEAD
    python benchmarks/kernels_ab.py MODEL.gguf token_embd.weight --trees main,src/kvgen/kernels --rows 512 --reps 2000

``--stream`` also times, in the same rounds, a prefetching read of the same packed bytes (vs_llamacpp's
``_prefetched_read``, 0, 8 and 16 kB ahead, the best): each product's GB/s then stands against the rate at which
this process reads those bytes at all, the decode roofline of one format. ``--json PATH`` writes the rows.

    python benchmarks/kernels_ab.py MODEL.gguf blk.0.ffn_gate.weight,output.weight --trees HEAD --stream

``--prompt`` times the products of a prompt's rows (``qmatmul(..., prompt=True)``: AVX2's Q4_K products on 16-bit
inputs), which builds from before that argument do not take.

``--attention SEQS,KEYS`` times the builds' ``attention`` instead: a decode step's 30 layers (SmolLM2's heads: 9
query heads on 3 key heads of 64) for SEQS sequences of KEYS keys each, each sequence's keys and values one run of
a float16 pool (``--kv-dtype``), each layer's its own (read from memory), the mask as the engine builds it.

    python benchmarks/kernels_ab.py --attention 16,576 --trees HEAD~1,HEAD --reps 7
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import torch

import kvgen.kernels as kernels
from kvgen.models.packed import PackedWeight, tile_rows, tiled_sizes
from kvgen.models.weight_arena import WeightArena

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_llamacpp import _cpu as cpu, _cpu_flags, _prefetched_read  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KERNELS = "src/kvgen/kernels"


def sources(tree: str, into: Path) -> None:
    """The kernel sources of ``tree`` (a folder, or a git revision of this repository) copied into ``into``."""
    if Path(tree).is_dir():
        for path in Path(tree).iterdir():
            if path.suffix in (".h", ".cpp"):
                shutil.copy(path, into)
        return
    listing = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{tree}:{KERNELS}"],
                             capture_output=True, text=True, check=True).stdout.split()
    for name in listing:
        if name.endswith((".h", ".cpp")):
            (into / name).write_bytes(subprocess.run(["git", "-C", str(ROOT), "show", f"{tree}:{KERNELS}/{name}"],
                                                     capture_output=True, check=True).stdout)


def build(tree: str, namespace: str, folder: Path) -> None:
    """``tree``'s kernels as ``folder/namespace.so``, their ops in ``torch.ops.<namespace>``, loaded."""
    src = folder / namespace
    src.mkdir()
    sources(tree, src)
    ops = src / "ops.cpp"
    ops.write_text(re.sub(r"TORCH_LIBRARY(_IMPL)?\(kvgen,", lambda m: f"TORCH_LIBRARY{m.group(1) or ''}({namespace},",
                          ops.read_text()))
    kernels._SOURCES, kernels._HEADERS = sorted(src.glob("*.cpp")), sorted(src.glob("*.h"))
    kernels._build(folder / f"{namespace}.so")
    torch.ops.load_library(str(folder / f"{namespace}.so"))


def weights(path: str, name: str, rows: int) -> tuple[list[tuple[int, torch.Tensor]], int]:
    """Every layer's copy of tensor ``name`` (``blk.0.`` names; others: the one tensor), tiled as models keep it
    (in one :class:`~kvgen.models.weight_arena.WeightArena`, 2 MB pages where THP allows), and its input features."""
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    raws, k = [], 0
    for layer in range(1000):
        t = tensors.get(name.replace("blk.0.", f"blk.{layer}."))
        if t is None or (layer and "blk.0." not in name):
            break
        k, n = int(t.shape[0]), int(t.shape[1])
        raws.append(PackedWeight([(int(t.tensor_type), torch.from_numpy(np.array(t.data)).reshape(n, -1)[:rows or n])],
                                 k))
    if not raws:
        raise SystemExit(f"{path} has no tensor {name!r} (every layer's copies: name layer 0's, e.g. "
                         "'blk.0.ffn_gate.weight'; others by their whole name, e.g. 'output.weight')")
    arena = WeightArena([size for raw in raws for size in tiled_sizes(raw)])
    return [tile_rows(raw, arena.empty_like).segments[0] for raw in raws], k


def best_times(calls, reps: int) -> list[float]:
    """The best time of each call over ``reps`` rounds, the calls in turn within each round."""
    times = [[] for _ in calls]
    for _ in range(reps):
        for call, spent in zip(calls, times):
            start = time.perf_counter()
            call()
            spent.append(time.perf_counter() - start)
    return [min(spent) for spent in times]


def time_attention(ops, trees: list[str], args) -> None:
    """Each build's attention over 30 layers of a decode step (see the module's docstring), alternating."""
    seqs, keys = map(int, args.attention.split(","))
    heads, kv_heads, d, layers, s = 9, 3, 64, 30, seqs * keys
    dtype = getattr(torch, args.kv_dtype)
    pools = [(torch.randn(1, kv_heads, s, d).to(dtype), torch.randn(1, kv_heads, s, d).to(dtype))
             for _ in range(layers)]
    q = torch.randn(1, heads, seqs, d)  # (1, H, T, D): one decode row per sequence
    mask = torch.zeros(1, 1, seqs, s, dtype=torch.bool)  # (1, 1, T, S): each row its own sequence's run
    for i in range(seqs):
        mask[0, 0, i, i * keys:(i + 1) * keys] = True
    first = ops[0](q, *pools[0], mask, d ** -0.5, 0.0)
    for op, tree in zip(ops[1:], trees[1:]):
        error = ((op(q, *pools[0], mask, d ** -0.5, 0.0) - first).abs().max() / first.abs().max()).item()
        assert error < 1e-5, f"{tree} attends otherwise ({error:.1e} of the largest output)"
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        best = best_times([lambda op=op: [op(q, k, v, mask, d ** -0.5, 0.0) for k, v in pools] for op in ops],
                          args.reps)
        read = layers * 2 * kv_heads * s * d * pools[0][0].element_size()
        print(f"attention ({seqs} sequences of {keys} keys, {args.kv_dtype}, {layers} layers, {threads} threads): "
              + "  ".join(f"{tree} {b * 1e3:.2f} ms {read / b / 1e9:.1f} GB/s ({best[0] / b:.2f}x)"
                          for tree, b in zip(trees, best)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", help="a GGUF file")
    parser.add_argument("tensors", nargs="?", help="comma-separated tensor names (blk.0.*: every layer's)")
    parser.add_argument("--attention", help="SEQS,KEYS: time a decode step's attention, not products")
    parser.add_argument("--kv-dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--trees", required=True, help="comma-separated git revisions or kernel source folders")
    parser.add_argument("--rows", type=int, default=0, help="only the first rows of each tensor (from cache)")
    parser.add_argument("--inputs", type=int, default=1, help="input rows of each product")
    parser.add_argument("--prompt", action="store_true", help="the input rows are a prompt's")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--stream", action="store_true", help="also time a prefetching read of the same bytes")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    if not args.attention and not (args.model and args.tensors):
        parser.error("give MODEL and TENSORS, or --attention SEQS,KEYS")
    assert kernels.kernels_available(), kernels.unavailable_reason()  # this tree's: the tiles' layout
    trees = args.trees.split(",")
    names = [f"ab{i}" for i in range(len(trees))]
    with tempfile.TemporaryDirectory() as folder:
        for tree, namespace in zip(trees, names):
            build(tree, namespace, Path(folder))
        if args.attention:
            time_attention([getattr(torch.ops, namespace).attention for namespace in names], trees, args)
            print(f"lscpu: {cpu()}; load average {open('/proc/loadavg').read().split()[:3]}")
            return
        ops, rows = [getattr(torch.ops, namespace).qmatmul for namespace in names], []
        read = _prefetched_read() if args.stream else None
        if args.prompt:
            ops = [lambda x, segments, formats, op=op: op(x, segments, formats, True) for op in ops]
        for tensor in args.tensors.split(","):
            segments, k = weights(args.model, tensor, args.rows)
            n = segments[0][1].shape[0]
            x = torch.randn(args.inputs, k)
            first = ops[0](x, [segments[0][1]], [segments[0][0]])
            for op, namespace in zip(ops[1:], names[1:]):
                error = ((op(x, [segments[0][1]], [segments[0][0]]) - first).abs().max() / first.abs().max()).item()
                assert error < 1e-5, (f"{namespace} gives other products ({error:.1e} of the largest): a wrong "
                                      "kernel, or a tree older than this one's tile layout (AVX2's runs stored "
                                      "in Quads order since 14375a2), which reads these tiles otherwise")
            for threads in map(int, args.threads.split(",")):
                torch.set_num_threads(threads)
                calls = [lambda op=op: [op(x, [data], [format]) for format, data in segments] for op in ops]
                if args.stream:  # (packed segments are whole cache lines of bytes: read as float32)
                    calls += [lambda ahead=ahead: [read(data.data_ptr(), data.numel() // 4, ahead, threads)
                                                   for _, data in segments] for ahead in (0, 8192, 16384)]
                times = [b / len(segments) for b in best_times(calls, args.reps)]
                best, stream = times[:len(ops)], min(times[len(ops):], default=None)
                weights_read = n * x.shape[1] * args.inputs
                nbytes = sum(data.numel() for _, data in segments) / len(segments)
                row = {"tensor": tensor, "shape": [n, x.shape[1]], "copies": len(segments), "inputs": args.inputs,
                       "threads": threads, "formats": sorted({format for format, _ in segments}),
                       "seconds": dict(zip(trees, best))}
                line = "  ".join(f"{tree} {b * 1e3:.3f} ms {weights_read / b / 1e9:.1f} Gw/s ({best[0] / b:.2f}x)"
                                 for tree, b in zip(trees, best))
                if stream is not None:
                    row["stream_seconds"] = stream
                    line += f"  | bytes {nbytes / 1e6:.1f} MB: stream {nbytes / stream / 1e9:.1f} GB/s, " + ", ".join(
                        f"{tree} {nbytes / b / 1e9:.1f} GB/s ({stream / b:.0%})" for tree, b in zip(trees, best))
                rows.append(row)
                print(f"{tensor} ({n} x {x.shape[1]}, {len(segments)} copies, {args.inputs} input rows, {threads} "
                      f"threads): {line}", flush=True)
    machine = f"lscpu: {cpu()} ({_cpu_flags()}); load average {open('/proc/loadavg').read().split()[:3]}"
    if args.json:
        args.json.write_text(json.dumps({"cpu": machine, "model": args.model, "rows": rows}, indent=1) + "\n")
    print(machine)


if __name__ == "__main__":
    sys.exit(main())
