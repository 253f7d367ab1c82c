"""kvgen's C++ kernels: built once per machine with the system's C++ compiler, loaded as torch ops.

The sources are split by idea, as llama.cpp's CPU backend is:

* ``simd.h``: vector types and primitives per instruction set (AVX-512, AVX2; VNNI, AMX flags);
* ``parallel.h``: the threads (torch's own pool);
* ``formats.h``, ``formats.cpp``: the weight formats (GGUF blocks, kvgen's int8/int4, float rows), their
  decoding and dequantization;
* ``tiles.h``, ``tiles2.h``: the same blocks in tiles of 16 rows, and their integer groups for ``vpdpbusd``
  (AVX-512 VNNI) and for ``vpmaddubsw`` (AVX2 without it);
* ``dot.h``, ``dot.cpp``, ``dot2.h``, ``rows2.h``, ``amx.h``: the matrix products (rows, tiles, integer dot
  products: AVX-512 VNNI, AVX2 and its one-row Q4_K and Q6_K products in assembly, Intel's tile unit);
  ``panels2.h``, ``panels16.h``: AVX2's prefill products on float32 panels, and
  Q4_K's of a prompt's rows on 16-bit inputs (:func:`prefill_inputs`, :mod:`kvgen.kernels.prompt_rows`);
* ``kv_rows.h``, ``kv_rows.cpp``: how a KV cache stores keys and values (float32, float16, bfloat16, int8 rows
  with their scales), rows turned into float32 and back;
* ``attention.h``, ``attention.cpp``: attention over dense and paged keys and values, read as stored;
* ``layer.h``, ``layer.cpp``: norms, rotary, the gated MLP, a decode step's stack of layers;
* ``sampling.h``, ``sampling.cpp``: a grammar's bitmask of allowed tokens applied to logits;
* ``ssm.h``, ``ssm.cpp``: the selective scan of Mamba's mixers;
* ``ops.cpp``: the torch ops (``torch.ops.kvgen.*``), the only file that knows torch's tensors.

The library is compiled for this CPU (``-march=native``) into ``~/.cache/kvgen/kernels/``,
keyed by the sources, torch's version and the CPU's flags: the sources in parallel, then one link that optimizes
them together (``-flto=auto``). Building takes ~20 s on 2 cores, once; :func:`kernels_available` says
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvgen.folders import cache_dir

_HERE = Path(__file__).parent
_SOURCES = sorted(_HERE.glob("*.cpp"))
_HEADERS = sorted(_HERE.glob("*.h"))
# hidden symbols: nothing but the op registration leaves the library, so the link optimizes across files as freely as
# within one
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno", "-std=c++20", "-fPIC",
          "-fvisibility=hidden", "-w"]
# Link-time optimization: the files optimized together at the link, spread over every core; a compiler that rejects
# the flag builds without it.
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
    key = hashlib.sha256()
    for part in (*(p.read_bytes() for p in _SOURCES + _HEADERS), torch.__version__.encode(),
                 " ".join(_FLAGS + _PARALLEL).encode(), _cpu_flags().encode()):
        key.update(part)
    return cache_dir() / "kernels" / f"kernels-{key.hexdigest()[:16]}.so"


def _compile(compiler: str, flags: list[str], link: list[str], directory: Path, out: Path):
    """Each source to an object in ``directory``, all at once, then the objects to ``out``; the first failure."""
    objects = [directory / f"{source.stem}.o" for source in _SOURCES]
    with ThreadPoolExecutor(max_workers=min(len(_SOURCES), os.cpu_count() or 1)) as pool:
        compiled = list(pool.map(
            lambda pair: subprocess.run([compiler, *flags, "-c", str(pair[0]), "-o", str(pair[1])],
                                        capture_output=True, text=True), zip(_SOURCES, objects)))
    failed = [done for done in compiled if done.returncode != 0]
    if failed:
        return failed[0]
    return subprocess.run([compiler, *flags, "-shared", *map(str, objects), *link, "-o", str(out)],
                          capture_output=True, text=True)


def _build(target: Path) -> None:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (install g++ or set CXX)")
    lib = cpp_extension.library_paths()[0]
    flags = [*_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             *(f"-I{p}" for p in cpp_extension.include_paths())]
    link = [f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        print(f"kvgen: building kernels for this CPU (once, ~20 s on 2 cores) into {target.parent}", file=sys.stderr)
        done = _compile(compiler, [*flags, *_PARALLEL], link, Path(tmp), out)
        if done.returncode != 0:
            done = _compile(compiler, flags, link, Path(tmp), out)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed:\n{done.stderr[-2000:]}")
        os.replace(out, target)  # atomic: a concurrent process sees no half-written library


@functools.cache
def _load() -> str | None:
    """Build (if needed) and load the kernels; None on success, else why they are unavailable. A wrong
    ``KVGEN_PREFILL_INPUTS`` raises here, where the kernels load, not in :func:`kernels_available`, which the models'
    fused ops ask at every call (a check there made it 1.25 us a call instead of 0.05)."""
    _check_prefill_inputs()
    if os.environ.get("KVGEN_DISABLE_KERNELS", "") not in ("", "0"):
        return "KVGEN_DISABLE_KERNELS is set"
    try:
        path = _library_path()
        if not path.is_file():
            _build(path)
        torch.ops.load_library(str(path))
        torch.library.register_fake("kvgen::qmatmul")(  # shapes for torch.compile
            lambda x, ws, formats, prompt=False: x.new_empty(x.shape[0], sum(w.shape[0] for w in ws)))
    except Exception as error:  # no compiler, read-only cache, a compiler error: fall back, say why
        return str(error)
    return None


def kernels_available() -> bool:
    """Whether ``torch.ops.kvgen`` holds the stored-precision kernels (built on first call)."""
    return _load() is None


PREFILL_INPUTS = ("int16", "float32")


def _check_prefill_inputs() -> str:
    """``KVGEN_PREFILL_INPUTS`` checked: ``"int16"`` (unset: the default) or ``"float32"``."""
    value = os.environ.get("KVGEN_PREFILL_INPUTS", "") or "int16"
    if value not in PREFILL_INPUTS:
        raise ValueError(f"KVGEN_PREFILL_INPUTS is {value!r}: set it to 'int16' (the default: AVX2's Q4_K products of "
                         "prompt rows on 16-bit inputs, logits within 1e-2) or 'float32' (every product exact up to "
                         "rounding order), or unset it")
    return value


def prefill_inputs() -> str:
    """What the products of a prompt's rows (:mod:`kvgen.kernels.prompt_rows`) take as inputs, from
    ``KVGEN_PREFILL_INPUTS``, read at each product (checked when the kernels load, and here). ``"int16"``, the default
    on AVX2 CPUs without AVX-512 VNNI: Q4_K weights' products on inputs rounded to 16 bits a row's window of 64 values
    at a time, the window's largest value exact (1.09-1.16x faster prefills; logits within 1e-2 of the dequantized
    float32 run; a row's the same whatever rows share its product). ``"float32"`` elsewhere, or where
    ``KVGEN_PREFILL_INPUTS=float32`` asks: exact up to float32 rounding order, as every other product is.

    Example:
        >>> import os
        >>> os.environ["KVGEN_PREFILL_INPUTS"] = "float32"  # doctest: +SKIP
    """
    value = _check_prefill_inputs()
    return value if panel_rows() > 0 else "float32"


def unavailable_reason() -> str | None:
    """Why the kernels are unavailable, or None when they are."""
    return _load()


@functools.cache
def integer_dot_formats() -> frozenset[int]:
    """Weight formats whose products take integer dot products on this CPU (AVX-512 VNNI; AVX2 without it: the 4-6-bit
    GGUF formats and Q8_0 in tiles); empty elsewhere."""
    return frozenset(torch.ops.kvgen.integer_dot_formats()) if kernels_available() else frozenset()


@functools.cache
def integer_dot_instruction() -> str:
    """The instruction of those products: ``"vpdpbusd"`` (AVX-512 VNNI), ``"vpmaddubsw"`` (AVX2) or ``""``."""
    return torch.ops.kvgen.integer_dot_instruction() if kernels_available() else ""


@functools.cache
def panel_rows(format: int = 0) -> int:
    """Input rows from which every integer dot format's products dequantize each tile once into float32 panels and
    multiply them by float32 multiply-adds (AVX2 without AVX-512 VNNI, where those share the pipes with vpmaddubsw and
    three int8 levels cost more per row), or given a format's code, from which that format's do (Q6_K and Q8_0 from
    5 rows, Q4_K from 8, the others from 10); 0 where they never do."""
    return torch.ops.kvgen.panel_rows(format) if kernels_available() else 0


@functools.cache
def tile_formats() -> frozenset[int]:
    """Weight formats whose products of 16 rows or more take AMX's tile products on this CPU (Intel's AMX, with
    Linux's permission; ``KVGEN_DISABLE_AMX=1`` turns them off): the integer dot formats but Q6_K (the same sums, 16
    input rows by 16 weight rows at a time) and BF16 (the rows split exactly into three bfloat16 parts); else none."""
    return frozenset(torch.ops.kvgen.tile_formats()) if kernels_available() else frozenset()
