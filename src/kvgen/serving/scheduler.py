"""Which tokens of which sequences go into the next forward pass.

First come, first served under two limits: ``max_num_seqs`` running sequences and
``max_batch_tokens`` tokens per pass. Running sequences come first (one token each when
decoding, the next chunk of the prompt when still prefilling), then waiting requests in
arrival order, their prompts cut into chunks that fit the budget left. Each kind of attention
layer (full, sliding window) has its own pool and block table per sequence; a block that every
future query of a sliding layer sees past its window goes back to that pool at once. When a pool has no
block for a running sequence's next token, the latest arrival is preempted: its blocks go
back to the pool (full ones stay in the prefix cache) and it waits at the front of the queue,
to be recomputed from its tokens so far; no request is ever dropped. With a shared ``store``
(:class:`kvgen.serving.store.PrefixStore`), a prompt's blocks missing here are looked up there
first, and every block filled here is offered to it.

Example:
    >>> scheduler = Scheduler({"full_attention": (BlockPool(64, 16), None)}, 8, 256)   # doctest: +SKIP
    >>> scheduler.add(Sequence("a", [1, 2, 3], SamplingParams(max_new_tokens=4)))         # doctest: +SKIP
    >>> scheduler.schedule()                                                              # doctest: +SKIP
    [(Sequence('a'), 3)]
"""

from __future__ import annotations

import itertools
from collections import deque
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import torch

from kvgen.serving.blocks import BlockPool, block_hash, prefix_keys

if TYPE_CHECKING:
    from kvgen.serving.store import PrefixStore


class RequestStatus(IntEnum):
    """Where a request is (transformers' names)."""

    PENDING = 0
    PREFILLING = 1
    DECODING = 2
    FINISHED = 3
    FAILED = 4


@dataclass
class SamplingParams:
    """Per-request decoding settings."""

    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    num_return_sequences: int = 1
    top_logprobs: int = 0
    frequency_penalty: float = 0.0  # OpenAI's: minus this times each token's count in the generated text so far
    presence_penalty: float = 0.0  # minus this for each token the generated text holds at least once
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's log-probability and the k likeliest
    grammar: str | None = None  # llguidance's grammar the reply must follow (kvgen.grammar)
    repetition_penalty: float = 1.0  # vLLM's and transformers': on the prompt's and the reply's tokens
    min_p: float = 0.0


_arrivals = itertools.count()
_RUN = 4  # blocks a sequence of full layers takes at once while the pool has room (attention reads runs faster)
_FETCH_WAIT = 0.01  # seconds a step waits for a shared-store read before it goes on without the request


@dataclass(eq=False)
class Sequence:
    """One request's tokens and its place in the pool."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    status: RequestStatus = RequestStatus.PENDING
    tables: dict[str, list[int]] = field(default_factory=dict)  # per layer kind: block ids, -1 once out of window
    num_computed: int = 0  # leading tokens whose keys/values are in the pools
    num_keyed: int = 0  # leading blocks of the tables registered in the prefix cache
    keys: list[bytes] = field(default_factory=list)  # prefix keys of the full blocks of ``tokens``
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)  # the first token's None: nothing before it
    prompt_top_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" or "length"
    generator: torch.Generator | None = None
    penalties: Any = None  # its kvgen.serving.sampler.Penalties, on the logits' device, from its first step
    arrival: int = field(default_factory=lambda: next(_arrivals))
    preemptions: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    fetching: Future | None = None  # its prompt's blocks being read from the shared store
    matcher: Any = None  # its grammar's llguidance matcher, at the reply's tokens so far

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def scores_prompt(self) -> bool:
        """Whether prompt tokens still need their log-probabilities (so none may come from the prefix cache)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt)

    def __repr__(self) -> str:
        return f"Sequence({self.request_id!r})"


