"""Compiled per-layer blocks for decode steps on CPU (regional compilation).

A decode step feeds one token per sequence, so it is a chain of small operations: in eager
mode every layer pays ~30 kernel launches, and a one-row matrix product streams its weight
at about half the memory bandwidth. A model marks the dense parts of a layer (norms,
projections, rotary, MLP) as blocks with :func:`decode_block`; for inputs of at most
:data:`MAX_ROWS` token rows on CPU without autograd, a block runs ``torch.compile``'d:
inductor fuses the element-wise work and, through :class:`kvgen.models.linear.Linear`,
streams each weight once. Weights are graph inputs, so one compiled graph serves every
layer. The cache update and attention stay eager, so every cache type works unchanged.

``KVGEN_DISABLE_COMPILE=1`` or :func:`eager_blocks` runs the blocks eagerly.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings

import torch

#: most token rows (batch x new tokens) a compiled block takes; larger inputs (prefill) run eagerly
MAX_ROWS = 8

_eager_depth = 0


def blocks_compiled() -> bool:
    """Whether blocks compile now (not disabled by the environment or :func:`eager_blocks`)."""
    return _eager_depth == 0 and os.environ.get("KVGEN_DISABLE_COMPILE", "") in ("", "0")


@contextlib.contextmanager
def eager_blocks():
    """Run every decode block eagerly inside this context (``generate(disable_compile=True)``)."""
    global _eager_depth
    _eager_depth += 1
    try:
        yield
    finally:
        _eager_depth -= 1


def run_blocks_eagerly(model: torch.nn.Module) -> None:
    """Never compile ``model``'s decode blocks (set on models whose weights are packed).

    Their matrix products are kvgen's kernels, which compiling cannot speed up; measured on
    SmolLM2 Q4_1, compiled blocks decoded at 52 tok/s against 56 eagerly (the per-call guard
    and wrapper costs outweigh the fused element-wise work), and a fresh process would pay
    seconds of tracing before its first token.
    """
    for module in model.modules():
        module.compile_decode = False


def _canonical(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the strides of a fresh contiguous tensor (a view such as ``x[:, -1:]`` of a prefill's
    hidden states has others, which would compile a second graph)."""
    stride, expected = t.stride(), []
    step = 1
    for size in reversed(t.shape):
        expected.append(step)
        step *= size
    if list(stride) == expected[::-1]:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def runs_fused(module) -> bool:
    """Whether ``module`` says kvgen's fused C++ ops compute it (``module.runs_fused()``: a decoder layer or a model
    head on float32 CPU weights): compiling its block would add seconds of tracing and no speed (SmolLM2 in float32,
    30 tokens after a short prompt in a fresh process: 17.3 s with a cold compile cache, 5.2 s warm, 0.82 s eager)."""
    check = getattr(module, "runs_fused", None)
    return check is not None and check()


def decode_block(fn):
    """Decorate ``fn(module, x, *tensors)``, where ``x`` is (B, T, hidden), as a compiled decode block.

    Example:
        >>> @decode_block
        ... def mlp_block(layer, x):
        ...     return x + layer.mlp(layer.norm(x))
    """
    compiled = None
    failed = False

    @functools.wraps(fn)
    def run(module, x, *args):
        nonlocal compiled, failed
        if (failed or not getattr(module, "compile_decode", True) or not x.is_cpu  # packed models: eager, decided first
                or x.shape[0] * x.shape[1] > MAX_ROWS or torch.is_grad_enabled() or torch.compiler.is_compiling()
                or not blocks_compiled() or runs_fused(module)):
            return fn(module, x, *args)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=False)
        x, *args = (_canonical(a) if isinstance(a, torch.Tensor) else a for a in (x, *args))
        try:
            return compiled(module, x, *args)
        except torch._dynamo.exc.BackendCompilerFailed as error:  # e.g. no C++ compiler on this machine
            failed = True
            warnings.warn(f"compiling {fn.__name__} failed, running it eagerly from now on: {error}")
            return fn(module, x, *args)

    return run
