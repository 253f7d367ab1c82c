"""Rotary tables: a one-token step's ``cos``/``sin`` come from a kept block of positions (``RotaryEmbedding``'s
decode path) and must be those a whole-sequence call computes for that position."""

from __future__ import annotations

import pytest
import torch

from kvgen.config import PretrainedConfig
from kvgen.rope import _BLOCK, RotaryEmbedding

# Both sides compute cos(p * inv_freq) elementwise, in tensors of different lengths; where a row falls in
# ATen's scalar tail loop on one side and in a vector lane on the other, the two cos/sin implementations may
# differ in the last bit. 1e-6 allows ~8 ulp at 1.0; the neighbouring position differs by ~0.5 or more.
TOLERANCE = 1e-6


def rotary(head_dim=64, rope_type="default"):
    params = {"rope_theta": 10000.0, "rope_type": rope_type}
    if rope_type == "linear":
        params["factor"] = 2.0
    config = PretrainedConfig(hidden_size=4 * head_dim, num_attention_heads=4, num_hidden_layers=1,
                              head_dim=head_dim, max_position_embeddings=4096, rope_parameters=params)
    return RotaryEmbedding(config)


@pytest.mark.parametrize("rope_type", ["default", "linear"])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_one_position_steps_match_the_whole_sequence(head_dim, rope_type):
    rope = rotary(head_dim, rope_type)
    positions = torch.arange(3 * _BLOCK + 5)
    cos, sin = rope(positions[None])  # (1, P, D): the prefill path
    for p in [0, 1, _BLOCK - 1, _BLOCK, _BLOCK + 1, 2 * _BLOCK + 7, 5, 3 * _BLOCK + 4, 0]:  # back and forth
        one_cos, one_sin = rope(torch.tensor([[p]]))
        assert one_cos.shape == (1, 1, head_dim) and one_cos.dtype == torch.float32
        torch.testing.assert_close(one_cos, cos[:, p:p + 1], atol=TOLERANCE, rtol=0)
        torch.testing.assert_close(one_sin, sin[:, p:p + 1], atol=TOLERANCE, rtol=0)


def test_one_position_for_a_batch_of_rows_and_in_another_dtype():
    rope = rotary()
    cos, sin = rope(torch.arange(100)[None])
    rows = torch.tensor([[70]]).expand(3, 1)  # as a batch's decode step passes them
    batch_cos, batch_sin = rope(rows)
    assert batch_cos.shape == (3, 1, 64)
    torch.testing.assert_close(batch_cos, cos[:, 70:71].expand(3, 1, 64), atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(batch_sin, sin[:, 70:71].expand(3, 1, 64), atol=TOLERANCE, rtol=0)
    half_cos, _ = rope(torch.tensor([[70]]), torch.bfloat16)
    assert half_cos.dtype == torch.bfloat16
    torch.testing.assert_close(half_cos, cos[:, 70:71].to(torch.bfloat16), atol=0, rtol=0)
    assert rope(torch.tensor([[70]]))[0].dtype == torch.float32


def test_changed_frequencies_are_used_by_the_next_step():
    rope = rotary()
    rope(torch.tensor([[3]]))  # keeps a block of tables
    rope.inv_freq = rope.inv_freq * 2
    cos, _ = rope(torch.tensor([[3]]))
    torch.testing.assert_close(cos, rope(torch.tensor([[1, 3]]))[0][:, 1:], atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(cos[0, 0, 0], torch.cos(torch.tensor(6.0)), atol=TOLERANCE, rtol=0)


def test_a_negative_position_is_computed_not_looked_up():
    rope = rotary()
    cos, sin = rope(torch.tensor([[-2]]))
    torch.testing.assert_close(cos[0, 0, 0], torch.cos(torch.tensor(-2.0)), atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(sin[0, 0, 32], torch.sin(torch.tensor(-2.0)), atol=TOLERANCE, rtol=0)
