"""Cache persistence: ``cache.save(path)`` / ``kvgen.load_cache(path, model=...)``.

* Round trips for every cache type: fill the cache with a prompt, save, load into new objects,
  and continue decoding (single tokens, then a chunk) on the loaded cache and on a deep copy
  of the original: the logits must be bit-for-bit equal. The real SmolLM2-135M for the dynamic
  and static caches; small random Llama / Mistral / Gemma 2 / Whisper models for the others.
* Model fingerprints: a cache file (or a loaded cache passed to forward/generate) of a model
  with other weights or another config is refused, naming both fingerprints.
* Damaged and edited files: truncated, a flipped byte, edited JSON, missing tensors, reshaped
  tensors, unknown classes, another format version, names that would run code: a clear
  ``CacheFileError``, never a cache holding garbage; nothing is ever unpickled.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import pickle
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvgen
from kvgen import (DynamicCache, EncoderDecoderCache, HQQQuantizedCache, HybridCache, OffloadedCache,
                   OffloadedStaticCache, QuantizedCache, QuantoQuantizedCache, SinkCache, SlidingWindowCache,
                   StaticCache, StaticSinkCache)
from kvgen.cache import (Cache, CacheFileError, CacheModelMismatchError, enable_offloading, model_fingerprint,
                         register_persistable)
from kvgen.cache.dynamic import DynamicLayer, DynamicSlidingWindowLayer
from kvgen.cache.offload import OffloadedLayer, Placement
from kvgen.config import PretrainedConfig
from kvgen.models.decode_blocks import eager_blocks

needs_quanto = pytest.mark.skipif(importlib.util.find_spec("optimum") is None
                                  or importlib.util.find_spec("optimum.quanto") is None,
                                  reason="optimum-quanto is not installed")
needs_hqq = pytest.mark.skipif(importlib.util.find_spec("hqq") is None, reason="hqq is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

VOCAB = 64
LLAMA = dict(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, eos_token_id=None,
             pad_token_id=None)
MISTRAL = {**LLAMA, "model_type": "mistral", "sliding_window": 4}
GEMMA2 = dict(model_type="gemma2", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
              max_position_embeddings=128, eos_token_id=None, pad_token_id=None)
WHISPER = dict(model_type="whisper", vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
               encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=48, decoder_ffn_dim=48,
               num_mel_bins=8, max_source_positions=16, max_target_positions=32, decoder_start_token_id=1,
               pad_token_id=0, eos_token_id=2)
SMALL_QUANT = {"nbits": 4, "q_group_size": 4, "residual_length": 2, "num_sink_tokens": 1}


@pytest.fixture(autouse=True)
def _eager():
    with eager_blocks(), torch.no_grad():  # compiled CPU blocks would only add compile time here
        yield


def tiny(fields: dict, seed: int = 0):
    """A random model with weights large enough for peaked attention (so that any state error shows)."""
    torch.manual_seed(seed)
    model = kvgen.AutoModelForCausalLM.from_config(PretrainedConfig(**fields)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return model.requires_grad_(False)


@pytest.fixture(scope="module")
def models():
    return {"llama": tiny(LLAMA), "mistral": tiny(MISTRAL), "gemma2": tiny(GEMMA2)}


def token_ids(batch=2, length=16, seed=1):
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def layer_kinds(cache) -> list[str]:
    return [type(layer).__name__ + (f"({type(layer.inner).__name__})" if isinstance(layer, OffloadedLayer) else "")
            for layer in cache.layers]


def continue_both(model, reference, loaded, ids, start):
    """Feed ``ids[:, start:]`` (three single tokens, then a chunk of three) to both caches; logits must be equal."""
    for a, b in ((start, start + 1), (start + 1, start + 2), (start + 2, start + 3), (start + 3, start + 6)):
        expected = model(ids[:, a:b], past_key_values=reference).logits
        got = model(ids[:, a:b], past_key_values=loaded).logits
        assert torch.equal(got, expected), f"logits differ after loading, feeding positions {a}..{b - 1}"


def round_trip(model, cache, path, prompt_length=9, batch=2):
    """Fill ``cache``, save, load into new objects and continue both; returns (reference, loaded)."""
    ids = token_ids(batch, prompt_length + 6)
    model(ids[:, :prompt_length], past_key_values=cache)
    cache.save(path)
    reference = copy.deepcopy(cache)
    loaded = kvgen.load_cache(path, model=model)
    assert type(loaded) is type(reference) and layer_kinds(loaded) == layer_kinds(cache)
    assert loaded.get_seq_length() == reference.get_seq_length() == prompt_length
    assert torch.equal(loaded.token_ids, ids[:, :prompt_length])  # the cached prefix, for prefix reuse
    assert loaded.common_prefix_length(ids) == prompt_length
    assert not _data_pointers(cache) & _data_pointers(loaded)  # new tensors, nothing shared with the saved cache
    assert loaded.model_fingerprint == model_fingerprint(model)
    continue_both(model, reference, loaded, ids, prompt_length)
    return reference, loaded


def _data_pointers(cache) -> set[int]:
    out = set()
    for layer in cache.layers:
        inner = layer.inner if isinstance(layer, OffloadedLayer) else layer
        out |= {v.data_ptr() for v in vars(inner).values() if isinstance(v, torch.Tensor)}
    return out


# -- round trips on the real default model --------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_smollm_round_trip(smollm, kind, tmp_path):
    model, tokenizer = smollm
    ids = tokenizer(["The capital of France is Paris, and"], return_tensors="pt").input_ids
    n = ids.shape[1] - 3
    cache = (DynamicCache(config=model.config) if kind == "dynamic"
             else StaticCache(config=model.config, max_cache_len=ids.shape[1] + 4))
    model(ids[:, :n], past_key_values=cache)
    path = tmp_path / "smollm.safetensors"
    cache.save(path)
    reference = copy.deepcopy(cache)
    loaded = kvgen.load_cache(path, model=model)
    assert type(loaded) is type(cache) and len(loaded.layers) == model.config.num_hidden_layers
    assert torch.equal(loaded.token_ids, ids[:, :n])
    for t in range(n, ids.shape[1]):
        expected = model(ids[:, t:t + 1], past_key_values=reference).logits
        assert torch.equal(model(ids[:, t:t + 1], past_key_values=loaded).logits, expected)
    if kind == "static":
        return
    # generate() continues a loaded cache as it continues the original
    again = kvgen.load_cache(path, model=model)
    out = model.generate(ids, past_key_values=again, max_new_tokens=2, do_sample=False)
    expected = model.generate(ids, past_key_values=copy.deepcopy(cache), max_new_tokens=2, do_sample=False)
    assert torch.equal(out, expected)


def test_smollm_fingerprint_is_cheap_and_remembered(smollm):
    model, _ = smollm
    first = model_fingerprint(model)
    assert set(first) == {"config", "weights"} and all(len(v) == 64 for v in first.values())
    memo = model.__dict__["_kvgen_weights_fingerprint"]
    assert model_fingerprint(model) == first and model.__dict__["_kvgen_weights_fingerprint"] is memo


# -- round trips on small random models, every cache type ------------------------------------------------------

CASES = {
    "dynamic": ("llama", lambda m: DynamicCache()),
    "dynamic-sliding-layers": ("mistral", lambda m: DynamicCache(config=m.config)),
    "dynamic-mixed-layers": ("gemma2", lambda m: DynamicCache(config=m.config)),
    "static": ("llama", lambda m: StaticCache(config=m.config, max_cache_len=24)),
    "sliding_window": ("mistral", lambda m: SlidingWindowCache(config=m.config, max_cache_len=24)),
    "hybrid": ("gemma2", lambda m: HybridCache(config=m.config, max_cache_len=24)),
    "sink": ("llama", lambda m: SinkCache(window_length=6, num_sink_tokens=2)),
    "static_sink": ("llama", lambda m: StaticSinkCache(config=m.config, window_length=6, num_sink_tokens=2,
                                                       max_cache_len=24)),
    "quantized-kivi": ("llama", lambda m: QuantizedCache(cache_config={"backend": "kivi", **SMALL_QUANT})),
    "quantized-kivi-2bit-mixed-layers": ("gemma2", lambda m: QuantizedCache(
        "kivi", m.config, nbits=2, q_group_size=4, residual_length=2)),
    "quantized-quanto": ("llama", lambda m: QuantoQuantizedCache(cache_config={"backend": "quanto", **SMALL_QUANT})),
    "quantized-hqq": ("llama", lambda m: HQQQuantizedCache(cache_config={"backend": "hqq", **SMALL_QUANT,
                                                                         "axis_key": 1, "axis_value": 1})),
    "offloaded": ("llama", lambda m: OffloadedCache()),
    "offloaded_static": ("llama", lambda m: OffloadedStaticCache(config=m.config, max_cache_len=24)),
    "dynamic-offloading-non-sliding": ("gemma2", lambda m: DynamicCache(config=m.config, offloading=True,
                                                                        offload_only_non_sliding=True)),
    "quantized-offloading": ("llama", lambda m: QuantizedCache(cache_config={"backend": "kivi", **SMALL_QUANT},
                                                               offloading=True)),
}
MARKS = {"quantized-quanto": needs_quanto, "quantized-hqq": needs_hqq}


@pytest.mark.parametrize("name", [pytest.param(n, marks=MARKS.get(n, ())) for n in CASES])
def test_round_trip_gives_identical_logits(models, name, tmp_path):
    model_name, make = CASES[name]
    model = models[model_name]
    round_trip(model, make(model), tmp_path / f"{name}.safetensors")


def test_the_layers_are_what_they_were(models, tmp_path):
    """Spot checks that the round trips above covered the interesting states, not empty ones."""
    _, loaded = round_trip(models["mistral"], SlidingWindowCache(config=models["mistral"].config, max_cache_len=24),
                           tmp_path / "ring.safetensors")
    assert int((loaded.layers[0]._pos >= 0).sum()) == 4  # a ring buffer that wrapped around
    ref, loaded = round_trip(models["llama"], QuantizedCache(cache_config={"backend": "kivi", **SMALL_QUANT}),
                             tmp_path / "kivi.safetensors")
    assert ref.layers[0].quantized_length > 0 and ref.layers[0].residual_length_now > 0
    assert loaded.layers[0].workspace is loaded.layers[1].workspace  # shared objects stay shared
    _, loaded = round_trip(models["gemma2"], DynamicCache(config=models["gemma2"].config),
                           tmp_path / "sliding.safetensors")
    assert isinstance(loaded.layers[0], DynamicSlidingWindowLayer) and loaded.layers[0].sliding_window == 4


def test_a_loaded_offloaded_cache_is_offloaded_again(models, tmp_path):
    model = models["gemma2"]
    cache = DynamicCache(config=model.config, offloading=True, offload_only_non_sliding=True)
    model(token_ids(length=9), past_key_values=cache)
    cache.save(tmp_path / "off.safetensors")
    loaded = kvgen.load_cache(tmp_path / "off.safetensors", model=model)
    offloaded = [layer for layer in loaded.layers if isinstance(layer, OffloadedLayer)]
    assert layer_kinds(loaded) == ["DynamicSlidingWindowLayer", "OffloadedLayer(DynamicLayer)"]
    assert offloaded and loaded.offloader.layers == offloaded
    assert all(layer.offloader is loaded.offloader and layer.state == "offloaded" for layer in offloaded)
    offload_device = loaded.offloader.placement.offload_device
    assert all(layer.inner._k.device == offload_device for layer in offloaded)
    assert loaded.offload_only_non_sliding
    # layers created later are offloaded too (the layer factory survived)
    lazy = OffloadedCache()
    model(token_ids(length=5), past_key_values=lazy)
    lazy.save(tmp_path / "lazy.safetensors")
    loaded = kvgen.load_cache(tmp_path / "lazy.safetensors")
    assert isinstance(loaded._layer_factory(7), OffloadedLayer)


@register_persistable
class CopyingPlacement(Placement):
    """A second "device" on the CPU: offloading moves layers (as copies), so its schedule really runs."""

    @property
    def moves(self) -> bool:
        return True

    def to_compute(self, t):
        return t.clone()

    def to_offload(self, t):
        return t.clone()


def test_offloaded_layers_that_were_resident_come_back_offloaded(models, tmp_path):
    model = models["llama"]
    cache = enable_offloading(DynamicCache(), placement=CopyingPlacement("cpu", "cpu"))
    ids = token_ids(length=15)
    model(ids[:, :9], past_key_values=cache)
    assert {layer.state for layer in cache.layers} == {"resident"}  # the last layer, and the first (prefetched)
    cache.save(tmp_path / "moving.safetensors")
    reference = copy.deepcopy(cache)
    loaded = kvgen.load_cache(tmp_path / "moving.safetensors", model=model)
    assert type(loaded.offloader.placement) is CopyingPlacement
    assert {layer.state for layer in loaded.layers} == {"offloaded"}
    assert loaded.offloader.active is None and loaded.offloader._on_compute == []
    continue_both(model, reference, loaded, ids, 9)
    assert {layer.state for layer in loaded.layers} == {"resident"}  # the schedule runs again


def test_forked_caches_round_trip(models, tmp_path):
    model = models["llama"]
    ids = token_ids(length=15)
    cache = DynamicCache()
    model(ids[:, :6], past_key_values=cache)
    fork, _ = cache.fork(2)
    model(ids[:, 6:9], past_key_values=fork)
    fork.save(tmp_path / "fork.safetensors")
    reference = copy.deepcopy(fork)
    assert all(type(layer).__name__ == "ForkedLayer" for layer in fork.layers)
    loaded = kvgen.load_cache(tmp_path / "fork.safetensors", model=model)
    assert layer_kinds(loaded) == layer_kinds(fork)
    continue_both(model, reference, loaded, ids, 9)


@needs_cuda
@pytest.mark.parametrize("kind", ["offloaded", "offloaded_static", "dynamic"])
def test_round_trip_on_cuda(kind, tmp_path):
    model = tiny(LLAMA).to("cuda")
    cache = {"offloaded": lambda: OffloadedCache(),
             "offloaded_static": lambda: OffloadedStaticCache(config=model.config, max_cache_len=24, device="cuda",
                                                              dtype=torch.float32),
             "dynamic": lambda: DynamicCache()}[kind]()
    ids = token_ids(length=15).cuda()
    model(ids[:, :9], past_key_values=cache)
    cache.save(tmp_path / "gpu.safetensors")
    reference = copy.deepcopy(cache)
    loaded = kvgen.load_cache(tmp_path / "gpu.safetensors", model=model)
    for layer in loaded.layers:
        inner = layer.inner if isinstance(layer, OffloadedLayer) else layer
        assert inner._k.device.type == ("cpu" if isinstance(layer, OffloadedLayer) else "cuda")
    continue_both(model, reference, loaded, ids, 9)
    cpu = kvgen.load_cache(tmp_path / "gpu.safetensors", device="cpu")
    assert all((layer.inner if isinstance(layer, OffloadedLayer) else layer)._k.device.type == "cpu"
               for layer in cpu.layers)


def test_encoder_decoder_cache_round_trip(tmp_path):
    whisper = pytest.importorskip("kvgen.models.whisper")
    torch.manual_seed(0)
    model = whisper.WhisperForConditionalGeneration(PretrainedConfig(**WHISPER)).eval()
    features = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    cache = EncoderDecoderCache(StaticCache(config=model.decoder_config, max_cache_len=16), DynamicCache())
    ids = token_ids(length=10)
    model(features, decoder_input_ids=ids[:, :4], past_key_values=cache)
    cache.save(tmp_path / "encdec.safetensors")
    reference = copy.deepcopy(cache)
    loaded = kvgen.load_cache(tmp_path / "encdec.safetensors", model=model)
    assert type(loaded.self_attention_cache) is StaticCache and type(loaded.cross_attention_cache) is DynamicCache
    assert loaded.is_updated == {0: True, 1: True} and loaded.get_seq_length() == 4
    for t in range(4, 7):
        expected = model(decoder_input_ids=ids[:, t:t + 1], past_key_values=reference).logits
        assert torch.equal(model(decoder_input_ids=ids[:, t:t + 1], past_key_values=loaded).logits, expected)


MAMBA = dict(model_type="mamba", vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, state_size=4, conv_kernel=3,
             expand=2)
JAMBA = dict(model_type="jamba", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, mamba_d_state=4, mamba_d_conv=3, mamba_expand=2,
             num_experts=2, num_experts_per_tok=1, expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2,
             attn_layer_offset=1)


@pytest.mark.parametrize("kind", ["mamba", "jamba"])
def test_state_space_caches_round_trip(kind, tmp_path):
    ssm = pytest.importorskip("kvgen.cache.ssm")
    pytest.importorskip(f"kvgen.models.{kind}")
    torch.manual_seed(0)
    model = kvgen.AutoModelForCausalLM.from_config(PretrainedConfig(**(MAMBA if kind == "mamba" else JAMBA))).eval()
    cache_class = ssm.MambaCache if kind == "mamba" else ssm.HybridMambaAttentionDynamicCache
    cache = cache_class(model.config, batch_size=2, dtype=torch.float32)
    ids = token_ids(length=12)
    model(ids[:, :7], past_key_values=cache, cache_position=torch.arange(7))
    cache.save(tmp_path / "ssm.safetensors")
    reference = copy.deepcopy(cache)
    loaded = kvgen.load_cache(tmp_path / "ssm.safetensors", model=model)
    assert type(loaded) is cache_class and layer_kinds(loaded) == layer_kinds(cache)
    assert "SSMLayer" in layer_kinds(loaded) and loaded.get_seq_length() == 7
    for t in range(7, 10):
        position = torch.tensor([t])
        expected = model(ids[:, t:t + 1], past_key_values=reference, cache_position=position).logits
        assert torch.equal(model(ids[:, t:t + 1], past_key_values=loaded, cache_position=position).logits, expected)


# -- fingerprints -------------------------------------------------------------------------------------------------

@pytest.fixture()
def saved(models, tmp_path):
    """A DynamicCache of the tiny Llama, saved: (path, model)."""
    model = models["llama"]
    cache = DynamicCache()
    model(token_ids(length=6), past_key_values=cache)
    path = tmp_path / "cache.safetensors"
    cache.save(path)
    return path, model


def perturbed(model):
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[0].self_attn.o_proj.weight.mul_(1.01)  # one layer's output projection, 1% larger
    return other


def other_config(model):
    other = tiny({**LLAMA, "rope_theta": 500000.0}, seed=3)
    other.load_state_dict(model.state_dict())  # the same weights
    return other


def test_a_model_with_other_weights_is_refused(saved):
    path, model = saved
    other = perturbed(model)
    fp, other_fp = model_fingerprint(model), model_fingerprint(other)
    assert fp["config"] == other_fp["config"] and fp["weights"] != other_fp["weights"]
    with pytest.raises(CacheModelMismatchError, match=r"\(the weights differ\)") as info:
        kvgen.load_cache(path, model=other)
    assert fp["weights"][:16] in str(info.value) and other_fp["weights"][:16] in str(info.value)


def test_a_model_with_another_config_is_refused(saved):
    path, model = saved
    other = other_config(model)
    fp, other_fp = model_fingerprint(model), model_fingerprint(other)
    assert fp["weights"] == other_fp["weights"] and fp["config"] != other_fp["config"]
    with pytest.raises(CacheModelMismatchError, match=r"\(the config differs\)") as info:
        kvgen.load_cache(path, model=other)
    assert fp["config"][:16] in str(info.value) and other_fp["config"][:16] in str(info.value)


def test_a_loaded_cache_remembers_its_model_and_forward_checks_it(saved):
    path, model = saved
    loaded = kvgen.load_cache(path)  # no model given: loads, and keeps the fingerprint
    assert loaded.model_fingerprint == model_fingerprint(model)
    step = token_ids(length=7)[:, 6:]
    prompt = torch.cat([token_ids(length=6), step], dim=1)  # the cached prefix and one more token
    for other in (perturbed(model), other_config(model)):
        with pytest.raises(CacheModelMismatchError, match="past_key_values was filled by a different model"):
            other(step, past_key_values=loaded)
        with pytest.raises(CacheModelMismatchError):
            other.generate(prompt, past_key_values=loaded, max_new_tokens=1)
    assert loaded.get_seq_length() == 6  # refused before anything was written
    model(step, past_key_values=loaded)  # the right model continues it
    assert loaded.get_seq_length() == 7
    loaded.reset()  # an emptied cache belongs to whichever model fills it next
    other = perturbed(model)
    other(token_ids(length=3), past_key_values=loaded)
    loaded.save(path)
    assert kvgen.load_cache(path, model=other).model_fingerprint == model_fingerprint(other)


def test_a_cache_in_memory_is_refused_by_another_model_too(models):
    model = models["llama"]
    cache = DynamicCache()
    model(token_ids(length=4), past_key_values=cache)
    with pytest.raises(CacheModelMismatchError, match=r"\(the weights differ\)"):
        perturbed(model)(token_ids(length=5)[:, 4:], past_key_values=cache)
    twin = copy.deepcopy(model)  # other object, same config and weights: fine
    twin(token_ids(length=5)[:, 4:], past_key_values=cache)


def test_the_fingerprint_follows_changes_to_the_weights(models):
    model = copy.deepcopy(models["llama"])
    before = model_fingerprint(model)
    assert model_fingerprint(model) == before
    with torch.no_grad():
        model.lm_head.weight.add_(1e-3)  # in place: the memo notices (tensor version counter)
    assert model_fingerprint(model)["weights"] != before["weights"]
    assert model_fingerprint(model.to(torch.bfloat16))["weights"] != before["weights"]


def test_a_file_without_fingerprint(models, tmp_path):
    cache = DynamicCache()
    cache.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), 0)  # filled by hand, no model involved
    cache.save(tmp_path / "hand.safetensors")
    with pytest.raises(CacheModelMismatchError, match="does not record which model"):
        kvgen.load_cache(tmp_path / "hand.safetensors", model=models["llama"])
    assert kvgen.load_cache(tmp_path / "hand.safetensors").model_fingerprint is None
    cache.save(tmp_path / "named.safetensors", model=models["llama"])  # or name the model explicitly
    kvgen.load_cache(tmp_path / "named.safetensors", model=models["llama"])


# -- damaged and edited files -------------------------------------------------------------------------------------

def read_raw(path):
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def write_raw(path, header, body):
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)


def edit_description(path, edit, rehash=True):
    """Apply ``edit`` to the file's JSON description, updating its checksum unless ``rehash=False``."""
    header, body = read_raw(path)
    document = json.loads(header["__metadata__"]["kvgen.cache"])
    edit(document)
    text = json.dumps(document)
    header["__metadata__"]["kvgen.cache"] = text
    if rehash:
        header["__metadata__"]["kvgen.cache.sha256"] = hashlib.sha256(text.encode()).hexdigest()
    write_raw(path, header, body)


