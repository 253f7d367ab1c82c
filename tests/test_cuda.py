"""kvgen on a CUDA GPU (skipped without one): every cache strategy, compiled static decode, quantized
weights, bfloat16 and the continuous-batching engine compute on the GPU what the same model computes
on the CPU.

GPU and CPU sum in different orders (and SDPA picks other kernels), so logits are compared within
1e-3 (float32; TF32 is off) and greedy tokens must be equal: the random models' weights are large
enough (std 0.2) that their greedy choices are far from ties.
"""

from __future__ import annotations

import copy

import gguf
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

import kvgen
from kvgen import SinkCache
from kvgen.serving import ContinuousBatchingConfig
from kvgen.quantization import TorchAoConfig
from test_persist import tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEVICE = "cuda"
VOCAB = 96
LLAMA = dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None,
             pad_token_id=None, tie_word_embeddings=False)
MISTRAL = {**LLAMA, "model_type": "mistral", "sliding_window": 8}
GEMMA2 = dict(model_type="gemma2", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=8, query_pre_attn_scalar=32,
              max_position_embeddings=256, eos_token_id=None, pad_token_id=None)
MAMBA = dict(model_type="mamba", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, conv_kernel=4,
             expand=2, eos_token_id=None, pad_token_id=None)
GREEDY = dict(do_sample=False, return_dict_in_generate=True, output_logits=True)


@pytest.fixture(autouse=True)
def _no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def on(model, device):
    model = copy.deepcopy(model).to(device)
    model.init_buffers(torch.device(device))
    return model


def prompt(batch=2, length=20, seed=1):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_same_generation(got, want, atol=1e-3):
    assert torch.equal(got.sequences.cpu(), want.sequences.cpu())
    for g, w in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(g.cpu(), w.cpu(), rtol=1e-4, atol=atol)


CACHES = [("dynamic", LLAMA, None), ("static", LLAMA, None), ("offloaded", LLAMA, None),
          ("offloaded_static", LLAMA, None), ("sliding_window", MISTRAL, None), ("hybrid", GEMMA2, None),
          ("sink", LLAMA, {"window_length": 12, "num_sink_tokens": 2}),
          ("static_sink", LLAMA, {"window_length": 12, "num_sink_tokens": 2}), ("mamba", MAMBA, None)]


@pytest.mark.parametrize("name, fields, cache_config", CACHES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CACHES)])
def test_every_cache_implementation_on_cuda_matches_the_cpu(name, fields, cache_config):
    model = tiny(fields)
    ids = prompt()
    kwargs = dict(max_new_tokens=16, cache_implementation=name, cache_config=cache_config, disable_compile=True,
                  **GREEDY)
    want = model.generate(ids, **kwargs)
    got = on(model, DEVICE).generate(ids.to(DEVICE), **kwargs)
    assert got.sequences.device.type == torch.device(DEVICE).type
    assert_same_generation(got, want)


def forced_logits(model, ids, cache, prompt_length):
    """Logits of a prefill of ``prompt_length`` tokens, then of each later token of ``ids`` fed one by one."""
    ids = ids.to(model.device)
    out = [model(ids[:, :prompt_length], past_key_values=cache).logits[:, -1]]
    for t in range(prompt_length, ids.shape[1]):
        out.append(model(ids[:, t:t + 1], past_key_values=cache).logits[:, -1])
    return torch.stack(out).cpu()


@pytest.mark.parametrize("backend, nbits, apart", [("kivi", 2, 0.1), ("quanto", 4, 0.1), ("hqq", 4, 0.2)])
def test_quantized_cache_on_cuda_is_as_faithful_as_on_the_cpu(backend, nbits, apart):
    """A code that rounds the other way (GPU and CPU sum in other orders) moves a logit by a whole step, so
    the GPU's quantized logits are held to the CPU's on average: their mean distance is at most ``apart`` of
    the quantization's own mean error (a GPU quantizer that were wrong would be as far off as that error).

    HQQ optimizes its scales and zeros in float16 on a GPU and in float32 on a CPU (``hqq.core.optimize``), so
    more codes differ: 0.128 of the error on an H100, and 0.128 on the CPU with its optimizer set to float16."""
    model = tiny(LLAMA)
    gpu = on(model, DEVICE)
    ids = prompt(length=36)
    cache_config = {"backend": backend, "nbits": nbits, "q_group_size": 16, "residual_length": 4}
    run = {device: {kind: forced_logits(m, ids, kvgen.QuantizedCache(config=m.config, cache_config=cache_config)
                                        if kind == "quantized" else kvgen.DynamicCache(), 20)
                    for kind in ("quantized", "full")} for device, m in (("cpu", model), ("gpu", gpu))}
    cpu_error = (run["cpu"]["quantized"] - run["cpu"]["full"]).abs().mean()
    assert cpu_error > 0.01  # the cache did quantize
    torch.testing.assert_close(run["gpu"]["full"], run["cpu"]["full"], rtol=1e-4, atol=1e-3)
    assert (run["gpu"]["quantized"] - run["cpu"]["quantized"]).abs().mean() <= apart * cpu_error
    assert (run["gpu"]["quantized"] - run["gpu"]["full"]).abs().mean() <= 1.1 * cpu_error


