"""The causal convolution and the selective scan of Mamba mixers (shared by Mamba and Jamba).

Per channel ``d`` and state ``n`` (``A < 0``, ``dt > 0``), with the state ``h``:

    h_t = a_t h_{t-1} + u_t,   a_t = exp(dt_t A),   u_t = dt_t x_t B_t,   y_t = C_t . h_t

On the CPU, prompts and decode steps take kvgen's C++ scan (``kvgen::selective_scan``: a
register's worth of channels walked token after token, their states in L1, exp vectorised).
Elsewhere (a GPU, autograd on, compilation, no C++ compiler) a decode step takes one
recurrence step (:func:`selective_step`) and a prompt a blocked parallel scan in plain tensor
operations (:func:`selective_scan`): inside blocks of :data:`BLOCK` tokens the pairs ``(a, u)``
are composed position by position, vectorised over every block, channel and state; then one
step per block adds the state the block starts from.

All three only multiply decays in ``(0, 1]`` and add (no division by a decay that could
underflow), so they are stable for any ``dt`` and agree with the token-by-token
recurrence to float32 rounding. Tensors are ``(batch, time, channels)``, as the
projections produce them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvgen.models.native import _native

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
                  D: torch.Tensor, z: torch.Tensor, dt_bias: torch.Tensor,
                  state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSM of a Mamba mixer over T new tokens, gated: ``y_t = (C_t . h_t + D x_t) * silu(z_t)``.

    ``x``, ``dt`` (before ``dt_bias`` and softplus) and ``z`` are (B, T, D); ``A`` is (D, N);
    ``B``, ``C`` are (B, T, N); ``state`` is (B, D, N) or ``None`` (zeros). Runs in float32;
    returns ``y`` (B, T, D) and the state after the last token (B, D, N): kvgen's C++ scan on the
    CPU (a decode step too: 0.07 ms a layer of mamba-130m's shape against 0.13 for torch's ops),
    elsewhere a recurrence step for one token, the blocked scan for more.
    """
    x, dt, z, B, C = x.float(), dt.float(), z.float(), B.float(), C.float()
    if state is None:
        state = x.new_zeros(x.shape[0], x.shape[2], A.shape[1])
    dt = F.softplus(dt + dt_bias.float())  # (B, T, D)
    if _native(x, None):  # (x is float32 by now)
        y, state = torch.ops.kvgen.selective_scan(state.float(), dt, x, A.float(), B, C)
    elif x.shape[1] == 1:
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
