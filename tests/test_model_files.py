"""benchmarks/model_files.py: random-weight GGUF files in real models' shapes, for speed at every size. A file it
writes must load as the model it claims to be, or the benchmarks measure some other model."""

import sys
from pathlib import Path

import pytest
import torch

import kvgen

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from model_files import SHAPES, Shape, byte_tokens, write_f16  # noqa: E402


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_random_model_file_loads_as_its_shape(tmp_path, arch):
    shape = Shape(arch, 64, 2, 4, 2, 96, 300, arch == "qwen2", 1e6, 1e-6)
    path = tmp_path / "tiny.gguf"
    write_f16(shape, path, "tiny")
    model = kvgen.AutoModelForCausalLM.from_pretrained(path)
    c = model.config
    assert (c.model_type, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size) == (arch, 64, 2, 4, 2, 96, 300)
    assert c.tie_word_embeddings == shape.tied
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 300) and torch.isfinite(logits).all() and logits.std() > 0


def test_the_shapes_have_their_models_parameter_counts():
    published = {"qwen2.5-0.5b": 0.49e9, "qwen2.5-1.5b": 1.54e9, "qwen2.5-3b": 3.09e9, "qwen2.5-7b": 7.62e9,
                 "llama3.2-1b": 1.24e9, "llama3.2-3b": 3.21e9, "llama3.1-8b": 8.03e9}
    assert set(published) == set(SHAPES)
    for name, count in published.items():
        assert abs(SHAPES[name].parameters() / count - 1) < 0.01, name


def test_the_byte_alphabet_is_gpt2s():
    tokens = byte_tokens()
    assert len(set(tokens)) == 256 and tokens[ord("A")] == "A" and tokens[ord(" ")] == "Ġ" and tokens[10] == "Ċ"