def test_sink_cache_object_and_beam_search_on_cuda():
    model = tiny(LLAMA)
    gpu = on(model, DEVICE)
    ids = prompt(batch=1)
    want = model.generate(ids, past_key_values=SinkCache(window_length=12, num_sink_tokens=2), max_new_tokens=10,
                          **GREEDY)
    got = gpu.generate(ids.to(DEVICE), past_key_values=SinkCache(window_length=12, num_sink_tokens=2),
                       max_new_tokens=10, **GREEDY)
    assert_same_generation(got, want)
    beams = dict(max_new_tokens=8, num_beams=3, do_sample=False)
    assert torch.equal(gpu.generate(ids.to(DEVICE), **beams).cpu(), model.generate(ids, **beams))


def test_logits_processors_and_warpers_on_cuda():
    """generate()'s processors build their tensors on the logits' device: greedy with every processor gives the
    CPU's tokens; a sampled run with every warper finishes on the GPU with tokens in the vocabulary."""
    model = tiny(LLAMA)
    gpu = on(model, DEVICE)
    ids = prompt(batch=2)
    processors = dict(repetition_penalty=1.3, no_repeat_ngram_size=2, bad_words_ids=[[5], [7, 8]],
                      sequence_bias={(3,): -2.0, (4, 9): 1.5}, forced_eos_token_id=1, renormalize_logits=True,
                      prefix_allowed_tokens_fn=lambda batch, sent: list(range(VOCAB - 4)))
    kwargs = dict(max_new_tokens=10, disable_compile=True, **GREEDY, **processors)
    assert_same_generation(gpu.generate(ids.to(DEVICE), **kwargs), model.generate(ids, **kwargs))
    torch.manual_seed(0)
    sampled = gpu.generate(ids.to(DEVICE), max_new_tokens=10, do_sample=True, temperature=0.8, top_k=20, top_p=0.9,
                           min_p=0.02, typical_p=0.95, epsilon_cutoff=1e-4, eta_cutoff=1e-4, **processors)
    assert sampled.device.type == torch.device(DEVICE).type and sampled.shape == (2, 30)
    assert int(sampled[:, 20:].max()) < VOCAB - 4  # prefix_allowed_tokens_fn held


COMPILED = [("static", LLAMA, None), ("sliding_window", MISTRAL, None), ("hybrid", GEMMA2, None),
            ("static_sink", LLAMA, {"window_length": 12, "num_sink_tokens": 2})]


@pytest.mark.parametrize("name, fields, cache_config", COMPILED, ids=[c[0] for c in COMPILED])
def test_compiled_static_decode_on_cuda_replays_cuda_graphs_and_matches_eager(name, fields, cache_config):
    """Compiled decode steps on a GPU replay CUDA graphs ("reduce-overhead"): none is skipped (a cache buffer
    written in place without a fixed address would skip them), and the logits kept from every step are those
    of eager steps (a graph's next replay overwrites its outputs)."""
    from torch._dynamo.utils import counters

    gpu = on(tiny(fields), DEVICE)
    ids = prompt().to(DEVICE)
    kwargs = dict(max_new_tokens=12, cache_implementation=name, cache_config=cache_config, **GREEDY)
    eager = gpu.generate(ids, disable_compile=True, **kwargs)
    counters.clear()
    compiled = gpu.generate(ids, **kwargs)
    assert getattr(gpu, "_compiled_forward", None) is not None  # the decode steps ran the compiled forward
    assert gpu._compiled_mode == "reduce-overhead"
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    assert_same_generation(compiled, eager, atol=1e-4)
    again = gpu.generate(ids, **kwargs)  # a new cache: graphs recorded again for its buffers
    assert_same_generation(again, eager, atol=1e-4)


