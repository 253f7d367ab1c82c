"""From the engine's thread to the HTTP requests' event loop: one :class:`Job` per request, a
:class:`Dispatcher` thread that polls the engine for every registered sequence's outputs (never blocking) and
hands them to the loop in batches, timing first tokens and inter-token gaps on the way; server-sent events.

Example:
    >>> sse({"text": "hi"})
    'data: {"text": "hi"}\\n\\n'
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

from kvgen.serving.engine import ContinuousBatchingManager, GenerationOutput
from kvgen.serving.metrics import Metrics

class Job:
    """One HTTP request: one engine request per prompt, ``n`` sequences each, and their outputs."""

    def __init__(self, prompts: list[list[int]], n: int):
        self.key, self.prompts, self.n = uuid.uuid4().hex[:16], prompts, n
        self.queue: asyncio.Queue = asyncio.Queue()
        self.parents: list[str] = []  # engine ids of the prompts added so far
        self.finished = 0

    def engine_ids(self, p: int) -> list[str]:
        rid = f"{self.key}-{p}"
        return [rid] + [f"{rid}__child#{i}" for i in range(self.n - 1)]


class Dispatcher:
    """Polls the engine for the outputs of every registered sequence (never blocking), hands them to the
    event loop in batches, and times first tokens and inter-token gaps on the way."""

    def __init__(self, manager: ContinuousBatchingManager, metrics: Metrics):
        self.manager, self.metrics = manager, metrics
        self.routes: dict[str, tuple[Job, int]] = {}  # engine id -> (job, choice index)
        self.clocks: dict[str, tuple[int, float]] = {}  # engine id -> (tokens seen, time of the last)
        self.lock, self.wake = threading.Lock(), threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.stopping = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.stopping = loop, False
        self.thread = threading.Thread(target=self._run, name="kvgen-serve-dispatcher", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()
        if self.thread is not None:
            self.thread.join()

    def register(self, job: Job, ids: list[str], first_index: int) -> None:
        with self.lock:
            self.routes.update({rid: (job, first_index + j) for j, rid in enumerate(ids)})
        self.wake.set()

    def unregister(self, ids: list[str]) -> None:
        with self.lock:
            for rid in ids:
                self.routes.pop(rid, None)

    def _run(self) -> None:
        while not self.stopping:
            self.metrics.sample(self.manager.generated_tokens)
            with self.lock:
                routes = list(self.routes.items())
            if not routes:
                self.wake.wait(0.5)
                self.wake.clear()
                continue
            batch = []
            for rid, (job, index) in routes:
                while True:
                    try:
                        output = self.manager.get_result(rid, timeout=0)
                    except KeyError:  # registered, not added yet
                        break
                    except RuntimeError as error:  # the engine loop failed
                        output = error
                    if output is None:
                        break
                    batch.append((job, index, output))
                    if isinstance(output, RuntimeError) or output.is_finished():
                        self._finished(rid, job, output)
                        break
                    self._clock(rid, output)
            if batch:
                self.loop.call_soon_threadsafe(deliver, batch)
            else:
                time.sleep(0.002)

    def _clock(self, rid: str, output: GenerationOutput) -> None:
        now, n = time.perf_counter(), len(output.generated_tokens)
        seen, last = self.clocks.get(rid, (0, 0.0))
        if n and not seen and output.first_token_time is not None:
            self.metrics.ttft.observe(output.first_token_time - output.created_time)
            seen, last = 1, output.first_token_time
        if seen and n > seen:
            self.metrics.itl.observe((now - last) / (n - seen), times=n - seen)
        self.clocks[rid] = (max(seen, n), now if n > seen else last)

    def _finished(self, rid: str, job: Job, output) -> None:
        done = isinstance(output, GenerationOutput)
        if done:
            self._clock(rid, output)
            reason = output.finish_reason or "error"
            self.metrics.finished[reason] = self.metrics.finished.get(reason, 0) + 1
        self.clocks.pop(rid, None)
        # the engine adds the children at the parent's first token: a parent ended before it never forks
        forked = not done or output.generated_tokens or "__child#" in rid
        self.unregister([rid] if forked else job.engine_ids(int(rid.rsplit("-", 1)[1])))


def deliver(batch) -> None:
    for job, index, output in batch:
        job.queue.put_nowait((index, output))




def sse(payload: dict) -> str:
    """One server-sent event of ``payload`` as JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
