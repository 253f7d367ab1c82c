"""kvgen.loading.ctranslate2: model.bin files written here in the documented format, and the real tiny.en.

The writer below is independent of kvgen: it fuses a transformers Whisper's weights the way
CTranslate2's converter does, so reading it back must give the transformers model again.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import wave
from pathlib import Path

import pytest
import torch

from kvgen.loading.ctranslate2 import is_ctranslate2_dir, load_ctranslate2_whisper, read_ctranslate2_model

transformers = pytest.importorskip("transformers")

TYPE_IDS = {torch.float32: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.float16: 4, torch.bfloat16: 5}
PANGRAM = "the quick brown fox jumps over the lazy dog"


# -- an independent model.bin writer ------------------------------------------------------------------------

def ct2_string(text: str) -> bytes:
    data = text.encode() + b"\0"
    return struct.pack("<H", len(data)) + data


def model_bin(variables: dict[str, torch.Tensor], aliases: dict[str, str], spec: str = "WhisperSpec",
              version: int = 6) -> bytes:
    out = [struct.pack("<I", version), ct2_string(spec), struct.pack("<I", 3), struct.pack("<I", len(variables))]
    for name, tensor in variables.items():
        raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        out += [ct2_string(name), struct.pack("<B", tensor.dim()), struct.pack(f"<{tensor.dim()}I", *tensor.shape),
                struct.pack("<B", TYPE_IDS[tensor.dtype]), struct.pack("<I", len(raw)), raw]
    out.append(struct.pack("<I", len(aliases)))
    for alias, target in aliases.items():
        out += [ct2_string(alias), ct2_string(target)]
    return b"".join(out)


def ct2_whisper_variables(model, dtype=torch.float16) -> dict[str, torch.Tensor]:
    """A transformers Whisper's weights under CTranslate2's names, q/k/v fused as its converter does."""
    sd = {k: v.to(dtype) for k, v in model.state_dict().items()}
    cfg = model.config
    v: dict[str, torch.Tensor] = {
        "decoder/activation": torch.tensor(3, dtype=torch.int8), "decoder/pre_norm": torch.tensor(1, dtype=torch.int8),
        "decoder/alibi": torch.tensor(0, dtype=torch.int8),
        "decoder/num_heads": torch.tensor(cfg.decoder_attention_heads, dtype=torch.int16),
        "encoder/num_heads": torch.tensor(cfg.encoder_attention_heads, dtype=torch.int16),
        "decoder/scale_embeddings": torch.tensor(0, dtype=torch.int8),
    }

    def norm(ct2, hf):
        v[f"{ct2}/gamma"], v[f"{ct2}/beta"] = sd[f"{hf}.weight"], sd[f"{hf}.bias"]

    def linear(ct2, hf):
        v[f"{ct2}/weight"], v[f"{ct2}/bias"] = sd[f"{hf}.weight"], sd[f"{hf}.bias"]

    def self_attention(ct2, hf):
        q, k, val = (sd[f"{hf}.{p}_proj.weight"] for p in "qkv")
        v[f"{ct2}/linear_0/weight"] = torch.cat([q, k, val])
        v[f"{ct2}/linear_0/bias"] = torch.cat([sd[f"{hf}.q_proj.bias"], torch.zeros_like(sd[f"{hf}.q_proj.bias"]),
                                               sd[f"{hf}.v_proj.bias"]])
        linear(f"{ct2}/linear_1", f"{hf}.out_proj")

    def cross_attention(ct2, hf):
        linear(f"{ct2}/linear_0", f"{hf}.q_proj")
        v[f"{ct2}/linear_1/weight"] = torch.cat([sd[f"{hf}.k_proj.weight"], sd[f"{hf}.v_proj.weight"]])
        v[f"{ct2}/linear_1/bias"] = torch.cat([torch.zeros_like(sd[f"{hf}.v_proj.bias"]), sd[f"{hf}.v_proj.bias"]])
        linear(f"{ct2}/linear_2", f"{hf}.out_proj")

    linear("encoder/conv1", "model.encoder.conv1")
    linear("encoder/conv2", "model.encoder.conv2")
    v["encoder/position_encodings/encodings"] = sd["model.encoder.embed_positions.weight"]
    for i in range(cfg.encoder_layers):
        ct2, hf = f"encoder/layer_{i}", f"model.encoder.layers.{i}"
        self_attention(f"{ct2}/self_attention", f"{hf}.self_attn")
        norm(f"{ct2}/self_attention/layer_norm", f"{hf}.self_attn_layer_norm")
        linear(f"{ct2}/ffn/linear_0", f"{hf}.fc1")
        linear(f"{ct2}/ffn/linear_1", f"{hf}.fc2")
        norm(f"{ct2}/ffn/layer_norm", f"{hf}.final_layer_norm")
    norm("encoder/layer_norm", "model.encoder.layer_norm")
    v["decoder/embeddings/weight"] = sd["model.decoder.embed_tokens.weight"]
    v["decoder/position_encodings/encodings"] = sd["model.decoder.embed_positions.weight"]
    for i in range(cfg.decoder_layers):
        ct2, hf = f"decoder/layer_{i}", f"model.decoder.layers.{i}"
        self_attention(f"{ct2}/self_attention", f"{hf}.self_attn")
        norm(f"{ct2}/self_attention/layer_norm", f"{hf}.self_attn_layer_norm")
        cross_attention(f"{ct2}/attention", f"{hf}.encoder_attn")
        norm(f"{ct2}/attention/layer_norm", f"{hf}.encoder_attn_layer_norm")
        linear(f"{ct2}/ffn/linear_0", f"{hf}.fc1")
        linear(f"{ct2}/ffn/linear_1", f"{hf}.fc2")
        norm(f"{ct2}/ffn/layer_norm", f"{hf}.final_layer_norm")
    norm("decoder/layer_norm", "model.decoder.layer_norm")
    return v


SPECIALS = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|de|>", "<|translate|>", "<|transcribe|>",
            "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>"]
VOCAB = 72  # 60 plain tokens, then the specials at 60..69, then two timestamps


def tiny_hf_whisper(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, d_model=16, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=4, encoder_ffn_dim=24, decoder_ffn_dim=40, max_source_positions=10,
        max_target_positions=12, bos_token_id=61, eos_token_id=60, pad_token_id=60, decoder_start_token_id=61)
    model = transformers.WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():  # non-trivial biases and norms, so a swapped name shows
        for name, param in model.named_parameters():
            if name.endswith(("bias", "norm.weight")):
                param.normal_(0.0, 0.5)
    return model


def write_ct2_folder(folder: Path, model, variables=None, aliases=None, settings=None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    variables = ct2_whisper_variables(model) if variables is None else variables
    aliases = {"decoder/projection/weight": "decoder/embeddings/weight"} if aliases is None else aliases
    (folder / "model.bin").write_bytes(model_bin(variables, aliases))
    vocabulary = [f"tok{i}" for i in range(60)] + SPECIALS + ["<|0.00|>", "<|0.02|>"]
    (folder / "vocabulary.txt").write_text("\n".join(vocabulary))
    settings = {"suppress_ids": [1, 2, 64], "suppress_ids_begin": [5, 60],
                "alignment_heads": [[0, 1], [0, 3]], "lang_ids": [62, 63]} if settings is None else settings
    (folder / "config.json").write_text(json.dumps(settings))
    return folder


# -- the reader ---------------------------------------------------------------------------------------------

def test_read_round_trip_names_shapes_dtypes_aliases(tmp_path):
    g = torch.Generator().manual_seed(0)
    variables = {
        "a/weight": torch.randn(3, 5, generator=g), "a/half": torch.randn(7, generator=g).half(),
        "b/bf16": torch.randn(2, 2, 2, generator=g).bfloat16(),
        "b/int8": torch.tensor([-128, 0, 127], dtype=torch.int8), "b/int16": torch.tensor(6, dtype=torch.int16),
        "c/int32": torch.tensor([[1, -2], [3, 2**31 - 1]], dtype=torch.int32),
        "c/empty": torch.zeros(0, 4),
    }
    (tmp_path / "model.bin").write_bytes(model_bin(variables, {"alias/one": "a/weight", "alias/two": "b/int16"},
                                                   spec="SomeSpec"))
    model = read_ctranslate2_model(tmp_path)
    assert model.spec == "SomeSpec" and model.revision == 3
    assert list(model.variables) == list(variables)
    for name, tensor in variables.items():
        assert model.variables[name].dtype == tensor.dtype and model.variables[name].shape == tensor.shape
        assert torch.equal(model.variables[name], tensor), name
    assert model.aliases == {"alias/one": "a/weight", "alias/two": "b/int16"}
    assert model["alias/one"] is model["a/weight"] and model.scalar("alias/two", 0) == 6
    assert "alias/one" in model and "nothing" not in model and model.scalar("nothing", 9) == 9


def test_converted_weights_equal_the_transformers_model(tmp_path):
    reference = tiny_hf_whisper()
    config, state, generation = load_ctranslate2_whisper(write_ct2_folder(tmp_path / "ct2", reference))
    assert {k: config[k] for k in ("vocab_size", "num_mel_bins", "d_model", "encoder_layers", "decoder_layers",
                                   "encoder_attention_heads", "decoder_attention_heads", "encoder_ffn_dim",
                                   "decoder_ffn_dim", "max_source_positions", "max_target_positions")} == {
        "vocab_size": VOCAB, "num_mel_bins": 8, "d_model": 16, "encoder_layers": 2, "decoder_layers": 1,
        "encoder_attention_heads": 2, "decoder_attention_heads": 4, "encoder_ffn_dim": 24, "decoder_ffn_dim": 40,
        "max_source_positions": 10, "max_target_positions": 12}
    assert (config["eos_token_id"], config["decoder_start_token_id"], config["dtype"]) == (60, 61, "float16")
    assert generation["suppress_tokens"] == [1, 2, 64] and generation["begin_suppress_tokens"] == [5, 60]
    assert generation["no_timestamps_token_id"] == 69 and generation["prev_sot_token_id"] == 67
    assert generation["alignment_heads"] == [[0, 1], [0, 3]] and generation["is_multilingual"] is False
    assert all(t.dtype == torch.float16 for t in state.values())

    expected = {k: v.half() for k, v in reference.state_dict().items() if k != "proj_out.weight"}
    assert sorted(state) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name

    model = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**config)).eval()
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    assert missing == ["proj_out.weight"] and unexpected == []
    assert model.proj_out.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()
    features = torch.randn(1, 8, 20, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[61, 69, 3, 4]])
    with torch.no_grad():
        ref_logits = reference.half().float()(input_features=features, decoder_input_ids=ids).logits
        logits = model(input_features=features, decoder_input_ids=ids).logits
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)


def test_untied_projection_and_int8_weights(tmp_path):
    reference = tiny_hf_whisper(seed=1)
    variables = ct2_whisper_variables(reference, dtype=torch.float32)
    projection = torch.randn(VOCAB, 16, generator=torch.Generator().manual_seed(2))
    variables["decoder/projection/weight"] = projection
    fc1 = variables["encoder/layer_1/ffn/linear_0/weight"]  # quantized per row as CTranslate2 does
    scale = 127.0 / fc1.abs().amax(dim=1)
    variables["encoder/layer_1/ffn/linear_0/weight"] = (fc1 * scale[:, None]).round().to(torch.int8)
    variables["encoder/layer_1/ffn/linear_0/weight_scale"] = scale
    config, state, _ = load_ctranslate2_whisper(write_ct2_folder(tmp_path / "ct2", reference, variables, aliases={}))
    assert config["tie_word_embeddings"] is False and torch.equal(state["proj_out.weight"], projection)
    dequantized = state["model.encoder.layers.1.fc1.weight"]
    assert dequantized.dtype == torch.float32 and "model.encoder.layers.1.fc1.weight_scale" not in state
    torch.testing.assert_close(dequantized, fc1, rtol=0, atol=float((0.5 / scale).max()) + 1e-6)
    model = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**config))
    model.load_state_dict(state, strict=True)  # untied: proj_out.weight is in the state dict


def test_multilingual_vocabulary_gives_language_ids(tmp_path):
    reference = tiny_hf_whisper()
    folder = write_ct2_folder(tmp_path / "ct2", reference)
    variables = ct2_whisper_variables(reference)
    embeddings = variables["decoder/embeddings/weight"]
    variables["decoder/embeddings/weight"] = torch.cat([embeddings, embeddings[:1].expand(51865 - VOCAB, -1)])
    (folder / "model.bin").write_bytes(model_bin(variables, {"decoder/projection/weight": "decoder/embeddings/weight"}))
    config, _, generation = load_ctranslate2_whisper(folder)
    assert config["vocab_size"] == 51865 and generation["is_multilingual"] is True
    assert generation["lang_to_id"] == {"<|en|>": 62, "<|de|>": 63}
    assert generation["task_to_id"] == {"transcribe": 65, "translate": 64}


def test_is_ctranslate2_dir(tmp_path):
    folder = write_ct2_folder(tmp_path / "ct2", tiny_hf_whisper())
    assert is_ctranslate2_dir(folder) and not is_ctranslate2_dir(folder / "model.bin")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "hf" / "model.bin").write_bytes(b"PK\x03\x04 a torch zip archive")
    assert not is_ctranslate2_dir(tmp_path / "hf")
    shutil.copy(folder / "model.bin", tmp_path / "hf" / "model.bin")
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    assert not is_ctranslate2_dir(tmp_path / "hf")  # HF weights beside it win
    assert not is_ctranslate2_dir(tmp_path / "missing")


def test_truncated_and_invalid_files_raise_clear_errors(tmp_path):
    folder = write_ct2_folder(tmp_path / "ct2", tiny_hf_whisper())
    data = (folder / "model.bin").read_bytes()
    for cut in (2, 9, 40, len(data) // 2, len(data) - 20, len(data) - 1):
        (folder / "model.bin").write_bytes(data[:cut])
        with pytest.raises(ValueError, match="truncated or corrupt"):
            load_ctranslate2_whisper(folder)
    (folder / "model.bin").write_bytes(data + b"\0")
    with pytest.raises(ValueError, match="unexpected bytes after the alias table"):
        read_ctranslate2_model(folder)
    (folder / "model.bin").write_bytes(struct.pack("<I", 5) + data[4:])
    with pytest.raises(ValueError, match="binary version 5; kvgen reads version"):
        load_ctranslate2_whisper(folder)
    (folder / "model.bin").write_bytes(model_bin({"x": torch.zeros(1)}, {}, spec="TransformerSpec"))
    with pytest.raises(ValueError, match="'TransformerSpec'; kvgen reads WhisperSpec"):
        load_ctranslate2_whisper(folder)
    variables = ct2_whisper_variables(tiny_hf_whisper())
    del variables["decoder/layer_0/attention/linear_1/weight"]
    (folder / "model.bin").write_bytes(model_bin(variables, {"decoder/projection/weight": "decoder/embeddings/weight"}))
    with pytest.raises(ValueError, match="not a complete Whisper model.*decoder/layer_0/attention/linear_1/weight"):
        load_ctranslate2_whisper(folder)
    (folder / "model.bin").write_bytes(model_bin({"x": torch.zeros(1)}, {"y": "missing"}))
    with pytest.raises(ValueError, match="alias 'y' points to 'missing'"):
        read_ctranslate2_model(folder)
    with pytest.raises(FileNotFoundError, match="CTranslate2 model file not found"):
        read_ctranslate2_model(tmp_path / "nowhere")


# -- the real Whisper tiny.en -------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_en():
    """The real tiny.en folder and its conversion (config, state dict, generation config), once per session."""
    from kvgen.loading.default_model import whisper_tiny_en_dir

    try:
        folder = whisper_tiny_en_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return folder, load_ctranslate2_whisper(folder)


@pytest.fixture(scope="session")
def hf_tiny_en(tiny_en):
    _, (config, state, generation) = tiny_en
    model = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**config)).eval()
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    assert missing == ["proj_out.weight"] and unexpected == []
    model.generation_config = transformers.GenerationConfig(**generation)
    return model


@pytest.fixture(scope="session")
def pangram_features(tmp_path_factory):
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (bash scripts/setup.sh --test installs it)")
    from kvgen.audio import WhisperFeatureExtractor, load_audio

    path = tmp_path_factory.mktemp("speech") / "pangram.wav"
    subprocess.run(["espeak-ng", "-w", str(path), PANGRAM], check=True)
    return WhisperFeatureExtractor()(load_audio(path), sampling_rate=16000).input_features


@pytest.fixture(scope="session")
def hf_pangram_ids(hf_tiny_en, pangram_features):
    """transformers' greedy transcription of the pangram (generated ids, without the prompt)."""
    with torch.no_grad():
        return hf_tiny_en.generate(pangram_features, max_new_tokens=32)


