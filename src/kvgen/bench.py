"""``kvgen bench``: kvgen and transformers side by side on the same weights and thread count.

Each measurement runs in a fresh worker process (so peak RSS belongs to that one
configuration), kvgen and transformers alternating so drift on this shared machine hits
both alike. Before each measurement the other processes' CPU use is sampled; with 2 torch
threads, any other busy process slows torch many times over, so a warning is printed when
it is high. The roofline is the memory traffic of one decode step (weights plus the KV
slots attention reads) divided by a copy bandwidth measured in the same run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvgen.generation.streamers import TokenTimer

BUSY_WARNING = 0.15  # cores' worth of other processes' CPU use that makes timings unreliable


def other_cpu_use(seconds: float = 0.5) -> float:
    """Cores kept busy by other processes over ``seconds`` (this process is asleep meanwhile)."""
    def sample():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    busy = 1 - (idle1 - idle0) / max(total1 - total0, 1)
    return busy * (os.cpu_count() or 1)


#: caches that take ``--cache-config`` (the others ignore it)
CONFIGURED_CACHES = ("quantized", "sink")
#: models whose decode traffic is not the Llama formula's: their roofline uses the weights kvgen
#: loaded and the cache bytes measured (Mamba states, Jamba's hybrid layers, Whisper's two halves)
SPECIAL_MODEL_TYPES = ("mamba", "jamba", "whisper")


def memory_bandwidth(threads: int, megabytes: int = 256) -> dict[str, float]:
    """Bytes per second of a large tensor copy (bytes copied; read + written) and of a sum (read), best of 5."""
    torch.set_num_threads(threads)
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)

    def best(fn):
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    copy_s, sum_s = best(lambda: dst.copy_(src)), best(src.sum)
    size = src.numel() * 4
    del src, dst
    return {"copy": size / copy_s, "copy_traffic": 2 * size / copy_s, "read": size / sum_s}


def decode_bytes_per_step(config: dict, batch: int, context: float, dtype_bytes: int = 4) -> tuple[int, int]:
    """(weight bytes, KV bytes) read by one decode step of a Llama-family model (``None, None`` for others)."""
    if "intermediate_size" not in config or "num_attention_heads" not in config or \
            config.get("model_type") in SPECIAL_MODEL_TYPES:
        return None, None
    h, i, n = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or h // heads
    per_layer = h * head_dim * (heads + 2 * kv_heads) + heads * head_dim * h + 3 * h * i + 2 * h
    weights = (n * per_layer + h + config["vocab_size"] * h) * dtype_bytes  # + final norm + lm_head
    kv = 2 * n * kv_heads * head_dim * context * batch * dtype_bytes
    return weights, int(kv)


def peak_rss_mb() -> float:
    """This process's peak resident memory (``VmHWM``; ``ru_maxrss`` would carry the parent's over exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("VmHWM not found in /proc/self/status")


def reset_peak_rss() -> None:
    """Reset ``VmHWM`` to the current resident size (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def cache_bytes(cache) -> int | None:
    """Bytes of a kvgen cache (``nbytes()``) or of a transformers cache (its layers' tensors)."""
    if cache is None:
        return None
    if hasattr(cache, "nbytes"):
        return cache.nbytes()
    halves = [getattr(cache, name) for name in ("self_attention_cache", "cross_attention_cache") if hasattr(cache, name)]
    layers = [layer for part in (halves or [cache]) for layer in getattr(part, "layers", [])]
    return sum(t.numel() * t.element_size() for layer in layers for t in vars(layer).values()
               if isinstance(t, torch.Tensor)) or None


# -- the worker (one configuration, one process) ------------------------------------------------------

def _weight_bytes(model) -> int:
    """Bytes of a model's distinct parameters (tied ones once)."""
    return sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in model.parameters()}.values())


def _speech_worker(spec: dict) -> dict:
    """Whisper: the encoder runs once on a 30 s clip of noise, then ``new_tokens`` decoder steps."""
    from kvgen.audio import WhisperFeatureExtractor

    impl, cache_name, batch, new = spec["impl"], spec["cache"], spec["batch"], spec["new_tokens"]
    audio = torch.randn(batch, 16000 * 30, generator=torch.Generator().manual_seed(0)) * 0.1
    features = WhisperFeatureExtractor()(list(audio), sampling_rate=16000).input_features  # (B, 80, 3000)
    start = time.perf_counter()
    if impl == "kvgen":
        import kvgen

        model = kvgen.AutoModelForSpeechSeq2Seq.from_pretrained(spec["model"], dtype=torch.float32)
    else:
        import transformers

        from kvgen.loading.ctranslate2 import is_ctranslate2_dir, load_ctranslate2_whisper

        if is_ctranslate2_dir(spec["model"]):  # transformers cannot read it: the same weights, converted
            config, state_dict, _ = load_ctranslate2_whisper(spec["model"])
            model = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**config))
            model.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=False)
        else:
            model = transformers.WhisperForConditionalGeneration.from_pretrained(spec["model"], dtype=torch.float32)
        model = model.float().eval()
    load_s = time.perf_counter() - start

    def run(n):
        clock = TokenTimer()
        kwargs = {} if cache_name == "dynamic" else {"cache_implementation": cache_name}
        with torch.no_grad():
            out = model.generate(features, max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=clock,
                                 return_dict_in_generate=True, **kwargs)
        return clock, out.past_key_values

    run(new)  # warm-up with the measured shapes (a static cache's size depends on them)
    return _timed(spec, lambda: run(new), load_s, _weight_bytes(model))


