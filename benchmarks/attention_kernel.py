"""``kvgen::attention`` (the C++ tile-skipping flash attention) against ``F.scaled_dot_product_attention``.

Cases (float32, CPU, bool masks as :mod:`kvgen.masks` builds them, keys and values as views of a
cache buffer):

* ``paged-decode``: a ragged batch of 16 decode tokens of 16 sequences (contexts 100-1000) over
  a paged pool of ``--slots`` slots in scattered 16-slot blocks (B = 1, T = 16);
* ``paged-mixed``: 256 prompt tokens of one sequence plus 15 decode tokens of others, same pool;
* ``static-prefill``: one sequence's causal prefill of 512 tokens into a 1024-slot static cache
  (the last 512 columns are empty slots);
* ``window-prefill``: a sliding-window (512) causal prefill of 1024 tokens, S = 1024;
* ``chunk-dense``: 64 tokens appended to 960 cached (S = 1024, 97% allowed): the op's worst case,
  which ``kvgen.models.native.attention`` leaves to SDPA (see its dispatch rule; ``--dispatch``);
* ``decode``: one sequence's decode step (T = 1, S = 1000, no mask): the flash-decoding split.

Each case times the kernel and SDPA alternately in one process (``--rounds`` rounds of
``--reps`` calls each; medians), so drift of a shared host hits both alike; compare the ratio.

    python benchmarks/attention_kernel.py                 # SmolLM2-135M's heads: H 9, Hkv 3, D 64
    python benchmarks/attention_kernel.py --heads 8 --kv-heads 4 --head-dim 256 --softcap 50  # Gemma 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvgen.kernels import kernels_available, unavailable_reason


def paged_mask(seqs: list[tuple[int, int]], slots: int, generator: torch.Generator, window: int | None = None,
               block: int = 16) -> torch.Tensor:
    """(1, 1, T, slots) bool: sequences (cached tokens, new tokens) own random ``block``-slot blocks of
    the pool; query rows are their new tokens in order; each allows its own sequence's slots at
    positions <= its own (and within ``window`` when given)."""
    blocks = torch.randperm(slots // block, generator=generator)
    rows = sum(new for _, new in seqs)
    mask = torch.zeros(rows, slots, dtype=torch.bool)
    row, used = 0, 0
    for cached, new in seqs:
        length = cached + new
        owned = blocks[used: used + (length + block - 1) // block]
        used += len(owned)
        assert used <= len(blocks), "pool too small"
        key_pos = torch.arange(length)
        slot_of = owned[key_pos // block] * block + key_pos % block
        q_pos = torch.arange(cached, length)[:, None]
        allowed = key_pos[None, :] <= q_pos
        if window is not None:
            allowed &= q_pos - key_pos[None, :] < window
        mask[row: row + new, slot_of] = allowed
        row += new
    return mask[None, None]


def window_mask(t: int, s: int, window: int | None, offset: int = 0) -> torch.Tensor:
    """(1, 1, t, s): query i at position offset + i, key j at position j (slots past the queries empty)."""
    q = torch.arange(offset, offset + t)[:, None]
    kpos = torch.arange(s)[None, :]
    allowed = kpos <= q
    if window is not None:
        allowed &= q - kpos < window
    return allowed[None, None]


def cases(args, g: torch.Generator) -> dict[str, tuple[int, torch.Tensor | None]]:
    ctx = [int(x) for x in torch.randint(100, 1000, (16,), generator=g)]
    return {
        "paged-decode": (args.slots, paged_mask([(c, 1) for c in ctx], args.slots, g)),
        "paged-mixed": (args.slots, paged_mask([(0, 256)] + [(c, 1) for c in ctx[:15]], args.slots, g)),
        "static-prefill": (1024, window_mask(512, 1024, None)),
        "window-prefill": (1024, window_mask(1024, 1024, 512)),
        "chunk-dense": (1024, window_mask(64, 1024, None, offset=960)),
        "decode": (1000, None),
    }


def sdpa(q, k, v, mask, scale, softcap):
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    from kvgen.models.gemma import softcapped_attention
    return softcapped_attention(q, k, v, mask, False, scale, softcap)


def timed(fn, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--softcap", type=float, default=0.0)
    parser.add_argument("--slots", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", nargs="*", help="case names to run")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--dispatch", action="store_true", help="time kvgen.models.native.attention (None: SDPA)")
    args = parser.parse_args()
    if not kernels_available():
        raise SystemExit(f"kernels unavailable: {unavailable_reason()}")
    from kvgen.models import native

    if args.threads:
        torch.set_num_threads(args.threads)

    g = torch.Generator().manual_seed(0)
    h, hkv, d, scale = args.heads, args.kv_heads, args.head_dim, args.head_dim ** -0.5
    print(f"threads {torch.get_num_threads()}, H {h}, Hkv {hkv}, D {d}, softcap {args.softcap or None}")
    print(f"{'case':15s} {'T':>5s} {'S':>6s} {'allowed':>8s} {'kernel ms':>10s} {'sdpa ms':>9s} {'sdpa/kernel':>11s}"
          f" {'max |diff|':>10s}")
    for name, (s, mask) in cases(args, g).items():
        if args.only and name not in args.only:
            continue
        t = mask.shape[2] if mask is not None else 1
        q = torch.randn(1, h, t, d, generator=g)
        pool = torch.randn(2, 1, hkv, s + 8, d, generator=g)  # a cache buffer: keys and values are views
        k, v = pool[0, :, :, :s], pool[1, :, :, :s]
        if args.dispatch:
            def kernel():
                out = native.attention(q, k, v, mask, False, scale, args.softcap or None)
                return sdpa(q, k, v, mask, scale, args.softcap) if out is None else out
        else:
            def kernel():
                return torch.ops.kvgen.attention(q, k, v, mask, scale, args.softcap)
        with torch.no_grad():
            diff = (kernel() - sdpa(q, k, v, mask, scale, args.softcap)).abs().max().item()
            kt, st = [], []
            for _ in range(args.rounds):
                kt.append(timed(kernel, args.reps))
                st.append(timed(lambda: sdpa(q, k, v, mask, scale, args.softcap), args.reps))
        km, sm = statistics.median(kt) * 1e3, statistics.median(st) * 1e3
        frac = mask.float().mean().item() if mask is not None else 1.0
        print(f"{name:15s} {t:5d} {s:6d} {frac:8.4f} {km:10.3f} {sm:9.3f} {sm / km:11.2f} {diff:10.2e}")


if __name__ == "__main__":
    main()
