"""Soak: ``kvgen serve`` under a long mixed load, with nothing lost.

64 clients (threads of the official ``openai`` client, and raw HTTP for malformed bodies) send,
until the time is up, a random mix of:

* greedy completions of fixed prompts (token ids), each checked token by token against
  ``generate()`` on that prompt alone in this process (logprobs give the server's tokens);
* sampled, streamed (chat) and ``n=3`` requests, checked for their shape and token counts;
* structured outputs (a JSON schema), whose finished replies must parse and validate;
* streams cancelled after two chunks;
* malformed JSON, out-of-range fields and prompts past the context (each must be a 400);

and a burst thread fires twice ``--max-queue`` requests at once every 30 s (some must get 429;
the clients wait for Retry-After after a 429, as clients do).
Redis (``redis-server``, the prefix store of ``--kv-store``, tried again 2 s after a failure) is
killed at 40% of the run and started again once the server has found it gone (at 55% of the run at the
earliest, 80% at the latest): no request may fail for it, and the store must be written to again after.

Reported (and the exit status is 1 when one fails): requests by kind and outcome; 5xx (must be
0); wrong answers (must be 0); the server's peak RSS (``VmRSS`` sampled every second) over the
second half of the run against the first (within 5%, checked on runs of 2 minutes or more);
KV blocks in use once the load drained (must be 0); the Redis outage's effect.

    python benchmarks/soak.py                              # 10 minutes, 64 clients (~11 minutes)
    python benchmarks/soak.py --minutes 0.5 --clients 16 --max-queue 8 --burst-every 10 --out /tmp/soak.json
                                                           # the test suite's short run

Writes ``benchmarks/results/soak.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import openai

KINDS = {"greedy": 30, "sampled": 10, "stream": 10, "n": 5, "structured": 8, "cancel": 10, "malformed": 5,
         "out_of_range": 7, "too_long": 5}
WORDS = ("the river ran under old stone bridges while a small boat carried bread and letters to the town "
         "where children learned to read by candle light and sing about the sea").split()
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
OUT_OF_RANGE = ({"temperature": 5.0}, {"max_tokens": -1}, {"top_p": 2.0}, {"n": 0}, {"logprobs": 99},
                {"presence_penalty": 9.0})
GREEDY_TOKENS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not come up within {timeout:g} s")


class Redis:
    """``redis-server`` on a loopback port, without persistence, that can be killed and started again."""

    def __init__(self):
        self.port, self.process = free_port(), None
        self.start()

    def start(self) -> None:
        self.process = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                                         "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
        wait_for(lambda: socket.create_connection(("127.0.0.1", self.port), timeout=1).close() or True, "redis-server")

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


class Server:
    """``kvgen serve`` in its own process; its log goes to a temporary file."""

    def __init__(self, model: str, threads: int, max_queue: int, kv_store: str | None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "kvgen.cli", "serve", "-m", model, "--served-model-name", "soak",
                   "--port", str(self.port), "-t", str(threads), "--max-num-seqs", "16", "--max-queue",
                   str(max_queue), "--kv-cache-memory", "128MB"]
        if kv_store:
            command += ["--kv-store", kv_store, "--kv-store-retry", "2"]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvgen-soak-", suffix=".log", delete=False)
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        wait_for(lambda: urllib.request.urlopen(f"{self.url}/health", timeout=1).status == 200, "kvgen serve")

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"{self.url}/metrics", timeout=10).read().decode()
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line and not line.startswith("#") and "{" not in line}

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def references(model: str, count: int) -> tuple[list[tuple[list[int], list[str]]], int]:
    """(prompt ids, the per-token texts of ``generate()``'s greedy continuation) for ``count`` prompts, and the
    model's context length."""
    import torch

    import kvgen
    from kvgen.cli import serving_kv_dtype

    rng = random.Random(0)
    lm, tokenizer = kvgen.AutoModelForCausalLM.from_pretrained(model), kvgen.AutoTokenizer.from_pretrained(model)
    kv = {"dtype": serving_kv_dtype(lm)}  # the server's KV precision: its tokens are generate()'s with it
    out = []
    for _ in range(count):
        ids = tokenizer(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))).capitalize())["input_ids"]
        new = lm.generate(torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False, eos_token_id=None,
                          cache_implementation="static", cache_config=kv)[0, len(ids):].tolist()
        out.append((ids, [tokenizer.decode([t]) for t in new]))
    return out, lm.config.max_position_embeddings