def test_the_file_is_one_safetensors_file_with_a_described_cache(saved):
    path, model = saved
    header, _ = read_raw(path)
    document = json.loads(header["__metadata__"]["kvgen.cache"])
    assert document["format"] == "kvgen.cache" and document["format_version"] == 1
    assert document["cache_class"] == "DynamicCache" and document["dtype"] == "float32"
    assert document["seq_length"] == 6 and [layer["class"] for layer in document["layers"]] == ["DynamicLayer"] * 2
    assert document["fingerprint"] == model_fingerprint(model)
    assert {r["path"] for r in document["tensors"].values()} >= {"cache.layers[0]._k", "cache.token_ids"}
    assert set(load_file(path)) == set(document["tensors"])


@pytest.mark.parametrize("cut", [1, 1000, -100, -9])
def test_a_truncated_file(saved, cut):
    path, _ = saved
    data = path.read_bytes()
    path.write_bytes(data[:cut] if cut > 0 else data[:cut])
    with pytest.raises(CacheFileError, match="truncated or damaged|not a readable"):
        kvgen.load_cache(path)


def test_a_flipped_byte_in_tensor_data(saved):
    path, _ = saved
    header, body = read_raw(path)
    start, end = header["t2"]["data_offsets"]  # layer 1's keys
    body = bytearray(body)
    body[(start + end) // 2] ^= 0x10
    write_raw(path, header, bytes(body))
    with pytest.raises(CacheFileError, match=r"bytes of tensor t2 \(cache.layers\[1\]._k\) do not match"):
        kvgen.load_cache(path)


def test_edited_json(saved):
    path, _ = saved
    edit_description(path, lambda d: d["objects"][1]["state"].update(_seen=5), rehash=False)
    with pytest.raises(CacheFileError, match="does not match its checksum"):
        kvgen.load_cache(path)


def test_edited_json_with_a_recomputed_checksum_still_has_to_agree_with_itself(saved):
    path, _ = saved
    edit_description(path, lambda d: d["objects"][1]["state"].update(_seen=5))
    with pytest.raises(CacheFileError, match="does not match the file's summary: seq_length: the file says 6, the restored cache 5"):
        kvgen.load_cache(path)


def test_missing_tensors(saved):
    path, _ = saved
    tensors, header = load_file(path), read_raw(path)[0]
    del tensors["t1"]
    save_file(tensors, path, metadata=header["__metadata__"])
    with pytest.raises(CacheFileError, match=r"missing from the file: \['t1 \(cache.layers\[0\]._v\)'\]"):
        kvgen.load_cache(path)


def test_tensor_shapes_that_disagree_with_the_description(saved):
    path, _ = saved
    tensors, header = load_file(path), read_raw(path)[0]
    tensors["t0"] = tensors["t0"].reshape(tensors["t0"].shape[0], -1).contiguous()  # same bytes, other shape
    save_file(tensors, path, metadata=header["__metadata__"])
    with pytest.raises(CacheFileError, match="in the cache description"):
        kvgen.load_cache(path)


def test_an_unknown_cache_class(saved):
    path, _ = saved
    edit_description(path, lambda d: d["objects"][0].update({"class": "TeleportCache"}))
    with pytest.raises(CacheFileError, match="'TeleportCache', which is not a kvgen cache class"):
        kvgen.load_cache(path)


@pytest.mark.parametrize("version, message", [(2, "newer kvgen: upgrade"), (0, "this kvgen reads version 1"),
                                              ("1", "version '1'")])
def test_another_format_version(saved, version, message):
    path, _ = saved
    edit_description(path, lambda d: d.update(format_version=version))
    with pytest.raises(CacheFileError, match=message):
        kvgen.load_cache(path)


def _set_factory(value):
    return lambda d: d["objects"][0]["state"].update(_layer_factory=value)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["objects"][0].update({"class": "builtins.eval"}), "not a kvgen cache class"),
    (lambda d: d["objects"][0].update({"class": "Popen"}), "not a kvgen cache class"),
    (_set_factory({"$function": "os.system"}), "unknown function 'os.system'"),
    (_set_factory({"$method": [{"$object": 0}, "__init__"]}), "is not a method of DynamicCache"),
    (_set_factory({"$method": [{"$object": 0}, "save"]}), None),  # a real method, harmless: loads
    (_set_factory({"$class": "subprocess.Popen"}), "not a kvgen cache class"),
    (lambda d: d["objects"][0]["state"].update(__class__={"$class": "StaticCache"}), "invalid attribute names"),
    (_set_factory({"$subclass": {"class": "torch.nn.Parameter", "inner": {}, "meta": None, "size": [],
                                 "stride": []}}), "are not loaded"),
    (_set_factory({"$pickle": "gASVIQ=="}), "unknown value tag"),
    (_set_factory({"$object": 99}), "object 99, which the file does not hold"),
    (lambda d: d["objects"][1]["state"].update(_k={"$tensor": "t9"}), "tensor 't9'"),
])
def test_names_that_could_run_code_are_refused(saved, edit, message):
    path, _ = saved
    edit_description(path, edit)
    if message is None:
        kvgen.load_cache(path)
        return
    with pytest.raises(CacheFileError, match=message):
        kvgen.load_cache(path)


