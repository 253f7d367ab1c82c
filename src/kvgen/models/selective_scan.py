"""The causal convolution and the selective scan of Mamba mixers (shared by Mamba and Jamba).

Per channel ``d`` and state ``n`` (``A < 0``, ``dt > 0``), with the state ``h``:

    h_t = a_t h_{t-1} + u_t,   a_t = exp(dt_t A),   u_t = dt_t x_t B_t,   y_t = C_t . h_t

Decoding takes one step at a time (:func:`selective_step`). A prompt is scanned in
chunks of :data:`CHUNK` tokens, with a Python loop over chunks only:

* prompts of :data:`COMPILE_MIN_TOKENS` tokens or more run each chunk as one
  ``torch.compile``'d kernel: the gated recurrence over the chunk's tokens, which
  inductor fuses so that ``a``, ``u`` and ``h`` stay in registers and only the inputs
  and ``y`` touch memory;
* shorter prompts, and any prompt without compilation (``KVGEN_DISABLE_COMPILE=1``,
  ``generate(disable_compile=True)``, no C++ compiler, autograd on), take a blocked
  parallel scan in plain tensor operations
  (:func:`selective_scan`): inside blocks of :data:`BLOCK` tokens the pairs ``(a, u)``
  are composed position by position, vectorised over every block, channel and state;
  then one step per block adds the state the block starts from.

Both only multiply decays in ``(0, 1]`` and add (no division by a decay that could
underflow), so they are stable for any ``dt`` and agree with the token-by-token
recurrence to float32 rounding. Tensors are ``(batch, time, channels)``, as the
projections produce them.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from kvgen.models.decode_blocks import blocks_compiled

#: tokens per compiled chunk (the prompt is padded to a multiple with tokens that leave the state as is)
CHUNK = 32
#: shorter prompts take the eager scan: compiling (seconds, once per process) pays off on long prompts only
COMPILE_MIN_TOKENS = 128
#: tokens per block of the eager blocked scan, and tokens per segment it materialises at once
BLOCK, SEGMENT = 16, 256


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                conv_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of ``x`` (B, T, D) after the inputs kept in ``conv_state``.

    ``weight`` is (D, K), ``conv_state`` (B, D, K) holds the last K inputs (``None``: zeros).
    Returns the output (B, T, D), before the activation, and the new conv state (B, D, K).
    """
    b, t, d = x.shape
    k = weight.shape[-1]
    if conv_state is None:
        context = x.new_zeros(b, k - 1, d)
    else:
        context = conv_state[:, :, 1:].transpose(1, 2).to(x.dtype)  # (B, K - 1, D)
    full = torch.cat([context, x], dim=1)  # (B, K - 1 + T, D)
    out = full[:, :t] * weight[:, 0]
    for i in range(1, k):
        out.addcmul_(full[:, i:i + t], weight[:, i])
    if bias is not None:
        out += bias
    return out, full[:, -k:].transpose(1, 2).contiguous()