class Soak:
    def __init__(self, server: Server, refs, context: int, seconds: float, clients: int, max_queue: int,
                 burst_every: float, kinds: dict[str, int]):
        self.server, self.refs, self.context, self.max_queue = server, refs, context, max_queue
        self.burst_every, self.kinds = burst_every, kinds
        self.deadline = time.monotonic() + seconds
        self.outcomes: collections.Counter = collections.Counter()
        self.failures: list[str] = []  # 5xx, connection errors and wrong answers, described
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(clients)]
        self.threads.append(threading.Thread(target=self.bursts, daemon=True))

    def record(self, kind: str, outcome: str, failure: str | None = None) -> None:
        with self.lock:
            self.outcomes[(kind, outcome)] += 1
            if failure is not None:
                self.failures.append(f"{kind}: {failure}")

    def openai_client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.server.url}/v1", api_key="none", max_retries=0, timeout=300)

    def client(self, index: int) -> None:
        rng, api = random.Random(index), self.openai_client()
        kinds, weights = list(self.kinds), list(self.kinds.values())
        while time.monotonic() < self.deadline:
            kind = rng.choices(kinds, weights)[0]
            try:
                outcome, failure = getattr(self, kind)(api, rng)
            except openai.APIStatusError as e:  # a full queue (429) is the only refusal a valid request may get
                outcome = str(e.status_code)
                failure = None if e.status_code == 429 else f"HTTP {e.status_code}: {e.message}"
                if e.status_code == 429:  # as clients do: wait Retry-After (at most 2 s) before the next request
                    time.sleep(min(2.0, float(e.response.headers.get("retry-after", 1))))
            except (openai.APIConnectionError, OSError) as e:
                outcome, failure = "connection error", f"{type(e).__name__}: {e}"
            self.record(kind, outcome, failure)

    # -- the kinds of request: each returns (outcome, failure or None) --------------------------------------
    def greedy(self, api, rng):
        ids, expected = rng.choice(self.refs)
        out = api.completions.create(model="soak", prompt=ids, max_tokens=GREEDY_TOKENS, temperature=0, logprobs=1)
        got = out.choices[0].logprobs.tokens
        return ("ok", None) if got == expected else ("wrong", f"tokens {got} != generate()'s {expected}")

    def sampled(self, api, rng):
        limit = rng.randint(4, 32)
        out = api.completions.create(model="soak", prompt=self.words(rng), max_tokens=limit, temperature=0.9,
                                     top_p=0.95, seed=rng.randint(0, 2**31))
        ok = 1 <= out.usage.completion_tokens <= limit and out.choices[0].finish_reason in ("length", "stop")
        return ("ok", None) if ok else ("wrong", f"{out.usage.completion_tokens} tokens of {limit}")

    def stream(self, api, rng):
        chunks = api.chat.completions.create(model="soak", messages=[{"role": "user", "content": self.words(rng)}],
                                             max_tokens=24, temperature=0.7, stream=True)
        finish = None
        for chunk in chunks:
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
        return ("ok", None) if finish in ("length", "stop") else ("wrong", f"finish_reason {finish}")

    def n(self, api, rng):
        out = api.completions.create(model="soak", prompt=self.words(rng), max_tokens=8, n=3, temperature=1.0)
        indices = sorted(c.index for c in out.choices)
        return ("ok", None) if indices == [0, 1, 2] else ("wrong", f"choices {indices}")

    def structured(self, api, rng):
        import jsonschema

        out = api.chat.completions.create(
            model="soak", messages=[{"role": "user", "content": f"A person called {rng.choice(WORDS)} as JSON."}],
            max_tokens=48, temperature=0.8, response_format={"type": "json_schema", "json_schema": {
                "name": "person", "schema": PERSON, "strict": True}})
        choice = out.choices[0]
        if choice.finish_reason != "stop":
            return "cut at max_tokens", None
        try:
            jsonschema.validate(json.loads(choice.message.content), PERSON)
        except (ValueError, jsonschema.ValidationError) as e:
            return "wrong", f"{choice.message.content!r} is not a valid person ({e})"
        return "ok", None

    def cancel(self, api, rng):
        chunks = api.completions.create(model="soak", prompt=self.words(rng), max_tokens=200, temperature=0.8,
                                        stream=True)
        for i, _ in enumerate(chunks):
            if i == 1:
                break
        chunks.close()
        return "cancelled", None

    def malformed(self, api, rng):
        body = rng.choice([b'{"model": "soak", "prompt": ', b"not json", b'{"model": "soak", "prompt": [1, 2,]}',
                           b"\xff\xfe"])
        return self.expect_400("POST", "/v1/completions", body)

    def out_of_range(self, api, rng):
        body = {"model": "soak", "prompt": self.words(rng), "max_tokens": 4, **rng.choice(OUT_OF_RANGE)}
        return self.expect_400("POST", "/v1/completions", json.dumps(body).encode())

    def too_long(self, api, rng):
        body = {"model": "soak", "prompt": [rng.randint(10, 1000) for _ in range(self.context + 8)], "max_tokens": 4}
        return self.expect_400("POST", "/v1/completions", json.dumps(body).encode())

    def expect_400(self, method: str, path: str, body: bytes):
        connection = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=60)
        try:
            connection.request(method, path, body, {"Content-Type": "application/json"})
            status = connection.getresponse().status
        finally:
            connection.close()
        if status in (400, 429):
            return str(status), None
        return str(status), f"HTTP {status} where 400 was due"

    def words(self, rng) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))).capitalize()

    def bursts(self) -> None:
        """Every ``burst_every`` s, twice --max-queue short requests at once: the overflow must be a 429."""
        api = self.openai_client()
        while time.monotonic() + self.burst_every < self.deadline:
            time.sleep(self.burst_every)
            results: list[str] = []

            def one(seed: int) -> None:
                try:
                    api.completions.create(model="soak", prompt=WORDS[seed % len(WORDS)], max_tokens=4, temperature=0)
                    results.append("200")
                except openai.APIStatusError as e:
                    results.append(str(e.status_code))
                except (openai.APIConnectionError, OSError) as e:
                    results.append(f"connection error: {e}")

            burst = [threading.Thread(target=one, args=(i,)) for i in range(2 * self.max_queue)]
            for t in burst:
                t.start()
            for t in burst:
                t.join()
            for outcome in results:
                failure = None if outcome in ("200", "429") else outcome
                self.record("burst", outcome, failure)

    def run(self) -> None:
        for t in self.threads:
            t.start()
        for t in self.threads:
            t.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="GGUF file or model folder (default: the packaged SmolLM2-135M GGUF)")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="the server's CPU threads")
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--burst-every", type=float, default=30.0, help="seconds between bursts past --max-queue")
    parser.add_argument("--no-redis", action="store_true", help="run without the Redis prefix store and its outage")
    parser.add_argument("--kinds", default=",".join(KINDS), help="the kinds of request to send, comma-separated")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "soak.json")
    args = parser.parse_args()
    if args.model is None:
        from kvgen.loading.default_model import default_gguf_path

        args.model = str(default_gguf_path())
    redis = None if args.no_redis or shutil.which("redis-server") is None else Redis()
    refs, context = references(args.model, 12)
    server = Server(args.model, args.threads, args.max_queue, redis and f"redis://127.0.0.1:{redis.port}/0")
    seconds = args.minutes * 60
    report: dict = {"model": Path(args.model).name, "minutes": args.minutes, "clients": args.clients,
                    "cpu": cpu_model(), "load_before": os.getloadavg()[0]}
    try:
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="none").completions.create(
            model="soak", prompt="Hi", max_tokens=2, timeout=600)  # builds the kernels on a fresh machine: untimed
        kinds = {kind: KINDS[kind] for kind in args.kinds.split(",")}
        soak = Soak(server, refs, context, seconds, args.clients, args.max_queue, args.burst_every, kinds)
        rss: list[tuple[float, float]] = []
        start = time.monotonic()
        events: dict = {}

        def watch() -> None:
            while time.monotonic() < soak.deadline:
                elapsed = time.monotonic() - start
                rss.append((elapsed, server.rss_mb()))
                if redis is not None and "redis_killed" not in events and elapsed > 0.40 * seconds:
                    events["writes_before_outage"] = server.metrics().get("kvgen_kv_store_writes_total")
                    redis.kill()
                    events["redis_killed"] = round(elapsed, 1)
                if redis is not None and "redis_killed" in events and "redis_started" not in events:
                    # the store is taken for gone after a failed call and tried again 2 s later: sample every second
                    available = server.metrics().get("kvgen_kv_store_available")
                    seen = events.get("store_available_during_outage", 1)
                    events["store_available_during_outage"] = min(seen, available if available is not None else 1)
                    noticed = events["store_available_during_outage"] == 0
                    if not (elapsed > 0.55 * seconds and noticed or elapsed > 0.8 * seconds):
                        time.sleep(1)
                        continue
                    redis.start()
                    events["redis_started"] = round(elapsed, 1)
                    events["writes_at_restart"] = server.metrics().get("kvgen_kv_store_writes_total")
                time.sleep(1)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        soak.run()
        watcher.join()
        drained = time.monotonic()
        while True:  # the load drains: nothing running or waiting
            m = server.metrics()
            if m["kvgen_requests_running"] + m["kvgen_requests_waiting"] == 0 or time.monotonic() - drained > 60:
                break
            time.sleep(0.2)
        half = [r for t, r in rss if t < seconds / 2], [r for t, r in rss if t >= seconds / 2]
        if redis is not None:
            events.update(store_available_at_end=m.get("kvgen_kv_store_available"),
                          writes_at_end=m.get("kvgen_kv_store_writes_total"),
                          store_errors=m.get("kvgen_kv_store_errors_total"))
        report.update({
            "outcomes": {f"{kind} {outcome}": n for (kind, outcome), n in sorted(soak.outcomes.items())},
            "requests": sum(soak.outcomes.values()),
            "server_errors": sum(n for (_, outcome), n in soak.outcomes.items() if outcome.startswith("5")),
            "wrong_answers": sum(n for (_, outcome), n in soak.outcomes.items() if outcome == "wrong"),
            "failures": soak.failures[:20], "failure_count": len(soak.failures),
            "rss_peak_mb_first_half": max(half[0], default=0.0), "rss_peak_mb_second_half": max(half[1], default=0.0),
            "rss_mb_every_30s": [round(r) for t, r in rss[::30]],
            "kv_blocks_used_after_drain": m["kvgen_kv_blocks_used"], "requests_left": m["kvgen_requests_running"]
            + m["kvgen_requests_waiting"], "server_alive": server.process.poll() is None, "redis": events,
            "load_after": os.getloadavg()[0],
        })
    finally:
        server.close()
        if redis is not None:
            redis.kill()
    checks = {
        "no 5xx": report["server_errors"] == 0,
        "no wrong answer": report["wrong_answers"] == 0,
        "no failed request": report["failure_count"] == 0,
        "no KV block in use after the drain": report["kv_blocks_used_after_drain"] == 0,
        "the server is alive": report["server_alive"],
        "a burst past --max-queue got 429": seconds <= 2 * args.burst_every or report["outcomes"].get("burst 429", 0) > 0,
    }
    if args.minutes >= 2:
        checks["peak RSS of the second half within 5% of the first"] = \
            report["rss_peak_mb_second_half"] <= 1.05 * report["rss_peak_mb_first_half"]
    if redis is not None and seconds >= 30:
        e = report["redis"]
        checks["the store is used again after Redis came back"] = \
            e.get("store_available_at_end") == 1 and (e.get("writes_at_end") or 0) > (e.get("writes_at_restart") or 0)
    report["checks"] = checks
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    failed = [name for name, ok in checks.items() if not ok]
    print("soak: " + ("all checks hold" if not failed else f"FAILED: {', '.join(failed)}"))
    print(f"server log: {server.log.name}")
    return 1 if failed else 0


def cpu_model() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
