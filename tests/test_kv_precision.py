"""Keys and values stored in float16, bfloat16 or int8 rows (kvgen.cache.precision): the row format, attention
reading each format as stored, the paged pool's size, and the contract: the batching engine's tokens equal
generate()'s with a cache of the same precision, and perplexity on the KJV stays within 0.5% (16-bit) and 2%
(int8) of float32's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import kvgen
from kvgen import LlamaForCausalLM, PretrainedConfig
from kvgen.cache.paged import PagedAttentionCache
from kvgen.cache.precision import KV_DTYPES, decode, encode, kv_dtype, stored_dim
from kvgen.kernels import kernels_available
from kvgen.loading.default_model import default_gguf_path
from kvgen.models.decode_blocks import eager_blocks
from kvgen.models.sdpa import scaled_dot_product_attention
from kvgen.serving import ContinuousBatchingConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from quantized_quality import kjv_ids, perplexity  # noqa: E402

STORED = [torch.float16, torch.bfloat16, torch.int8]
CONFIG = dict(model_type="llama", vocab_size=96, hidden_size=128, intermediate_size=160, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
              rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu", eos_token_id=None)  # head dim 32

needs_kernels = pytest.mark.skipif(not kernels_available(), reason="kvgen's C++ kernels could not be built here")


@pytest.fixture(scope="module")
def gguf():
    path = default_gguf_path()  # weights in their stored types, float32 activations: what kvgen serve runs
    return kvgen.AutoModelForCausalLM.from_pretrained(path), kvgen.AutoTokenizer.from_pretrained(path)


# -- the formats --------------------------------------------------------------------------------------------


def test_int8_rows_hold_the_codes_then_a_float32_scale_per_32_values():
    x = torch.zeros(1, 1, 2, 64)
    x[0, 0, 0, :32] = torch.linspace(-2.54, 1.0, 32)  # largest magnitude 2.54: scale 0.02
    x[0, 0, 0, 32:] = 0.5  # every code 127
    x[0, 0, 1] = 0.0  # a zero group: scale 0, codes 0
    stored = encode(x, torch.int8)
    assert stored.shape == (1, 1, 2, 72) and stored.dtype == torch.int8
    codes, scales = stored[0, 0, :, :64], stored[0, 0, :, 64:].contiguous().view(torch.float32)  # (2, 64), (2, 2)
    assert scales[0].tolist() == [pytest.approx(2.54 / 127), pytest.approx(0.5 / 127)]
    assert codes[0, 0] == -127 and codes[0, 32:].eq(127).all()
    assert torch.equal(codes[0, :32], (x[0, 0, 0, :32] / scales[0, 0]).round().to(torch.int8))
    assert codes[1].eq(0).all() and scales[1].eq(0).all()
    back = decode(stored, 64)
    assert ((back - x).abs() <= scales.repeat_interleave(32, dim=1)[None, None] / 2 + 1e-7).all()
    assert back[0, 0, 1].eq(0).all()


def test_float_formats_round_and_float16_saturates():
    x = torch.tensor([1.0 + 2 ** -12, -1e6, 1e6, 3.0])
    assert encode(x, torch.float16).tolist() == [1.0, -65504.0, 65504.0, 3.0]  # finite: no inf reaches attention
    assert decode(encode(x, torch.bfloat16), 4).tolist() == [1.0, -999424.0, 999424.0, 3.0]


def test_names_and_head_sizes_are_checked():
    assert [kv_dtype(name) for name in KV_DTYPES] == list(KV_DTYPES.values())
    assert kv_dtype("torch.int8") is torch.int8 and kv_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="float32, float16, bfloat16, int8"):
        kv_dtype("fp8")
    assert stored_dim(torch.int8, 128) == 144 and stored_dim(torch.float16, 48) == 48
    with pytest.raises(ValueError, match="scale per 32 values.*48.*float16 or bfloat16"):
        stored_dim(torch.int8, 48)


def test_the_paged_pool_takes_the_bytes_of_its_precision():
    sizes = {dtype: PagedAttentionCache(PretrainedConfig(**CONFIG), num_blocks=4, dtype=dtype)
             for dtype in ("float32", "float16", torch.bfloat16, "int8")}
    per_block = {str(c.dtype).removeprefix("torch."): c.bytes_per_block for c in sizes.values()}
    assert per_block["float16"] * 2 == per_block["bfloat16"] * 2 == per_block["float32"]  # 3 layers x 2 x 2 x 16 x 32
    assert per_block["int8"] * 32 == per_block["float32"] * 9  # 36 bytes per 32 values against 128
    assert sizes["int8"].layers[0].pool_keys.shape == (1, 2, 64, 36)
    with pytest.raises(ValueError, match="scale per 32 values"):
        PagedAttentionCache(PretrainedConfig(**{**CONFIG, "hidden_size": 64}), num_blocks=4, dtype="int8")


@needs_kernels
@pytest.mark.parametrize("dtype", STORED, ids=str)
def test_the_one_pass_store_writes_what_encode_gives(dtype):
    """kvgen::kv_store_ (PagedLayer.update, StaticLayer.update) against index_copy_ of encode(): the same bits,
    for rows across 35 decades, a zero row, float16's saturation, ties of int8's rounding, strided rows."""
    g = torch.Generator().manual_seed(0)
    for d in (32, 64, 256):
        x = torch.randn(2, 3, 7, d, generator=g) * torch.logspace(-30, 5, 7)[None, None, :, None]  # (B, H, T, D)
        x[0, 0, 0], x[0, 1, 1, 0], x[1, 0, 2, 3] = 0.0, 1e6, -7e4
        x[1, 2, 3] = torch.tensor([0.5, 1.5, 2.5, -0.5] * (d // 4)) * (2.5 / 127)  # codes x.5: rounded to even
        index = torch.tensor([5, 0, 9, 3, 1, 7, 2])
        expected = torch.zeros(2, 3, 10, stored_dim(dtype, d), dtype=dtype).index_copy_(2, index, encode(x, dtype))
        for rows in (x, x.transpose(1, 2).contiguous().transpose(1, 2)):
            got = torch.zeros_like(expected)
            torch.ops.kvgen.kv_store_(got, index, rows)
            assert torch.equal(got.view(torch.uint8 if dtype == torch.int8 else torch.int16),
                               expected.view(torch.uint8 if dtype == torch.int8 else torch.int16)), d
    with pytest.raises(RuntimeError, match="slot 10 is outside"):
        torch.ops.kvgen.kv_store_(expected, torch.tensor([0, 1, 2, 3, 4, 5, 10]), x)


# -- attention reads them as stored -------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("dtype", STORED, ids=str)
def test_attention_over_stored_keys_is_attention_over_their_decoded_floats(dtype):
    """The op turns each tile into the floats decode() gives and runs the float32 path on them: the same bits
    (identical by construction). Shapes: decode rows and prefill rows, grouped heads, a last tile cut short,
    masked and unmasked, a soft-cap; and within float32 rounding of SDPA on the decoded floats."""
    g = torch.Generator().manual_seed(0)
    shapes = [(2, 6, 3, 1, 37, 64, True, 0.0), (1, 8, 2, 5, 300, 128, True, 0.0), (1, 4, 1, 40, 203, 256, True, 30.0),
              (2, 4, 4, 1, 1000, 64, False, 0.0), (1, 2, 1, 70, 70, 32, False, 0.0)]
    for b, heads, kv_heads, t, s, d, masked, cap in shapes:  # (B, H, Hkv, T, S, D, a mask, the soft-cap)
        q = torch.randn(b, heads, t, d, generator=g)
        k, v = torch.randn(b, kv_heads, s, d, generator=g), torch.randn(b, kv_heads, s, d, generator=g) * 3
        mask = torch.rand(b, 1, t, s, generator=g) < 0.6 if masked else None
        if mask is not None:
            mask[..., 0] = True  # every row allows a key
        ks, vs = encode(k, dtype), encode(v, dtype)
        got = torch.ops.kvgen.attention(q, ks, vs, mask, d ** -0.5, cap)
        floats = torch.ops.kvgen.attention(q, decode(ks, d), decode(vs, d), mask, d ** -0.5, cap)
        assert torch.equal(got, floats), (b, heads, kv_heads, t, s, d)
        if not cap:
            ref = scaled_dot_product_attention(q, ks, vs, mask, False, d ** -0.5, heads != kv_heads)  # (decodes them)
            torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


@needs_kernels
def test_attention_refuses_mixed_or_unknown_storage():
    q, k = torch.randn(1, 2, 1, 64), torch.randn(1, 2, 5, 64)
    with pytest.raises(RuntimeError, match="stored alike"):
        torch.ops.kvgen.attention(q, k.half(), k.bfloat16(), None, 0.125, 0.0)
    with pytest.raises(RuntimeError, match="float32, float16, bfloat16 or int8"):
        torch.ops.kvgen.attention(q, k.double(), k.double(), None, 0.125, 0.0)
    with pytest.raises(RuntimeError, match=r"\(B, Hkv, S, 72\)"):
        torch.ops.kvgen.attention(q, k.to(torch.int8), k.to(torch.int8), None, 0.125, 0.0)  # rows without scales


# -- the contract: the engine equals generate() with the same precision ---------------------------------------


def alone(model, prompt: list[int], new: int, dtype) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, cache_implementation="static",
                         cache_config={"dtype": dtype})
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8"])
def test_the_engine_equals_generate_with_a_cache_of_its_precision(dtype):
    torch.manual_seed(0)
    model = LlamaForCausalLM(PretrainedConfig(**CONFIG)).eval().requires_grad_(False)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)  # peaked distributions: greedy choices are far from ties
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (int(n),), generator=g).tolist() for n in torch.randint(1, 150, (10,), generator=g)]
    config = ContinuousBatchingConfig(num_blocks=200, max_batch_tokens=64, max_num_seqs=8, kv_dtype=dtype)
    with eager_blocks():
        manager = model.init_continuous_batching(continuous_batching_config=config)
        with manager:  # prompts of 1-150 tokens: chunked prefills beside decodes
            outputs = [manager.get_result(rid, timeout=300) for rid in manager.add_requests(prompts, max_new_tokens=16)]
        expected = [alone(model, prompt, 16, dtype) for prompt in prompts]
    assert manager.cache.layers[0].pool_keys.dtype == kv_dtype(dtype)
    assert [out.generated_tokens for out in outputs] == expected


def test_the_real_model_as_served_equals_generate_with_16_bit_and_int8_keys(gguf):
    from pydoc_data.topics import topics

    model, tokenizer = gguf
    names = ["assert", "assignment", "async", "atom-identifiers"]
    prompts = [tokenizer(topics[n][: 150 + 150 * i])["input_ids"] for i, n in enumerate(names)]
    for dtype in ("float16", "int8"):
        config = ContinuousBatchingConfig(num_blocks=120, max_batch_tokens=128, kv_dtype=dtype)
        outputs = model.generate_batch(prompts, max_new_tokens=20, continuous_batching_config=config)
        got = [outputs[f"req_{i}"].generated_tokens for i in range(len(prompts))]
        assert got == [alone(model, prompt, 20, dtype) for prompt in prompts], dtype


def test_kjv_perplexity_stays_within_half_a_percent_at_16_bits_and_two_at_int8(gguf):
    """512 KJV tokens through a static cache of each precision, 128 at a time, so that later chunks attend to the
    stored keys and values (benchmarks/kv_precision.py measures 4,096)."""
    model, tokenizer = gguf
    ids = kjv_ids(tokenizer, 512)

    def ppl(dtype) -> float:
        with torch.no_grad():
            cache = kvgen.StaticCache(config=model.config, max_cache_len=512, dtype=dtype)
            return perplexity(model, ids, cache, 128, 128)[0]

    base = ppl(torch.float32)
    for dtype, budget in ((torch.float16, 0.005), (torch.bfloat16, 0.005), (torch.int8, 0.02)):
        assert abs(ppl(dtype) / base - 1) <= budget, dtype


def test_kvgen_serve_stores_keys_as_asked_and_answers_as_generate_does(gguf):
    from test_server import Server

    from kvgen.cli import serving_kv_dtype

    model, tokenizer = gguf
    assert serving_kv_dtype(model) == torch.float16  # the default for stored-precision weights on the CPU
    prompt = tokenizer("The river ran under the old bridge, and")["input_ids"]
    server = Server(default_gguf_path(), "--kv-dtype", "int8", "--kv-cache-memory", "64MB", "-t", "2")
    try:
        reply = server.client().completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                                   extra_body={"ignore_eos": True})
        blocks = server.metrics()["kvgen_kv_blocks_total"]
    finally:
        server.close()
    assert reply.choices[0].text == tokenizer.decode(alone(model, prompt, 16, "int8"))
    per_block = 30 * 2 * 3 * 16 * 72  # SmolLM2: 30 layers, keys and values, 3 kv heads, 16 tokens, int8 rows of 64
    assert blocks == 64 * 2 ** 20 // per_block