def _worker(spec: dict) -> dict:
    torch.set_num_threads(spec["threads"])
    config = json.loads((Path(spec["model"]) / "config.json").read_text())
    if config.get("model_type") == "whisper" or (Path(spec["model"]) / "model.bin").is_file():
        return _speech_worker(spec)
    impl, cache_name = spec["impl"], spec["cache"]
    batch, prompt, new = spec["batch"], spec["prompt"], spec["new_tokens"]
    vocab = config["vocab_size"]  # small test models too
    ids = torch.randint(10, min(40000, vocab), (batch, prompt), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if impl == "kvgen":
        import kvgen
        from kvgen.cache import create_cache

        start = time.perf_counter()
        model = kvgen.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
        load_s = time.perf_counter() - start

        def make_cache(max_len):
            return create_cache(cache_name, config=model.config, batch_size=batch, max_cache_len=max_len,
                                device="cpu", dtype=torch.float32, cache_config=spec.get("cache_config"))
        extra = {}
    else:
        import transformers

        start = time.perf_counter()
        model = transformers.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
        load_s = time.perf_counter() - start
        extra, make_cache = {}, None
        if cache_name == "static":
            # transformers compiles on CPU only behind this private flag; its cache is built with
            # the measured run's size for the warm-up too, so the warm-up compiles the same graph
            compile_config = transformers.CompileConfig()
            compile_config._compile_all_devices = True
            extra["compile_config"] = compile_config

            def make_cache(max_len):
                return transformers.StaticCache(config=model.config, max_cache_len=max_len)
        elif cache_name != "dynamic":
            extra["cache_implementation"] = cache_name
            if spec.get("hf_cache_config"):
                extra["cache_config"] = spec["hf_cache_config"]

    def run(p, n):
        clock = TokenTimer()
        kwargs = dict(extra)
        if make_cache is not None:
            kwargs["past_key_values"] = make_cache(prompt + new)
        with torch.no_grad():
            out = model.generate(ids[:, :p], attention_mask=mask[:, :p], max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, streamer=clock, pad_token_id=0, return_dict_in_generate=True,
                                 **kwargs)
        return clock, out.past_key_values

    run(8, 4)  # warm-up: compiles the static decode step for these shapes
    return _timed(spec, lambda: run(prompt, new), load_s, _weight_bytes(model))


def _timed(spec: dict, run, load_s: float, weight_bytes: int) -> dict:
    """Measure ``run()`` (-> streamer clock, cache) after the warm-up, with bandwidth and peak memory."""
    peak_before = peak_rss_mb()  # loading and warm-up
    bandwidth = memory_bandwidth(spec["threads"])  # the host drifts: measure right next to the decode
    reset_peak_rss()  # forget the bandwidth probe's buffers
    clock, cache = run()
    decode_seconds = clock.stamps[-1] - clock.stamps[1]
    return {
        "bandwidth_bytes_s": bandwidth,
        "load_s": load_s,
        "prefill_s": clock.stamps[1] - clock.start,
        "decode_tok_s": spec["batch"] * (len(clock.stamps) - 2) / decode_seconds,
        "peak_rss_mb": max(peak_before, peak_rss_mb()),
        "cache_bytes": cache_bytes(cache),
        "weight_bytes": weight_bytes,
    }


def _measure(spec: dict) -> dict:
    out = subprocess.run([sys.executable, "-m", "kvgen.bench", json.dumps(spec)], capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- the driver ---------------------------------------------------------------------------------------------

def run_bench(args) -> int:
    from kvgen.loading.default_model import default_model_dir

    model_dir = args.model or str(default_model_dir())
    config = json.loads((Path(model_dir) / "config.json").read_text())
    print(f"roofline = copy bandwidth (bytes copied per second by a 256 MB tensor copy, {args.threads} threads, "
          "measured in each worker right before its decode) / bytes of weights and KV read per decode step")
    rows = []
    header = (f"{'impl':12s} {'cache':16s} {'prompt':>6s} {'batch':>5s} {'prefill_s':>9s} {'decode_tok/s':>12s} "
              f"{'roofline':>8s} {'of_roof':>7s} {'rss_MB':>7s} {'cache_MB':>8s} {'GB/s':>5s} {'busy':>5s}")
    print(header)
    for cache_name in args.caches.split(","):
        for prompt in map(int, args.prompts.split(",")):
            for batch in map(int, args.batches.split(",")):
                for impl in args.implementations.split(","):
                    spec = {"impl": impl, "cache": cache_name, "prompt": prompt, "batch": batch,
                            "new_tokens": args.new_tokens, "threads": args.threads, "model": model_dir}
                    if cache_name in CONFIGURED_CACHES:
                        spec["cache_config"] = args.cache_config
                        spec["hf_cache_config"] = args.hf_cache_config or args.cache_config
                    busy = other_cpu_use()
                    result = _measure(spec)
                    context = prompt + args.new_tokens if cache_name == "static" else prompt + args.new_tokens / 2
                    weights, kv = decode_bytes_per_step(config, batch, context)
                    if weights is None:  # not a Llama-family model: what was loaded and what the cache holds
                        weights = result.get("weight_bytes") or float("nan")
                    if (cache_name == "quantized" or kv is None) and result.get("cache_bytes"):  # measured
                        kv = result["cache_bytes"] * context / (prompt + args.new_tokens)
                    kv = kv or 0
                    bandwidth = result.get("bandwidth_bytes_s", {}).get("copy", float("nan"))
                    roofline = batch * bandwidth / (weights + kv)
                    row = {**spec, **result, "other_cpu_cores_busy": round(busy, 3), "roofline_tok_s": roofline,
                           "decode_bytes_per_step": weights + kv}
                    rows.append(row)
                    if "error" in result:
                        print(f"{impl:12s} {cache_name:16s} {prompt:6d} {batch:5d}  error: {result['error']}")
                        continue
                    cache_mb = "-" if result["cache_bytes"] is None else f"{result['cache_bytes'] / 2**20:.1f}"
                    print(f"{impl:12s} {cache_name:16s} {prompt:6d} {batch:5d} {result['prefill_s']:9.2f} "
                          f"{result['decode_tok_s']:12.2f} {roofline:8.2f} {result['decode_tok_s'] / roofline:7.0%} "
                          f"{result['peak_rss_mb']:7.0f} {cache_mb:>8s} {bandwidth / 1e9:5.1f} {busy:5.2f}", flush=True)
                    if busy > BUSY_WARNING:
                        print(f"  warning: other processes kept {busy:.2f} cores busy; timings are unreliable")
    _print_summary(rows)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"threads": args.threads,
                                  "torch": torch.__version__, "rows": rows}, indent=1))
    print(f"wrote {output}")
    try:
        chart(rows, output.with_suffix(".png"))
        print(f"wrote {output.with_suffix('.png')}")
    except ImportError:
        print("no chart: matplotlib is missing (pip install 'kvgen[bench]')")
    return 0


