"""``Linear``: a linear layer whose weight streams from memory fast during decode on CPU.

A decode step multiplies one row per sequence by every weight matrix, so its speed is
how fast the weights stream from memory. MKL's ``F.linear`` streams a (out, in) float32
matrix at about 10 GB/s on this kind of machine, and far slower for 2-8 rows (it repacks
the weight on every call); oneDNN with the weight packed once, ahead of time, streams it
about twice as fast for any number of rows, prefill included. After :meth:`Linear.pack`
the layer keeps only the packed weight (same size); ``state_dict()`` and device or dtype
moves see the ordinary dense weight again.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.nn.functional as F
from torch import nn


# A plain dispatcher op (cheaper per call than torch.library.custom_op): inductor cannot lower
# oneDNN's op with a packed weight that is not a frozen constant, so it sees this opaque op.
_LIBRARY = torch.library.Library("kvgen", "DEF")
_LIBRARY.define("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")


def _packed_linear(x, packed, bias, out_features):
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


for _key in ("CPU", "MkldnnCPU"):  # x is a CPU tensor, the packed weight an MkldnnCPU one
    _LIBRARY.impl("packed_linear", _packed_linear, _key)


@torch.library.register_fake("kvgen::packed_linear")
def _(x, packed, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


def packing_enabled() -> bool:
    return torch.backends.mkldnn.is_available() and os.environ.get("KVGEN_PACK_WEIGHTS", "1") != "0"


class Linear(nn.Linear):
    """``nn.Linear`` that can keep its weight pre-packed for oneDNN on float32 CPU.

    Example:
        >>> layer = Linear(4, 3)
        >>> x = torch.randn(2, 4)
        >>> dense = layer(x)
        >>> layer.pack()
        >>> torch.allclose(layer(x), dense, atol=1e-5), tuple(layer.state_dict()["weight"].shape)
        (True, (3, 4))
    """

    packed: torch.Tensor | None = None
    keep_dense: bool = False  #: set when the dense weight is shared (tied embeddings) and must stay

    def pack(self) -> None:
        """Switch to the packed weight when on float32 CPU with oneDNN; otherwise do nothing."""
        w = self.weight
        if self.packed is not None or w.device.type != "cpu" or w.dtype != torch.float32 or not packing_enabled():
            return
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)
        if not self.keep_dense:
            w.data = w.data.new_empty(0)  # the packed copy is now the only one

    def unpack(self) -> None:
        if self.packed is None:
            return
        if not self.keep_dense:
            self.weight.data = self.packed.to_dense()
        self.packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.kvgen.packed_linear(x, self.packed, self.bias, self.out_features)

    def _apply(self, fn, recurse=True):
        was_packed = self.packed is not None
        self.unpack()
        out = super()._apply(fn, recurse)
        if was_packed:
            self.pack()
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.packed is not None and not self.keep_dense:
            destination[prefix + "weight"] = self.packed.to_dense()

    def __deepcopy__(self, memo):
        twin = self.__class__.__new__(self.__class__)
        memo[id(self)] = twin
        twin.__dict__.update(copy.deepcopy({k: v for k, v in self.__dict__.items() if k != "packed"}, memo))
        if self.packed is not None:  # a packed tensor has no storage to copy: repack a dense copy
            if not self.keep_dense:
                twin.weight.data = self.packed.to_dense()
            twin.pack()
        return twin