def test_real_tiny_en_config(tiny_en):
    folder, (config, state, generation) = tiny_en
    assert is_ctranslate2_dir(folder)
    assert (config["vocab_size"], config["d_model"], config["encoder_layers"], config["decoder_layers"],
            config["encoder_attention_heads"], config["num_mel_bins"]) == (51864, 384, 4, 4, 6, 80)
    assert (config["decoder_start_token_id"], config["eos_token_id"], generation["no_timestamps_token_id"]) == (
        50257, 50256, 50362)
    assert generation["begin_suppress_tokens"] == [220, 50256] and len(generation["suppress_tokens"]) == 90
    assert state["model.decoder.embed_tokens.weight"].shape == (51864, 384)
    assert state["model.encoder.layers.0.self_attn.k_proj.weight"].shape == (384, 384)


def test_real_tiny_en_transcribes_speech_in_transformers(tiny_en, hf_pangram_ids):
    from kvgen.audio import WhisperProcessor

    text = WhisperProcessor.from_pretrained(tiny_en[0]).batch_decode(hf_pangram_ids, skip_special_tokens=True)[0]
    words = text.lower().replace(".", " ").replace(",", " ").split()
    assert {"quick", "brown", "fox", "over", "lazy", "dog"} <= set(words), text
    assert any(word.startswith("jump") for word in words), text