def chart(rows: list[dict], path: Path) -> None:
    """Decode tok/s of each configuration, one bar per implementation (matplotlib, the ``kvgen[bench]`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "error" not in r]
    keys = list(dict.fromkeys((r["cache"], r["prompt"], r["batch"]) for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    speed = {(r["impl"], r["cache"], r["prompt"], r["batch"]): r["decode_tok_s"] for r in rows}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(keys)), 4))
    width = 0.8 / max(len(impls), 1)
    for i, impl in enumerate(impls):
        ax.bar([k + i * width for k in range(len(keys))], [speed.get((impl, *key), 0) for key in keys], width,
               label=impl)
    ax.set_xticks([k + width * (len(impls) - 1) / 2 for k in range(len(keys))],
                  [f"{c}\nprompt {p}\nbatch {b}" for c, p, b in keys], fontsize=8)
    ax.set_ylabel("decode tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _print_summary(rows: list[dict]) -> None:
    """kvgen/transformers ratios, and roofline fractions against the median bandwidth of all workers
    (steadier than one worker's probe on a drifting host)."""
    rows = [r for r in rows if "error" not in r]
    if not rows:
        return
    by_key = {(r["impl"], r["cache"], r["prompt"], r["batch"]): r for r in rows}
    print("\nkvgen / transformers decode speed:")
    for (impl, cache, prompt, batch), row in by_key.items():
        ref = by_key.get(("transformers", cache, prompt, batch))
        if impl == "kvgen" and ref:
            print(f"  {cache:16s} prompt {prompt:5d} batch {batch}: {row['decode_tok_s'] / ref['decode_tok_s']:.2f}x "
                  f"(prefill {ref['prefill_s'] / row['prefill_s']:.2f}x faster)")
    median = statistics.median(r["bandwidth_bytes_s"]["copy"] for r in rows)
    print(f"\nof the roofline at the median copy bandwidth of all workers ({median / 1e9:.1f} GB/s):")
    for (impl, cache, prompt, batch), row in by_key.items():
        roofline = batch * median / row["decode_bytes_per_step"]
        row["roofline_median_tok_s"] = roofline
        print(f"  {impl:12s} {cache:16s} prompt {prompt:5d} batch {batch}: {row['decode_tok_s'] / roofline:4.0%}")


if __name__ == "__main__":
    print(json.dumps(_worker(json.loads(sys.argv[1]))))
