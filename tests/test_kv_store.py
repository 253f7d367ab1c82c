"""The prefix-block store on Redis (``kvgen serve --kv-store``): replicas share prefill work, bad entries are
never used, and Redis going away leaves a working local cache. Each test runs its own ``redis-server`` on a free
loopback port (Debian's; ``bash scripts/setup.sh --test`` installs it): without one these tests fail."""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pydoc_data.topics import topics

import pytest
import torch

import kvgen
from kvgen import LlamaForCausalLM, PretrainedConfig
from kvgen.cache.paged import PagedAttentionCache
from kvgen.loading.default_model import default_gguf_path
from kvgen.models.decode_blocks import eager_blocks
from kvgen.serving import ContinuousBatchingConfig
from kvgen.serving.blocks import prefix_keys
from kvgen.serving.engine import ContinuousBatchingManager
from kvgen.serving.store import open_store

CONFIG = dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
              rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu", eos_token_id=None)
STORE_LOG = "kvgen.serving.store"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Redis:
    """A throwaway ``redis-server`` on a free loopback port, nothing saved to disk, and a client to it."""

    def __init__(self):
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed, and these tests need a real Redis: run "
                        "`bash scripts/setup.sh --test` (or `apt-get install redis-server`)")
        try:
            import redis
        except ModuleNotFoundError:
            pytest.fail("the redis client is not installed: pip install 'kvgen[serve]'")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                         "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self.client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                return
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"redis-server did not start on port {self.port}")
                time.sleep(0.02)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture
