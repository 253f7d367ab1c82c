"""kvgen against llama.cpp's own ``llama-bench`` on the same GGUF files and thread counts.

llama.cpp is built once from the source that PyPI's ``llama-cpp-python`` sdist vendors
(``pip download --no-deps --no-binary :all: llama-cpp-python``), with cmake, into
``~/.cache/kvgen-bench/llamacpp`` (about 15 minutes on 2 cores; only the ``llama-bench``
target). It is a benchmark tool, never a kvgen dependency. It is built for this CPU (``GGML_NATIVE``)
without AMX: that version's AMX matrix product crashes on a Xeon with AMX (an invalid tile
configuration: SIGILL or SIGSEGV at its first tile instruction; llama.cpp PR 26954, open), so an x86 build
takes ``-mno-amx-tile -mno-amx-int8 -mno-amx-bf16`` (no change on CPUs without AMX).

For each model (SmolLM2-135M Q4_1, Gemma 3 270M Q4_K_M) and thread count (1, 2), kvgen and
llama-bench alternate in fresh processes, ``--rounds`` times:

* prefill: 512 prompt tokens (llama-bench ``-p 512 -n 0``), after one untimed prefill of as many, the mean
  rate of 3 repetitions on each side (llama-bench ``-r 3``);
* decode: 128 tokens after a 512-token prompt, batch 1 (llama-bench ``-p 0 -n 128 -d 512``);
  kvgen also at batch 4. Both feed random tokens and compute every step's logits without sampling
  (llama-bench's generation test draws its tokens with ``rand()``);
* peak RSS of each process (``wait4``).

kvgen's decode is also put against the roofline: the bytes one step reads (stored weights,
plus the keys and values attended to) over the rate at which the worker reads a buffer of as many
bytes, the best of torch's ``sum`` and ``amax`` and a prefetching C loop (:func:`read_bandwidth`),
read just before and just after its batch-1 steps (the higher of the two; the worker's peak RSS is
taken before the probe's buffer exists). Until 2026-11-27 the buffer was 256 MB and read by torch
alone: on a Xeon with 480 MB of L3 that understates the rate at a decode step's size. Writes
``benchmarks/results/vs_llamacpp.json`` and ``vs_llamacpp.png``.

    python benchmarks/vs_llamacpp.py                      # both models, 1 and 2 threads, 3 rounds
    python benchmarks/vs_llamacpp.py --models smollm2 --threads 2 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
CACHE = Path(os.environ.get("KVGEN_BENCH_CACHE", Path.home() / ".cache" / "kvgen-bench")) / "llamacpp"
PROMPT, NEW, BATCHES = 512, 128, (1, 4)
REPS = 3  # timed repetitions of each test, as llama-bench -r 3


def llama_bench() -> Path:
    """Path of ``llama-bench``, building it on first use."""
    return llama_cpp_tool("llama-bench")


def llama_cpp_tool(name: str) -> Path:
    """Path of llama.cpp's ``llama-bench`` or ``llama-server``, building both on first use (~15 minutes)."""
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
    print(f"building llama-bench and llama-server in {source} (about 15 minutes)", file=sys.stderr)
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" if platform.machine() in ("x86_64", "AMD64") else ""
    subprocess.run(["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
                    f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"], cwd=source, check=True)
    subprocess.run(["cmake", "--build", "build", "--target", "llama-bench", "llama-server",
                    "-j", str(os.cpu_count() or 1)], cwd=source, check=True)
    return source / "build" / "bin" / name


def run_measured(command: list[str]) -> tuple[str, float]:
    """(stdout, peak RSS in MB) of a command run to completion."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"{command[0]} failed with status {process.returncode}")
    return out, usage.ru_maxrss / 1024


def llamacpp(binary: Path, model: Path, threads: int) -> dict:
    prefill, rss_p = run_measured([str(binary), "-m", str(model), "-p", str(PROMPT), "-n", "0", "-t", str(threads),
                                   "-r", str(REPS), "-o", "json"])
    decode, rss_d = run_measured([str(binary), "-m", str(model), "-p", "0", "-n", str(NEW), "-d", str(PROMPT),
                                  "-t", str(threads), "-r", str(REPS), "-o", "json"])
    return {"prefill_tok_s": json.loads(prefill)[0]["avg_ts"], "decode_tok_s": {"1": json.loads(decode)[0]["avg_ts"]},
            "peak_rss_mb": max(rss_p, rss_d)}


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

    m = AutoModelForCausalLM.from_pretrained(model)
    vocab = m.config.vocab_size
    ids = torch.randint(100, min(vocab, 30000), (1, PROMPT), generator=torch.Generator().manual_seed(0))
    result = {"weight_format": m.weight_format, "decode_tok_s": {}, "step_bytes": {}}
    weights = sum(b.numel() * b.element_size() for b in m.buffers() if b.dtype == torch.uint8) + \
        sum(p.numel() * p.element_size() for p in m.parameters())  # bytes a decode step streams
    with torch.no_grad():
        # as llama-bench: one untimed prefill of the whole prompt (compiled blocks, scratch buffers, page faults),
        # then REPS timed ones, each into a fresh cache, reported as the mean of their rates (its avg_ts)
        m(ids, past_key_values=DynamicCache(), logits_to_keep=1)
        rates = [PROMPT / _timed(lambda: m(ids, past_key_values=DynamicCache(), logits_to_keep=1)) for _ in range(REPS)]
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
            if batch == 1:
                result["read_bandwidths"].append(read_bandwidth(probe))
            result["decode_tok_s"][str(batch)] = batch / seconds
            result["step_bytes"][str(batch)] = weights + attended_kv_bytes(m, cache, PROMPT + 3 + NEW / 2)
    return result


def read_bandwidth(src) -> float:
    """The rate at which this process's threads read ``src`` again and again, bytes/s: the best of torch's ``sum`` and
    ``max`` and of a plain C loop that prefetches 0-16 kB ahead (:func:`_prefetched_read`), 5 reads each. ``src``
    holds as many bytes as a decode step reads: where the last-level cache is large (a Xeon with 480 MB of L3) the
    rate depends on the size, 17.8 GB/s over 178 MB on 1 thread against 14.9 over 256 MB and 15.6 over 1 GB.
    ``sum`` alone reads ~15% slower than ``max`` on Zen 4 (45.6 against 54.0 GB/s, 2 threads, where kvgen's own
    Q8_0 lm_head product reached 54.6); on that Xeon both fall short of a prefetching loop (11.7 / 9.8 against
    14.0 GB/s over 256 MB, 1 thread; kvgen's products prefetch there)."""
    import torch

    reads = [src.sum, src.amax]
    summed = _prefetched_read()
    for ahead in (0, 8192, 16384):
        reads.append(lambda ahead=ahead: summed(src.data_ptr(), src.numel(), ahead, torch.get_num_threads()))
    return max(src.numel() * src.element_size() / _timed(read) for read in reads for _ in range(5))


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


def models() -> dict[str, Path]:
    from kvgen.loading.default_model import default_gguf_path, gemma3_gguf_path

    return {"smollm2": default_gguf_path(), "gemma3": gemma3_gguf_path()}


def chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    rows = results["rows"]
    labels = [f"{r['model']}\n{r['threads']} thr" for r in rows]
    x = range(len(rows))
    for ax, key, title in ((axes[0], "decode", "decode, batch 1 (tok/s)"), (axes[1], "prefill", "prefill 512 (tok/s)")):
        ours = [r["kvgen"][f"{key}_tok_s"]["1"] if key == "decode" else r["kvgen"]["prefill_tok_s"] for r in rows]
        theirs = [r["llamacpp"][f"{key}_tok_s"]["1"] if key == "decode" else r["llamacpp"]["prefill_tok_s"]
                  for r in rows]
        ax.bar([i - 0.2 for i in x], ours, 0.4, label="kvgen")
        ax.bar([i + 0.2 for i in x], theirs, 0.4, label="llama.cpp (llama-bench)")
        ax.set_xticks(list(x), labels)
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"same GGUF files, {results['cpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="smollm2,gemma3")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "THREADS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(kvgen_worker(args.worker[0], int(args.worker[1]))))
        return
    binary = llama_bench()
    paths = models()
    rows = []
    for name in args.models.split(","):
        for threads in map(int, args.threads.split(",")):
            ours, theirs = [], []
            for _ in range(args.rounds):  # alternating, fresh processes
                out, _ = run_measured([sys.executable, __file__, "--worker", str(paths[name]), str(threads)])
                run = json.loads(out)
                # the higher of the bandwidths read just before and just after the batch-1 steps: the roofline is
                # not flattered by a dip (read in processes of their own until 2026-11-27: seconds from the steps)
                run["read_bandwidth"] = max(run["read_bandwidths"])
                run["roofline"] = {batch: run["step_bytes"][batch] * run["decode_tok_s"][batch] / int(batch)
                                   / run["read_bandwidth"] for batch in run["step_bytes"]}
                ours.append(run)
                theirs.append(llamacpp(binary, paths[name], threads))
            row = {"model": name, "file": paths[name].name, "threads": threads,
                   "kvgen": _median(ours), "llamacpp": _median(theirs), "rounds": {"kvgen": ours, "llamacpp": theirs}}
            row["decode_ratio"] = row["kvgen"]["decode_tok_s"]["1"] / row["llamacpp"]["decode_tok_s"]["1"]
            row["prefill_ratio"] = row["kvgen"]["prefill_tok_s"] / row["llamacpp"]["prefill_tok_s"]
            rows.append(row)
            print(f"{name} t={threads}: decode {row['kvgen']['decode_tok_s']['1']:.1f} vs "
                  f"{row['llamacpp']['decode_tok_s']['1']:.1f} tok/s ({row['decode_ratio']:.2f}x, "
                  f"{row['kvgen']['roofline']['1']:.0%} of roofline), batch 4 {row['kvgen']['decode_tok_s']['4']:.1f}; "
                  f"prefill {row['kvgen']['prefill_tok_s']:.0f} vs {row['llamacpp']['prefill_tok_s']:.0f} tok/s "
                  f"({row['prefill_ratio']:.2f}x); peak RSS {row['kvgen']['peak_rss_mb']:.0f} vs "
                  f"{row['llamacpp']['peak_rss_mb']:.0f} MB", flush=True)
    results = {"cpu": _cpu(), "load_average": os.getloadavg(), "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vs_llamacpp.json").write_text(json.dumps(results, indent=1) + "\n")
    chart(results, out / "vs_llamacpp.png")


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


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    main()
