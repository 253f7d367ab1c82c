"""kvgen against llama.cpp's own ``llama-bench`` on the same GGUF files and thread counts.

llama.cpp is built once from the source that PyPI's ``llama-cpp-python`` sdist vendors
(``pip download --no-deps --no-binary :all: llama-cpp-python``), with cmake, into
``~/.cache/kvgen-bench/llamacpp`` (about 15 minutes on 2 cores; only the ``llama-bench``
target). It is a benchmark tool, never a kvgen dependency. It is built for this CPU (``GGML_NATIVE``)
without AMX: that version's AMX matrix product crashes on a Xeon with AMX (an invalid tile
configuration: SIGILL or SIGSEGV at its first tile instruction; llama.cpp PR 26954, open), so an x86 build
takes ``-mno-amx-tile -mno-amx-int8 -mno-amx-bf16`` (no change on CPUs without AMX).

For each model and thread count (1, 2), kvgen and llama-bench alternate in fresh processes, ``--rounds`` times.
The models: the packaged SmolLM2-135M (Q4_1) and Gemma 3 270M (Q4_K_M), the real Qwen2.5-Coder-0.5B-Instruct
(``coder``: mostly Q5_0) and random-weight files in the shapes of Qwen2.5 0.5B-7B and Llama 3 1B-8B, quantized to
Q4_K_M or Q8_0 by ``llama-quantize`` (``qwen2.5-1.5b:q4_k_m``; ``model_files.py``). Measured:

* prefill: 512 prompt tokens (llama-bench ``-p 512 -n 0``), after one untimed prefill of as many, the mean
  rate of 3 repetitions on each side (llama-bench ``-r 3``);
* decode: 128 tokens after a 512-token prompt, batch 1 (llama-bench ``-p 0 -n 128 -d 512``);
  kvgen also at batch 4. Both feed random tokens and compute every step's logits without sampling
  (llama-bench's generation test draws its tokens with ``rand()``);
* peak RSS of each process (its ``VmHWM``: llama-bench's read while it runs, as ``ru_maxrss`` carries the size of
  the process that started it);
* load time: llama-bench's wall time for a 1-token prompt (``-p 1 -n 0 -r 1``: load, warm-up and one token), and
  kvgen's ``from_pretrained`` plus a 1-token forward in its worker (after ``import torch``), the file in the page
  cache (a second load).

``--baseline SRC`` adds a third side: the kvgen of another source tree (a ``git worktree`` of main), whose worker
runs in each round beside this one's, so a change is measured before and after in one run (``baseline_ratio``).
``--reps`` sets the timed repetitions (3, as llama-bench's ``-r 3``; 1 for the 7-8B models' long prefills).
kvgen's prefills are marked as a prompt's rows, as ``generate()`` marks them (``kvgen.kernels.prompt_rows``: AVX2's
Q4_K products on 16-bit inputs); ``KVGEN_PREFILL_INPUTS=float32`` in the environment keeps them exact (each row
records its ``prefill_inputs``).

kvgen's decode is also put against the roofline: the bytes one step reads (stored weights,
plus the keys and values attended to) over the rate at which the worker reads a buffer of as many
bytes, the best of torch's ``sum`` and ``amax`` and a prefetching C loop (:func:`read_bandwidth`),
read just before and just after its batch-1 steps (the higher of the two; the worker's peak RSS is
taken before the probe's buffer exists). Until 2026-11-27 the buffer was 256 MB and read by torch
alone: on a Xeon with 480 MB of L3 that understates the rate at a decode step's size. On a shared VM the
neighbours' load moves the memory's rate within seconds, so ``paired_roofline`` also divides each of 24 more
steps by one read of the probe right after it (the fastest way of the probe's), their median: each pair under
the same load. Writes
``benchmarks/results/vs_llamacpp.json`` and ``vs_llamacpp.png``.

    python benchmarks/vs_llamacpp.py                      # SmolLM2 and Gemma 3, 1 and 2 threads, 3 rounds
    python benchmarks/vs_llamacpp.py --models smollm2 --threads 2 --rounds 1 --baseline /tmp/main/src
    python benchmarks/vs_llamacpp.py --models coder,qwen2.5-1.5b:q4_k_m,llama3.1-8b:q8_0 --reps 1 --rounds 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
CACHE = Path(os.environ.get("KVGEN_BENCH_CACHE", Path.home() / ".cache" / "kvgen-bench")) / "llamacpp"
PROMPT, NEW, BATCHES = 512, 128, (1, 4)
PAIRS = 24  # batch-1 decode steps each timed next to a read of as many bytes (paired_roofline)
REPS = 3  # timed repetitions of each test, as llama-bench -r 3 (--reps)


def llama_bench() -> Path:
    """Path of ``llama-bench``, building it on first use."""
    return llama_cpp_tool("llama-bench")


def llama_cpp_tool(name: str) -> Path:
    """Path of llama.cpp's ``llama-bench``, ``llama-server`` or ``llama-quantize``, building the three on first use
    (~15 minutes)."""
    binaries = sorted(CACHE.glob(f"llama_cpp_python-*/vendor/llama.cpp/build/bin/{name}"))
    if binaries:
        return binaries[-1]
    CACHE.mkdir(parents=True, exist_ok=True)
    if not list(CACHE.glob("llama_cpp_python-*.tar.gz")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "llama-cpp-python", "-d", str(CACHE)], check=True)
    archive = sorted(CACHE.glob("llama_cpp_python-*.tar.gz"))[-1]
    source = CACHE / archive.name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
    if not source.exists():
        with tarfile.open(archive) as tar:
            tar.extractall(CACHE, filter="data")
    print(f"building llama-bench, llama-server and llama-quantize in {source} (about 15 minutes)", file=sys.stderr)
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" if platform.machine() in ("x86_64", "AMD64") else ""
    subprocess.run(["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
                    f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"], cwd=source, check=True)
    subprocess.run(["cmake", "--build", "build", "--target", "llama-bench", "llama-server", "llama-quantize",
                    "-j", str(os.cpu_count() or 1)], cwd=source, check=True)
    return source / "build" / "bin" / name


def run_measured(command: list[str], env: dict | None = None) -> tuple[str, float, float]:
    """(stdout, peak RSS in MB, wall seconds) of a command run to completion. The peak is the process's own
    ``VmHWM``, read every 10 ms while it runs (a new mapping at exec starts it afresh; ``ru_maxrss`` would carry
    this process's size over the fork)."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    peak = [0.0]

    def watch():
        status = Path(f"/proc/{process.pid}/status")
        while process.poll() is None:
            try:
                line = next(x for x in status.read_text().splitlines() if x.startswith("VmHWM:"))
                peak[0] = max(peak[0], int(line.split()[1]) / 1024)
            except (OSError, StopIteration):
                pass
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    out = process.stdout.read()
    process.wait()
    seconds = time.perf_counter() - start
    watcher.join()
    if process.returncode != 0:
        raise RuntimeError(f"{command[0]} failed with status {process.returncode}")
    return out, peak[0], seconds


def llamacpp(binary: Path, model: Path, threads: int) -> dict:
    prefill, rss_p, _ = run_measured([str(binary), "-m", str(model), "-p", str(PROMPT), "-n", "0", "-t", str(threads),
                                      "-r", str(REPS), "-o", "json"])
    decode, rss_d, _ = run_measured([str(binary), "-m", str(model), "-p", "0", "-n", str(NEW), "-d", str(PROMPT),
                                     "-t", str(threads), "-r", str(REPS), "-o", "json"])
    _, _, load = run_measured([str(binary), "-m", str(model), "-p", "1", "-n", "0", "-r", "1", "-t", str(threads),
                               "-o", "json"])
    info = json.loads(prefill)[0]
    return {"prefill_tok_s": info["avg_ts"], "decode_tok_s": {"1": json.loads(decode)[0]["avg_ts"]},
            "peak_rss_mb": max(rss_p, rss_d), "load_s": load, "parameters": info["model_n_params"],
            "file_bytes": info["model_size"]}


def attended_kv_bytes(model, cache, context: float) -> float:
    """The bytes of keys and values a decode step at ``context`` tokens (the steps' mean) reads: each layer's stored
    bytes per token times the keys it attends to, at most its sliding window. (``cache.nbytes()``, used until
    2026-11-26 20:30, counts the buffers' spare room as well: 47.2 MB where SmolLM2's 643 tokens hold 29.6, so
    the rooflines read 5-13% high.)"""
    total = 0.0
    for layer, (keys, values) in zip(model.model.layers, cache):
        per_token = (keys.numel() * keys.element_size() + values.numel() * values.element_size()) / keys.shape[2]
        total += per_token * min(context, getattr(layer.self_attn, "sliding_window", None) or context)
    return total


def kvgen_worker(model: str, threads: int) -> dict:
    """Run in a fresh process: prefill 512 tokens, then 128 decode steps at batch 4 and 1; the read bandwidth just
    before and just after the batch-1 steps (after the peak RSS is taken: the probe's 256 MB are not kvgen's)."""
    import torch

    torch.set_num_threads(threads)
    from kvgen import AutoModelForCausalLM, DynamicCache
    from kvgen.bench import peak_rss_mb
    from kvgen.kernels import prefill_inputs
    try:
        from kvgen.kernels.prompt_rows import prompt_rows
    except ImportError:  # a --baseline tree from before prompt rows were marked: its forwards as they were
        def prompt_rows(rows):
            return contextlib.nullcontext()

    start = time.perf_counter()
    m = AutoModelForCausalLM.from_pretrained(model)
    with torch.no_grad():
        m(torch.tensor([[100]]))
    load = time.perf_counter() - start
    vocab = m.config.vocab_size
    ids = torch.randint(100, min(vocab, 30000), (1, PROMPT), generator=torch.Generator().manual_seed(0))
    result = {"weight_format": m.weight_format, "prefill_inputs": prefill_inputs(), "decode_tok_s": {},
              "step_bytes": {}, "load_s": load}
    weights = sum(b.numel() * b.element_size() for b in m.buffers() if b.dtype == torch.uint8) + \
        sum(p.numel() * p.element_size() for p in m.parameters())  # bytes a decode step streams
    with torch.no_grad():
        # as llama-bench: one untimed prefill of the whole prompt (compiled blocks, scratch buffers, page faults),
        # then REPS timed ones, each into a fresh cache, reported as the mean of their rates (its avg_ts)
        with prompt_rows(PROMPT):  # (generate()'s prefill: a prompt's rows)
            m(ids, past_key_values=DynamicCache(), logits_to_keep=1)
            rates = [PROMPT / _timed(lambda: m(ids, past_key_values=DynamicCache(), logits_to_keep=1))
                     for _ in range(REPS)]
        result["prefill_tok_s"] = statistics.mean(rates)
        probe = None
        for batch in sorted(BATCHES, reverse=True):
            cache = DynamicCache()
            m(ids.expand(batch, -1), past_key_values=cache, logits_to_keep=1)
            # as llama-bench's generation test: random tokens fed one step at a time, the logits computed
            # but not sampled from (a greedy pick over Gemma 3's 262k logits is ~0.3 ms of a ~11 ms step)
            tokens = torch.randint(100, min(vocab, 30000), (batch, NEW + 3), generator=torch.Generator().manual_seed(1))
            if batch == 1:  # the roofline's bandwidth, read on either side of the steps it divides
                result["peak_rss_mb"] = peak_rss_mb()
                probe = torch.ones(int(weights + attended_kv_bytes(m, cache, PROMPT + 3 + NEW / 2)) // 4)
                result["read_bandwidths"] = [read_bandwidth(probe)]
            for i in range(3):
                m(tokens[:, i:i + 1], past_key_values=cache)  # warm-up at this batch size
            start = time.perf_counter()
            for i in range(3, NEW + 3):
                m(tokens[:, i:i + 1], past_key_values=cache)
            seconds = (time.perf_counter() - start) / NEW
            result["decode_tok_s"][str(batch)] = batch / seconds
            result["step_bytes"][str(batch)] = weights + attended_kv_bytes(m, cache, PROMPT + 3 + NEW / 2)
            if batch == 1:
                result["read_bandwidths"].append(read_bandwidth(probe))
                result["paired_steps"] = paired_steps(
                    lambda i: m(tokens[:, i:i + 1], past_key_values=cache), probe, result["step_bytes"]["1"])
    return result


def paired_steps(step, probe, step_bytes: float) -> list[list[float]]:
    """PAIRS more decode steps (``step(i)``: ``i`` from 0), each followed by one read of ``probe`` in the way that read
    it fastest: [step bytes/s, read bytes/s] a pair. The two of a pair lie ~0.1-1 s apart, so a neighbour's load on
    a shared VM (its read rate moved 24 -> 16 GB/s within an hour) weighs on both alike."""
    best = max(reads(probe), key=lambda read: probe.numel() * probe.element_size() / _timed(read))
    pairs = []
    for i in range(PAIRS):
        pairs.append([step_bytes / _timed(lambda: step(i)), probe.numel() * probe.element_size() / _timed(best)])
    return pairs


def read_bandwidth(src) -> float:
    """The rate at which this process's threads read ``src`` again and again, bytes/s: the best of torch's ``sum`` and
    ``max`` and of a plain C loop that prefetches 0-16 kB ahead (:func:`_prefetched_read`), 5 reads each. ``src``
    holds as many bytes as a decode step reads: where the last-level cache is large (a Xeon with 480 MB of L3) the
    rate depends on the size, 17.8 GB/s over 178 MB on 1 thread against 14.9 over 256 MB and 15.6 over 1 GB.
    ``sum`` alone reads ~15% slower than ``max`` on Zen 4 (45.6 against 54.0 GB/s, 2 threads, where kvgen's own
    Q8_0 lm_head product reached 54.6); on that Xeon both fall short of a prefetching loop (11.7 / 9.8 against
    14.0 GB/s over 256 MB, 1 thread; kvgen's products prefetch there)."""
    return max(src.numel() * src.element_size() / _timed(read) for read in reads(src) for _ in range(5))


def reads(src) -> list:
    """Ways to read all of ``src`` (a float32 tensor) on this process's threads: torch's ``sum`` and ``amax``, and
    :func:`_prefetched_read` 0, 8 and 16 kB ahead."""
    import torch

    summed = _prefetched_read()
    threads = torch.get_num_threads()
    return [src.sum, src.amax] + [lambda ahead=ahead: summed(src.data_ptr(), src.numel(), ahead, threads)
                                  for ahead in (0, 8192, 16384)]


def _prefetched_read():
    """``float sum(const float* p, long n, long ahead, int threads)``: OpenMP threads each summing their share of
    ``p``, 4 cache lines at a time, prefetching ``ahead`` bytes on (built with the system's g++ into the
    benchmark's cache on first use)."""
    import ctypes

    library = CACHE / "prefetched_read_4.so"
    if not library.exists():
        source = CACHE / "prefetched_read.cpp"
        CACHE.mkdir(parents=True, exist_ok=True)
        source.write_text("""
#include <omp.h>
typedef float v16 __attribute__((vector_size(64)));
extern "C" float sum(const float* p, long n, long ahead, int threads) {
  float total = 0;
  #pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const long lines = n / 16, per = (lines + omp_get_num_threads() - 1) / omp_get_num_threads();
    const long begin = per * omp_get_thread_num(), end = begin + per < lines ? begin + per : lines;
    v16 a = {}, b = {}, c = {}, d = {};
    for (long i = begin; i + 3 < end; i += 4) {
      for (int l = 0; ahead && l < 4; ++l) __builtin_prefetch((const char*)(p + 16 * i) + ahead + 64 * l, 0, 3);
      a += *(const v16*)(p + 16 * i);
      b += *(const v16*)(p + 16 * i + 16);
      c += *(const v16*)(p + 16 * i + 32);
      d += *(const v16*)(p + 16 * i + 48);
    }
    for (int j = 0; j < 16; ++j) total += a[j] + b[j] + c[j] + d[j];
  }
  return total;
}
""")
        subprocess.run(["g++", "-O2", "-march=native", "-fopenmp", "-shared", "-fPIC", str(source), "-o",
                        str(library)], check=True)
    function = ctypes.CDLL(str(library)).sum
    function.restype, function.argtypes = ctypes.c_float, [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_int]
    return function


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def model_path(name: str) -> Path:
    """The GGUF of a model name: ``smollm2``, ``gemma3`` (packaged), ``coder`` (Qwen2.5-Coder-0.5B-Instruct) or a
    random-weight ``<shape>:<format>`` file (model_files.py), built on first use."""
    from model_files import coder_file, model_file

    if name in ("smollm2", "gemma3"):
        from kvgen.loading.default_model import default_gguf_path, gemma3_gguf_path

        return default_gguf_path() if name == "smollm2" else gemma3_gguf_path()
    return coder_file() if name == "coder" else model_file(name)


def chart(results: dict, path: Path) -> None:
    """kvgen's decode and prefill rates over llama.cpp's against the models' sizes, a line per thread count and
    format (the part of a model's name after ``:``; a named model on its own)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = results["rows"]
    for ax, key, title in ((axes[0], "decode_ratio", "decode, batch 1"), (axes[1], "prefill_ratio", "prefill 512")):
        def line(r):  # (threads, format), a named model on its own
            return r["threads"], r["model"].partition(":")[2] or r["model"]

        for threads, kind in sorted({line(r) for r in rows}):
            mine = sorted((r for r in rows if line(r) == (threads, kind)), key=lambda r: r["parameters"])
            ax.plot([r["parameters"] / 1e9 for r in mine], [r[key] for r in mine], "o-" if threads == 1 else "s--",
                    label=f"{kind}, {threads} thread(s)")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("parameters (billions)")
        ax.set_ylabel("kvgen / llama.cpp (tok/s)")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle(f"kvgen against llama-bench on the same GGUF files, {results['cpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    global REPS
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="smollm2,gemma3")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--name", default="vs_llamacpp", help="the results' file name (json and png)")
    parser.add_argument("--reps", type=int, default=REPS)
    parser.add_argument("--baseline", help="a kvgen source tree (its src folder) to run beside this one")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="join the rows of earlier runs into --name")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "THREADS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    REPS = args.reps
    if args.worker:
        print(json.dumps(kvgen_worker(args.worker[0], int(args.worker[1]))))
        return
    if args.merge:
        runs = [json.loads(Path(path).read_text()) for path in args.merge]
        return write(args, {"cpu": runs[0]["cpu"], "lscpu_flags": runs[0].get("lscpu_flags"),
                            "load_average": [run["load_average"] for run in runs], "merged": args.merge,
                            "rows": [row for run in runs for row in run["rows"]]})
    binary = llama_bench()
    sides = {"kvgen": None} | ({"baseline": args.baseline} if args.baseline else {})
    rows = []
    for name in args.models.split(","):
        path = model_path(name)
        for threads in map(int, args.threads.split(",")):
            runs = {side: [] for side in [*sides, "llamacpp"]}
            for _ in range(args.rounds):  # alternating, fresh processes
                for side, source in sides.items():
                    runs[side].append(kvgen_run(path, threads, source))
                runs["llamacpp"].append(llamacpp(binary, path, threads))
            row = {"model": name, "file": path.name, "threads": threads, "reps": REPS,
                   **{side: _median(r) for side, r in runs.items()}, "rounds": runs}
            row["parameters"], row["file_bytes"] = row["llamacpp"]["parameters"], row["llamacpp"]["file_bytes"]
            row["decode_ratio"] = row["kvgen"]["decode_tok_s"]["1"] / row["llamacpp"]["decode_tok_s"]["1"]
            row["prefill_ratio"] = row["kvgen"]["prefill_tok_s"] / row["llamacpp"]["prefill_tok_s"]
            if args.baseline:
                new, old = row["kvgen"], row["baseline"]
                row["baseline_ratio"] = {"decode_tok_s": new["decode_tok_s"]["1"] / old["decode_tok_s"]["1"],
                                         "prefill_tok_s": new["prefill_tok_s"] / old["prefill_tok_s"]}
            rows.append(row)
            k, ll = row["kvgen"], row["llamacpp"]
            print(f"{name} t={threads}: decode {k['decode_tok_s']['1']:.1f} vs {ll['decode_tok_s']['1']:.1f} tok/s "
                  f"({row['decode_ratio']:.2f}x, {k['roofline']['1']:.0%} of roofline, "
                  f"{k['paired_roofline']:.0%} paired), batch 4 "
                  f"{k['decode_tok_s']['4']:.1f}; prefill {k['prefill_tok_s']:.1f} vs {ll['prefill_tok_s']:.1f} tok/s "
                  f"({row['prefill_ratio']:.2f}x); peak RSS {k['peak_rss_mb']:.0f} vs {ll['peak_rss_mb']:.0f} MB; "
                  f"load {k['load_s']:.2f} vs {ll['load_s']:.2f} s"
                  + (f"; against the baseline: decode {row['baseline_ratio']['decode_tok_s']:.3f}x, prefill "
                     f"{row['baseline_ratio']['prefill_tok_s']:.3f}x" if args.baseline else ""), flush=True)
            # after every row: a long run stopped early keeps what it measured
            write(args, {"cpu": _cpu(), "lscpu_flags": _cpu_flags(), "load_average": os.getloadavg(), "rows": rows})


def write(args, results: dict) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(results, indent=1) + "\n")
    chart(results, out / f"{args.name}.png")


def kvgen_run(path: Path, threads: int, source: str | None) -> dict:
    """One kvgen worker in a fresh process (the kvgen of ``source``, a src folder, where given), with its roofline."""
    env = os.environ | {"PYTHONPATH": source} if source else None
    out, _, _ = run_measured([sys.executable, __file__, "--reps", str(REPS), "--worker", str(path), str(threads)], env)
    run = json.loads(out)
    # the higher of the bandwidths read just before and just after the batch-1 steps: the roofline is
    # not flattered by a dip (read in processes of their own until 2026-11-27: seconds from the steps)
    run["read_bandwidth"] = max(run["read_bandwidths"])
    run["roofline"] = {batch: run["step_bytes"][batch] * run["decode_tok_s"][batch] / int(batch)
                       / run["read_bandwidth"] for batch in run["step_bytes"]}
    # each step over the read next to it (the median of PAIRS): both under the same neighbours' load
    run["paired_roofline"] = statistics.median(step / read for step, read in run.pop("paired_steps"))
    return run


def _median(runs: list[dict]) -> dict:
    """Per-key median over rounds (nested dicts of numbers)."""
    first = runs[0]
    out = {}
    for key, value in first.items():
        if isinstance(value, dict):
            out[key] = _median([r[key] for r in runs])
        elif isinstance(value, (int, float)):
            out[key] = statistics.median(r[key] for r in runs)
        else:
            out[key] = value
    return out


def _cpu_flags() -> str:
    """The vector extensions lscpu lists (what a speed claim holds on)."""
    flags = _lscpu_field("Flags", "").split()
    return " ".join(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))


def _cpu() -> str:
    return _lscpu_field("Model name", platform.processor())


def _lscpu_field(name: str, default: str) -> str:
    """A field of ``lscpu``'s output, or ``default`` where there is none."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return default
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith(name)), default)


if __name__ == "__main__":
    main()
