"""Bad input gives a clear exception whose message says what was wrong (and, where it can, what to do)."""

from __future__ import annotations

import copy

import json
import shutil
import sys

import pytest
import torch
import transformers

import kvgen
from kvgen import AutoModelForCausalLM, DynamicCache, StaticCache

transformers.logging.set_verbosity_error()

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random Llama checkpoint saved by transformers: (folder, transformers model)."""
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE)).eval()
    folder = tmp_path_factory.mktemp("tiny")
    hf.save_pretrained(folder)
    return folder, hf


@pytest.fixture(scope="module")
def model(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint[0])


def ids(length=6, batch=1):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(0))


def edited_copy(folder, tmp_path, **changes):
    target = tmp_path / "edited"
    shutil.copytree(folder, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


# -- checkpoints -------------------------------------------------------------------------------------------

def test_tensor_shapes_that_do_not_match_the_config(checkpoint, tmp_path):
    folder = edited_copy(checkpoint[0], tmp_path, intermediate_size=100)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.\w+\.weight.* has shape .*needs"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_more_layers_in_the_config_than_in_the_checkpoint(checkpoint, tmp_path):
    folder = edited_copy(checkpoint[0], tmp_path, num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"3 layers.*missing \['model\.layers\.2\."):
        AutoModelForCausalLM.from_pretrained(folder)


def test_fewer_layers_in_the_config_than_in_the_checkpoint(checkpoint, tmp_path):
    folder = edited_copy(checkpoint[0], tmp_path, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"unexpected \['model\.layers\.1\."):
        AutoModelForCausalLM.from_pretrained(folder)


def test_unsupported_model_type(checkpoint, tmp_path):
    folder = edited_copy(checkpoint[0], tmp_path, model_type="gpt2")
    with pytest.raises(ValueError, match=r"'gpt2' is not supported; kvgen loads: gemma2, gemma3, gemma3_text, jamba, llama, mamba, mistral, phi3, qwen2, qwen3"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_dtype_and_torch_dtype_that_disagree(checkpoint):
    with pytest.raises(ValueError, match="dtype= or torch_dtype="):
        AutoModelForCausalLM.from_pretrained(checkpoint[0], dtype=torch.float32, torch_dtype=torch.bfloat16)
    same = AutoModelForCausalLM.from_pretrained(checkpoint[0], dtype=torch.bfloat16, torch_dtype=torch.bfloat16)
    assert same.dtype == torch.bfloat16


# -- model references: folders and hub ids ----------------------------------------------------------------------

def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist and is not a hub id"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "no" / "such" / "folder")


@pytest.fixture
def empty_hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)  # "org/name" is not a folder here
    return cache


def test_hub_id_not_cached_and_hub_unreachable(empty_hub_cache, monkeypatch):
    huggingface_hub = pytest.importorskip("huggingface_hub")

    def unreachable(*args, **kwargs):
        raise ConnectionError("Failed to resolve 'huggingface.co'")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(OSError) as info:
        AutoModelForCausalLM.from_pretrained("some-org/some-model")
    message = str(info.value)
    assert "'some-org/some-model' is not in the local Hugging Face cache" in message
    assert str(empty_hub_cache) in message
    assert "unreachable" in message and "ConnectionError" in message
    assert "hf download some-org/some-model" in message  # what to do


def test_hub_id_not_cached_without_huggingface_hub(empty_hub_cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    with pytest.raises(FileNotFoundError) as info:
        AutoModelForCausalLM.from_pretrained("some-org/some-model")
    message = str(info.value)
    assert "not in the local Hugging Face cache" in message and "huggingface_hub is not installed" in message
    assert "pass its local folder" in message


def test_hub_id_in_the_local_cache_loads(checkpoint, empty_hub_cache, monkeypatch):
    folder, hf = checkpoint
    repo = empty_hub_cache / "models--some-org--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)

    def no_download(*args, **kwargs):
        raise AssertionError("a cached model must not be downloaded")

    huggingface_hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_download)
    loaded = AutoModelForCausalLM.from_pretrained("some-org/tiny-llama")
    x = ids(8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, hf(x).logits, atol=1e-4, rtol=0)


# -- generate() arguments -------------------------------------------------------------------------------------------

def test_unknown_cache_implementation(model):
    valid = r"unknown cache_implementation 'paged_nope'; valid names are: .*dynamic.*static"
    with pytest.raises(ValueError, match=valid):
        model.generate(ids(), cache_implementation="paged_nope", max_new_tokens=2)


def test_unknown_generate_argument(model):
    with pytest.raises(TypeError, match=r"\['max_new_tokenz'\]"):
        model.generate(ids(), max_new_tokenz=2)


def test_static_cache_too_small_for_max_new_tokens(model):
    cache = StaticCache(config=model.config, max_cache_len=8)
    with pytest.raises(ValueError, match=r"max_length 11 .*exceeds the cache's max_cache_len 8.*max_cache_len >= 11"):
        model.generate(ids(6), past_key_values=cache, max_new_tokens=5, disable_compile=True)
    assert cache.get_seq_length() == 0  # nothing was written before the error


@pytest.mark.parametrize("settings, message", [
    (dict(do_sample=True, temperature=0.0), r"temperature must be > 0 with do_sample=True, got 0.0"),
    (dict(do_sample=True, top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(do_sample=True, top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(do_sample=True, min_p=1.5), r"min_p must be in \[0, 1\], got 1.5"),
    (dict(repetition_penalty=0.0), r"repetition_penalty must be > 0"),
    (dict(max_new_tokens=0), r"max_new_tokens must be > 0"),
    (dict(num_return_sequences=2), r"num_return_sequences > 1 needs do_sample=True"),
])
def test_invalid_generation_settings(model, settings, message):
    kwargs = {"max_new_tokens": 3, **settings}
    with pytest.raises(ValueError, match=message):
        model.generate(ids(), **kwargs)


def test_sampling_settings_are_ignored_by_greedy_decoding(model, checkpoint):
    """transformers accepts temperature=0 with do_sample=False (greedy); so does kvgen."""
    _, hf = checkpoint
    x = ids()
    ref = hf.generate(x, do_sample=False, temperature=0.0, max_new_tokens=5, eos_token_id=None)
    got = model.generate(x, do_sample=False, temperature=0.0, max_new_tokens=5, eos_token_id=None)
    assert torch.equal(got, ref)


def test_max_length_not_longer_than_the_prompt(model):
    with pytest.raises(ValueError, match=r"input_ids has 6 tokens but max_length is 6"):
        model.generate(ids(6), max_length=6)


def test_an_empty_prompt(model):
    with pytest.raises(ValueError, match=r"input_ids holds no tokens.*at least one"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=3)


# -- forward() arguments --------------------------------------------------------------------------------------------

@pytest.fixture
def filled_cache(model):
    cache = DynamicCache()
    with torch.no_grad():
        model(ids(5), past_key_values=cache)
    assert cache.get_seq_length() == 5
    return cache


def test_cache_position_behind_the_cache(model, filled_cache):
    with pytest.raises(ValueError, match=r"cache_position runs 3\.\.3 but this DynamicLayer holds 5 tokens.*5\.\.5"):
        model(ids(1), past_key_values=filled_cache, cache_position=torch.tensor([3]))


def test_cache_position_of_the_wrong_length(model, filled_cache):
    with pytest.raises(ValueError, match=r"one entry per new token \(1\); got shape \(2,\)"):
        model(ids(1), past_key_values=filled_cache, cache_position=torch.tensor([5, 6]))


def test_whole_sequence_cache_position_with_only_the_new_token(model, filled_cache):
    """The seeds' Gemma 2 example passes arange(past + new) with just the new token: it means the last entry."""
    reference = copy.deepcopy(filled_cache)
    with torch.no_grad():
        out = model(ids(1), past_key_values=filled_cache, cache_position=torch.arange(6)).logits
        expected = model(ids(1), past_key_values=reference, cache_position=torch.tensor([5])).logits
    torch.testing.assert_close(out, expected)
    assert filled_cache.get_seq_length() == 6
    with pytest.raises(ValueError, match=r"one entry per new token \(1\); got shape \(8,\)"):
        model(ids(1), past_key_values=filled_cache, cache_position=torch.arange(8))  # cache holds 6, not 7


def test_attention_mask_shorter_than_past_and_new(model, filled_cache):
    with pytest.raises(ValueError, match=r"attention_mask covers 1 positions but the cache and the new tokens span 6"):
        model(ids(1), past_key_values=filled_cache, attention_mask=torch.ones(1, 1, dtype=torch.long))


def test_static_cache_position_past_its_end(model):
    cache = StaticCache(config=model.config, max_cache_len=4)
    with pytest.raises(ValueError, match=r"cache_position 5 does not fit a StaticCache of max_cache_len=4"):
        model(ids(6), past_key_values=cache)
