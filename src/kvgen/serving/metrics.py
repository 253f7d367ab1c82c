"""What ``kvgen serve`` counts and times, rendered for Prometheus at ``/metrics``: the engine's queues, blocks
and prefix-cache hits, tokens, finish reasons, and histograms of time to first token and between tokens.

Example:
    >>> metrics = Metrics()
    >>> metrics.ttft.observe(0.2)
    >>> metrics.ttft.count
    1
"""

from __future__ import annotations

import time
from collections import deque

class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts, self.sum, self.count = [0] * len(buckets), 0.0, 0

    def observe(self, value: float, times: int = 1) -> None:
        for i, bound in enumerate(self.buckets):
            self.counts[i] += times if value <= bound else 0
        self.sum, self.count = self.sum + value * times, self.count + times

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram",
                *(f'{self.name}_bucket{{le="{b}"}} {n}' for b, n in zip(self.buckets, self.counts)),
                f'{self.name}_bucket{{le="+Inf"}} {self.count}', f"{self.name}_sum {self.sum:.6f}",
                f"{self.name}_count {self.count}"]


class Metrics:
    """What the dispatcher measures; ``/metrics`` prints it beside the engine's stats."""

    def __init__(self):
        self.ttft = Histogram("kvgen_time_to_first_token_seconds", "Time from arrival to the first token.",
                               (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.itl = Histogram("kvgen_inter_token_latency_seconds", "Time between two tokens of a sequence.",
                              (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))
        self.finished: dict[str, int] = {}
        self.prompt_tokens = 0
        self.samples: deque[tuple[float, int]] = deque(maxlen=21)  # (time, generated tokens), every 0.5 s

    def sample(self, generated_tokens: int) -> None:
        now = time.monotonic()
        if not self.samples or now - self.samples[-1][0] >= 0.5:
            self.samples.append((now, generated_tokens))

    def render(self, stats: dict) -> str:
        (t0, g0), (t1, g1) = (self.samples[0], self.samples[-1]) if self.samples else ((0, 0), (0, 0))
        rows = [("requests_running", "gauge", "Sequences being prefilled or decoded.", stats["running"]),
                ("requests_waiting", "gauge", "Requests waiting for a slot.", stats["waiting"]),
                ("kv_blocks_total", "gauge", "Blocks of the paged KV cache.", stats["blocks_total"]),
                ("kv_blocks_used", "gauge", "KV blocks held by sequences.",
                 stats["blocks_total"] - stats["blocks_free"]),
                ("kv_blocks_free", "gauge", "KV blocks free (cached prefixes included).", stats["blocks_free"]),
                ("prefix_cache_hit_rate", "gauge", "Share of prompt tokens found in the prefix cache.",
                 stats["prefix_cache_hit_rate"]),
                ("generation_tokens_per_second", "gauge", "Generated tokens per second over the last 10 s.",
                 (g1 - g0) / (t1 - t0) if t1 > t0 else 0.0),
                ("generation_tokens_total", "counter", "Tokens generated.", stats["generated_tokens"]),
                ("prompt_tokens_total", "counter", "Prompt tokens received.", self.prompt_tokens),
                ("preemptions_total", "counter", "Sequences preempted for lack of blocks.", stats["preemptions"])]
        if "kv_store_hits" in stats:
            rows += [("kv_store_available", "gauge", "1 while the shared prefix store (Redis) is in use.",
                      stats["kv_store_available"]),
                     ("kv_store_hits_total", "counter", "Prefix blocks loaded from the shared store.",
                      stats["kv_store_hits"]),
                     ("kv_store_misses_total", "counter", "Prefix blocks asked of the shared store and absent.",
                      stats["kv_store_misses"]),
                     ("kv_store_rejected_total", "counter", "Shared-store entries ignored (damaged, other model).",
                      stats["kv_store_rejected"]),
                     ("kv_store_errors_total", "counter", "Failed calls to the shared store.",
                      stats["kv_store_errors"]),
                     ("kv_store_writes_total", "counter", "Prefix blocks written to the shared store.",
                      stats["kv_store_writes"]),
                     ("kv_store_pending", "gauge", "Prefix blocks waiting to be written.", stats["kv_store_pending"])]
        lines = [line for name, kind, help_text, value in rows for line in
                 (f"# HELP kvgen_{name} {help_text}", f"# TYPE kvgen_{name} {kind}", f"kvgen_{name} {value}")]
        finished = "kvgen_requests_finished_total"
        lines += [f"# HELP {finished} Sequences finished, by reason.", f"# TYPE {finished} counter",
                  *(f'{finished}{{finish_reason="{r}"}} {n}' for r, n in sorted(self.finished.items()))]
        return "\n".join(lines + self.ttft.render() + self.itl.render()) + "\n"