def test_bfloat16_on_cuda_stays_close_to_float32():
    model = tiny(LLAMA)
    ids = prompt().to(DEVICE)
    full = on(model, DEVICE)(ids).logits
    half = on(model, DEVICE).to(torch.bfloat16)
    logits = half(ids).logits
    assert logits.dtype == torch.bfloat16
    assert (logits.float() - full).abs().max() <= 0.05 * full.abs().max()  # bfloat16 keeps 8 bits of mantissa
    out = half.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static")
    assert out.shape == (2, 28)


def test_eager_float16_decode_on_cuda_keeps_off_cudnn_attention():
    """cuDNN's attention builds a graph for each new key count (one every eager decode step): kvgen's torch path
    takes another backend where torch, left to choose, takes cuDNN's (float16 on Hopper)."""
    fields = {**LLAMA, "hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128}
    model = on(tiny(fields), DEVICE).half()
    q = torch.randn(1, 2, 1, 128, device=DEVICE, dtype=torch.float16)
    k = v = torch.randn(1, 1, 40, 128, device=DEVICE, dtype=torch.float16)

    def kernels(fn):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
        return {event.key for event in prof.key_averages()}

    if not any("cudnn" in name for name in kernels(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))):
        pytest.skip("torch does not choose cuDNN's attention on this GPU: nothing to keep off")
    ran = kernels(lambda: model.generate(prompt().to(DEVICE), max_new_tokens=6, do_sample=False, disable_compile=True))
    assert any("scaled_dot_product" in name for name in ran)  # the torch path ran ...
    assert not any("cudnn" in name for name in ran), sorted(ran)  # ... on another backend than cuDNN's


@pytest.mark.parametrize("quant_type, group_size", [("int8_weight_only", 128), ("int4_weight_only", 32)])
def test_quantized_weights_on_cuda_match_the_cpu_kernels(quant_type, group_size):
    model = tiny(LLAMA)
    TorchAoConfig(quant_type, group_size=group_size, modules_to_not_convert=[]).quantize_model(model)
    gpu = on(model, DEVICE)
    layer = gpu.model.layers[0].mlp.down_proj
    stored = layer.packed_0  # the stored bytes, on the GPU
    assert stored.device.type == torch.device(DEVICE).type and stored.dtype == torch.uint8
    ids = prompt()
    kwargs = dict(max_new_tokens=12, disable_compile=True, **GREEDY)
    assert_same_generation(gpu.generate(ids.to(DEVICE), **kwargs), model.generate(ids, **kwargs))
    quantized_there = tiny(LLAMA).to(DEVICE)  # quantizing a model already on the GPU
    TorchAoConfig(quant_type, group_size=group_size).quantize_model(quantized_there)
    assert quantized_there(ids.to(DEVICE)).logits.isfinite().all()


GGUF_TYPES = {"embed_tokens": Q.Q4_1, "q_proj": Q.Q4_K, "k_proj": Q.Q5_0, "v_proj": Q.Q8_0, "o_proj": Q.Q4_1,
              "gate_proj": Q.Q6_K, "up_proj": Q.Q4_K, "down_proj": Q.Q8_0, "lm_head": Q.Q6_K}
K_SCALES = {Q.Q4_K: 1e-3, Q.Q6_K: 2e-4}  # std of random K-quant blocks' float16 scales: weights of std ~0.25