class Scheduler:
    """Waiting and running queues over one :class:`BlockPool` per layer kind.

    ``pools``: ``{kind: (pool, window)}``, ``window`` the sliding window of that kind's layers
    (``None``: they see every position). All pools have the same block size. ``store``: a shared
    :class:`~kvgen.serving.store.PrefixStore` for the one pool of a model whose layers are all full attention.
    """

    def __init__(self, pools: dict[str, tuple[BlockPool, int | None]], max_num_seqs: int, max_batch_tokens: int,
                 prefix_caching: bool = True, store: PrefixStore | None = None):
        if max_num_seqs < 1 or max_batch_tokens < 1:
            raise ValueError(f"max_num_seqs and max_batch_tokens must be >= 1, got {max_num_seqs}, {max_batch_tokens}")
        self.pools = pools
        self.block_size = next(iter(pools.values()))[0].block_size
        self.max_num_seqs, self.max_batch_tokens = max_num_seqs, max_batch_tokens
        self.prefix_caching = prefix_caching
        if store is not None and (not prefix_caching or list(pools) != ["full_attention"]):
            raise ValueError("a prefix store needs prefix caching and a model whose layers are all full attention")
        self.store = store
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.hit_tokens = self.query_tokens = 0  # prefix cache: prompt tokens served / asked

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens served from cached blocks so far."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def add(self, seq: Sequence, front: bool = False) -> None:
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next pass: ``(sequence, number of its tokens to feed from seq.num_computed)`` pairs."""
        budget, batch, preempted = self.max_batch_tokens, [], False
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if budget == 0:
                break
            if seq not in self.running:  # preempted for an earlier one in this loop
                continue
            n = min(len(seq.tokens) - seq.num_computed, budget)
            while not self._reserve(seq, seq.num_computed + n):
                victim = max(self.running, key=lambda s: s.arrival)
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                batch.append((seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if not seq.tables:
                if not self._fetched(seq):
                    break  # its blocks are on their way from the shared store; the running ones go on
                self._match_prefix(seq)
            n = min(len(seq.tokens) - seq.num_computed, budget)
            if not self._reserve(seq, seq.num_computed + n):
                break  # wait for blocks; never preempt a running sequence for a new one
            self.waiting.popleft()
            self.running.append(seq)
            seq.status = RequestStatus.PREFILLING
            batch.append((seq, n))
            budget -= n
        return batch

    def _first_needed(self, window: int | None, position: int) -> int:
        """First block a layer with ``window`` still reads when the next query is at ``position``."""
        return 0 if window is None else max(0, position - window + 1) // self.block_size

    def waits_for_store(self) -> bool:
        """Whether the next waiting request waits for blocks being read from the shared store."""
        return bool(self.waiting) and self.waiting[0].fetching is not None

    def _prefix_keys(self, seq: Sequence) -> list[bytes]:
        """The prefix keys of the full blocks of ``seq`` before its last token (computed once)."""
        full = (len(seq.tokens) - 1) // self.block_size
        if len(seq.keys) < full:
            previous = seq.keys[-1] if seq.keys else None
            start = len(seq.keys) * self.block_size
            seq.keys += prefix_keys(seq.tokens[start: full * self.block_size], self.block_size, previous)
        return seq.keys[:full]

    def _fetched(self, seq: Sequence) -> bool:
        """Whether ``seq`` can be matched now: no shared store, no block missing here, or the store's read
        (started on the first call, in the background) is done and its blocks are in the pool."""
        if self.store is None:
            return True
        pool = self.pools["full_attention"][0]
        keys = self._prefix_keys(seq)
        if seq.fetching is None:
            local = pool.lookup(keys)
            if None not in local:
                return True
            seq.fetching = self.store.fetch(keys[local.index(None):])
            wait([seq.fetching], timeout=_FETCH_WAIT)  # a quick answer (often: none there) joins this step
        if not seq.fetching.done():
            return False
        found, seq.fetching = seq.fetching.result(), None
        held = pool.match_prefix(keys)  # the local chain, held: not evicted for the store's blocks
        try:
            self.store.install(pool, found)
        finally:
            pool.free(held)
        return True

    def _match_prefix(self, seq: Sequence) -> None:
        """Start ``seq`` from the longest cached prefix (at least one token left to compute): full layers need
        its every block, sliding layers the blocks of its last window."""
        seq.tables = {kind: [] for kind in self.pools}
        if not self.prefix_caching or seq.scores_prompt:
            return
        full = len(self._prefix_keys(seq))
        found = {kind: pool.lookup(seq.keys[:full]) for kind, (pool, _) in self.pools.items()}
        hit = full
        while hit > 0 and not all(None not in found[kind][self._first_needed(window, hit * self.block_size): hit]
                                  for kind, (_, window) in self.pools.items()):
            hit -= 1
        for kind, (pool, window) in self.pools.items():
            first = self._first_needed(window, hit * self.block_size)
            held = found[kind][first:hit]
            pool.share(held)
            seq.tables[kind] = [-1] * first + held
        seq.num_computed, seq.num_keyed = hit * self.block_size, hit
        if seq.preemptions == 0:
            seq.cached_prompt_tokens = seq.num_computed
            self.query_tokens += len(seq.prompt)
            self.hit_tokens += seq.num_computed

    def _reserve(self, seq: Sequence, tokens: int) -> bool:
        """Give ``seq`` blocks for its first ``tokens`` tokens in every pool; False (nothing taken) when one is short."""
        if not seq.tables:
            seq.tables = {kind: [] for kind in self.pools}
        missing = {kind: self.blocks_for(tokens) - len(seq.tables[kind]) for kind in self.pools}
        if any(n > self.pools[kind][0].num_free for kind, n in missing.items()):
            return False
        for kind, n in missing.items():
            if n > 0:
                (pool, window), table = self.pools[kind], seq.tables[kind]
                if n < _RUN and window is None and pool.num_free >= _RUN * (len(self.running) + 2):
                    # room: a run for what follows (sliding layers read a few blocks: they take what they need)
                    n = _RUN
                table += pool.allocate(n, after=table[-1] if table and table[-1] >= 0 else None)
        return True

    def computed(self, seq: Sequence, n: int) -> None:
        """``n`` more tokens of ``seq`` are in the pools: key its blocks that are full now, and give back the
        blocks that slid out of every future query's window."""
        seq.num_computed += n
        size = self.block_size
        if self.prefix_caching:
            for j in range(seq.num_keyed, seq.num_computed // size):
                if j == len(seq.keys):
                    seq.keys.append(block_hash(seq.keys[-1] if seq.keys else None, seq.tokens[j * size:(j + 1) * size]))
                for kind, (pool, _) in self.pools.items():
                    if seq.tables[kind][j] >= 0:
                        pool.register(seq.tables[kind][j], seq.keys[j])
                if self.store is not None:
                    self.store.save(seq.tables["full_attention"][j], seq.keys[j])
                seq.num_keyed = j + 1
        for kind, (pool, window) in self.pools.items():
            table = seq.tables[kind]
            for j in range(self._first_needed(window, seq.num_computed)):
                if table[j] >= 0:
                    pool.free([table[j]])
                    table[j] = -1

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and queue it first, to be recomputed from its tokens so far."""
        self.running.remove(seq)
        self._release(seq)
        seq.status = RequestStatus.PENDING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, status: RequestStatus = RequestStatus.FINISHED) -> None:
        """Take ``seq`` out of the queues and give its blocks back at once (finished or cancelled)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = status

    def _release(self, seq: Sequence) -> None:
        for kind, table in seq.tables.items():
            self.pools[kind][0].free([b for b in table if b >= 0])
        seq.tables, seq.num_computed, seq.num_keyed = {}, 0, 0
