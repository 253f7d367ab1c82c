"""Weights kept in their stored formats: kernels against gguf's own dequantization, and whole
models run quantized against the same weights dequantized to float32.

GGUF dequantization is exact in float32, so ``dequantize_`` must equal gguf's bit for bit,
and a quantized model must compute what its dequantized twin computes up to summation order:
logits within 1e-3 over a prefill and 50 decode steps, and the same greedy text.
"""

from __future__ import annotations

import copy
import mmap
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

import kvgen
from kvgen.kernels import (integer_dot_formats, integer_dot_instruction, kernels_available, panel_rows,
                           prefill_inputs, unavailable_reason)
from kvgen.kernels.prompt_rows import prompt_rows, rows_kind
from kvgen.loading.gguf_file import read_gguf_header
from kvgen.models.packed import TILED, TILED_HEADS, PackedWeight, dequantize_on_device, row_bytes, tile_rows, untile_rows
from kvgen.models.quantized_linear import QuantizedEmbedding, QuantizedLinear
from kvgen.models.weight_arena import WeightArena
from kvgen.quantization import TorchAoConfig, quantize_int4, quantize_int8

# skipped only where there is no compiler; a compiler error in kvgen's own source fails every test here
pytestmark = pytest.mark.skipif(not kernels_available() and "no C++ compiler" in unavailable_reason(),
                                reason="no C++ compiler to build kvgen's kernels")

QUANTIZABLE = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.F16, Q.BF16]  # gguf.quants can quantize these
K_QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]  # it can only dequantize these: random blocks with sane scales
SCALES_AT = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # byte offsets of each block's float16 scales


