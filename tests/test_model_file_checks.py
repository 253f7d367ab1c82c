"""Model files are input from strangers: a damaged GGUF, config.json or CTranslate2 file is refused before any
weight is used, with a ModelFileError (a ValueError) naming the file, the key or tensor, what was expected and
what was found. Positions in the GGUF written here are found with gguf's own reader, not kvgen's."""

import json
import shutil
import struct

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import kvgen
from kvgen import ModelFileError
from kvgen.loading.gguf import load_gguf

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, TOKENS = 256, 4, 2, 64, 256, 300


def _write(path, tokens: int = TOKENS, layers: int = 1, skip: str = "", extra: str = "") -> None:
    """A complete one-layer llama in Q4_0, Q8_0 and F32 tensors, with a 300-token vocabulary."""
    rng = np.random.default_rng(7)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(32)
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(tokens)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    shapes = {"token_embd.weight": (TOKENS, HIDDEN), "output_norm.weight": (HIDDEN,)}
    for layer in range(1 if extra else layers):
        p = f"blk.{layer}."
        shapes |= {p + "attn_norm.weight": (HIDDEN,), p + "ffn_norm.weight": (HIDDEN,),
                   p + "attn_q.weight": (HEADS * HEAD_DIM, HIDDEN), p + "attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                   p + "attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN), p + "attn_output.weight": (HIDDEN, HIDDEN),
                   p + "ffn_gate.weight": (INTER, HIDDEN), p + "ffn_up.weight": (INTER, HIDDEN),
                   p + "ffn_down.weight": (HIDDEN, INTER)}
    if extra:
        shapes[extra] = (HIDDEN,)
    for name, shape in shapes.items():
        if name == skip:
            continue
        values = rng.standard_normal(shape).astype(np.float32) * 0.05
        qtype = Q.F32 if len(shape) == 1 else Q.Q4_0 if name == "token_embd.weight" else Q.Q8_0
        data = values if qtype == Q.F32 else gguf.quants.quantize(values, qtype)
        writer.add_tensor(name, data, raw_dtype=None if qtype == Q.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "good.gguf"
    _write(path)
    return path


def _value_at(reader: gguf.GGUFReader, key: str) -> int:
    """Byte offset of a scalar field's value (after its key and type)."""
    return reader.fields[key].offset + 8 + len(key.encode()) + 4


def _tensor_at(reader: gguf.GGUFReader, name: str) -> dict[str, int]:
    """Byte offsets of one tensor-table entry's fields."""
    tensor = next(t for t in reader.tensors if t.name == name)
    start = tensor.field.offset + 8 + len(name.encode())
    dims = len(tensor.shape)
    return {"n_dims": start, "dims": start + 4, "type": start + 4 + 8 * dims, "offset": start + 8 + 8 * dims}


def _damaged(good, tmp_path, edit) -> object:
    """A copy of the good file with ``edit(bytearray, reader)`` applied."""
    data = bytearray(good.read_bytes())
    edit(data, gguf.GGUFReader(good))
    path = tmp_path / "damaged.gguf"
    path.write_bytes(bytes(data))
    return path


def _put(data: bytearray, at: int, fmt: str, value) -> None:
    data[at:at + struct.calcsize(fmt)] = struct.pack(fmt, value)


def test_the_undamaged_file_loads_and_runs(good):
    model = kvgen.AutoModelForCausalLM.from_pretrained(good)
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, TOKENS) and torch.isfinite(logits).all()


def _offset_of(name, delta):
    def edit(data, reader):
        at = _tensor_at(reader, name)["offset"]
        _put(data, at, "<Q", struct.unpack_from("<Q", data, at)[0] + delta)
    return edit


def _tensor_field(name, field, fmt, value):
    return lambda data, reader: _put(data, _tensor_at(reader, name)[field], fmt, value)


def _key_value(key, fmt, value):
    return lambda data, reader: _put(data, _value_at(reader, key), fmt, value)


def _rename_key(old, new):
    def edit(data, reader):
        at = reader.fields[old].offset + 8
        data[at:at + len(new)] = new.encode()
    return edit


def _rename_tensor(old, new):
    def edit(data, reader):
        at = next(t for t in reader.tensors if t.name == old).field.offset + 8
        data[at:at + len(new)] = new.encode()
    return edit


