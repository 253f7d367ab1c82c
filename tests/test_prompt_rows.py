"""A prompt's rows and generated tokens' rows (kvgen.kernels.prompt_rows): products of a prompt's rows may take cheaper
inputs (AVX2's Q4_K products on 16-bit inputs), each row's numerics depending only on its kind and values, so that
generate()'s prefill, its decode steps and the serving engine's mixed steps agree; unmarked forwards stay exact."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

import kvgen
from kvgen.kernels import kernels_available, panel_rows, prefill_inputs
from kvgen.kernels.prompt_rows import prompt_rows, rows_kind
from kvgen.models.native import decoder_mlp
from kvgen.serving import ContinuousBatchingConfig
from test_loading import _random_llama_state, _write_llama_gguf
from test_quantized_weights import random_raw

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no C++ compiler to build kvgen's kernels")

CFG = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, inter=256, layers=2, vocab=96)  # K-quants: 256 wide


def sixteen_bit() -> bool:
    """Whether a prompt's Q4_K products take 16-bit inputs here (AVX2 without AVX-512 VNNI, the default setting)."""
    return panel_rows() > 0 and prefill_inputs() == "int16"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Llama whose products are all Q4_K (random blocks: weights of std ~0.25, peaked logits)."""
    state = _random_llama_state(tied=False, cfg=CFG)
    replace = {name: (random_raw(Q.Q4_K, *w.shape, seed=i, scale=1e-3), Q.Q4_K)
               for i, (name, w) in enumerate(state.items()) if w.dim() == 2 and "embed" not in name}
    path = tmp_path_factory.mktemp("q4k") / "tiny.gguf"
    _write_llama_gguf(path, state, Q.F32, replace=replace, cfg=CFG)
    m = kvgen.AutoModelForCausalLM.from_pretrained(path)
    assert m.weight_format == "Q4_K"
    return m


def ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, CFG["vocab"], (1, n), generator=torch.Generator().manual_seed(seed))


def test_a_mark_names_the_rows_of_its_products():
    assert rows_kind(5) is False  # unmarked: exact
    with prompt_rows(5):
        assert rows_kind(5) is True and rows_kind(1) is False  # (the head's product of the kept row: exact)
        with prompt_rows(torch.tensor([True, False, True])):
            assert rows_kind(3).tolist() == [True, False, True] and rows_kind(5) is False
        assert rows_kind(5) is True
    with prompt_rows(torch.ones(4, dtype=torch.bool)):
        assert rows_kind(4) is True
    with prompt_rows(torch.zeros(4, dtype=torch.bool)):
        assert rows_kind(4) is False
    with pytest.raises(ValueError, match="a row count or a 1-d bool mask"):
        with prompt_rows(torch.ones(2, 3, dtype=torch.bool)):
            pass


def test_each_row_takes_its_kind_s_products_whatever_shares_the_product(model):
    layer = model.model.layers[0].mlp.gate_up_proj
    x = torch.randn(12, CFG["hidden"], generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([True, False, False, True, True, False, True, True, False, True, False, True])
    exact = layer(x)
    with prompt_rows(12):
        prompt = layer(x)
    with prompt_rows(mask):
        mixed = layer(x)
    assert torch.equal(mixed[mask], prompt[mask])  # a prompt row's products do not depend on the other rows
    assert torch.equal(mixed[~mask], torch.ops.kvgen.qmatmul(x[~mask], layer._segments, layer.formats))
    assert (mixed[~mask] - exact[~mask]).abs().max() <= 1e-5 * exact.abs().max()  # (fewer rows: other sum orders)
    if sixteen_bit():
        assert (prompt - exact).abs().max() > 1e-5 * exact.abs().max()  # the mark changes what the products take
    else:
        assert torch.equal(prompt, exact)


def test_the_fused_layer_ops_leave_mixed_rows_to_the_modules_only_where_their_products_differ(model, monkeypatch):
    layer = model.model.layers[0]
    x = torch.randn(1, 6, CFG["hidden"], generator=torch.Generator().manual_seed(4))
    attn = torch.randn(1, 6, CFG["heads"] * CFG["head_dim"], generator=torch.Generator().manual_seed(5))
    mask = torch.tensor([True, True, True, False, True, False])

    def fused():
        with torch.no_grad(), prompt_rows(mask):
            return decoder_mlp(x, attn, layer.self_attn.o_proj, layer.post_attention_layernorm, layer.mlp)

    assert (fused() is None) == sixteen_bit()  # Q4_K: the kinds' products differ where prompts take 16 bits
    monkeypatch.setenv("KVGEN_PREFILL_INPUTS", "float32")
    assert fused() is not None  # every row exact: one op for the whole step, as without a mark


def test_generate_prefills_the_prompt_s_rows_and_decodes_exactly(model):
    prompt = ids(40)
    out = model.generate(prompt, max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    cache = kvgen.DynamicCache()
    with torch.no_grad():
        with prompt_rows(prompt.numel()):
            logits = [model(prompt, past_key_values=cache, logits_to_keep=1).logits[:, -1]]
        for token in out.sequences[0, 40:-1]:  # the decode steps: rows of generated tokens, unmarked
            logits.append(model(token.view(1, 1), past_key_values=cache).logits[:, -1])
        unmarked = model(prompt, past_key_values=kvgen.DynamicCache(), logits_to_keep=1).logits[:, -1]
    for got, expected in zip(out.logits, logits):
        assert torch.equal(got, expected)
    assert torch.equal(out.logits[0], unmarked) != sixteen_bit()


def test_the_engine_marks_its_steps_prompt_rows_as_generate_does(model, monkeypatch):
    """Prompts split into chunks that share steps with other requests' decodes (both kinds in one product): each
    request's tokens and log-probabilities are generate()'s on its prompt alone. Unmarked, the engine's differed by
    up to 8e-5 (AVX2); marked, by ~5e-7 (the paged attention's other summation order)."""
    kinds = []
    recorded = rows_kind

    def record(rows):
        kind = recorded(rows)
        kinds.append(kind if isinstance(kind, bool) else "mixed")
        return kind

    monkeypatch.setattr("kvgen.models.quantized_linear.rows_kind", record)  # (the fused layer ops ask it too)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, CFG["vocab"], (int(n),), generator=g).tolist()
               for n in torch.randint(5, 120, (6,), generator=g)]
    config = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=48, max_num_seqs=4)
    outputs = model.generate_batch(prompts, max_new_tokens=6, continuous_batching_config=config)
    assert {True, False, "mixed"} <= set(kinds)
    for i, prompt in enumerate(prompts):
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                               return_dict_in_generate=True, output_logits=True)
        tokens = alone.sequences[0, len(prompt):].tolist()
        assert outputs[f"req_{i}"].generated_tokens == tokens
        logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(alone.logits, tokens)]
        assert max(abs(a - b) for a, b in zip(logprobs, outputs[f"req_{i}"].logprobs)) < 3e-6