def random_raw(qtype, rows, cols, seed=0, scale=0.01) -> np.ndarray:
    """gguf's quantization of standard normal values, or random K-quant blocks whose float16 scales are normal with
    std ``scale``."""
    rng = np.random.default_rng(seed)
    if qtype in QUANTIZABLE:
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype).view(np.uint8)
    block, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    for at in SCALES_AT[qtype]:
        raw[:, :, at:at + 2] = (rng.standard_normal((rows, cols // block, 1)) * scale).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def check_against_gguf(raw: np.ndarray, qtype, cols: int) -> None:
    """dequantize_ and dequantize_on_device (the GPU's torch operations, here on CPU tensors) equal gguf bit for bit;
    qmatmul (1, 2, 3, 8, 11 and 70 rows) equals x @ W.T up to summation order. The same in tiles of 16 rows (the
    layout models keep Q4_0, Q4_1, Q5_0, Q4_K and Q6_K in; untile_rows gives the rows back), and embedding lookups
    of either layout."""
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(raw.shape[0], cols))
    weight = PackedWeight([(int(qtype), torch.from_numpy(np.ascontiguousarray(raw)))], cols)
    assert torch.equal(dequantize_on_device(int(qtype), weight.segments[0][1], cols), expected)
    tiled = tile_rows(weight)
    assert torch.equal(untile_rows(tiled).segments[0][1], weight.segments[0][1])
    is_tiled = tiled.segments[0][0] != int(qtype)
    tiles = {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q4_K, Q.Q6_K} | ({Q.Q8_0} if 2008 in integer_dot_formats() else set())
    assert is_tiled == (qtype in tiles and raw.shape[0] % 16 == 0)
    for w in (weight, tiled) if is_tiled else (weight,):
        ((format, data),) = w.segments
        assert torch.equal(w.dequantize(), expected)
        ids = torch.tensor([[0, raw.shape[0] - 1, 5], [17 % raw.shape[0], 5, 2]])
        assert torch.equal(QuantizedEmbedding(w)(ids), expected[ids])
        for rows in (1, 2, 3, 8, 11, 70):  # every path of the kernels: 1-2 and more rows unpack differently
            x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
            got = torch.ops.kvgen.qmatmul(x, [data], [format])
            reference = x.double() @ expected.double().T
            bound = 1e-5 * (x.double().abs() @ expected.double().abs().T) + 1e-6  # float32 summation error
            assert ((got.double() - reference).abs() <= bound).all()


@pytest.mark.parametrize("qtype", QUANTIZABLE + K_QUANTS, ids=lambda q: q.name)
def test_kernels_match_gguf_on_synthetic_blocks(qtype):
    check_against_gguf(random_raw(qtype, 48, 512), qtype, 512)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_integer_dot_products_at_their_largest_sums(qtype):
    """Every stored value at its largest code and every input value at the largest rounded magnitude: the integer
    dot products sum a group's three levels in int32, which holds 32 x 31 (16 x 63) x 127 * 2^14 with little to
    spare; a wider bound or a misplaced shift wraps the sums and fails this. Q8_0's largest is -128: AVX2 multiplies
    its magnitude, 128, by a level (2 x 128 x 127 fills vpmaddubsw's 16-bit lane)."""
    block, nbytes = GGML_QUANT_SIZES[qtype]
    # all bits set: every code at its maximum (Q8_0: every value -128)
    raw = np.full((16, 256 // block, nbytes), 0x80 if qtype == Q.Q8_0 else 0xFF, dtype=np.uint8)
    scales = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q6_K: [208]}[qtype]
    for at in scales:
        raw[:, :, at:at + 2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    if qtype == Q.Q6_K:
        raw[:, :, 192:208] = 127  # its int8 group scales (0xFF would read as -1)
    raw = raw.reshape(16, -1)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(16, 256))
    tiled = tile_rows(PackedWeight([(int(qtype), torch.from_numpy(raw))], 256))
    ((format, data),) = tiled.segments
    signs = torch.where(torch.arange(256) % 3 == 0, -1.0, 1.0)
    for x in (torch.ones(16, 256), -torch.ones(16, 256), signs.expand(16, 256) * 3.5):
        for rows in (1, 8, 16):
            xr = x[:rows].contiguous()
            got = torch.ops.kvgen.qmatmul(xr, [data], [format])
            reference = xr.double() @ expected.double().T
            assert ((got.double() - reference).abs() <= 1e-5 * (xr.double().abs() @ expected.double().abs().T)).all()


@pytest.fixture(scope="module")
def gemma3_gguf():
    from kvgen.loading.default_model import gemma3_gguf_path

    return gemma3_gguf_path()


def test_kernels_match_gguf_on_the_packaged_files(gemma3_gguf):
    from kvgen.loading.default_model import default_gguf_path

    seen = set()
    for path in (default_gguf_path(), gemma3_gguf):
        # the tensor table (kvgen's reader: gguf's parses Gemma's 262k-token vocabulary first, ~20 s)
        for tensor in read_gguf_header(Path(path)).tensors:
            if tensor.type == Q.F32 or tensor.type in seen:
                continue
            seen.add(tensor.type)
            cols = tensor.shape[0]
            block, block_bytes = GGML_QUANT_SIZES[tensor.type]
            raw = np.fromfile(path, np.uint8, 64 * cols // block * block_bytes, offset=tensor.offset)  # 64 rows
            check_against_gguf(raw.reshape(64, -1), tensor.type, cols)
    assert seen == {Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q6_K}


def test_fingerprint_does_not_depend_on_the_tile_layout():
    """Q8_0 is kept in tiles only where integer dot products run, so a model's fingerprint (cache files, the
    shared prefix store's keys) samples packed weights in GGUF row order whatever their layout."""
    from types import SimpleNamespace

    from kvgen.cache.fingerprint import model_fingerprint
    from kvgen.models.packed import stored_positions

    def model(weight):
        m = torch.nn.Module()
        m.proj, m.config = QuantizedLinear(weight), SimpleNamespace(hidden_size=512)
        return m

    for qtype in (Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K):
        raw = torch.from_numpy(random_raw(qtype, 48, 512))
        weight = PackedWeight([(int(qtype), raw)], 512)
        ((format, data),) = tile_rows(weight).segments
        every = torch.arange(raw.numel())
        assert torch.equal(data.reshape(-1)[stored_positions(format, data, every)], raw.reshape(-1))
        assert model_fingerprint(model(weight)) == model_fingerprint(model(tile_rows(weight)))
        other = PackedWeight([(int(qtype), torch.from_numpy(random_raw(qtype, 48, 512, seed=1)))], 512)
        assert model_fingerprint(model(other))["weights"] != model_fingerprint(model(weight))["weights"]


def test_int8_and_int4_rows_dequantize_to_their_definition():
    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(0))
    packed = quantize_int8(w)
    rows = packed.segments[0][1]
    q, scale = rows[:, :256].view(torch.int8).float(), rows[:, 256:].view(torch.float32)
    assert torch.equal(packed.dequantize(), q * scale)
    assert (packed.dequantize() - w).abs().max() <= scale.max() / 2 + 1e-6
    for group in (32, 64, 128):
        packed = quantize_int4(w, group)
        blocks = packed.segments[0][1].reshape(40, 256 // group, 8 + group // 2)
        d, m = blocks[..., :4].contiguous().view(torch.float32), blocks[..., 4:8].contiguous().view(torch.float32)
        nib = blocks[..., 8:]
        q = torch.cat([nib & 15, nib >> 4], dim=-1).float()  # (40, groups, G)
        assert torch.equal(packed.dequantize(), (q * d + m).reshape(40, 256))
        error = (packed.dequantize() - w).reshape(40, 256 // group, group)
        inside = (w.reshape(error.shape) >= m - 1e-6) & (w.reshape(error.shape) <= m + 15 * d + 1e-6)
        assert (error.abs() <= d / 2 + 1e-6)[inside].all()  # rounding error only, where the range holds w
        g = w.reshape(error.shape)  # the range search never does worse than plain min/max per group
        low, high = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        plain = ((g - low) / ((high - low) / 15)).round() * ((high - low) / 15) + low - g
        assert (error.square().sum(-1) <= plain.square().sum(-1) * (1 + 1e-5) + 1e-9).all()
        x = torch.randn(5, 256, dtype=torch.float64)
        got = QuantizedLinear(packed)(x.float()).double()
        # the kernel sums d * q * x and m * x apart: float32 rounding of the larger of the two
        magnitude = x.abs() @ ((q * d).abs() + m.abs()).reshape(40, 256).double().T
        assert ((got - x @ packed.dequantize().double().T).abs() <= 1e-5 * magnitude + 1e-6).all()


@pytest.mark.parametrize("format", sorted(TILED_HEADS))
def test_the_tiling_kernel_keeps_every_formats_bytes(format):
    """``tile_rows_`` (the C++ copy a load tiles with, 16 columns a transpose) against ``untile_rows`` (torch's
    reshapes): every tiled format's geometry (head fields of 2 or 4 bytes or none, bytes past the last 16-column
    run, int8's row scales after the blocks), random bytes, rows read from a wider buffer (a stride of their own)."""
    nbytes = row_bytes(format, 512)
    wide = torch.randint(0, 256, (48, nbytes + 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(format))
    rows = wide[:, 8:8 + nbytes]  # (48, row bytes), 40 bytes apart more than their length
    tiles = torch.empty(rows.shape, dtype=torch.uint8)
    if format not in (2, 3, 6, 8, 12, 14) and 2000 + format not in integer_dot_formats():  # kvgen's int8 / int4
        with pytest.raises(RuntimeError, match="no tiles in this build"):
            torch.ops.kvgen.tile_rows_(tiles, rows, 2000 + format)
        return
    torch.ops.kvgen.tile_rows_(tiles, rows, 2000 + format)
    assert not torch.equal(tiles, rows)
    assert torch.equal(untile_rows(PackedWeight([(2000 + format, tiles)], 512)).segments[0][1], rows)


LOAD_TIME = {"int8": quantize_int8, **{f"int4/g{g}": lambda w, g=g: quantize_int4(w, g) for g in (32, 64, 128)}}


@pytest.mark.parametrize("name", LOAD_TIME)
def test_int8_and_int4_tiles_hold_the_rows_bytes_and_products(name):
    """kvgen's int8 and int4 rows go into tiles of 16 rows where their integer dot products run (else they stay
    rows): the rows' bytes in another order (untile_rows, the fingerprint's positions), the same dequantized values
    and embedding rows, and products (1-70 rows: every path) equal to x @ W.T within float32 summation error, to
    which x's rounding to 21 bits per block of 32 values adds at most 2^-22 of the block's largest value."""
    from kvgen.models.packed import stored_positions

    w = torch.randn(48, 512, generator=torch.Generator().manual_seed(5))
    rows = LOAD_TIME[name](w)
    ((format, data),) = rows.segments
    ((tiled_format, tiles),) = tile_rows(rows).segments
    if 2000 + format not in integer_dot_formats():
        assert (tiled_format, tiles) == (format, data)  # no kernel for those tiles on this CPU
        return
    assert tiled_format == 2000 + format and not torch.equal(tiles, data)
    assert torch.equal(untile_rows(PackedWeight([(tiled_format, tiles)], 512)).segments[0][1], data)
    assert torch.equal(tiles.reshape(-1)[stored_positions(tiled_format, tiles, torch.arange(data.numel()))],
                       data.reshape(-1))
    expected = rows.dequantize()
    tiled = PackedWeight([(tiled_format, tiles)], 512)
    assert torch.equal(tiled.dequantize(), expected)
    ids = torch.tensor([[0, 47, 5], [17, 5, 16]])
    assert torch.equal(QuantizedEmbedding(tiled)(ids), expected[ids])
    for count in (1, 2, 3, 8, 11, 16, 17, 70):
        x = torch.randn(count, 512, generator=torch.Generator().manual_seed(count))
        got = torch.ops.kvgen.qmatmul(x, [tiles], [tiled_format]).double()
        bound = 1e-5 * (x.double().abs() @ expected.double().abs().T) + 1e-6
        assert ((got - x.double() @ expected.double().T).abs() <= bound).all(), count


@pytest.mark.parametrize("name", LOAD_TIME)
def test_int8_and_int4_tiles_at_their_largest_sums(name):
    """Every code at its extreme (int8: +-127 by columns; int4: 15) and every input at its largest rounded magnitude:
    int8's values take the tiles' bias of 128 (sums up to 32 x 255 x 127 x 2^14, combined in float32) and int4's sum
    their three levels in int32; a wrapped or misplaced sum fails this. (Where no integer dot products run, the rows'
    float32 products.)"""
    ((format, data),) = LOAD_TIME[name](torch.randn(16, 256)).segments
    if name == "int8":
        data[:, :256] = torch.tensor([127, 129], dtype=torch.uint8).repeat(128)  # 127, -127, ...
        data[:, 256:] = torch.tensor([0.01]).view(torch.uint8)
    else:
        group = int(name.removeprefix("int4/g"))
        blocks = data.view(16, 256 // group, 8 + group // 2)
        blocks[..., :8] = torch.tensor([0.01, -0.05]).view(torch.uint8)  # scale, min
        blocks[..., 8:] = 0xFF  # every code 15
    rows = PackedWeight([(format, data)], 256)
    expected = rows.dequantize().double()
    ((tiled_format, tiles),) = tile_rows(rows).segments
    signs = torch.where(torch.arange(256) % 3 == 0, -1.0, 1.0)
    for x in (torch.ones(16, 256), -torch.ones(16, 256), signs.expand(16, 256) * 3.5):
        for count in (1, 8, 16):
            xr = x[:count].contiguous()
            got = torch.ops.kvgen.qmatmul(xr, [tiles], [tiled_format]).double()
            reference = xr.double() @ expected.T
            assert ((got - reference).abs() <= 1e-5 * (xr.double().abs() @ expected.abs().T)).all()


def test_device_decoding_by_torch_operations_equals_the_kernels():
    """The GPU path (dequantize_on_device: torch operations on any device) against the CPU kernels."""
    w = torch.randn(24, 256, generator=torch.Generator().manual_seed(3))
    weights = [quantize_int8(w), *(quantize_int4(w, g) for g in (32, 64, 128)),
               PackedWeight([(int(Q.F16), w.half().view(torch.uint8))], 256),
               PackedWeight([(int(Q.BF16), w.bfloat16().view(torch.uint8))], 256)]
    for weight in weights:
        ((format, data),) = weight.segments
        assert torch.equal(dequantize_on_device(format, data, 256), weight.dequantize()), format
    ((format, tiles),) = tile_rows(PackedWeight([(int(Q.Q4_K), torch.from_numpy(random_raw(Q.Q4_K, 16, 256)))],
                                                256)).segments
    with pytest.raises(ValueError, match=r"Q4_K rows in tiles of 16 \(format 2012\) decode on the CPU only.*untile"):
        dequantize_on_device(format, tiles, 256)


def test_packed_layers_leave_the_cpu_in_gguf_rows():
    """Off the CPU, weights in tiles of 16 rows go back to GGUF rows, which dequantize_on_device and row lookups
    read (here the meta device: shapes only; tests/test_cuda.py runs a GGUF model on a GPU and back)."""
    q4_k = PackedWeight([(int(Q.Q4_K), torch.from_numpy(random_raw(Q.Q4_K, 32, 256)))], 256)
    q8_0 = PackedWeight([(int(Q.Q8_0), torch.from_numpy(random_raw(Q.Q8_0, 8, 256)))], 256)  # 8 rows: no tiles
    layer = QuantizedLinear(tile_rows(PackedWeight(q4_k.segments + q8_0.segments, 256)))
    embedding = QuantizedEmbedding(tile_rows(q4_k))
    assert layer.formats == [2012, 8] and embedding.formats == [2012]
    layer, embedding = layer.to("meta"), embedding.to("meta")
    assert layer.formats == [12, 8] and embedding.formats == [12] and layer.packed_0.device.type == "meta"
    assert layer(torch.randn(3, 256, device="meta")).shape == (3, 40)
    assert embedding(torch.tensor([[1, 31]], device="meta")).shape == (1, 2, 256)


def test_a_fused_weight_of_several_formats_is_one_product():
    parts = [(Q.Q5_0, 24), (Q.Q8_0, 8), (Q.Q5_0, 40), (Q.Q6_K, 16)]  # Gemma 3's q/k/v formats, and a K-quant
    segments = [(int(q), torch.from_numpy(random_raw(q, rows, 256, seed=i))) for i, (q, rows) in enumerate(parts)]
    weight = PackedWeight(segments, 256)
    dense = torch.cat([PackedWeight([s], 256).dequantize() for s in segments])
    assert torch.equal(weight.dequantize(), dense)
    layer = QuantizedLinear(weight, bias=torch.randn(88))
    for rows in (1, 5, 8, 12):  # 12 rows: the prefill path (dequantized into the scratch buffer)
        x = torch.randn(rows, 256)
        torch.testing.assert_close(layer(x), x @ dense.T + layer.bias, rtol=1e-4, atol=1e-4)


def test_quantized_layers_reject_bad_input():
    packed = quantize_int8(torch.randn(8, 64))
    with pytest.raises(ValueError, match="int4 group_size must be one of"):
        TorchAoConfig("int4_weight_only", group_size=16)
    with pytest.raises(ValueError, match="quant_type 'int3' is not supported"):
        TorchAoConfig("int3")
    with pytest.raises(ValueError, match="cannot hold rows of 48 values"):
        PackedWeight([(3, torch.zeros(2, 30, dtype=torch.uint8))], in_features=48)
    with pytest.raises(ValueError, match=r"must be \(rows, 40\) uint8"):
        PackedWeight([(3, torch.zeros(2, 30, dtype=torch.uint8))], in_features=64)
    with pytest.raises(RuntimeError, match="input features"):
        torch.ops.kvgen.qmatmul(torch.randn(1, 32), [packed.segments[0][1]], [1008])
    with pytest.raises(IndexError, match="token id 8 is outside the embedding table's 8 rows"):
        QuantizedEmbedding(packed)(torch.tensor([8]))
    with pytest.raises(IndexError, match="token id -1 is outside"):
        QuantizedEmbedding(packed)(torch.tensor([[0, -1]]))


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q6_K, Q.Q8_0], ids=lambda q: q.name)
def test_embedding_rows_of_tiled_and_untiled_tables(qtype):
    raw = torch.from_numpy(random_raw(qtype, 48, 256))
    rows_weight = PackedWeight([(int(qtype), raw)], in_features=256)
    for weight in (rows_weight, tile_rows(rows_weight)):
        ids = torch.tensor([[0, 15, 16, 47], [5, 5, 33, 31]])  # first/last rows of tiles, repeats
        rows = QuantizedEmbedding(weight)(ids)
        assert rows.shape == (2, 4, 256)
        assert torch.equal(rows, weight.dequantize()[ids])


DOT_WEIGHTS = {**{q.name: q for q in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K)}, **LOAD_TIME}


def _rounded16(x: torch.Tensor) -> torch.Tensor:
    """x (rows, K) as AVX2's Q4_K products of a prompt's rows take it: in each row's window of 64 values, the value of
    the largest magnitude (the first such) exact, the window's other values rounded to int16 on the scale of their
    largest (float32 arithmetic, ties to even)."""
    rows, k = x.shape
    w = x.reshape(rows, k // 64, 64)
    exact = torch.zeros_like(w, dtype=torch.bool).scatter_(-1, w.abs().argmax(-1, keepdim=True), True)
    top = w.abs().masked_fill(exact, 0.0).amax(-1, keepdim=True)
    inv = torch.where(top > 0, torch.tensor(32767.0) / top, torch.tensor(0.0))
    return torch.where(exact, w, torch.round(w * inv) * (top / 32767.0)).reshape(rows, k)


def test_q4_k_products_of_prompt_rows_take_16_bit_inputs(monkeypatch):
    """Products of a prompt's rows (qmatmul's ``prompt``): where AVX2 without AVX-512 VNNI has the route
    (panel_rows() > 0), Q4_K's take x rounded as _rounded16 says, whatever the number of rows, exact but for float32
    rounding (the int32 sums of a window are exact: a few roundings a window, 1e-6 of the products' magnitude), each
    row's the same bits whatever the other rows (the same operations on the same values); KVGEN_PREFILL_INPUTS=float32
    and other CPUs: the exact product, as for rows of generated tokens. A NaN input gives its row NaN and no other;
    other values of the variable are refused."""
    rows = PackedWeight([(int(Q.Q4_K), torch.from_numpy(np.ascontiguousarray(random_raw(Q.Q4_K, 48, 512))))], 512)
    ((format, data),) = tile_rows(rows).segments
    weight = rows.dequantize().double()
    generator = torch.Generator().manual_seed(7)
    sixteen = panel_rows() > 0 and format in integer_dot_formats()
    monkeypatch.delenv("KVGEN_PREFILL_INPUTS", raising=False)
    assert prefill_inputs() == ("int16" if sixteen else "float32")
    for count, scale in ((1, 1.0), (3, 1.0), (10, 1.0), (11, 1e-3), (64, 300.0)):
        x = torch.randn(count, 512, generator=generator) * scale
        x[:, 5] *= 50  # an outlier column
        x[0, 64:128] = 0  # a window of zeros
        if count > 1:
            x[1, 128:192] = 0
            x[1, 130] = 2.0  # a window of one value
        exact = torch.ops.kvgen.qmatmul(x, [data], [format])
        assert torch.equal(torch.ops.kvgen.qmatmul(x, [data], [format], False), exact)
        got = torch.ops.kvgen.qmatmul(x, [data], [format], True)
        if sixteen:
            taken = _rounded16(x).double()
            magnitude = taken.abs() @ weight.abs().T
            assert ((got.double() - taken @ weight.T).abs() <= 1e-6 * magnitude).all()
            assert not ((exact.double() - taken @ weight.T).abs() <= 1e-6 * magnitude).all()  # x itself: farther
        else:
            assert torch.equal(got, exact)
        monkeypatch.setenv("KVGEN_PREFILL_INPUTS", "float32")
        assert prefill_inputs() == "float32"
        assert torch.equal(torch.ops.kvgen.qmatmul(x, [data], [format], True), exact)
        monkeypatch.delenv("KVGEN_PREFILL_INPUTS")
    others = torch.randn(20, 512, generator=generator) * 100.0  # a row's products whatever the product's other rows
    mixed = torch.ops.kvgen.qmatmul(torch.cat([others[:7], x, others[7:]]), [data], [format], True)
    assert torch.equal(mixed[7:7 + len(x)], got)
    x[3, 7] = float("nan")
    y = torch.ops.kvgen.qmatmul(x, [data], [format], True)
    assert y[3].isnan().all() and y[torch.arange(len(x)) != 3].isfinite().all()
    monkeypatch.setenv("KVGEN_PREFILL_INPUTS", "int8")
    with pytest.raises(ValueError, match="KVGEN_PREFILL_INPUTS is 'int8'"):
        prefill_inputs()
    # and where the kernels load (kernels_available, which the fused ops ask at every call, does not read it again)
    loading = subprocess.run([sys.executable, "-c", "import kvgen.kernels as k; k.kernels_available()"],
                             capture_output=True, text=True, env=os.environ | {"KVGEN_PREFILL_INPUTS": "int8"})
    assert loading.returncode != 0 and "ValueError: KVGEN_PREFILL_INPUTS is 'int8'" in loading.stderr


def _amx_cpu() -> bool:
    flags = kvgen.kernels._cpu_flags()  # the flags line the kernels are built and keyed for
    return " amx_int8" in flags and " amx_tile" in flags and " avx512_vnni" in flags


@pytest.mark.parametrize("name", DOT_WEIGHTS)
def test_products_of_many_rows_take_the_same_integer_sums_as_few(name):
    """Products of 16 input rows or more (prefill) take AMX's tile products where the CPU has them: 16 input rows by 16
    weight rows per instruction, the same exact integer sums as the vpdpbusd products of 1-8 rows, combined by the
    same code (add_group). So a 35-row product (two tiles of 16 rows and 3 more) equals its rows taken 4 at a time,
    bit for bit, by construction; on CPUs without AMX, the 16-row vpdpbusd products equal the 8-row ones the same
    way, and so do the products of one row. On a CPU with AMX, Linux's permission must have been granted (else every
    prefill silently runs ~1.3x slower)."""
    from kvgen.kernels import tile_formats

    if _amx_cpu() and kernels_available() and os.environ.get("KVGEN_DISABLE_AMX", "") in ("", "0"):
        assert tile_formats() == integer_dot_formats() - {2014} | {30}, "this CPU has AMX: kvgen's kernels lack it"
    qtype = DOT_WEIGHTS[name]
    if isinstance(qtype, Q):
        rows = PackedWeight([(int(qtype), torch.from_numpy(np.ascontiguousarray(random_raw(qtype, 64, 512))))], 512)
    else:
        rows = qtype(torch.randn(64, 512, generator=torch.Generator().manual_seed(3)))
    ((format, data),) = tile_rows(rows).segments
    if format not in integer_dot_formats():
        pytest.skip("no integer dot products for this format on this CPU: products in float32, tested above")
    x = torch.randn(35, 512, generator=torch.Generator().manual_seed(4)) * 3

    def product(first, end):
        return torch.ops.kvgen.qmatmul(x[first:end].contiguous(), [data], [format])

    many = product(0, 35)
    few = torch.cat([product(i, i + 4) for i in range(0, 35, 4)])
    # one row at a time (a decode step's product: AVX2 has its own loops for Q4_K and Q6_K) gives the same bits
    one = torch.cat([product(i, i + 1) for i in range(35)])
    assert torch.equal(one, few)
    panel = panel_rows()
    if panel:  # AVX2: from `panel` rows on, float32 panels, each row's sums in one order whatever the rows
        assert 8 < panel <= 35 - panel
        assert torch.equal(many, torch.cat([product(0, panel), product(panel, 35)]))
    else:
        assert torch.equal(many, few)
    weight = rows.dequantize().double()
    for out in (many, few):
        assert ((out.double() - x.double() @ weight.T).abs() <= 1e-5 * (x.double().abs() @ weight.abs().T)).all()


def products_at_1_and_2_threads(x, data, format) -> dict[int, torch.Tensor]:
    """``qmatmul``'s products of ``x`` with one tiled weight at 1 and at 2 threads, by thread count."""
    outs, before = {}, torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs[threads] = torch.ops.kvgen.qmatmul(x, [data], [format])
    finally:
        torch.set_num_threads(before)
    return outs


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_float_panels_of_many_rows_give_the_dequantized_products(qtype):
    """Where AVX2 runs without AVX-512 VNNI, products of ``panel_rows()`` input rows or more dequantize each tile of
    16 weight rows once into float32 panels of 256 columns and multiply every row by them: the float32 products of the
    dequantized weight (1e-5 of the sum of the terms' sizes), with a last panel of fewer columns (K = 17 blocks of 32,
    or 3 of 256), two passes of rows (300 = 256 + 44), blocks of 6 rows and their remainders, and tiles split between
    threads; each row the same bits however many rows come with it, from the format's own fewest rows on. A
    prefill's products take them too (no dequantized copy of the weight)."""
    panel = panel_rows()
    if not panel:
        pytest.skip("products take integer dot products at every row count on this CPU (tested above)")
    k = 17 * 32 if GGML_QUANT_SIZES[qtype][0] == 32 else 3 * 256
    rows = PackedWeight([(int(qtype), torch.from_numpy(np.ascontiguousarray(random_raw(qtype, 80, k))))], k)
    tiled = tile_rows(rows)
    assert QuantizedLinear(tiled).takes_qmatmul(2048)
    ((format, data),) = tiled.segments
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(5))
    weight = rows.dequantize().double()
    outs = products_at_1_and_2_threads(x, data, format)
    out = outs[1]
    assert torch.equal(out, outs[2])
    assert ((out.double() - x.double() @ weight.T).abs() <= 1e-5 * (x.double().abs() @ weight.abs().T)).all()
    fewest = panel_rows(format)  # (Q6_K and Q8_0 take the panels from 5 rows, Q4_K from 8)
    assert fewest <= panel
    for first, end in ((0, panel), (7, 7 + panel + 5), (100, 300), (3, 3 + fewest)):
        assert torch.equal(torch.ops.kvgen.qmatmul(x[first:end].contiguous(), [data], [format]), out[first:end])


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda q: q.name)
def test_two_threads_give_every_row_of_a_product(qtype):
    """A product's output rows are split between the threads: over 1,040 weight rows (65 tiles, an odd count), a
    decode step's input row and a prefill's 12 give every output row at 2 threads, the same bits as at 1, each within
    the float32 bound of the dequantized product."""
    rows = PackedWeight([(int(qtype), torch.from_numpy(np.ascontiguousarray(random_raw(qtype, 1040, 256))))], 256)
    ((format, data),) = tile_rows(rows).segments
    weight = rows.dequantize().double()
    for inputs in (1, 12):
        x = torch.randn(inputs, 256, generator=torch.Generator().manual_seed(inputs))
        outs = products_at_1_and_2_threads(x, data, format)
        assert torch.equal(outs[1], outs[2])
        bound = 1e-5 * (x.double().abs() @ weight.abs().T)
        assert ((outs[2].double() - x.double() @ weight.T).abs() <= bound).all()


@pytest.mark.parametrize("rows", [8, 16, 35, 64])
def test_bf16_products_keep_every_bit_of_the_input(rows):
    """BF16 weights times 16 rows or more take AMX's bfloat16 products where the CPU has them, with the input rows
    split into three bfloat16 parts (8 significant bits each) that sum to them exactly. A one-hot weight picks input
    values: every bit must come back (losing the last part would leave ~2^-17 of each value off, well inside the
    float32 summation bound that the products' other tests allow)."""
    eye = torch.eye(32, 64).to(torch.bfloat16)
    data = eye.view(torch.int16).view(torch.uint8).reshape(32, 128)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)) * torch.logspace(-20, 20, 64)
    assert torch.equal(torch.ops.kvgen.qmatmul(x, [data], [30]), x[:, :32])


def test_bf16_layers_take_prefill_products_only_in_whole_tiles():
    """A prefill-sized product of BF16 weights is kvgen's own where AMX's tile products run (16 weight rows a tile);
    a weight of another row count keeps dequantize + float32 matmul there, not the slower one-pass product."""
    from kvgen.models.quantized_linear import any_rows_formats

    def layer(rows):
        data = torch.randn(rows, 64).to(torch.bfloat16).view(torch.int16).view(torch.uint8)
        return QuantizedLinear(PackedWeight([(30, data)], 64))

    assert layer(48).takes_qmatmul(512) == (30 in any_rows_formats())
    assert not layer(40).takes_qmatmul(512) and layer(40).takes_qmatmul(8)


# -- whole models ------------------------------------------------------------------------------------------


def compare_decoding(quantized, reference, prompt_ids, steps=50):
    """Max |logit difference| over a prefill and ``steps`` greedy decode steps (fed the reference's tokens)."""
    worst = 0.0
    caches = kvgen.DynamicCache(), kvgen.DynamicCache()
    ids = prompt_ids
    with torch.no_grad():
        for _ in range(steps + 1):
            a = quantized(ids, past_key_values=caches[0], logits_to_keep=1).logits[:, -1]
            b = reference(ids, past_key_values=caches[1], logits_to_keep=1).logits[:, -1]
            worst = max(worst, (a - b).abs().nan_to_num(nan=float("inf")).max().item())  # max() would pass over NaN
            ids = b.argmax(-1, keepdim=True)
    return worst


@pytest.fixture(scope="module")
def smollm_pair():
    from kvgen.loading.default_model import default_gguf_path

    path = default_gguf_path()
    quantized = kvgen.AutoModelForCausalLM.from_pretrained(path)
    reference = kvgen.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return quantized, reference, kvgen.AutoTokenizer.from_pretrained(path)


def test_gguf_loads_in_its_stored_types_by_default(smollm_pair):
    quantized, reference, _ = smollm_pair
    assert quantized.weight_format == "Q8_0+Q4_1" and reference.weight_format == "float32"
    layer = quantized.model.layers[0]
    assert layer.mlp.down_proj.formats == [2003] and layer.self_attn.qkv_proj.formats == [2003] * 3  # in tiles
    # Q8_0 in tiles where they take integer dot products (AVX-512 VNNI, AVX2), else in rows
    assert quantized.model.embed_tokens.formats == [2008 if 2008 in integer_dot_formats() else 8]
    with pytest.raises(ValueError, match="tiles"):
        layer.mlp.down_proj.weight.permute_rows(torch.arange(576))
    assert isinstance(quantized.model.embed_tokens, QuantizedEmbedding)
    assert quantized.lm_head.packed_0 is quantized.model.embed_tokens.packed_0  # tied: stored once
    stored = sum(b.numel() for b in quantized.buffers() if b.dtype == torch.uint8)
    assert stored < 0.2 * sum(p.numel() * 4 for p in reference.parameters())  # Q4_1/Q8_0: under a fifth
    from kvgen.cache.fingerprint import model_fingerprint

    assert model_fingerprint(quantized) != model_fingerprint(reference)


def test_tiled_weights_sit_in_one_arena_in_huge_pages(smollm_pair):
    """Every tiled segment of a loaded GGUF model lies in the one mapping of its WeightArena, back to back
    in load order (64-byte aligned), advised for transparent huge pages where Linux has them."""
    quantized = smollm_pair[0]
    tiled = [data for module in quantized.modules() if isinstance(module, (QuantizedLinear, QuantizedEmbedding))
             for format, data in module.weight.segments if format in TILED]
    tiled = list({t.data_ptr(): t for t in tiled}.values())  # the tied embedding / lm_head once
    storages = {t.untyped_storage().data_ptr() for t in tiled}
    assert len(tiled) > 90 and len(storages) == 1  # 30 layers x (q, k, v, o, gate, up, down) + embedding
    starts = sorted(t.data_ptr() for t in tiled)
    assert all(start % 64 == 0 for start in starts)
    span = max(t.data_ptr() + t.nbytes for t in tiled) - starts[0]
    assert span <= sum(-(-t.nbytes // 64) * 64 for t in tiled)  # no gaps beyond the alignment
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")  # "always [madvise] never" here
    if hasattr(mmap, "MADV_HUGEPAGE") and thp.exists() and "[never]" not in thp.read_text():
        flags = _vm_flags(starts[0])
        assert "hg" in flags, f"the arena's mapping was not advised for huge pages: VmFlags {flags}"


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``address`` (``/proc/self/smaps``)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(a, 16) for a in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_weight_arena_hands_out_aligned_slices_then_ordinary_tensors():
    arena = WeightArena([100, 64])
    like = torch.zeros(100, dtype=torch.uint8)
    a, b = arena.empty_like(like), arena.empty_like(torch.zeros(64, dtype=torch.uint8))
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # one mapping
    assert b.data_ptr() - a.data_ptr() == 128 and a.data_ptr() % (2 << 20) == 0  # aligned; starts on a huge page
    a.fill_(1), b.fill_(2)
    assert int(a.sum()) == 100 and int(b.sum()) == 128  # no overlap
    c = arena.empty_like(like)  # past its size: an ordinary allocation, not an overlapping slice
    assert c.untyped_storage().data_ptr() != a.untyped_storage().data_ptr() and c.shape == like.shape
    empty = WeightArena([])
    assert empty.empty_like(like).shape == like.shape


def test_smollm2_quantized_matches_dequantized(smollm_pair):
    quantized, reference, tokenizer = smollm_pair
    prompt = tokenizer("Once upon a time, there was a little", return_tensors="pt")
    worst = compare_decoding(quantized, reference, prompt["input_ids"])
    assert worst < 1e-3, worst
    texts = [tokenizer.decode(m.generate(**prompt, max_new_tokens=30)[0]) for m in (quantized, reference)]
    assert texts[0] == texts[1]


@pytest.mark.parametrize("cache", ["dynamic", "static", "sink", "quantized", "offloaded", "offloaded_static"])
def test_every_cache_type_runs_on_quantized_weights(smollm_pair, cache, monkeypatch):
    monkeypatch.setenv("KVGEN_DISABLE_COMPILE", "1")  # eager here; compiled decode runs in the test above
    quantized, reference, tokenizer = smollm_pair
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    config = {"sink": {"window_length": 64, "num_sink_tokens": 4}, "quantized": {"backend": "kivi", "nbits": 4}}.get(cache)
    kwargs = dict(max_new_tokens=12, cache_implementation=cache, cache_config=config)
    assert torch.equal(quantized.generate(**prompt, **kwargs), reference.generate(**prompt, **kwargs))


def test_a_static_cache_decodes_eagerly_on_stored_weights(smollm_pair):
    """Compiling cannot speed up kvgen's C++ products and cost ~10 s a process before the first token: a static
    cache on stored-precision weights decodes eagerly, with the dynamic cache's tokens."""
    quantized, _, tokenizer = smollm_pair
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    static = quantized.generate(**prompt, max_new_tokens=8, cache_implementation="static")
    assert getattr(quantized, "_compiled_forward", None) is None
    assert torch.equal(static, quantized.generate(**prompt, max_new_tokens=8))


def check_fused_decode_layers(model, tokenizer, monkeypatch):
    """A decode step on stored weights runs two C++ ops per layer (kvgen::decoder_attention_inputs,
    kvgen::decoder_mlp) in place of its modules. Same kernels, same order; only the activation's
    exp / tanh differ (ATen's vectorised ones against the C library's, within an ulp or two), so
    logits of 1 and 3 rows over 8 steps agree to float32 rounding through every layer (1e-4). The
    whole stack as one op (kvgen::decoder_layers, the default) runs those same functions: equal bits."""
    from kvgen.models import native

    calls = []
    for name in ("decoder_attention_inputs", "decoder_mlp"):
        def counted(*args, _op=getattr(native, name), _name=name):
            out = _op(*args)
            calls.append((_name, out is not None))
            return out
        monkeypatch.setattr(native, name, counted)
    ids = tokenizer(["The capital of France is"] * 3, return_tensors="pt")["input_ids"]
    for rows in (1, 3):
        caches = kvgen.DynamicCache(), kvgen.DynamicCache(), kvgen.DynamicCache()
        with torch.no_grad():
            step = ids[:rows]
            for _ in range(8):
                stacked = model(step, past_key_values=caches[2]).logits[:, -1]
                with monkeypatch.context() as m:  # layer by layer
                    m.setattr(model.decode_stack, "run", lambda *a: None)
                    calls.clear()
                    fused = model(step, past_key_values=caches[0]).logits[:, -1]
                    used = set(calls)
                    m.setattr(native, "decoder_attention_inputs", lambda *a: None)  # the modules themselves
                    m.setattr(native, "decoder_mlp", lambda *a: None)
                    plain = model(step, past_key_values=caches[1]).logits[:, -1]
                assert (fused - plain).abs().max().item() < 1e-4
                assert torch.equal(stacked, fused)
                step = plain.argmax(-1, keepdim=True)
            assert used == {("decoder_attention_inputs", True), ("decoder_mlp", True)}  # the last step ran fused


def check_fused_prefill(model, monkeypatch) -> None:
    """A 100-token prefill runs the fused attention inputs and MLP halves where every product they hold takes
    kvgen::qmatmul at that many rows (with AVX-512 VNNI: the tiled GGUF formats but Q6_K; with AVX2's float32 panels:
    every tiled format; elsewhere none), with the modules' bits; so does a 37-token one after it, its MLP in the 100
    rows' scratch (kept by the op)."""
    from kvgen.models import native
    from kvgen.models.quantized_linear import any_rows_formats

    one_pass = lambda *linears: all(any_rows_formats().issuperset(p.formats) for p in linears)  # noqa: E731
    expected = sum(one_pass(layer.self_attn.qkv_proj) + one_pass(layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                                                 layer.mlp.down_proj) for layer in model.model.layers)
    for length in (100, 37):
        ids = torch.randint(100, 20000, (1, length), generator=torch.Generator().manual_seed(3))
        check_fused_prompt(model, monkeypatch, ids, expected)


def check_fused_prompt(model, monkeypatch, ids, expected) -> None:
    """check_fused_prefill for one prompt (expected: the fused calls)."""
    from kvgen.models import native

    results = []
    for fused in (True, False):
        calls = []
        with monkeypatch.context() as m:
            for name in ("decoder_attention_inputs", "decoder_mlp"):
                def spy(*args, _op=getattr(native, name), _fused=fused, **kwargs):
                    out = _op(*args, **kwargs) if _fused else None
                    calls.append(out is not None)
                    return out
                m.setattr(native, name, spy)
            cache = kvgen.DynamicCache()
            with torch.no_grad():
                logits = model(ids, past_key_values=cache).logits
        results.append((logits, cache.layers[-1].keys, sum(calls)))
    assert results[0][2] == expected and results[1][2] == 0 and (expected > 0 or integer_dot_instruction() != "vpdpbusd")
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_fused_prefill_gives_the_module_bits(smollm_pair, gemma3_gguf, monkeypatch):
    check_fused_prefill(smollm_pair[0], monkeypatch)  # with VNNI: all 30 layers' two halves
    gemma3 = kvgen.AutoModelForCausalLM.from_pretrained(gemma3_gguf)
    assert 0 < sum(layer.mlp.down_proj.formats == [2014] for layer in gemma3.model.layers) < 18  # some Q6_K
    check_fused_prefill(gemma3, monkeypatch)


def test_fused_decode_layers_compute_what_the_modules_compute(smollm_pair, monkeypatch):
    quantized, _, tokenizer = smollm_pair
    check_fused_decode_layers(quantized, tokenizer, monkeypatch)


def test_fused_gemma3_decode_layers_compute_what_the_modules_compute(gemma3_gguf, monkeypatch):
    """Gemma 3: per-head query / key norms, sandwich norms, tanh GELU."""
    check_fused_decode_layers(kvgen.AutoModelForCausalLM.from_pretrained(gemma3_gguf),
                              kvgen.AutoTokenizer.from_pretrained(gemma3_gguf), monkeypatch)


def test_beam_search_forks_and_saved_caches_on_quantized_weights(smollm_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("KVGEN_DISABLE_COMPILE", "1")
    quantized, reference, tokenizer = smollm_pair
    prompt = tokenizer("The best way to learn", return_tensors="pt")
    beams = dict(max_new_tokens=8, num_beams=3, num_return_sequences=2)
    assert torch.equal(quantized.generate(**prompt, **beams), reference.generate(**prompt, **beams))
    cache = kvgen.DynamicCache()
    quantized(**prompt, past_key_values=cache)
    cache.save(tmp_path / "prefix.safetensors", model=quantized)
    with pytest.raises(ValueError, match="model"):  # the float twin is another model for a cache file
        kvgen.load_cache(tmp_path / "prefix.safetensors", model=reference)
    loaded = kvgen.load_cache(tmp_path / "prefix.safetensors", model=quantized)
    a, b = loaded.fork(2)
    step = torch.tensor([[42]])
    assert torch.equal(quantized(step, past_key_values=a).logits, quantized(step, past_key_values=b).logits)
    assert torch.equal(quantized(step, past_key_values=copy.deepcopy(cache)).logits,
                       quantized(torch.tensor([[42]]), past_key_values=cache).logits)


def test_gemma3_quantized_matches_dequantized_on_a_long_prompt(gemma3_gguf):
    quantized = kvgen.AutoModelForCausalLM.from_pretrained(gemma3_gguf)
    reference = kvgen.AutoModelForCausalLM.from_pretrained(gemma3_gguf, dtype=torch.float32)
    tokenizer = kvgen.AutoTokenizer.from_pretrained(gemma3_gguf)
    assert set(quantized.weight_format.split("+")) == {"Q8_0", "Q5_0", "Q4_K", "Q6_K"}
    text = " ".join(f"Verse {i}: in the beginning was the word, and the word was with light." for i in range(60))
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :700]
    assert ids.shape[1] == 700  # past the 512-token sliding window
    worst = compare_decoding(quantized, reference, ids, steps=20)
    assert worst < 1e-3, worst
    out = [m.generate(ids, max_new_tokens=20) for m in (quantized, reference)]
    assert torch.equal(out[0], out[1])
    # a prompt's rows on 16-bit inputs (AVX2, generate()'s prefills): Gemma's residual stream has the largest outliers
    # of the packaged models (5.3e-3 over 512 tokens of KJV; Qwen2.5-Coder-0.5B 5.1e-4), within the 1e-2 that
    # prefills may take
    with torch.no_grad(), prompt_rows(ids.numel()):
        assert (quantized(ids).logits - reference(ids).logits).abs().max() < 1e-2


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "BF16"), (torch.float16, "F16")])
def test_16bit_checkpoints_keep_their_width_and_compute_in_float32(tmp_path, dtype, name, monkeypatch):
    import transformers

    monkeypatch.setenv("KVGEN_DISABLE_COMPILE", "1")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).to(dtype).save_pretrained(tmp_path)
    stored = kvgen.AutoModelForCausalLM.from_pretrained(tmp_path, dtype="auto")
    upcast = kvgen.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)  # the same values, 4 bytes
    assert stored.weight_format == name and stored.dtype == torch.float32
    assert isinstance(stored.model.embed_tokens, QuantizedEmbedding)
    assert stored.lm_head.packed_0 is stored.model.embed_tokens.packed_0
    packed = sum(b.numel() for b in stored.buffers() if b.dtype == torch.uint8)
    assert packed == 2 * sum(p.numel() for n, p in upcast.named_parameters() if "norm" not in n)
    ids = torch.randint(0, 160, (2, 12), generator=torch.Generator().manual_seed(1))
    assert compare_decoding(stored, upcast, ids, steps=10) < 1e-4