# (what is damaged, the edit, the message: where, expected, found)
DAMAGES = {
    "magic": (lambda d, r: d.__setitem__(slice(0, 4), b"GGUX"), r"the magic: expected b'GGUF' .*found b'GGUX'"),
    "old version": (lambda d, r: _put(d, 4, "<I", 1), r"the version: expected GGUF version 2 or 3, found version 1"),
    "big-endian": (lambda d, r: _put(d, 4, ">I", 3), r"the version: .*found version 50331648 \(a big-endian file\)"),
    "tensor count": (lambda d, r: _put(d, 8, "<Q", 2**40), r"the tensor count: expected at most \d+ tensors"),
    "key count": (lambda d, r: _put(d, 16, "<Q", 2**40), r"the key count: expected at most \d+ keys"),
    "string length": (lambda d, r: _put(d, 24, "<Q", 2**40), r"key 0 \(a string of 1099511627776 bytes\): "
                      r"expected 1099511627776 bytes at offset 32, found the file ends"),
    "array length": (lambda d, r: _put(d, _value_at(r, "tokenizer.ggml.tokens") + 4, "<Q", 2**40),
                     r"key tokenizer\.ggml\.tokens \(an array of 1099511627776 values\): .*the file ends"),
    "value type": (lambda d, r: _put(d, _value_at(r, "llama.block_count") - 4, "<I", 99),
                   r"key llama\.block_count: expected a GGUF value type 0-12, found type 99"),
    "key text": (lambda d, r: d.__setitem__(r.fields["llama.block_count"].offset + 8, 0xFF),
                 r"key \d+: expected UTF-8 text, found invalid bytes"),
    "duplicate key": (_rename_key("tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id"),
                      r"key tokenizer\.ggml\.bos_token_id: expected each key once, found it twice"),
    "alignment": (_key_value("general.alignment", "<I", 24), r"key general\.alignment: expected a power of two, "
                  r"found 24"),
    "tensor type": (_tensor_field("blk.0.attn_k.weight", "type", "<I", 99),
                    r"tensor blk\.0\.attn_k\.weight: expected a known GGML tensor type .*found type id 99"),
    "dimensions": (_tensor_field("blk.0.attn_k.weight", "n_dims", "<I", 5),
                   r"tensor blk\.0\.attn_k\.weight: expected 1 to 4 dimensions, found 5"),
    "zero dimension": (_tensor_field("blk.0.attn_k.weight", "dims", "<Q", 0),
                       r"tensor blk\.0\.attn_k\.weight: expected dimensions of at least 1 .*found shape \[0, 128\]"),
    "partial block": (_tensor_field("blk.0.attn_k.weight", "dims", "<Q", 250),
                      r"tensor blk\.0\.attn_k\.weight: expected a first dimension that is a multiple of Q8_0's "
                      r"32-value blocks, found shape \[250, 128\]"),
    "misaligned offset": (_offset_of("blk.0.attn_k.weight", 1), r"tensor blk\.0\.attn_k\.weight: expected a data "
                          r"offset that is a multiple of general\.alignment \(32\), found offset \d+"),
    "overlapping offset": (_offset_of("blk.0.attn_k.weight", -32), r"tensor blk\.0\.attn_k\.weight: expected its "
                           r"data at offset \d+, right after blk\.0\.attn_q\.weight .*overlapping"),
    "gap": (_offset_of("blk.0.attn_k.weight", 32), r"tensor blk\.0\.attn_k\.weight: .*leaving a gap before it"),
    "type of another size": (_tensor_field("blk.0.attn_q.weight", "type", "<I", int(Q.Q4_0)),
                             r"tensor blk\.0\.attn_k\.weight: expected its data at offset \d+, right after "
                             r"blk\.0\.attn_q\.weight .*leaving a gap"),
    "type of the same size": (_tensor_field("token_embd.weight", "type", "<I", int(Q.Q4_K)),
                              r"tensor token_embd\.weight: expected finite Q4_K scales and values, found infinite "
                              r"or NaN ones"),
    "duplicate tensor": (_rename_tensor("blk.0.attn_v.weight", "blk.0.attn_k.weight"),
                         r"tensor blk\.0\.attn_k\.weight: expected each tensor name once, found it twice"),
    "shape": (_tensor_field("blk.0.ffn_down.weight", "dims", "<Q", 128),
              r"tensor blk\.0\.ffn_down\.weight: expected shape \[256, 256\] from the metadata.*found shape "
              r"\[128, 256\]"),
    "heads": (_key_value("llama.attention.head_count", "<I", 3), r"key llama\.attention\.head_count: expected a "
              r"divisor of llama\.embedding_length \(256\), found 3"),
    "key/value heads": (_key_value("llama.attention.head_count_kv", "<I", 3), r"key llama\.attention\.head_count_kv: "
                        r"expected a divisor of llama\.attention\.head_count \(4\), found 3"),
    "head dimension": (_key_value("llama.rope.dimension_count", "<I", 63), r"key llama\.rope\.dimension_count: "
                       r"expected an even count \(rotated in pairs\) .*found 63"),
    "hidden size": (_key_value("llama.embedding_length", "<I", 128), r"tensor token_embd\.weight: expected shape "
                    r"\[128, 300\] from the metadata: hidden 128.*found shape \[256, 300\]"),
    "layers": (_key_value("llama.block_count", "<I", 0), r"key llama\.block_count: expected a positive integer, "
               r"found 0"),
    "more layers": (_key_value("llama.block_count", "<I", 2), r"tensor blk\.1\.attn_norm\.weight: expected the "
                    r"tensors of a 2-layer llama model, found 9 missing"),
    "context length": (_key_value("llama.context_length", "<I", 0), r"key llama\.context_length: expected a positive "
                       r"integer, found 0"),
    "special token": (_key_value("tokenizer.ggml.bos_token_id", "<I", 5000), r"key tokenizer\.ggml\.bos_token_id: "
                      r"expected a token id in 0\.\.299 \(the vocabulary\), found 5000"),
    "header cut": (lambda d, r: d.__delitem__(slice(100, None)), r"the key count: expected at most 6 keys in a "
                   r"100-byte file, found 13 \(a truncated file"),
    "vocabulary cut": (lambda d, r: d.__delitem__(slice(_value_at(r, "tokenizer.ggml.tokens") + 2900, None)),
                       r"key tokenizer\.ggml\.tokens\[\d+\]: expected \d+ bytes at offset \d+, found the file ends"),
    "data cut": (lambda d, r: d.__delitem__(slice(len(d) - 100, None)), r"tensor blk\.0\.ffn_down\.weight: expected "
                 r"\d+ bytes of Q8_0 \[256, 256\] ending inside the file, found they end at byte"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_gguf_is_refused_naming_what_is_wrong(good, tmp_path, damage):
    edit, message = DAMAGES[damage]
    path = _damaged(good, tmp_path, edit)
    with pytest.raises(ModelFileError, match=r"damaged\.gguf: " + message) as error:
        kvgen.AutoModelForCausalLM.from_pretrained(path)
    assert isinstance(error.value, ValueError) and error.value.path == str(path)


def test_an_empty_file(tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelFileError, match=r"empty\.gguf: the file: expected a GGUF file, found an empty file"):
        load_gguf(tmp_path / "empty.gguf")


@pytest.mark.parametrize("tokens, kwargs, message", [
    (400, {}, r"tensor token_embd\.weight: expected a row for each of the 400 tokens of tokenizer\.ggml\.tokens, "
              r"found 300 rows"),
    (TOKENS, {"skip": "blk.0.ffn_gate.weight"}, r"tensor blk\.0\.ffn_gate\.weight: expected the tensors of a "
                                                r"1-layer llama model, found 1 missing"),
    (TOKENS, {"extra": "blk.5.attn_norm.weight"}, r"tensor blk\.5\.attn_norm\.weight: expected layers 0\.\.0 "
                                                  r"\(llama\.block_count\), found a tensor of layer 5"),
], ids=["embedding rows", "missing tensor", "layer past the last"])
def test_tensors_that_do_not_match_the_metadata(tmp_path, tokens, kwargs, message):
    _write(tmp_path / "bad.gguf", tokens=tokens, **kwargs)
    with pytest.raises(ModelFileError, match=r"bad\.gguf: " + message):
        load_gguf(tmp_path / "bad.gguf")


def test_a_packed_weight_whose_shape_is_not_the_configs_never_reaches_the_kernels(good):
    from kvgen.models.llama import LlamaForCausalLM
    from kvgen.models.packed import PackedWeight

    config, state = load_gguf(good, packed=True)
    rows = state["model.layers.0.mlp.down_proj.weight"]
    state["model.layers.0.mlp.down_proj.weight"] = PackedWeight([(rows.segments[0][0], rows.segments[0][1][:128])],
                                                                rows.in_features)  # half its rows
    with pytest.raises(ValueError, match=r"down_proj\.weight' has shape \(128, 256\) but the config needs \(256, 256\)"):
        LlamaForCausalLM._from_state_dict(kvgen.PretrainedConfig.from_dict(config), state, torch.float32,
                                          torch.device("cpu"))


# -- config.json and CTranslate2 --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from kvgen.loading.checkpoint import save_safetensors_checkpoint

    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 1, "intermediate_size": 96, "vocab_size": 100, "max_position_embeddings": 128,
              "bos_token_id": 1, "eos_token_id": [2, 3], "tie_word_embeddings": True}
    model = kvgen.AutoModelForCausalLM.from_config(kvgen.PretrainedConfig.from_dict(config))
    path = tmp_path_factory.mktemp("checkpoint")
    save_safetensors_checkpoint(path, model.state_dict(), config)
    return path


@pytest.mark.parametrize("change, message", [
    ({"num_attention_heads": 5}, r"key num_attention_heads: expected a divisor of hidden_size \(64\), found 5"),
    ({"num_key_value_heads": 3}, r"key num_key_value_heads: expected a divisor of num_attention_heads \(4\), found 3"),
    ({"num_hidden_layers": 0}, r"key num_hidden_layers: expected a positive integer, found 0"),
    ({"hidden_size": "64"}, r"key hidden_size: expected a positive integer, found '64'"),
    ({"max_position_embeddings": -1}, r"key max_position_embeddings: expected a positive integer, found -1"),
    ({"eos_token_id": [2, 100]}, r"key eos_token_id: expected a token id in 0\.\.99 \(the vocabulary\), found 100"),
    ({"rms_norm_eps": float("nan")}, r"key rms_norm_eps: expected a positive finite number, found nan"),
])
def test_a_config_json_that_cannot_describe_a_model(folder, tmp_path, change, message):
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ModelFileError, match=r"config\.json: " + message):
        kvgen.AutoModelForCausalLM.from_pretrained(copy)
    kvgen.AutoModelForCausalLM.from_pretrained(folder)  # the undamaged one loads