# -- kvgen's own Whisper on CTranslate2 folders (compared with transformers on the same weights) ----------------

def test_kvgen_from_pretrained_reads_a_ctranslate2_folder(tmp_path):
    from kvgen import WhisperForConditionalGeneration

    reference = tiny_hf_whisper(seed=3).half().float()  # the folder stores float16
    model = WhisperForConditionalGeneration.from_pretrained(write_ct2_folder(tmp_path / "ct2", reference))
    assert model.generation_config.extra["no_timestamps_token_id"] == 69
    features = torch.randn(2, 8, 20, generator=torch.Generator().manual_seed(4))
    ids = torch.tensor([[61, 69, 3, 4], [61, 69, 7, 1]])
    with torch.no_grad():
        expected = reference(input_features=features, decoder_input_ids=ids).logits
        logits = model(input_features=features, decoder_input_ids=ids).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)


def test_kvgen_transcribes_like_transformers_on_real_tiny_en(tiny_en, hf_tiny_en, pangram_features, hf_pangram_ids):
    from kvgen import WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(tiny_en[0], dtype=torch.float32)
    ids = model.generate(pangram_features, max_new_tokens=32)
    assert ids.tolist() == hf_pangram_ids.tolist()
    sequence = torch.cat([torch.tensor([[50257, 50362]]), hf_pangram_ids], dim=1)  # prompt + transcript
    with torch.no_grad():
        ref_states = hf_tiny_en.model.encoder(pangram_features).last_hidden_state  # (1, 1500, 384)
        states = model.model.encoder(pangram_features).last_hidden_state
        ref_logits = hf_tiny_en(encoder_outputs=(ref_states,), decoder_input_ids=sequence).logits
        logits = model(encoder_outputs=states, decoder_input_ids=sequence).logits
    torch.testing.assert_close(states, ref_states, rtol=0, atol=1e-3)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=2e-3)


def test_transcribe_wav_file_longer_than_30_seconds(tmp_path, tiny_en, pangram_features):
    from kvgen.audio import load_audio
    from kvgen.transcribe import transcribe

    # 34 s at 22050 Hz: the pangram, silence to the 30 s mark, then a second phrase in the next 30 s window
    for name, text in (("fox", PANGRAM), ("morning", "good morning everyone")):
        subprocess.run(["espeak-ng", "-w", str(tmp_path / f"{name}.wav"), text], check=True)
    first, second = (load_audio(tmp_path / f"{name}.wav", 22050) for name in ("fox", "morning"))
    speech = torch.cat([first, torch.zeros(30 * 22050 - first.shape[0]), second])
    with wave.open(str(tmp_path / "long.wav"), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(22050)
        f.writeframes((speech * 32767).round().to(torch.int16).numpy().tobytes())
    text = transcribe(tmp_path / "long.wav")  # the default model: the packaged tiny.en
    assert text.startswith("The quick brown fox") and text.endswith("lazy dog. Good morning everyone."), text
