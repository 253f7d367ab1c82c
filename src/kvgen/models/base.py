"""What every kvgen model shares: loading from checkpoints, device and dtype, ``generate()``,
and the decoder-input preparation (cache, ``cache_position``, ``position_ids``) of the seeds' contract.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from kvgen.cache.base import Cache
from kvgen.cache.dynamic import DynamicCache, as_cache
from kvgen.cache.fingerprint import check_cache_model
from kvgen.config import PretrainedConfig
from kvgen.generation.config import GenerationConfig
from kvgen.generation.generate import GenerationMixin
from kvgen.loading.hub import resolve_model_dir
from kvgen.masks import attention_mask as build_mask, check_padding_mask, range_attention_mask

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def parse_dtype(dtype, config: PretrainedConfig) -> torch.dtype:
    """``torch.float16`` / ``"float16"`` / ``"auto"`` (the checkpoint's dtype) / ``None`` (float32)."""
    if dtype is None:
        return torch.float32
    if dtype == "auto":
        dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
    if isinstance(dtype, torch.dtype):
        return dtype
    if str(dtype).removeprefix("torch.") in _DTYPES:
        return _DTYPES[str(dtype).removeprefix("torch.")]
    raise ValueError(f"unsupported dtype {dtype!r}; use torch.float32, torch.float16, torch.bfloat16 or 'auto'")


def parse_device_map(device_map) -> torch.device:
    """Place the whole model on one device: ``"auto"``, ``"cpu"``, ``"cuda:0"``, ``0`` or ``{"": 0}``."""
    if device_map is None:
        return torch.device("cpu")
    if isinstance(device_map, dict):
        targets = set(device_map.values())
        if len(targets) != 1:
            raise ValueError(f"device_map {device_map} splits the model; kvgen places a model on one device")
        device_map = targets.pop()
    if device_map == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device_map, int):
        return torch.device("cuda", device_map)
    return torch.device(device_map)


@contextlib.contextmanager
def skip_weight_init():
    """Build modules without random initialisation (their weights are about to be replaced).

    Cheaper than building on the meta device, whose first use imports much of torch.
    """
    names = ("kaiming_uniform_", "uniform_", "normal_", "trunc_normal_", "xavier_uniform_", "zeros_", "ones_")
    saved = {name: getattr(nn.init, name) for name in names}
    try:
        for name in names:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