def redis_server():
    server = Redis()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _eager():
    with eager_blocks():
        yield


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    m = LlamaForCausalLM(PretrainedConfig(**CONFIG)).eval().requires_grad_(False)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)  # peaked distributions: greedy choices are far from ties
    return m


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def prompt(length: int = 100, seed: int = 1) -> list[int]:
    return torch.randint(0, CONFIG["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def alone(model, ids: list[int], new: int) -> list[int]:
    return model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False)[0, len(ids):].tolist()


def replica(model, url: str) -> ContinuousBatchingManager:
    """An engine as one ``kvgen serve`` replica runs it, sharing ``url``."""
    return ContinuousBatchingManager(model, config=ContinuousBatchingConfig(num_blocks=64, kv_store=url))


def run(manager: ContinuousBatchingManager, ids: list[int], new: int = 6):
    with manager:
        output = manager.get_result(manager.add_request(ids, max_new_tokens=new), timeout=60)
    assert output.error is None and output.is_finished()
    return output


def store_lines(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == STORE_LOG and text in r.getMessage()]


def test_a_second_replica_loads_the_blocks_the_first_computed(model, redis_server):
    ids = prompt(100)  # 6 full blocks
    a = replica(model, redis_server.url)
    first = run(a, ids)
    assert a.store.stats()["kv_store_writes"] == 6 and redis_server.client.dbsize() == 6
    b = replica(model, redis_server.url)
    second = run(b, ids)
    assert second.cached_prompt_tokens == 96 and b.store.stats()["kv_store_hits"] == 6
    assert second.generated_tokens == first.generated_tokens == alone(model, ids, 6)
    assert b.store.stats()["kv_store_writes"] == 0  # its 6 full blocks came from Redis
    longer = ids + prompt(40, seed=2)  # B has 6 blocks of it; Redis gives none more; the rest is computed
    assert run(b, longer).generated_tokens == alone(model, longer, 6)
    assert b.stats()["kv_store_misses"] >= 1


def test_running_requests_go_on_while_a_prompt_is_read_from_redis(model, redis_server):
    ids = prompt(100)
    run(replica(model, redis_server.url), ids)  # computes and writes its 6 full blocks
    b = replica(model, redis_server.url)
    read = b.store._fetch
    b.store._fetch = lambda keys: time.sleep(1.0) or read(keys)  # a slow Redis: 1 s a read
    with b:
        running = b.add_request(prompt(20, seed=3), max_new_tokens=300, streaming=True)
        times = []
        for output in b.request_id_iter(running):
            times.append(time.perf_counter())
            if len(times) == 2:
                start = time.perf_counter()
                fetched = b.add_request(ids, max_new_tokens=6)
            if output.is_finished() or time.perf_counter() - times[0] > 5:
                b.cancel_request(running)
                break
        out = b.get_result(fetched, timeout=60)
    during = sum(start + 0.1 < t < start + 0.9 for t in times)
    assert during >= 10, f"{during} tokens of the running request while the other one's blocks were read"
    assert out.cached_prompt_tokens == 96 and out.generated_tokens == alone(model, ids, 6)


def test_a_quick_answer_of_the_store_admits_the_request_in_the_same_step():
    """A read that returns within milliseconds (often: nothing there) costs the request no step."""
    from kvgen.serving.blocks import BlockPool
    from kvgen.serving.scheduler import SamplingParams, Scheduler, Sequence

    class QuickStore:  # answers from a background thread after 1 ms: no block there
        def __init__(self):
            self.reader = ThreadPoolExecutor(1)

        def fetch(self, keys):
            return self.reader.submit(lambda: time.sleep(0.001) or [])

        def install(self, pool, found):
            return len(found)

    scheduler = Scheduler({"full_attention": (BlockPool(64, 16), None)}, 8, 256, store=QuickStore())
    seq = Sequence("a", list(range(40)), SamplingParams(max_new_tokens=4))
    scheduler.add(seq)
    assert scheduler.schedule() == [(seq, 40)]


def test_an_entry_of_another_model_is_ignored_and_recomputed(model, redis_server, caplog):
    ids = prompt(100)
    run(replica(model, redis_server.url), ids)
    other = replica(tiny_model(seed=5), redis_server.url)  # same shapes, other weights: another namespace
    run(other, ids)
    client, ours = redis_server.client, replica(model, redis_server.url).store
    for key in prefix_keys(ids, 16):  # put the other model's entries under this model's names
        client.set(ours._name(key), client.get(other.store._name(key)))
    fresh = replica(model, redis_server.url)
    with caplog.at_level(logging.WARNING, STORE_LOG):
        out = run(fresh, ids)
    assert out.generated_tokens == alone(model, ids, 6) and out.cached_prompt_tokens == 0
    assert len(store_lines(caplog, "written for another model")) == fresh.store.stats()["kv_store_rejected"] == 6
    fresh.store.drain(5)
    assert run(replica(model, redis_server.url), ids).cached_prompt_tokens == 96  # written again, correctly


def test_a_damaged_entry_is_ignored_and_recomputed(model, redis_server, caplog):
    ids = prompt(100)
    run(replica(model, redis_server.url), ids)
    client, names = redis_server.client, [replica(model, redis_server.url).store._name(k) for k in prefix_keys(ids, 16)]
    value = bytearray(client.get(names[3]))
    value[-100] ^= 0x40  # one bit of a tensor
    client.set(names[3], bytes(value))
    client.set(names[5], b"not an entry")
    fresh = replica(model, redis_server.url)
    with caplog.at_level(logging.WARNING, STORE_LOG):
        out = run(fresh, ids)
    assert out.generated_tokens == alone(model, ids, 6)
    assert out.cached_prompt_tokens == 48  # blocks 0-2 from Redis; 3 onwards computed
    assert store_lines(caplog, "damaged (its checksum does not match)")
    fresh.store.drain(5)
    assert client.get(names[3]) != bytes(value)  # replaced by the recomputed block


def test_redis_unreachable_at_start_leaves_a_local_cache(model, caplog):
    with caplog.at_level(logging.WARNING, STORE_LOG):
        manager = replica(model, f"redis://127.0.0.1:{free_port()}/0")
    assert store_lines(caplog, "unreachable at start")
    ids = prompt(100)
    assert run(manager, ids).generated_tokens == alone(model, ids, 6)
    assert run(manager, ids).cached_prompt_tokens == 96  # the local prefix cache still works
    assert manager.stats()["kv_store_available"] == 0


def test_redis_going_away_mid_run_fails_no_request(model, redis_server, caplog):
    manager = replica(model, redis_server.url)
    manager.store.retry_after = 0.0  # try Redis at every step: each try must fail quietly
    with caplog.at_level(logging.WARNING, STORE_LOG), manager:
        first = manager.get_result(manager.add_request(prompt(100), max_new_tokens=6), timeout=60)
        manager.store.drain(5)
        redis_server.stop()
        rids = [manager.add_request(prompt(100, seed=s), max_new_tokens=6) for s in (1, 2, 3)]  # a hit and misses
        outputs = [manager.get_result(rid, timeout=60) for rid in rids]
    assert first.error is None and all(o.error is None and o.is_finished() for o in outputs)
    assert [o.generated_tokens for o in outputs] == [alone(model, prompt(100, seed=s), 6) for s in (1, 2, 3)]
    assert outputs[0].cached_prompt_tokens == 96
    assert len(store_lines(caplog, "unreachable")) == 1  # logged once per outage
    assert manager.stats()["kv_store_errors"] >= 2


def test_models_with_sliding_layers_cache_locally_only(caplog):
    config = PretrainedConfig(**CONFIG, sliding_window=32,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    cache = PagedAttentionCache(config, num_blocks=4)
    with caplog.at_level(logging.WARNING, STORE_LOG):
        assert open_store("redis://127.0.0.1:1/0", None, cache) is None
    assert store_lines(caplog, "shares full-attention blocks only")


# -- two `kvgen serve` replicas on the real model ---------------------------------------------------


def test_replica_b_skips_the_prefill_replica_a_did(redis_server):
    from test_server import Server

    tokenizer = kvgen.AutoTokenizer.from_pretrained(default_gguf_path())
    text = "\n".join(topics[name] for name in sorted(topics))
    ids = tokenizer(text[:20000], add_special_tokens=False)["input_ids"][:2000]
    assert len(ids) == 2000
    args = (default_gguf_path(), "--kv-cache-memory", "256MB", "--kv-store", redis_server.url)
    with ThreadPoolExecutor(2) as pool:  # both start (load, first request) at once
        a, b = pool.map(lambda _: Server(*args), range(2))
    try:
        def ask(server) -> tuple[float, str, int]:
            start, first, text, cached = time.perf_counter(), None, "", None
            for chunk in server.client().completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0,
                                                            stream=True, stream_options={"include_usage": True}):
                if chunk.choices and chunk.choices[0].text and first is None:
                    first = time.perf_counter() - start
                text += chunk.choices[0].text if chunk.choices else ""
                cached = chunk.usage.prompt_tokens_details.cached_tokens if chunk.usage else cached
            return first, text, cached

        ttft_a, text_a, cached_a = ask(a)
        deadline = time.monotonic() + 30
        while (m := a.metrics())["kvgen_kv_store_pending"] or m["kvgen_kv_store_writes_total"] < 125:
            assert time.monotonic() < deadline, f"replica A did not write its blocks: {m}"
            time.sleep(0.05)
        ttft_b, text_b, cached_b = ask(b)
        print(f"2,000-token prompt: time to first token on A {ttft_a:.3f} s, on B {ttft_b:.3f} s "
              f"({ttft_a / ttft_b:.1f}x)")
        assert (cached_a, cached_b) == (0, 1984) and b.metrics()["kvgen_kv_store_hits_total"] == 124
        assert text_b == text_a
        # B measured 5-13x sooner here (2 cores; 5x when the host was busy): 2x still tells a recomputed
        # prefill (about 1x) from a fetched one, far from the host's noise
        assert ttft_b * 2 <= ttft_a, f"B's time to first token {ttft_b:.3f} s is not 2x below A's {ttft_a:.3f} s"
    finally:
        for server in (a, b):
            server.process.terminate()
            server.process.wait(30)
