"""Compiled decode blocks: same numbers as eager, one graph per block for all layers, and the off switches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from kvgen import DynamicCache, GenerationConfig, LlamaForCausalLM, PretrainedConfig, StaticCache
from kvgen.models.decode_blocks import MAX_ROWS, eager_blocks
from kvgen.models import linear
from kvgen.models.linear import Linear

CONFIG = dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
              rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = LlamaForCausalLM(PretrainedConfig(**CONFIG)).eval()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return m


def compiled_graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS, MAX_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_under_compile_equals_f_linear(rows, bias):
    torch.manual_seed(rows)
    layer = Linear(48, 40, bias=bias)
    x = torch.randn(rows, 1, 48)
    out = torch.compile(layer, dynamic=False)(x)
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    strided = torch.randn(rows, 3, 48)[:, -1:]  # rows 144 floats apart: the input is not stored densely
    out = torch.compile(lambda t: layer(torch.tanh(t)), dynamic=False)(strided)
    torch.testing.assert_close(out, F.linear(torch.tanh(strided), layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    out = torch.compile(layer, dynamic=False)(strided)
    torch.testing.assert_close(out, F.linear(strided, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(1, 48), (3, 1, 48), (MAX_ROWS + 1, 48), (0, 48), (2, 5, 48)])
def test_eager_linear_equals_f_linear(shape):
    """Eager products (oneDNN's matmul where torch has it) equal F.linear up to float32 rounding, with
    or without bias, for any leading shape, an empty batch and strided input rows."""
    torch.manual_seed(len(shape))
    for bias in (False, True):
        layer = Linear(48, 40, bias=bias)
        for x in (torch.randn(shape), torch.randn(*shape[:-1], 96)[..., ::2]):
            with torch.no_grad():
                torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(linear._ONEDNN_LINEAR is None, reason="this torch has no oneDNN matmul")
def test_packed_linear_products_follow_the_weight():
    """A packed layer (its weight copied into oneDNN's layout) computes F.linear for any number of rows, and packs
    again when its weight is changed in place or replaced; unpacked, the copy is gone."""
    torch.manual_seed(0)
    layer = Linear(96, 80)
    assert layer.pack() == 96 * 80 * 4 and layer._onednn is not None
    with torch.no_grad():
        for rows in (1, 3, 14, 64, 200):
            x = torch.randn(rows, 96)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        layer.weight.mul_(-2)  # in place: the copy is stale
        x = torch.randn(5, 96)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        layer.weight = torch.nn.Parameter(torch.randn(80, 96))  # replaced
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    model = torch.nn.Sequential(layer, Linear(80, 8))
    assert linear.pack_weights(model) == (96 * 80 + 80 * 8) * 4
    linear.pack_weights(model, pack=False)
    assert all(m._onednn is None for m in model)


def decode(model, steps=5, batch=2):
    """Logits of ``steps`` one-token decode steps after an 8-token prompt, through a DynamicCache."""
    ids = torch.randint(0, CONFIG["vocab_size"], (batch, 8), generator=torch.Generator().manual_seed(1))
    cache, out = DynamicCache(), []
    with torch.no_grad():
        logits = model(ids, past_key_values=cache).logits
        for _ in range(steps):
            logits = model(logits[:, -1:].argmax(-1), past_key_values=cache).logits
            out.append(logits)
    return torch.cat(out, dim=1)


def test_decode_steps_compile_once_for_all_layers_and_match_eager(model):
    torch._dynamo.reset()
    counters.clear()
    compiled = decode(model)
    # three blocks (attention inputs, rest of the layer, final norm + lm_head) shared by the 3 layers,
    # and no recompilation as the cache grows
    assert compiled_graphs() == 3
    with eager_blocks():
        eager = decode(model)
    assert compiled_graphs() == 3
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)


def test_blocks_stay_eager_when_switched_off_or_too_big(model, monkeypatch):
    torch._dynamo.reset()
    counters.clear()
    decode(model, batch=MAX_ROWS + 1)  # more rows than a block takes
    with torch.enable_grad():  # autograd: eager
        model(torch.ones(1, 1, dtype=torch.long))
    monkeypatch.setenv("KVGEN_DISABLE_COMPILE", "1")
    decode(model)
    monkeypatch.delenv("KVGEN_DISABLE_COMPILE")
    ids = torch.ones(1, 4, dtype=torch.long)
    model.generate(ids, generation_config=GenerationConfig(max_new_tokens=3, disable_compile=True))
    model.generate(ids, max_new_tokens=3, past_key_values=StaticCache(config=model.config, max_cache_len=8),
                   disable_compile=True)
    assert compiled_graphs() == 0


def test_the_last_position_of_a_short_prefill_reuses_the_decode_graph(model):
    torch._dynamo.reset()
    counters.clear()
    cache = DynamicCache()
    with torch.no_grad():
        logits = model(torch.ones(1, 4, dtype=torch.long), past_key_values=cache, logits_to_keep=1).logits
        for _ in range(2):
            logits = model(logits[:, -1:].argmax(-1), past_key_values=cache).logits
    # 4-token prefill: two layer blocks + logits of x[:, -1:] (a strided view, given canonical strides);
    # decode: two layer blocks for one token, the logits graph reused
    assert compiled_graphs() == 5
