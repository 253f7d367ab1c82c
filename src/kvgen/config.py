"""Model configuration: a typed-enough attribute bag read from ``config.json``.

Both spellings that Hugging Face has written over the years load: the older
``rope_theta`` + ``rope_scaling`` and the newer ``rope_parameters``. After
loading, every config exposes the same normalised fields that caches and models
read: ``head_dim``, ``num_key_value_heads``, ``rope_parameters`` (a dict with at
least ``rope_type`` and ``rope_theta``), ``layer_types`` and ``sliding_window``.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from kvgen.loading.consistency import check_config
from kvgen.loading.errors import ModelFileError

# Defaults per model_type for the fields that differ between families.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False},
    "mistral": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "sliding_window": 4096},
    "qwen2": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_bias": True,
              "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_bias": False,
              "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28},
    "phi3": {"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": None},
}
# Gemma 2 / Gemma 3 text: transformers' config defaults (Gemma 3's global rope base is 1e6, local 1e4).
_GEMMA_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "tie_word_embeddings": True, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
}
_FAMILY_DEFAULTS["gemma2"] = {**_GEMMA_DEFAULTS, "rope_theta": 10000.0, "max_position_embeddings": 8192,
                              "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0}
_FAMILY_DEFAULTS["gemma3_text"] = {**_GEMMA_DEFAULTS, "rope_theta": 1_000_000.0, "max_position_embeddings": 131_072,
                                   "final_logit_softcapping": None, "attn_logit_softcapping": None,
                                   "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6}
# Whisper: transformers' WhisperConfig defaults (the sizes of whisper-tiny).
_FAMILY_DEFAULTS["whisper"] = {
    "vocab_size": 51865, "num_mel_bins": 80, "d_model": 384, "encoder_layers": 4, "decoder_layers": 4,
    "encoder_attention_heads": 6, "decoder_attention_heads": 6, "encoder_ffn_dim": 1536, "decoder_ffn_dim": 1536,
    "activation_function": "gelu", "max_source_positions": 1500, "max_target_positions": 448,
    "decoder_start_token_id": 50257, "pad_token_id": 50256, "bos_token_id": 50256, "eos_token_id": 50256,
    "begin_suppress_tokens": [220, 50256], "tie_word_embeddings": True, "is_encoder_decoder": True,
}
# Mamba and Jamba: transformers' MambaConfig / JambaConfig defaults (no position limit: Mamba has no positions).
_FAMILY_DEFAULTS["mamba"] = {
    "layer_norm_epsilon": 1e-5, "state_size": 16, "expand": 2, "conv_kernel": 4, "use_bias": False,
    "use_conv_bias": True, "residual_in_fp32": True, "time_step_rank": "auto", "tie_word_embeddings": True,
    "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0, "max_position_embeddings": None,
}
_FAMILY_DEFAULTS["jamba"] = {
    "rms_norm_eps": 1e-6, "attn_layer_period": 8, "attn_layer_offset": 4, "expert_layer_period": 2,
    "expert_layer_offset": 1, "num_experts": 16, "num_experts_per_tok": 2, "mamba_d_state": 16, "mamba_d_conv": 4,
    "mamba_expand": 2, "mamba_dt_rank": "auto", "mamba_conv_bias": True, "mamba_proj_bias": False,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 262144,
}
GEMMA3_TYPES = ("gemma3_text", "gemma3")  # "gemma3" is the multimodal wrapper; kvgen reads its text part
_FAMILY_DEFAULTS["gemma3"] = _FAMILY_DEFAULTS["gemma3_text"]


class PretrainedConfig:
    """Attribute bag for a model's ``config.json`` with normalised rope and layer fields.

    Example:
        >>> cfg = PretrainedConfig(model_type="llama", hidden_size=64, num_attention_heads=4,
        ...                        num_hidden_layers=2, vocab_size=100, intermediate_size=128)
        >>> cfg.head_dim, cfg.num_key_value_heads, cfg.rope_parameters["rope_type"]
        (16, 4, 'default')
    """

    def __init__(self, **kwargs: Any):
        model_type = kwargs.get("model_type", "llama")
        for key, value in _FAMILY_DEFAULTS.get(model_type, {}).items():
            kwargs.setdefault(key, value)
        kwargs.setdefault("model_type", model_type)
        if model_type == "whisper":  # the decoder's sizes under the names caches read (transformers aliases them)
            for name, source in (("hidden_size", "d_model"), ("num_attention_heads", "decoder_attention_heads"),
                                 ("num_hidden_layers", "decoder_layers"),
                                 ("max_position_embeddings", "max_target_positions")):
                kwargs.setdefault(name, kwargs[source])
        kwargs.setdefault("tie_word_embeddings", False)
        kwargs.setdefault("max_position_embeddings", 2048)
        kwargs.setdefault("hidden_act", "silu")
        kwargs.setdefault("use_cache", True)
        self.__dict__.update(kwargs)
        self._normalise()

    # -- normalisation ---------------------------------------------------------------------------
    def _normalise(self) -> None:
        if "num_attention_heads" in self.__dict__ and "hidden_size" in self.__dict__:
            if getattr(self, "num_key_value_heads", None) is None:
                self.num_key_value_heads = self.num_attention_heads
            if getattr(self, "head_dim", None) is None:
                self.head_dim = self.hidden_size // self.num_attention_heads
        self._normalise_rope()
        self._normalise_layer_types()

    def _normalise_rope(self) -> None:
        if self.model_type in GEMMA3_TYPES:
            self._split_gemma3_rope()
        params = getattr(self, "rope_parameters", None)
        if params is None:
            scaling = getattr(self, "rope_scaling", None) or {}
            params = dict(scaling)
            params["rope_theta"] = getattr(self, "rope_theta", 10000.0)
        else:
            params = dict(params)
        # Old configs say "type", new ones "rope_type"; phi3 longrope configs say "su"/"yarn" etc.
        rope_type = params.pop("type", None) or params.get("rope_type") or "default"
        params["rope_type"] = rope_type
        params.setdefault("rope_theta", getattr(self, "rope_theta", 10000.0))
        if "partial_rotary_factor" not in params and getattr(self, "partial_rotary_factor", None) is not None:
            params["partial_rotary_factor"] = self.partial_rotary_factor
        self.rope_parameters = params
        self.rope_theta = params["rope_theta"]

    def _split_gemma3_rope(self) -> None:
        """Gemma 3: global layers' rope -> ``rope_parameters``, sliding layers' -> ``local_rope_parameters``.

        Reads transformers 5's per-layer-type ``rope_parameters`` ({"full_attention": {...},
        "sliding_attention": {...}}) and the older ``rope_theta`` + ``rope_scaling`` (global) +
        ``rope_local_base_freq`` (local, always default rope) spelling alike.
        """
        params = getattr(self, "rope_parameters", None)
        if isinstance(params, dict) and params.keys() & {"full_attention", "sliding_attention"}:
            full = dict(params.get("full_attention") or {})
            full.setdefault("rope_theta", getattr(self, "rope_theta", 1_000_000.0))
            local = dict(params.get("sliding_attention") or {})
            local.setdefault("rope_theta", self.rope_local_base_freq)
            self.rope_parameters = full
            self.local_rope_parameters = local
        elif getattr(self, "local_rope_parameters", None) is None:
            self.local_rope_parameters = {"rope_type": "default", "rope_theta": self.rope_local_base_freq}
        local = dict(self.local_rope_parameters)
        local["rope_type"] = local.pop("type", None) or local.get("rope_type") or "default"
        self.local_rope_parameters = local
        self.rope_local_base_freq = local["rope_theta"]

    def _normalise_layer_types(self) -> None:
        n = getattr(self, "num_hidden_layers", None)
        if n is None:
            return
        if self.model_type in ("qwen2", "qwen3") and not getattr(self, "use_sliding_window", False):
            self.sliding_window = None
        window = getattr(self, "sliding_window", None)
        if self.model_type in ("mamba", "jamba"):
            self._mamba_layer_types(n)
        if getattr(self, "layer_types", None) is None and self.model_type in ("gemma2", *GEMMA3_TYPES):
            # Gemma 2 alternates sliding/global from layer 0; Gemma 3 makes every pattern-th layer global
            pattern = 2 if self.model_type == "gemma2" else self.sliding_window_pattern
            self.layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        if getattr(self, "layer_types", None) is None:
            first_sliding = getattr(self, "max_window_layers", 0) if self.model_type in ("qwen2", "qwen3") else 0
            self.layer_types = [
                "sliding_attention" if window is not None and i >= first_sliding else "full_attention"
                for i in range(n)
            ]
        if len(self.layer_types) != n:
            raise ValueError(
                f"config.layer_types has {len(self.layer_types)} entries but num_hidden_layers is {n}; "
                "give one entry per layer."
            )

    def _mamba_layer_types(self, n: int) -> None:
        """Mamba: every layer is "mamba"; Jamba: "full_attention" every ``attn_layer_period``-th layer from
        ``attn_layer_offset``, "mamba" elsewhere (transformers' name "linear_attention" reads as "mamba")."""
        if self.model_type == "jamba":
            for what in ("attn", "expert"):
                period, offset = getattr(self, f"{what}_layer_period"), getattr(self, f"{what}_layer_offset")
                if not 0 <= offset < period:
                    raise ValueError(f"{what}_layer_offset ({offset}) must be in [0, {what}_layer_period={period})")
        if getattr(self, "layer_types", None) is None:
            if self.model_type == "mamba":
                self.layer_types = ["mamba"] * n
            else:
                period, offset = self.attn_layer_period, self.attn_layer_offset
                self.layer_types = ["full_attention" if i % period == offset else "mamba" for i in range(n)]
        self.layer_types = ["mamba" if kind == "linear_attention" else kind for kind in self.layer_types]

    # -- dict-like access --------------------------------------------------------------------------
    def get(self, name: str, default: Any = None) -> Any:
        return self.__dict__.get(name, default)

    def __contains__(self, name: str) -> bool:
        return name in self.__dict__

    def __repr__(self) -> str:
        return f"{type(self).__name__}({json.dumps(self.to_dict(), indent=1, sort_keys=True, default=str)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PretrainedConfig) and self.to_dict() == other.to_dict()

    def to_dict(self) -> dict[str, Any]:
        return {k: copy.deepcopy(v) for k, v in self.__dict__.items() if not k.startswith("_")}

    # -- files -------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PretrainedConfig":
        return cls(**data)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "PretrainedConfig":
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"config file not found: {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e}); re-export the checkpoint's config.json.") from None
        if not isinstance(data, dict):
            raise ModelFileError(path, "the document", "a JSON object of settings", type(data).__name__)
        check_config(data, path)
        return cls.from_dict(data)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "PretrainedConfig":
        from kvgen.loading.hub import resolve_model_dir

        return cls.from_json_file(os.path.join(resolve_model_dir(path), "config.json"))

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)


class AutoConfig:
    """``AutoConfig.from_pretrained(path)`` reads ``config.json`` into a :class:`PretrainedConfig`."""

    @staticmethod
    def from_pretrained(path: str | os.PathLike) -> PretrainedConfig:
        return PretrainedConfig.from_pretrained(path)
