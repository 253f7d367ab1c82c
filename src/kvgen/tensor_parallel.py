"""Tensor parallelism on torch.distributed: each rank holds a slice of every layer, as Megatron splits them.

* the fused q/k/v product is split by heads (column-parallel): a rank computes its query heads and the key/value
  heads they read, so its cache holds only those; with fewer key/value heads than ranks, each is replicated on the
  ranks whose queries read it;
* the gate/up product is split by columns, the gate's and the up's alike, as evenly as the down product's stored
  blocks allow (:func:`split_features`);
* ``o_proj`` and ``down_proj`` are split by their input features (row-parallel): each rank's partial products are
  summed by one all-reduce after attention and one after the MLP (:class:`AllReduced`); their biases are added
  once, on rank 0;
* ``lm_head`` is split by rows of the vocabulary, and one all-gather joins the logits (:class:`Gathered`): every
  rank holds the same logits; embeddings and norms are replicated.

The model's config then describes one rank's layers (``num_attention_heads``, ``num_key_value_heads``,
``intermediate_size``), so that every cache, sized from the config, holds one rank's heads and knows nothing of
ranks. ``tp_size`` and ``tp_rank`` record the split.

torchrun starts the ranks (``torchrun --nproc-per-node 2 script.py``); :func:`shard_model` joins the process
group they form (gloo on CPUs, NCCL on GPUs), with a timeout on every collective, so that a rank that dies
makes the others raise instead of waiting forever.

Example:
    >>> model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")   # doctest: +SKIP
    >>> model.config.tp_size, model.config.num_attention_heads                # doctest: +SKIP
    (2, 16)
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import os

import torch
import torch.distributed as dist
from torch import nn

from kvgen.models.decode_blocks import run_blocks_eagerly
from kvgen.models.linear import Linear
from kvgen.models.packed import FORMATS, PackedWeight, tile_rows, untile_rows
from kvgen.models.quantized_linear import QuantizedLinear

#: seconds a collective waits for the other ranks before it raises (``KVGEN_TP_TIMEOUT`` sets it)
TIMEOUT_S = 300


class TensorParallelError(RuntimeError):
    """A setup that cannot be split over the ranks: heads or sizes that do not divide, ranks on different
    models, a model family or weight format that kvgen does not split."""


class AllReduced(nn.Module):
    """A row-parallel product: the wrapped layer's partial output (its slice of the input features), summed over
    the ranks of ``group`` by one all-reduce. Example: ``AllReduced(Linear(512, 1024), group)``."""

    def __init__(self, inner: nn.Module, group):
        super().__init__()
        self.inner, self.group = inner, group

    @property
    def in_features(self) -> int:
        return self.inner.in_features

    @property
    def out_features(self) -> int:
        return self.inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)  # (..., out): this rank's share of the sum
        dist.all_reduce(y, group=self.group)
        return y


class Gathered(nn.Module):
    """A column-parallel output head: the wrapped layer computes this rank's rows of the vocabulary (``rows`` of
    each rank's, padded to the largest), one all-gather puts every rank's logits side by side. Example:
    ``Gathered(Linear(512, 16000), group, [16000, 16000])``."""

    def __init__(self, inner: nn.Module, group, rows: list[int]):
        super().__init__()
        self.inner, self.group, self.rows = inner, group, rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)  # (..., this rank's rows)
        pad = max(self.rows) - y.shape[-1]
        if pad:
            y = nn.functional.pad(y, (0, pad))
        parts = [torch.empty_like(y) for _ in self.rows]
        dist.all_gather(parts, y.contiguous(), group=self.group)
        return torch.cat([p[..., :n] for p, n in zip(parts, self.rows)], dim=-1)  # (..., V)


def process_group():
    """The default process group, joined from torchrun's environment if this process has not joined one yet:
    gloo for CPU tensors and, where CUDA is available, NCCL for CUDA tensors on this rank's GPU (``LOCAL_RANK``,
    made the current device first: NCCL refuses two ranks on one GPU, and its object collectives use the current
    device); every collective bounded by :data:`TIMEOUT_S`."""
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
            raise TensorParallelError('tp_plan="auto" runs under torchrun (torchrun --nproc-per-node N script.py), '
                                      "which sets RANK and WORLD_SIZE; or join a process group first")
        timeout = datetime.timedelta(seconds=float(os.environ.get("KVGEN_TP_TIMEOUT", TIMEOUT_S)))
        backend = "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            backend = "cpu:gloo,cuda:nccl"  # a model kept on the CPU (device_map="cpu") still splits over gloo
        dist.init_process_group(backend, timeout=timeout)
    return dist.group.WORLD


def broadcast_object(value=None):
    """Rank 0's ``value`` on every rank of the default group (a step's plan for the engine's other ranks)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def split_heads(heads: int, kv_heads: int, ranks: int, rank: int) -> tuple[range, range]:
    """The query heads and key/value heads that ``rank`` of ``ranks`` holds. Query heads are split evenly; each
    rank holds the key/value heads its queries read (replicated where there are fewer of them than ranks).

    Example:
        >>> split_heads(8, 2, 4, 3)
        (range(6, 8), range(1, 2))
    """
    if heads % ranks:
        raise TensorParallelError(f"{heads} attention heads do not split over {ranks} ranks: use a number of "
                                  f"ranks that divides {heads}")
    if kv_heads % ranks and ranks % kv_heads:
        raise TensorParallelError(f"{kv_heads} key/value heads do not split over {ranks} ranks, nor are they "
                                  f"replicated evenly: use a number of ranks that divides {kv_heads} or a "
                                  f"multiple of it")
    local = heads // ranks
    queries = range(rank * local, (rank + 1) * local)
    if kv_heads >= ranks:
        per = kv_heads // ranks
        return queries, range(rank * per, (rank + 1) * per)
    group = heads // kv_heads  # query heads per key/value head: a rank's queries all read one
    return queries, range(queries.start // group, queries.start // group + 1)


def split_features(features: int, ranks: int, blocks: int = 1) -> list[range]:
    """``features`` split over ``ranks`` as evenly as cuts on ``blocks`` boundaries allow: the MLP's on its stored
    blocks (Qwen2.5-0.5B's 4,864 in Q6_K blocks of 256 split 2,560 + 2,304 over 2 ranks), the vocabulary on tiles
    of 16 rows.

    Example:
        >>> split_features(4864, 2, 256)
        [range(0, 2560), range(2560, 4864)]
    """
    cuts = [0, *(round(features / blocks * r / ranks) * blocks for r in range(1, ranks)), features]
    if any(a == b for a, b in zip(cuts, cuts[1:])):
        raise TensorParallelError(f"{features} features in blocks of {blocks} do not split over {ranks} ranks: use "
                                  f"at most {features // blocks} ranks")
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def _rows(layer: nn.Module, rows: torch.Tensor) -> nn.Module:
    """A new layer of ``layer``'s output rows ``rows`` (and their biases): float rows, or stored rows (whole rows
    of blocks, in their formats; tiled again where they were)."""
    bias = None if layer.bias is None else layer.bias.detach()[rows].contiguous()
    if isinstance(layer, QuantizedLinear):
        segments, start = [], 0
        for format, data in untile_rows(layer.weight).segments:  # (rows, row bytes) each, GGUF order
            mine = rows[(rows >= start) & (rows < start + data.shape[0])] - start
            if len(mine):
                segments.append((format, data[mine].contiguous()))
            start += data.shape[0]
        return QuantizedLinear(_retiled(layer, PackedWeight(segments, layer.in_features)), bias)
    out = Linear(layer.in_features, len(rows), bias=bias is not None, device="meta")
    out.weight = nn.Parameter(layer.weight.detach()[rows].contiguous(), requires_grad=False)  # (rows, in)
    if bias is not None:
        out.bias = nn.Parameter(bias, requires_grad=False)
    return out


def _columns(layer: nn.Module, columns: range, bias: bool) -> nn.Module:
    """A new layer of ``layer``'s input features ``columns`` (a range: stored weights split on block boundaries);
    its bias only where ``bias``."""
    kept = layer.bias.detach().clone() if bias and layer.bias is not None else None
    if isinstance(layer, QuantizedLinear):
        segments = []
        for format, data in untile_rows(layer.weight).segments:
            name, values, nbytes, extra = FORMATS[format]
            cuts = [c for c in (columns.start, columns.stop) if c % values]
            if extra or cuts:
                where = f"at feature {cuts[0]} (blocks of {values})" if cuts else "by columns (a scale per row)"
                raise TensorParallelError(f"a {name} weight of {layer.in_features} input features cannot be split "
                                          f"{where}: use fewer ranks or dtype=torch.float32")
            cut = slice(columns.start // values * nbytes, columns.stop // values * nbytes)
            segments.append((format, data[:, cut].contiguous()))  # (rows, bytes of the columns' blocks)
        return QuantizedLinear(_retiled(layer, PackedWeight(segments, len(columns))), kept)
    out = Linear(len(columns), layer.out_features, bias=kept is not None, device="meta")
    out.weight = nn.Parameter(layer.weight.detach()[:, columns.start:columns.stop].contiguous(),
                              requires_grad=False)  # (out, columns)
    if kept is not None:
        out.bias = nn.Parameter(kept, requires_grad=False)
    return out


def _retiled(layer: QuantizedLinear, weight: PackedWeight) -> PackedWeight:
    """``weight`` in tiles of 16 rows where ``layer``'s weight was (on the CPU)."""
    tiled = any(format >= 2000 for format in layer.formats) and weight.segments[0][1].device.type == "cpu"
    return tile_rows(weight) if tiled else weight


def _heads(head_range: range, head_dim: int, offset: int = 0) -> torch.Tensor:
    """The feature indices of the heads ``head_range``, ``offset`` features in."""
    return torch.arange(head_range.start * head_dim, head_range.stop * head_dim) + offset


def _check_splittable(model: nn.Module) -> None:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") and hasattr(layer, "mlp") and
                                 hasattr(layer.mlp, "gate_up_proj") for layer in layers):
        raise TensorParallelError(f"kvgen splits the Llama family and Gemma over ranks, not "
                                  f"{type(model).__name__}")
    for name, module in model.named_modules():
        if (name.startswith("model.layers.") and name.endswith("_proj")
                and type(module) not in (Linear, QuantizedLinear)):
            raise TensorParallelError(f"{name} holds {type(module).__name__} weights; tp_plan splits float "
                                      "weights and GGUF blocks: load with dtype=torch.float32")


def _agree(model: nn.Module, group) -> None:
    """Raise on every rank unless every rank loaded the same model (its config and a digest of its weights)."""
    digest = hashlib.sha256(repr(sorted(model.config.to_dict().items())).encode())
    for tensor in [*model.model.embed_tokens.state_dict().values(), *model.model.layers[-1].state_dict().values()]:
        flat = tensor.detach().reshape(-1)
        digest.update(flat[::max(1, flat.numel() // 4096)].cpu().numpy().tobytes())  # ~4k values of each
    digests = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest.hexdigest(), group=group)
    if len(set(digests)) > 1:
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        raise TensorParallelError(f"ranks {differ} loaded another model than rank 0: every rank must load the same "
                                  "files")


def shard_model(model: nn.Module, group=None) -> nn.Module:
    """Split ``model``'s layers over the ranks of ``group`` (default: torchrun's, joined by
    :func:`process_group`), in place; returns it. Every rank must call it on the same model."""
    group = process_group() if group is None else group
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    _check_splittable(model)
    _agree(model, group)  # before the split: the full weights are the same on every rank
    config = model.config
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    queries, keys = split_heads(heads, kv_heads, ranks, rank)
    inner = config.intermediate_size
    stored = [layer.mlp.down_proj for layer in model.model.layers if isinstance(layer.mlp.down_proj, QuantizedLinear)]
    blocks = max((FORMATS[f][1] for down in stored for f in down.formats), default=1)  # values per stored block
    columns = split_features(inner, ranks, blocks)[rank]
    share = torch.arange(columns.start, columns.stop)
    qkv_rows = torch.cat([_heads(queries, head_dim), _heads(keys, head_dim, heads * head_dim),
                          _heads(keys, head_dim, (heads + kv_heads) * head_dim)])
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = _rows(attn.qkv_proj, qkv_rows)
        attn.o_proj = AllReduced(_columns(attn.o_proj, range(queries.start * head_dim, queries.stop * head_dim),
                                          bias=rank == 0), group)
        attn.num_heads, attn.num_kv_heads = len(queries), len(keys)
        mlp.gate_up_proj = _rows(mlp.gate_up_proj, torch.cat([share, share + inner]))
        mlp.down_proj = AllReduced(_columns(mlp.down_proj, columns, bias=rank == 0), group)
    vocab = split_features(model.lm_head.out_features, ranks, 16)  # whole tiles of 16 rows
    model.lm_head = Gathered(_rows(model.lm_head, torch.arange(vocab[rank].start, vocab[rank].stop)), group,
                             [len(r) for r in vocab])
    local = copy.copy(config)
    local.__dict__.update(num_attention_heads=len(queries), num_key_value_heads=len(keys), head_dim=head_dim,
                          intermediate_size=len(columns), tp_size=ranks, tp_rank=rank)
    model.config = local
    run_blocks_eagerly(model)  # a compiled block would trace the all-reduce: eager steps, one graph for all
    return model