def test_other_files(saved, tmp_path):
    path = tmp_path / "weights.safetensors"
    save_file({"weight": torch.zeros(2)}, path)  # a model checkpoint, say
    with pytest.raises(CacheFileError, match="not a kvgen cache"):
        kvgen.load_cache(path)
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(CacheFileError):
        kvgen.load_cache(path)
    with pytest.raises(FileNotFoundError):
        kvgen.load_cache(tmp_path / "nothing.safetensors")


def test_loading_never_unpickles(saved, monkeypatch):
    path, model = saved

    def refuse(*args, **kwargs):
        raise AssertionError("load_cache must not unpickle")

    for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    loaded = kvgen.load_cache(path, model=model)
    assert loaded.get_seq_length() == 6


# -- what cannot be saved ------------------------------------------------------------------------------------------

class MyCache(DynamicCache):
    """A cache class outside kvgen: a file may not name it, so it is not saved either."""


def test_saving_refuses_what_loading_could_not_rebuild(tmp_path):
    cache = MyCache()
    with pytest.raises(TypeError, match="MyCache is not a class kvgen cache files may hold"):
        cache.save(tmp_path / "x.safetensors")
    cache = DynamicCache()
    cache.extra = object()
    with pytest.raises(TypeError, match=r"cannot save cache.extra"):
        cache.save(tmp_path / "x.safetensors")
    cache = Cache(layer_factory=lambda i: DynamicLayer())
    with pytest.raises(TypeError, match="a lambda"):
        cache.save(tmp_path / "x.safetensors")
    assert not list(tmp_path.iterdir())  # nothing half-written
