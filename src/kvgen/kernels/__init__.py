"""kvgen's C++ kernels (``quantized.cpp``): built once per machine with the system's C++ compiler.

The library is compiled for this CPU (``-march=native``) into ``~/.cache/kvgen/kernels/``,
keyed by the source, torch's version and the CPU's flags, then loaded as torch ops
(``torch.ops.kvgen.*``). Building takes ~20 s on 2 cores, once; :func:`kernels_available` says
whether the ops could be built (no compiler: stored-precision weights fall back to float32).

Example:
    >>> from kvgen.kernels import kernels_available
    >>> kernels_available()  # doctest: +SKIP
    True
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

_SOURCE = Path(__file__).with_name("quantized.cpp")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno", "-std=c++20", "-shared", "-fPIC",
          "-w"]
# Link-time optimization splits the optimization of the one source file over every core (g++: 27 -> 18 s on 2 cores,
# the same code speed); a compiler that rejects the flag builds without it.
_PARALLEL = ["-flto=auto"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def _library_path() -> Path:
    from kvgen.loading.default_model import cache_dir

    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), torch.__version__.encode(), " ".join(_FLAGS + _PARALLEL).encode(),
                 _cpu_flags().encode()):
        key.update(part)
    return cache_dir() / "kernels" / f"quantized-{key.hexdigest()[:16]}.so"


def _build(target: Path) -> None:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (install g++ or set CXX)")
    lib = cpp_extension.library_paths()[0]
    command = [compiler, *_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               *(f"-I{p}" for p in cpp_extension.include_paths()), str(_SOURCE),
               f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        print(f"kvgen: building kernels for this CPU (once, ~20 s on 2 cores) into {target.parent}", file=sys.stderr)
        done = subprocess.run([*command, *_PARALLEL, "-o", str(out)], capture_output=True, text=True)
        if done.returncode != 0:
            done = subprocess.run([*command, "-o", str(out)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed:\n{done.stderr[-2000:]}")
        os.replace(out, target)  # atomic: a concurrent process sees no half-written library


@functools.cache
def _load() -> str | None:
    """Build (if needed) and load the kernels; None on success, else why they are unavailable."""
    if os.environ.get("KVGEN_DISABLE_KERNELS", "") not in ("", "0"):
        return "KVGEN_DISABLE_KERNELS is set"
    try:
        path = _library_path()
        if not path.is_file():
            _build(path)
        torch.ops.load_library(str(path))
        torch.library.register_fake("kvgen::qmatmul")(  # shapes for torch.compile
            lambda x, ws, formats: x.new_empty(x.shape[0], sum(w.shape[0] for w in ws)))
    except Exception as error:  # no compiler, read-only cache, a compiler error: fall back, say why
        return str(error)
    return None


def kernels_available() -> bool:
    """Whether ``torch.ops.kvgen`` holds the stored-precision kernels (built on first call)."""
    return _load() is None


def unavailable_reason() -> str | None:
    """Why the kernels are unavailable, or None when they are."""
    return _load()


@functools.cache
def integer_dot_formats() -> frozenset[int]:
    """Weight formats whose products take integer dot products on this CPU (AVX-512 VNNI); empty elsewhere."""
    return frozenset(torch.ops.kvgen.integer_dot_formats()) if kernels_available() else frozenset()


@functools.cache
def tile_formats() -> frozenset[int]:
    """Weight formats whose products of 16 rows or more take AMX's tile products on this CPU (Intel's AMX, with
    Linux's permission; ``KVGEN_DISABLE_AMX=1`` turns them off): the integer dot formats but Q6_K (the same sums, 16
    input rows by 16 weight rows at a time) and BF16 (the rows split exactly into three bfloat16 parts); else none."""
    return frozenset(torch.ops.kvgen.tile_formats()) if kernels_available() else frozenset()
