"""The C++ decode-time ops (``kvgen.models.native``) against torch's: RMSNorm and attention.

They must equal torch up to float32 rounding for every shape a decode step produces: GQA,
1-8 query rows, boolean masks per batch row or shared, keys and values as strided views of
a larger cache buffer, soft-capped scores (Gemma 2), head sizes 64 and 256.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvgen.kernels import kernels_available
from kvgen.models import native
from kvgen.models.gemma import softcapped_attention

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no C++ compiler to build kvgen's kernels")


def test_rms_norm_matches_torch():
    g = torch.Generator().manual_seed(0)
    for shape in [(1, 1, 576), (2, 4, 640), (8, 64)]:
        x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
        with torch.no_grad():
            torch.testing.assert_close(native.rms_norm(x, w, 1e-6), F.rms_norm(x, (shape[-1],), w, 1e-6),
                                       rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("b,h,hkv,t,s,d", [(1, 9, 3, 1, 517, 64), (2, 4, 1, 3, 40, 256), (1, 8, 8, 8, 17, 64)])
@pytest.mark.parametrize("masked", [False, True])
def test_attention_matches_sdpa(b, h, hkv, t, s, d, masked):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, h, t, d, generator=g)
    buffer = torch.randn(2, b, hkv, s + 7, d, generator=g)  # a cache's storage: keys and values are views
    k, v = buffer[0, :, :, 3:s + 3], buffer[1, :, :, 3:s + 3]
    mask = None
    if masked:
        mask = torch.rand(b, 1, t, s, generator=g) > 0.4
        mask[..., 0] = True  # every query sees something, as masks.py guarantees
    with torch.no_grad():
        got = native.attention(q, k, v, mask, False, d ** -0.5)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d ** -0.5, enable_gqa=h != hkv)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        capped = native.attention(q, k, v, mask, False, d ** -0.5, 5.0)
        torch.testing.assert_close(capped, softcapped_attention(q, k, v, mask, False, d ** -0.5, 5.0),
                                   rtol=1e-5, atol=1e-5)


def test_attention_leaves_other_cases_to_torch():
    q, k = torch.randn(1, 2, 1, 64), torch.randn(1, 2, 5, 64)
    with torch.no_grad():
        assert native.attention(q, k, k, None, True, 0.1) is None  # causal: torch's kernel
        assert native.attention(torch.randn(1, 2, 9, 64), k, k, None, False, 0.1) is None  # 9 rows: a prefill
        assert native.attention(torch.randn(1, 2, 1, 24), k[..., :24], k[..., :24], None, False, 0.1) is None
    assert native.attention(q, k, k, None, False, 0.1) is None  # autograd on: torch's differentiable op