# -- tokenizers ------------------------------------------------------------------------------------------

def _write_vocabulary(path, tokens, merges, types=None, eos=2) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(types if types is not None else [1] * len(tokens))
    writer.add_eos_token_id(eos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


TOKENS_ = ["a", "b", "ab", "c", "ac"]


def test_a_consistent_vocabulary_tokenizes(tmp_path):
    _write_vocabulary(tmp_path / "v.gguf", TOKENS_, ["a b", "a c"])
    assert kvgen.AutoTokenizer.from_pretrained(tmp_path / "v.gguf").encode("abac") == [2, 4]


@pytest.mark.parametrize("tokens, merges, kwargs, message", [
    (TOKENS_ + ["ab"], ["a b"], {}, r"key tokenizer\.ggml\.tokens\[5\]: expected each token once, found 'ab', token 2"),
    (TOKENS_, ["a b"], {"types": [1, 1]}, r"key tokenizer\.ggml\.token_type: expected one entry per token \(5\), "
                                          r"found 2"),
    (TOKENS_, ["a b", "a d"], {}, r"key tokenizer\.ggml\.merges: expected merges of tokens in tokenizer\.ggml\.tokens, "
                                  r"found .*Token `d` out of vocabulary"),
    (TOKENS_, ["ab"], {}, r"key tokenizer\.ggml\.merges\[0\]: expected two tokens separated by a space, found 'ab'"),
    (TOKENS_, ["a b"], {"eos": 9}, r"key tokenizer\.ggml\.eos_token_id: expected a token id in 0\.\.4 \(the vocabulary\), "
                                   r"found 9"),
], ids=["duplicate token", "token types", "merge of an unknown token", "merge without a space", "special id"])
def test_an_inconsistent_gguf_vocabulary_is_refused(tmp_path, tokens, merges, kwargs, message):
    _write_vocabulary(tmp_path / "v.gguf", tokens, merges, **kwargs)
    with pytest.raises(ModelFileError, match=r"v\.gguf: " + message):
        kvgen.AutoTokenizer.from_pretrained(tmp_path / "v.gguf")


def test_an_inconsistent_tokenizer_json_is_refused(tmp_path):
    from tokenizers import Tokenizer, models

    document = json.loads(Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")])).to_str())
    for name, change, message in [
        ("merge", {"merges": [["a", "c"]]}, r"the document: expected a tokenizers JSON document whose merges use "
                                            r"tokens of its vocabulary, found Token `c` out of vocabulary"),
        ("ids", {"vocab": {"a": 0, "b": 0, "ab": 2}}, r"model\.vocab: expected one token per id, found id 0 for 'a' "
                                                      r"and 'b'"),
    ]:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "tokenizer.json").write_text(json.dumps({**document, "model": {**document["model"], **change}}))
        with pytest.raises(ModelFileError, match=r"tokenizer\.json: " + message):
            kvgen.AutoTokenizer.from_pretrained(folder)