def test_gguf_block_types_on_cuda_match_the_cpu(tmp_path):
    """A GGUF loaded in its stored types (Q4_K, Q6_K, Q5_0, Q8_0, Q4_1: tiles of 16 rows on the CPU) moves to the GPU
    in GGUF rows, decoded there by torch operations to the CPU kernels' values: the CPU's greedy tokens and prefill
    logits within 1e-4 (other summation orders). Back on the CPU it is in tiles again, with the same logits."""
    from test_loading import _random_llama_state, _write_llama_gguf
    from test_quantized_weights import random_raw

    cfg = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, inter=256, layers=2, vocab=VOCAB)  # K-quants: 256 wide
    state = _random_llama_state(tied=False, cfg=cfg)
    replace = {}  # every matrix in its type: gguf quantizes the legacy types (std 0.2), K-quants are random blocks
    for name, w in state.items():
        if w.dim() == 2:
            qtype = GGUF_TYPES[name.split(".")[-2]]
            replace[name] = (random_raw(qtype, *w.shape, seed=len(replace), scale=K_SCALES[qtype]) if qtype in K_SCALES
                             else gguf.quants.quantize(2 * w.numpy(), qtype)), qtype
    _write_llama_gguf(tmp_path / "tiny.gguf", state, Q.F32, replace=replace, cfg=cfg)
    model = kvgen.AutoModelForCausalLM.from_pretrained(tmp_path / "tiny.gguf")
    assert set(model.weight_format.split("+")) == {"Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_1"}
    gpu = on(model, DEVICE)
    qkv = gpu.model.layers[0].self_attn.qkv_proj
    assert qkv.formats == [12, 6, 8] and qkv.packed_0.device.type == "cuda"  # GGUF rows, stored bytes on the GPU
    assert model.model.layers[0].self_attn.qkv_proj.formats[:2] == [2012, 2006]  # the CPU's tiles
    ids = prompt()
    with torch.no_grad():
        logits = model(ids).logits
        assert (gpu(ids.to(DEVICE)).logits.cpu() - logits).abs().max() <= 1e-4
        kwargs = dict(max_new_tokens=12, disable_compile=True, **GREEDY)
        assert_same_generation(gpu.generate(ids.to(DEVICE), **kwargs), model.generate(ids, **kwargs), atol=1e-4)
        back = on(gpu, "cpu")
        assert back.model.layers[0].self_attn.qkv_proj.formats == model.model.layers[0].self_attn.qkv_proj.formats
        assert torch.equal(back(ids).logits, logits)


def test_continuous_batching_on_cuda_equals_generate_alone():
    gpu = on(tiny(LLAMA), DEVICE)
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(3, 90, (10,), generator=g)
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist() for n in lengths]
    config = ContinuousBatchingConfig(num_blocks=96, max_batch_tokens=64, max_num_seqs=6)
    outputs = gpu.generate_batch(prompts, max_new_tokens=12, do_sample=False, continuous_batching_config=config)
    for i, p in enumerate(prompts):
        alone = gpu.generate(torch.tensor([p], device=DEVICE), max_new_tokens=12, do_sample=False)
        assert outputs[f"req_{i}"].generated_tokens == alone[0, len(p):].tolist(), f"request {i}"


def engine_outputs(model, prompts, **config):
    config = ContinuousBatchingConfig(num_blocks=96, max_batch_tokens=64, max_num_seqs=6, **config)
    manager = model.init_continuous_batching(continuous_batching_config=config)
    runs = []
    if manager.runner.graphs is not None:
        run = manager.runner.graphs.run
        manager.runner.graphs.run = lambda ids, *rest: runs.append(len(ids)) or run(ids, *rest)
    ids = [manager.add_request(p, max_new_tokens=12, eos_token_id=[], top_logprobs=1) for p in prompts]
    with manager:
        outputs = [manager.get_result(i, timeout=300) for i in ids]
    return outputs, manager, runs


@pytest.mark.parametrize("fields", [LLAMA, MISTRAL, {**GEMMA2, "attn_logit_softcapping": 5.0}],
                         ids=["llama", "mistral-window", "gemma2-softcap"])
def test_block_sparse_attention_and_decode_graphs_on_cuda_match_the_dense_masks(fields):
    """The GPU engine's defaults (block-sparse flex_attention over the pool, decode steps replayed from CUDA
    graphs of sizes 1, 2, 4, 8) give the tokens of the dense masks' eager steps and logprobs within 1e-3; every
    size was captured and the decode steps went through the graphs."""
    gpu = on(tiny(fields), DEVICE)
    g = torch.Generator().manual_seed(6)
    lengths = torch.randint(3, 40, (9,), generator=g)
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist() for n in lengths]
    graphs, manager, runs = engine_outputs(gpu, prompts)
    assert manager.cache.block_sparse and sorted(manager.runner.graphs.graphs) == [1, 2, 4, 8]
    assert len(runs) >= 11 and max(runs) == 6
    dense, _, _ = engine_outputs(gpu, prompts, block_sparse=False, decode_graphs=False)
    for a, b in zip(graphs, dense):
        assert a.generated_tokens == b.generated_tokens
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3