def selective_ssm(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                  D: torch.Tensor, z: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor | None,
                  compiled: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSM of a Mamba mixer over T new tokens, gated: ``y_t = (C_t . h_t + D x_t) * silu(z_t)``.

    ``x``, ``dt`` (before ``dt_bias`` and softplus) and ``z`` are (B, T, D); ``A`` is (D, N);
    ``B``, ``C`` are (B, T, N); ``state`` is (B, D, N) or ``None`` (zeros). Runs in float32;
    returns ``y`` (B, T, D) and the state after the last token (B, D, N). One token takes
    a recurrence step, more the chunked scan (``compiled``: force or avoid the compiled
    chunks; default: for prompts of :data:`COMPILE_MIN_TOKENS` tokens or more, when usable).
    """
    x, dt, z, B, C = x.float(), dt.float(), z.float(), B.float(), C.float()
    if state is None:
        state = x.new_zeros(x.shape[0], x.shape[2], A.shape[1])
    if compiled is None:
        compiled = x.shape[1] >= COMPILE_MIN_TOKENS and _compile_usable()
    if compiled and x.shape[1] > 1:
        try:
            return _scan_compiled(state, x, dt, z, A, B, C, D.detach().float(), dt_bias.detach().float())
        except Exception as error:  # e.g. no C++ compiler: fall back for good, as decode blocks do
            _disable_compile(error)
    dt = F.softplus(dt + dt_bias.float())  # (B, T, D)
    if x.shape[1] == 1:
        y, state = selective_step(state, dt[:, 0], dt[:, 0] * x[:, 0], A, B[:, 0], C[:, 0])
        y = y[:, None]
    else:
        y, state = selective_scan(state, dt, x, A, B, C)
    return (y + x * D.float()) * F.silu(z), state


def selective_step(state: torch.Tensor, dt: torch.Tensor, dtx: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrence step: ``dt``, ``dtx = dt * x`` (B, D), ``B``, ``C`` (B, N), ``state`` (B, D, N) -> (C . h, h)."""
    state = state * torch.exp(dt[..., None] * A) + dtx[..., None] * B[:, None, :]  # (B, D, N)
    return (state @ C[..., None])[..., 0], state  # (B, D), (B, D, N)


def selective_scan(state: torch.Tensor, dt: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocked parallel scan in plain tensor operations: ``C_t . h_t`` (B, T, D) and the last state (B, D, N).

    ``dt`` (after softplus) and ``x`` are (B, T, D), ``B`` and ``C`` (B, T, N), ``state`` (B, D, N),
    all float32. Inside blocks of :data:`BLOCK` tokens, the maps ``h -> a h + u`` are composed
    position by position, vectorised over every block; then each block adds its starting state.
    """
    batch, t, d = dt.shape
    n = A.shape[1]
    h, dtx, ys = state, dt * x, []
    for start in range(0, t, SEGMENT):
        length = min(SEGMENT, t - start)
        blocks = -(-length // BLOCK)
        pad = (0, 0, 0, blocks * BLOCK - length)  # padded tokens: dt = 0, so a = 1 and u = 0 (the state stays)
        dt_s, dtx_s, B_s, C_s = (F.pad(v[:, start:start + length], pad) for v in (dt, dtx, B, C))
        a = torch.exp(dt_s[..., None] * A).view(batch, blocks, BLOCK, d, n)  # (B, blocks, BLOCK, D, N)
        u = (dtx_s[..., None] * B_s[:, :, None, :]).view(batch, blocks, BLOCK, d, n)
        for j in range(1, BLOCK):  # (a, u)[j] := the map from a block's starting state to its j-th state
            u[:, :, j].addcmul_(a[:, :, j], u[:, :, j - 1])
            a[:, :, j].mul_(a[:, :, j - 1])
        for k in range(blocks):  # u becomes the states: add each block's starting state
            u[:, k].addcmul_(a[:, k], h[:, None])
            h = u[:, k, -1]
        y = u.view(batch, blocks * BLOCK, d, n) @ C_s[..., None]  # (B, T', D, 1)
        ys.append(y[:, :length, :, 0])
    return torch.cat(ys, dim=1), h.clone()  # (a copy: a view would keep the whole segment alive in the cache)


def _sequential_chunk(h, x, dt, z, A, B, C, D, dt_bias):
    """The gated SSM over one chunk (B, CHUNK, ...), token by token; only ever run compiled (one fused kernel)."""
    ys = []
    for i in range(x.shape[1]):
        step = F.softplus(dt[:, i] + dt_bias)  # (B, D)
        h = h * torch.exp(step[..., None] * A) + (step * x[:, i])[..., None] * B[:, i, None, :]  # (B, D, N)
        ys.append(((h * C[:, i, None, :]).sum(-1) + D * x[:, i]) * F.silu(z[:, i]))  # (B, D)
    return torch.stack(ys, dim=1), h


def _scan_compiled(h, x, dt, z, A, B, C, D, dt_bias):
    t = x.shape[1]
    if t % CHUNK:  # padded tokens (dt = -inf: softplus 0) leave the state as is; their outputs are dropped
        pad = (0, 0, 0, -t % CHUNK)
        x, z, B, C = (F.pad(v, pad) for v in (x, z, B, C))
        dt = F.pad(dt, pad, value=float("-inf"))
    x, dt, z, B, C = (v.contiguous() for v in (x, dt, z, B, C))
    # The compiled graph is specialised to its inputs' layout: chunks of a single sequence are contiguous
    # views (no copy), chunks of a batch are copied to fresh tensors; either way every chunk looks alike.
    chunk_fn, ys = _compiled_chunk(), []
    h, A, D, dt_bias = (_fresh(v) for v in (h, A, D, dt_bias))
    for start in range(0, x.shape[1], CHUNK):
        x_c, dt_c, z_c, B_c, C_c = (v[:, start:start + CHUNK] for v in (x, dt, z, B, C))
        if x.shape[0] > 1:
            x_c, dt_c, z_c, B_c, C_c = (_fresh(v) for v in (x_c, dt_c, z_c, B_c, C_c))
        y, h = chunk_fn(h, x_c, dt_c, z_c, A, B_c, C_c, D, dt_bias)
        ys.append(y)
    return torch.cat(ys, dim=1)[:, :t], h


def _fresh(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


_compiled_fn = None
_compile_failed = False


def _compile_usable() -> bool:
    return (not _compile_failed and blocks_compiled() and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling())


def _compiled_chunk():
    global _compiled_fn
    if _compiled_fn is None:
        # One thread: a chunk is a small job (~0.5 ms), and an OpenMP fork/join per chunk stalls whenever the
        # other core is busy. On this shared 2-core host a 2-thread kernel made an 8-layer prefill 11-21 s where
        # this one takes 6-8 s (transformers: 8-10 s); on an idle host 2 threads save ~25 ms per layer.
        _compiled_fn = torch.compile(_sequential_chunk, fullgraph=True, dynamic=True, options={"cpp.threads": 1})
    return _compiled_fn


def _disable_compile(error: Exception) -> None:
    global _compile_failed
    _compile_failed = True
    warnings.warn(f"the compiled selective scan failed ({type(error).__name__}: {error}); Mamba prompts now use "
                  "the eager blocked scan (set KVGEN_DISABLE_COMPILE=1 to skip compilation)")
