"""A prefix-block store shared by replicas: full KV blocks in Redis, keyed by their prefix hash.

Replicas of ``kvgen serve`` that share one Redis (``--kv-store redis://host:port/db``) share
their prefix caches: a block that one replica computed is loaded by another on a local miss,
which then skips that part of the prefill.

* Key: ``kvgen:kv:<model>:<kind>:<block size>:<prefix key>``; ``<prefix key>`` is the block's
  chained hash (:func:`kvgen.serving.blocks.block_hash`, the same in every process) and
  ``<model>`` a digest of the model fingerprint (:func:`kvgen.cache.fingerprint.model_fingerprint`)
  and of the cache's dtype and layer shapes.
* Value: one safetensors blob holding the block's keys and values of every layer, each
  ``(layers, kv_heads, block_size, head_dim)``, described with the persistence codec
  (:mod:`kvgen.cache.codec`); its metadata holds a JSON document (format, the fingerprint, the
  dtype, the shapes, the prefix key) and the sha256 of that document and the tensor bytes.

A value whose checksum, fingerprint or prefix key does not match is never used: it is logged,
deleted, and the block is computed (and written again). Reads and writes run in background threads,
off the engine's step (a request waits for its blocks while the running ones go on); blocks known
to be in Redis are not sent again. When Redis cannot be reached
(at start or later) the store logs it once and the engine goes on with its local cache alone,
trying Redis again every ``retry_after`` seconds; no request fails for it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvgen.cache.codec import decode, encode
from kvgen.cache.fingerprint import model_fingerprint
from kvgen.cache.paged import PagedAttentionCache
from kvgen.serving.blocks import BlockPool

logger = logging.getLogger(__name__)

FORMAT = "kvgen.block"
FORMAT_VERSION = 1
_DOCUMENT, _CHECKSUM = "kvgen.block", "kvgen.block.sha256"
_FETCH_CHUNK = 32  # blocks per MGET: one round trip, a bounded reply
_WRITE_BATCH = 32  # blocks per pipelined write
_KNOWN = 1 << 16  # prefix keys remembered as being in Redis


class PrefixStore:
    """The full blocks of a :class:`PagedAttentionCache`, shared through Redis (see the module docstring).

    Only for models whose layers are all full attention (use :func:`open_store`, which says so
    and returns ``None`` for the others).

    Example:
        >>> store = PrefixStore("redis://127.0.0.1:6379/0", model, cache)     # doctest: +SKIP
        >>> fetched = store.fetch(prefix_keys(prompt, 16))  # a Future: read in the background  # doctest: +SKIP
        >>> store.install(pool, fetched.result())  # blocks Redis held, now cached in pool    # doctest: +SKIP
        7
        >>> store.save(block, key); store.flush()        # a block filled here goes to Redis  # doctest: +SKIP
    """

    def __init__(self, url: str, model, cache: PagedAttentionCache, timeout: float = 1.0, retry_after: float = 30.0,
                 max_pending: int = 4096):
        try:
            import redis
        except ModuleNotFoundError:
            raise ModuleNotFoundError("the Redis prefix store needs the redis client: pip install 'kvgen[serve]'") \
                from None
        if cache.kinds != ("full_attention",):
            raise ValueError(f"the Redis prefix store holds full-attention layers only; this model has {cache.kinds}")
        try:
            self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        except ValueError as error:
            raise ValueError(f"cannot use the kv store URL: {error}; write redis://host:port/db") from None
        self.url = re.sub(r"//[^/@]*@", "//***@", url)  # for log lines: no password
        self.retry_after, self._errors = retry_after, redis.RedisError
        self.layers = list(cache.layers)
        self.block_size = cache.block_size
        _, kv_heads, _, width = self.layers[0].pool_keys.shape  # (width: a stored row, kvgen.cache.precision)
        self.block_shape = (len(self.layers), kv_heads, self.block_size, width)
        self.identity = {"fingerprint": model_fingerprint(model), "dtype": str(cache.dtype).removeprefix("torch."),
                         "kind": "full_attention", "block_shape": list(self.block_shape)}
        digest = hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()[:16]
        self.prefix = f"kvgen:kv:{digest}:full_attention:{self.block_size}:"
        self.hits = self.misses = self.rejected = self.errors = self.writes = 0
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()
        self._pending: list[tuple[int, bytes]] = []
        self._queue: queue.Queue = queue.Queue(max_pending)
        self._down_until, self._outage = 0.0, False
        try:
            self.client.ping()
            logger.info("kv store: sharing prefix blocks through %s", self.url)
        except self._errors as error:
            self._lost(error, "at start")
        threading.Thread(target=self._write_loop, name="kvgen-kv-store", daemon=True).start()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kvgen-kv-fetch")

    # -- state -------------------------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        """False while Redis is taken for gone (until ``retry_after`` seconds after the last failure)."""
        return time.monotonic() >= self._down_until

    def stats(self) -> dict:
        """Counters: blocks loaded (hits), asked for and absent (misses), entries rejected, failed Redis calls,
        blocks written, blocks waiting to be written, and whether Redis is in use now."""
        return {"kv_store_available": int(self.available), "kv_store_hits": self.hits,
                "kv_store_misses": self.misses, "kv_store_rejected": self.rejected, "kv_store_errors": self.errors,
                "kv_store_writes": self.writes, "kv_store_pending": self._queue.unfinished_tasks}

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the queued writes; True when none is left."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks

    def _lost(self, error: Exception, when: str = "") -> None:
        with self._lock:  # the engine and the writer thread may both find Redis gone: one line
            self.errors += 1
            self._down_until = time.monotonic() + self.retry_after
            first, self._outage = not self._outage, True
        if first:
            logger.warning("kv store: Redis at %s is unreachable%s (%s: %s); caching prefixes locally only, "
                           "retrying every %g s", self.url, f" {when}" if when else "", type(error).__name__, error,
                           self.retry_after)

    def _reached(self) -> None:
        with self._lock:
            back, self._outage = self._outage, False
        if back:
            logger.info("kv store: Redis at %s is reachable again; sharing prefix blocks", self.url)

    def _remember(self, keys) -> None:
        with self._lock:
            for key in keys:
                self._known[key] = None
                self._known.move_to_end(key)
            while len(self._known) > _KNOWN:
                self._known.popitem(last=False)

    # -- loading -----------------------------------------------------------------------------------------
    def fetch(self, keys: list[bytes]) -> Future:
        """The leading entries of the chain ``keys`` that Redis holds and that pass the checks, read in a
        background thread (round trips, checksums, decoding): a Future of ``(key, keys, values)`` for
        :meth:`install`. Stops at the first block that is absent or rejected."""
        if not keys or not self.available:
            done = Future()
            done.set_result([])
            return done
        return self._reader.submit(self._fetch, keys)

    def install(self, pool: BlockPool, found: list[tuple[bytes, torch.Tensor, torch.Tensor]]) -> int:
        """Copy fetched entries into free blocks of ``pool``, keyed there as cached prefix blocks (not held);
        returns how many. Takes at most ``pool.num_free - 1`` blocks (one is left for the prompt's tail)."""
        found = found[:max(0, pool.num_free - 1)]
        if not found:
            return 0
        blocks = pool.allocate(len(found))
        for i, name in ((1, "pool_keys"), (2, "pool_values")):
            layers = self._blocks_of(name)
            for block, entry in zip(blocks, found):
                for layer, rows in zip(layers, entry[i]):  # rows (Hkv, S, D); block by block: no strided copies
                    layer[:, block].copy_(rows)
        for block, (key, _, _) in zip(blocks, found):
            pool.register(block, key)
        pool.free(blocks)
        self._remember(key for key, _, _ in found)
        self.hits += len(found)
        return len(found)

    def _fetch(self, keys: list[bytes]) -> list[tuple[bytes, torch.Tensor, torch.Tensor]]:
        """``(key, keys, values)`` of the leading entries of ``keys`` that Redis holds and that pass the checks.
        The entries fetched after a rejected one are checked too, so that every bad one is replaced."""
        found, broken = [], False
        for start in range(0, len(keys), _FETCH_CHUNK):
            chunk = keys[start:start + _FETCH_CHUNK]
            try:
                values = self.client.mget([self._name(key) for key in chunk])
            except self._errors as error:
                self._lost(error)
                return found
            self._reached()
            for key, value in zip(chunk, values):
                if value is None:
                    self.misses += not broken
                    return found
                entry = self._decode(key, value)
                broken = broken or entry is None
                if not broken:
                    found.append((key, *entry))
            if broken:
                return found
        return found

    def _decode(self, key: bytes, value: bytes) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The keys and values (L, Hkv, S, D) of an entry, or None (logged, the entry deleted) for one that must
        not be used."""
        from safetensors.torch import load

        name = self._name(key)
        try:
            size = int.from_bytes(value[:8], "little")
            metadata = json.loads(value[8:8 + size])["__metadata__"]
            text = metadata[_DOCUMENT]
            tensors = load(value)
            if metadata[_CHECKSUM] != _checksum(text, tensors):
                return self._reject(name, "it is damaged (its checksum does not match)")
            document = json.loads(text)
            if document["format"] != FORMAT or document["format_version"] != FORMAT_VERSION:
                return self._reject(name, f"it has format {document['format']!r} version "
                                          f"{document['format_version']!r}, not {FORMAT!r} {FORMAT_VERSION}")
            if document["identity"] != self.identity:
                return self._reject(name, "it was written for another model (its fingerprint, dtype or block shape "
                                          "differs)")
            if document["key"] != key.hex():
                return self._reject(name, "it holds the block of another prefix")
            entry = decode(document["entry"], tensors)
            keys, values = entry["keys"], entry["values"]
        except Exception as error:  # a blob that is not an entry: garbled header, JSON or tensors
            return self._reject(name, f"it cannot be read ({type(error).__name__}: {error})")
        if tuple(keys.shape) != self.block_shape or tuple(values.shape) != self.block_shape:
            return self._reject(name, f"its blocks are {tuple(keys.shape)}, not {self.block_shape}")
        return keys, values

    def _reject(self, name: str, why: str) -> None:
        self.rejected += 1
        logger.warning("kv store: ignoring the entry %s: %s; the block is recomputed", name, why)
        try:
            self.client.delete(name)  # so that the recomputed block takes its place
        except self._errors as error:
            self._lost(error)
        return None

    # -- writing -----------------------------------------------------------------------------------------
    def save(self, block: int, key: bytes) -> None:
        """Note that ``block`` of the pool is full and keyed ``key``; :meth:`flush` sends what was noted."""
        if self.available and key not in self._known:
            self._pending.append((block, key))

    def flush(self) -> None:
        """Copy the noted blocks out of the pool (call it before the next pass can overwrite them) and queue them
        for the writer thread; when the queue is full, blocks are dropped (they stay cached locally)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        keys, values = self._blocks_of("pool_keys"), self._blocks_of("pool_values")
        for block, key in pending:
            try:
                self._queue.put_nowait((key, torch.stack([layer[:, block] for layer in keys]).cpu(),  # (L, Hkv, S, D)
                                        torch.stack([layer[:, block] for layer in values]).cpu()))
            except queue.Full:
                return

    def _blocks_of(self, name: str) -> list[torch.Tensor]:
        """Each layer's pool of keys or values (``name``) as (Hkv, blocks, S, D) views."""
        _, heads, _, dim = self.block_shape
        return [getattr(layer, name)[0].view(heads, -1, self.block_size, dim) for layer in self.layers]

    def _write_loop(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < _WRITE_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                if self.available:
                    self._write(batch)
            except self._errors as error:
                self._lost(error)
            finally:
                for _ in batch:
                    self._queue.task_done()

    def _write(self, batch: list[tuple[bytes, torch.Tensor, torch.Tensor]]) -> None:
        names = [self._name(key) for key, _, _ in batch]
        with self.client.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.exists(name)
            present = pipe.execute()
            for name, (key, k, v), there in zip(names, batch, present):
                if not there:
                    pipe.set(name, self._encode(key, k, v), nx=True)
            written = pipe.execute()
        self._reached()
        self.writes += sum(map(bool, written))
        self._remember(key for key, _, _ in batch)

    def _encode(self, key: bytes, keys: torch.Tensor, values: torch.Tensor) -> bytes:
        from safetensors.torch import save

        description, tensors, _ = encode({"keys": keys, "values": values})
        text = json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, "identity": self.identity,
                           "key": key.hex(), "entry": description}, separators=(",", ":"))
        return save(tensors, metadata={_DOCUMENT: text, _CHECKSUM: _checksum(text, tensors)})

    def _name(self, key: bytes) -> str:
        return self.prefix + key.hex()


def open_store(url: str, model, cache: PagedAttentionCache, retry_after: float = 30.0) -> PrefixStore | None:
    """The :class:`PrefixStore` at ``url`` for ``cache``; ``None`` (logged) when the model has layers other than
    full attention, whose blocks the store does not share yet."""
    if cache.kinds != ("full_attention",):
        logger.warning("kv store: not used: this model has %s layers and the Redis store shares full-attention "
                       "blocks only; prefixes are cached locally", "/".join(cache.kinds))
        return None
    return PrefixStore(url, model, cache, retry_after=retry_after)


def _checksum(text: str, tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256(text.encode())
    for name in sorted(tensors):
        h.update(tensors[name].reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()