def test_quantized_at_load_perplexity_stays_close_to_float(smollm):
    """int8 at most +0.5% and int4 (groups of 32) at most +5% perplexity over 1024 tokens of pydoc's topics
    (benchmarks/weight_quality.py measures 4096 KJV tokens)."""
    import torch.nn.functional as F
    from pydoc_data.topics import topics

    from kvgen.loading.default_model import default_model_dir

    model, tokenizer = smollm
    ids = torch.tensor(tokenizer("\n".join(topics[k] for k in sorted(topics)))["input_ids"][:1024])

    def perplexity(m):
        with torch.no_grad():
            logits = m(ids[None, :-1], past_key_values=kvgen.DynamicCache()).logits[0]
        return F.cross_entropy(logits, ids[1:]).exp().item()

    base = perplexity(model)
    for config, name, budget in ((TorchAoConfig("int8_weight_only"), "int8", 0.005),
                                 (TorchAoConfig("int4_weight_only", group_size=32), "int4/g32", 0.05)):
        quantized = kvgen.AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32,
                                                              quantization_config=config)
        assert quantized.weight_format == name and not isinstance(quantized.lm_head, QuantizedLinear)  # as HF
        assert perplexity(quantized) / base - 1 <= budget, (name, perplexity(quantized), base)
        # in tiles of 16 rows where their integer dot products run: decoding as the float32 products of the rows
        rows = copy.deepcopy(quantized)
        for layer in (m for m in rows.modules() if isinstance(m, QuantizedLinear)):
            layer.weight = untile_rows(layer.weight)
        down = quantized.model.layers[0].mlp.down_proj.formats[0]
        row_format = rows.model.layers[0].mlp.down_proj.formats[0]
        assert down == (2000 + row_format if 2000 + row_format in integer_dot_formats() else row_format)
        assert compare_decoding(quantized, rows, ids[None, :40], steps=20) < 1e-3