class PreTrainedModel(nn.Module, GenerationMixin):
    """Base of every kvgen model: ``from_pretrained``, ``device``, ``dtype``, ``generate``.

    Subclasses set ``model_types`` and implement ``convert_checkpoint`` (checkpoint
    names -> module names) and ``forward``.
    """

    model_types: tuple[str, ...] = ()

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.config = config
        self.generation_config = GenerationConfig.from_model_config(config)
        self.register_forward_pre_hook(_refuse_foreign_cache, with_kwargs=True)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype computations run in (weights kept in a stored format are not parameters)."""
        return next(self.parameters()).dtype

    @property
    def weight_format(self) -> str:
        """How the weights are stored: ``"float32"``, ``"Q4_1+Q8_0"``, ``"int8"``, ...

        Example:
            >>> model.weight_format  # doctest: +SKIP
            'Q4_1+Q8_0'
        """
        from kvgen.models.quantized_linear import _Packed

        names = [m.weight.format_name for m in self.modules() if isinstance(m, _Packed)]
        formats = dict.fromkeys(n for name in names for n in name.split("+"))
        return "+".join(formats) if formats else str(self.dtype).removeprefix("torch.")

    @classmethod
    def convert_checkpoint(cls, state_dict: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
        """Checkpoint names -> module names; may consume ``state_dict`` to free memory early."""
        return state_dict

    # -- loading -----------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *, dtype=None, torch_dtype=None,
                        device_map=None, gguf_file: str | None = None, revision: str = "main",
                        quantization_config=None, tp_plan: str | None = None):
        """Load from an HF folder (single or sharded safetensors), a hub id, a GGUF file, or a CTranslate2 folder.

        A GGUF file's weights stay in their stored types unless ``dtype`` is given (then they are
        dequantized, as in transformers). On the CPU, ``dtype="auto"`` keeps a bfloat16 or float16
        checkpoint's linear and embedding weights at that width and computes in float32 (this
        CPU has no 16-bit arithmetic; the weights stream at half the bytes). ``quantization_config``
        (a :class:`kvgen.TorchAoConfig` or its dict) quantizes a float checkpoint's linear layers
        at load: int8 or int4. ``tp_plan="auto"``, under torchrun, splits the layers over the ranks
        (:mod:`kvgen.tensor_parallel`; each rank on ``cuda:LOCAL_RANK`` where CUDA is available).
        """
        from kvgen.quantization import parse_quantization_config
        from kvgen.loading.checkpoint import load_safetensors_state_dict, read_generation_config
        from kvgen.loading.ctranslate2 import is_ctranslate2_dir, load_ctranslate2_whisper

        if dtype is not None and torch_dtype is not None and dtype != torch_dtype:
            raise ValueError("pass dtype= or torch_dtype= (the older name), not both")
        dtype = dtype if dtype is not None else torch_dtype
        path = Path(str(pretrained_model_name_or_path)).expanduser()
        if gguf_file is None and path.suffix == ".gguf":
            path, gguf_file = path.parent, path.name
        quantization = parse_quantization_config(quantization_config)
        if tp_plan is not None and device_map is None and torch.cuda.is_available():
            device_map = f"cuda:{os.environ.get('LOCAL_RANK', 0)}"  # a GPU per rank, as torchrun numbers them
        folder = resolve_model_dir(path, revision)
        generation = None
        if gguf_file is not None:
            from kvgen.kernels import kernels_available, unavailable_reason
            from kvgen.loading.gguf import load_gguf

            packed = dtype is None and quantization is None and parse_device_map(device_map).type == "cpu"
            if packed and not kernels_available():
                warnings.warn(f"kvgen's kernels are unavailable ({unavailable_reason()}); {gguf_file} is "
                              "dequantized to float32", stacklevel=2)
                packed = False
            config_dict, state_dict = load_gguf(folder / gguf_file, packed=packed)
            config = PretrainedConfig.from_dict(config_dict)
        elif is_ctranslate2_dir(folder):  # a CTranslate2 Whisper folder (faster-whisper's model.bin)
            config_dict, state_dict, generation = load_ctranslate2_whisper(folder)
            config = PretrainedConfig.from_dict(config_dict)
        else:
            config = PretrainedConfig.from_json_file(folder / "config.json")
            state_dict = load_safetensors_state_dict(folder)
            generation = read_generation_config(folder)
        model_cls = cls._class_for(config)
        compute_dtype, device = parse_dtype(dtype, config), parse_device_map(device_map)
        keep_width = (dtype == "auto" and compute_dtype in _PACKED_FLOATS and device.type == "cpu"
                      and quantization is None and gguf_file is None)
        if keep_width:
            from kvgen.kernels import kernels_available

            keep_width = kernels_available()
        model = model_cls._from_state_dict(config, state_dict, torch.float32 if keep_width else compute_dtype, device,
                                           keep_width=keep_width)
        if quantization is not None:
            quantization.quantize_model(model)
        if generation:
            model.generation_config = GenerationConfig.from_dict(generation)
        model.name_or_path = str(pretrained_model_name_or_path)
        if tp_plan is not None:
            from kvgen.tensor_parallel import shard_model

            if tp_plan != "auto":
                raise ValueError(f'tp_plan takes "auto" (the model family\'s split), not {tp_plan!r}')
            shard_model(model)
        return model

    @classmethod
    def _class_for(cls, config: PretrainedConfig) -> type["PreTrainedModel"]:
        if config.model_type not in cls.model_types:
            raise ValueError(
                f"{cls.__name__} cannot load a checkpoint of model_type {config.model_type!r}; "
                f"it loads {', '.join(cls.model_types)}. Use AutoModelForCausalLM."
            )
        return cls

    @classmethod
    def _from_state_dict(cls, config, state_dict, dtype, device, keep_width: bool = False) -> "PreTrainedModel":
        with skip_weight_init():
            model = cls(config)
        state_dict = cls.convert_checkpoint(state_dict, config)
        if keep_width:
            _pack_16bit_weights(model, state_dict)
        _use_packed_weights(model, state_dict, device)
        seen_ids: set[int] = set()
        expected = {}  # tied tensors (e.g. lm_head = embeddings) are expected once, under their first name
        for name, tensor in model.state_dict(keep_vars=True).items():
            if ".packed_" in name:  # a stored-format weight, already in place
                continue
            if id(tensor) not in seen_ids:
                seen_ids.add(id(tensor))
                expected[name] = tensor
        missing = [name for name in expected if name not in state_dict]
        unexpected = [name for name in state_dict if name not in expected]
        if missing or unexpected:
            raise ValueError(
                f"checkpoint tensors do not match the {config.model_type} config "
                f"({config.get('num_hidden_layers')} layers): missing {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                f"{' ...' if len(unexpected) > 8 else ''}"
            )
        for name, param in expected.items():
            if tuple(state_dict[name].shape) != tuple(param.shape):
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(state_dict[name].shape)} but the config "
                    f"(hidden_size={config.get('hidden_size')}, heads={config.get('num_attention_heads')}, "
                    f"kv_heads={config.get('num_key_value_heads')}) needs {tuple(param.shape)}"
                )
        model.load_state_dict({k: v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device)
                               for k, v in state_dict.items()}, assign=True, strict=False)
        state_dict.clear()  # the model holds the only references now
        model.tie_weights()
        model.init_buffers(device)
        model.requires_grad_(False)
        return model.eval()

    def tie_weights(self) -> None:
        """Share input and output embeddings when the config says so (subclasses with heads override)."""

    def init_buffers(self, device) -> None:
        """Recreate non-persistent buffers (e.g. rotary tables) that the meta-device build left empty."""


_PACKED_FLOATS = {torch.bfloat16: 30, torch.float16: 1}  # dtype -> its stored format (GGML type id)


def _pack_16bit_weights(model: nn.Module, state_dict: dict) -> None:
    """Turn the bfloat16/float16 weights of ``model``'s linear and embedding layers into packed weights
    that keep their width (rows whose length is not a multiple of 32 stay float)."""
    from kvgen.models.packed import PackedWeight, can_pack

    for name, module in model.named_modules():
        weight = state_dict.get(f"{name}.weight")
        if isinstance(module, (nn.Linear, nn.Embedding)) and isinstance(weight, torch.Tensor) \
                and weight.dtype in _PACKED_FLOATS and can_pack(_PACKED_FLOATS[weight.dtype], weight.shape[1]):
            rows = weight.contiguous().view(torch.uint8)  # (out, 2 * in): the stored bytes
            state_dict[f"{name}.weight"] = PackedWeight([(_PACKED_FLOATS[weight.dtype], rows)], weight.shape[1])


def _use_packed_weights(model: nn.Module, state_dict: dict, device: torch.device) -> None:
    """Put each :class:`PackedWeight` of ``state_dict`` in place: its ``nn.Linear`` / ``nn.Embedding``
    becomes a quantized layer (layers tied to it too), and the entry leaves ``state_dict``."""
    from kvgen.models.packed import PackedWeight, tile_rows, tiled_sizes
    from kvgen.models.decode_blocks import run_blocks_eagerly
    from kvgen.models.quantized_linear import QuantizedEmbedding, QuantizedLinear
    from kvgen.models.weight_arena import WeightArena

    packed = {name: w for name, w in state_dict.items() if isinstance(w, PackedWeight)}
    if not packed:
        return
    if device.type != "cpu":
        raise ValueError(f"weights kept in their stored format are loaded on the CPU, not {device}: load them "
                         f"there and move the model with .to({str(device)!r}), or pass dtype=torch.float32")
    sharing: dict[int, list[str]] = {}  # parameter -> every module holding it (tied embeddings)
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            sharing.setdefault(id(module.weight), []).append(name)
    arena = WeightArena([size for weight in packed.values() for size in tiled_sizes(weight)])  # in 2 MB pages
    for name in list(packed):
        weight = packed.pop(name)  # the rows are dropped once tiled (a permuted q or k is a copy of its own)
        module_name = name.removesuffix(".weight")
        original = model.get_submodule(module_name)
        if tuple(weight.shape) != tuple(original.weight.shape):  # the kernels trust a packed weight's shape
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(weight.shape)} but the config needs "
                             f"{tuple(original.weight.shape)}")
        weight = tile_rows(weight, arena.empty_like)  # 4-6-bit formats in tiles of 16 rows for the one-row product
        for holder in sharing[id(original.weight)]:
            module = model.get_submodule(holder)
            if isinstance(module, nn.Embedding):
                replacement = QuantizedEmbedding(weight)
            else:
                bias = None if module.bias is None else torch.empty(module.out_features)
                replacement = QuantizedLinear(weight, bias)
            model.set_submodule(holder, replacement)
        del state_dict[name]
    run_blocks_eagerly(model)


def _refuse_foreign_cache(model, args, kwargs) -> None:
    """Forward pre-hook of every model: a cache filled by another model (other config or weights) raises."""
    if not torch.compiler.is_compiling():
        for value in (kwargs.get("past_key_values"), *args):
            if isinstance(value, Cache):
                check_cache_model(value, model)


# -- decoder inputs (the seeds' forward contract) -------------------------------------------------------

def prepare_decoder_inputs(config, input_ids: torch.Tensor | None, batch: int, length: int, device, past_key_values,
                           use_cache: bool | None, cache_position: torch.Tensor | None,
                           position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None):
    """Resolve the cache and the positions of ``length`` new tokens.

    Returns ``(cache, return_legacy, cache_position, position_ids)``. The cache records
    ``input_ids`` (``None`` for embeddings) at their positions. A legacy tuple cache
    is converted and will be returned as a tuple; ``use_cache=False`` gives no cache.
    ``cache_position`` defaults to the positions after what the cache holds and is checked
    against it; ``position_ids`` default to ``cache_position`` (as in transformers).
    """
    use_cache = config.get("use_cache", True) if use_cache is None else use_cache
    past_key_values, legacy = as_cache(past_key_values)
    cache = (past_key_values if past_key_values is not None else DynamicCache(config=config)) if use_cache else None
    compiling = torch.compiler.is_compiling()
    if cache_position is None:
        start = cache.get_seq_length() if cache is not None else 0
        cache_position = torch.arange(start, start + length, device=device)
    elif not compiling:
        if cache_position.dim() == 1 and cache_position.shape[0] > length and cache is not None \
                and bool((cache_position == torch.arange(cache_position.shape[0], device=device)).all()) \
                and cache_position.shape[0] - length == cache.get_seq_length():
            # the seeds' Gemma 2 example passes arange(whole sequence) with only its unseen last tokens
            cache_position = cache_position[-length:]
        if cache_position.dim() != 1 or cache_position.shape[0] != length:
            raise ValueError(
                f"cache_position must be 1-D with one entry per new token ({length}); got shape "
                f"{tuple(cache_position.shape)}. For a filled cache pass torch.arange(past, past + new_tokens)."
            )
    if cache is not None and not compiling:
        cache.check_cache_position(cache_position)
        cache.record_token_ids(input_ids, cache_position)
    if attention_mask is not None and not compiling:
        check_padding_mask(attention_mask, int(cache_position[-1]) + 1)
        if attention_mask.shape[0] != batch:
            raise ValueError(f"attention_mask has batch {attention_mask.shape[0]} but the input has {batch}")
    if position_ids is None:
        position_ids = cache_position.unsqueeze(0).expand(batch, -1)
    return cache, legacy, cache_position, position_ids


class LayerMasks:
    """Builds each distinct attention mask of a forward pass once, shared by layers alike."""

    def __init__(self, cache: Cache | None, cache_position: torch.Tensor, padding_mask: torch.Tensor | None):
        self.cache, self.cache_position, self.padding_mask = cache, cache_position, padding_mask
        self.static = torch.compiler.is_compiling()
        self._built: dict[tuple, tuple[torch.Tensor | BlockMask | None, bool]] = {}

    def __call__(self, layer_idx: int, sliding_window: int | None) -> tuple[torch.Tensor | BlockMask | None, bool]:
        group = (None if self.cache is None else self.cache.mask_group(layer_idx), sliding_window)
        if group not in self._built:
            settled = self._settled(layer_idx, sliding_window)
            if settled is None and self.cache is not None:
                sparse = self.cache.block_mask(layer_idx, sliding_window)  # a BlockMask: flex_attention runs
                settled = None if sparse is None else (sparse, False)
            if settled is None:
                keys = (self.cache_position if self.cache is None
                        else self.cache.key_positions(layer_idx, self.cache_position))
                settled = build_mask(self.cache_position, keys, self.padding_mask, sliding_window, static=self.static)
            self._built[group] = settled
        return self._built[group]

    def _settled(self, layer_idx: int, sliding_window: int | None) -> tuple[torch.Tensor | None, bool] | None:
        """The mask of a one-token step without padding, from the positions as integers
        (:meth:`~kvgen.cache.base.CacheLayer.key_range`, :func:`~kvgen.masks.range_attention_mask`) where the
        cache gives them, else ``None``."""
        if self.cache is None or self.padding_mask is not None or self.static or self.cache_position.shape[0] != 1:
            return None
        keys = self.cache.key_range(layer_idx, self.cache_position)
        if keys is None or keys.start < 0:
            return None
        return range_attention_mask(int(self.cache_position), keys, sliding_window, self.cache_position.device)


def keep_logit_rows(x: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The rows of ``x`` (B, T, hidden) to compute logits for: the last ``n`` (0: all), or the indices of a 1-D tensor
    (as in transformers; a ragged batch keeps the last token of each sequence)."""
    if isinstance(logits_to_keep, torch.Tensor):
        return x[:, logits_to_keep]  # (B, len(logits_to_keep), hidden)
    return x[:, -logits_to_keep:] if logits_to_keep else x


def finish_cache(cache: Cache | None, legacy: bool) -> Any:
    """What ``forward`` returns as ``past_key_values``."""
    if cache is not None and legacy:
        return cache.to_legacy_cache()
    return cache
