"""Tokenizers with the Hugging Face ``AutoTokenizer`` API, built on the ``tokenizers`` library.

A tokenizer loads from a folder holding ``tokenizer.json`` (plus the optional
``tokenizer_config.json``, ``special_tokens_map.json``, ``chat_template.jinja`` or
``chat_template.json``), from a hub id, or from the vocabulary embedded in a GGUF file
(:mod:`kvgen.loading.gguf_tokenizer`, built once per file into kvgen's cache). Chat templates render in a
sandbox (:mod:`kvgen.chat_template`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, processors

from kvgen.chat_template import compile_chat_template, render_chat_template
from kvgen.loading.errors import ModelFileError
from kvgen.loading.gguf_tokenizer import read_gguf_vocabulary
from kvgen.loading.hub import resolve_model_dir

VERY_LARGE_INTEGER = int(1e30)  # transformers' model_max_length for "no limit"
_LARGE_INTEGER = int(1e20)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_IGNORED_LOAD_KWARGS = {"use_fast", "trust_remote_code", "local_files_only", "cache_dir", "token"}



class BatchEncoding(dict):
    """The tokenizer's output: a dict whose keys (``input_ids``, ``attention_mask``) are also attributes.

    Example:
        >>> enc = tokenizer(["Hi", "Hello there"], padding=True, return_tensors="pt").to("cpu")
        >>> enc.input_ids.shape == enc["attention_mask"].shape
        True
    """

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"BatchEncoding has no field {name!r}; it has {sorted(self)}") from None

    def to(self, device: str | torch.device) -> BatchEncoding:
        """Move every tensor to ``device`` in place and return ``self``."""
        for key, value in self.items():
            if isinstance(value, torch.Tensor):
                self[key] = value.to(device)
        return self


def _special_properties(name: str) -> tuple[property, property]:
    """``<name>`` and ``<name>_id`` properties over ``self._special[name]``, both settable."""

    def set_token(self: PreTrainedTokenizerFast, value: Any) -> None:
        self._special[name] = None if value is None else str(value)

    def get_id(self: PreTrainedTokenizerFast) -> int | None:
        return None if self._special[name] is None else self.convert_tokens_to_ids(self._special[name])

    def set_id(self: PreTrainedTokenizerFast, value: int | None) -> None:
        self._special[name] = None if value is None else self._tokenizer.id_to_token(int(value))

    label = name.replace("_", " ")
    return (property(lambda self: self._special[name], set_token, doc=f"The {label} string, or None."),
            property(get_id, set_id, doc=f"The id of the {label}, or None."))


def _add_flag(attribute: str, doc: str) -> property:
    """A settable add_bos_token/add_eos_token flag; setting it rebuilds the post-processor."""

    def set_(self: PreTrainedTokenizerFast, value: bool) -> None:
        setattr(self, attribute, bool(value))
        self._explicit_bos_eos = True
        self._update_post_processor()

    return property(lambda self: getattr(self, attribute), set_, doc=doc)


def _read_tokenizer_file(path: str | os.PathLike) -> Tokenizer:
    """A ``tokenizer.json``, refused (:class:`ModelFileError`) when its merges use tokens outside its
    vocabulary or two tokens share an id."""
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a plain Exception: bad JSON, merges of unknown tokens
        raise ModelFileError(path, "the document", "a tokenizers JSON document whose merges use tokens of its "
                             "vocabulary", str(e)) from None
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    if len(set(vocab.values())) != len(vocab):
        tokens_of: dict[int, list[str]] = {}
        for token, i in vocab.items():
            tokens_of.setdefault(i, []).append(token)
        i, tokens = min((i, sorted(tokens)) for i, tokens in tokens_of.items() if len(tokens) > 1)
        raise ModelFileError(path, "model.vocab", "one token per id", f"id {i} for {' and '.join(map(repr, tokens))}")
    return tokenizer


class PreTrainedTokenizerFast:
    """A ``tokenizers.Tokenizer`` with transformers' encode/decode, padding and chat-template API.

    Usually made by :meth:`AutoTokenizer.from_pretrained`.

    Example:
        >>> tok = AutoTokenizer.from_pretrained("path/to/model")
        >>> tok.pad_token = tok.pad_token or tok.eos_token
        >>> tok.padding_side = "left"
        >>> batch = tok(["Hello", "A longer prompt"], padding=True, return_tensors="pt")
        >>> tok.batch_decode(batch.input_ids, skip_special_tokens=True)
        ['Hello', 'A longer prompt']
    """

    bos_token, bos_token_id = _special_properties("bos_token")
    eos_token, eos_token_id = _special_properties("eos_token")
    unk_token, unk_token_id = _special_properties("unk_token")
    sep_token, sep_token_id = _special_properties("sep_token")
    pad_token, pad_token_id = _special_properties("pad_token")
    cls_token, cls_token_id = _special_properties("cls_token")
    mask_token, mask_token_id = _special_properties("mask_token")
    add_bos_token = _add_flag("_add_bos_token", "Whether ``add_special_tokens=True`` prepends the BOS token.")
    add_eos_token = _add_flag("_add_eos_token", "Whether ``add_special_tokens=True`` appends the EOS token.")

    def __init__(self, tokenizer_object: Tokenizer | None = None, *, tokenizer_file: str | os.PathLike | None = None,
                 additional_special_tokens: list[str] | tuple[str, ...] = (),
                 chat_template: str | dict[str, str] | None = None,
                 padding_side: str = "right", truncation_side: str = "right",
                 model_max_length: int = VERY_LARGE_INTEGER, add_bos_token: bool | None = None,
                 add_eos_token: bool | None = None, name_or_path: str = "", **special_tokens: str | None):
        if (tokenizer_object is None) == (tokenizer_file is None):
            raise ValueError("pass exactly one of tokenizer_object (a tokenizers.Tokenizer) or tokenizer_file "
                             "(a path to tokenizer.json)")
        unknown = set(special_tokens) - set(SPECIAL_TOKEN_NAMES)
        if unknown:
            raise TypeError(f"unexpected arguments {sorted(unknown)}; special tokens are {SPECIAL_TOKEN_NAMES}")
        self._tokenizer = tokenizer_object if tokenizer_object is not None else _read_tokenizer_file(tokenizer_file)
        json_padding = self._tokenizer.padding
        self._tokenizer.no_padding()  # padding and truncation are applied per call
        self._tokenizer.no_truncation()
        if json_padding and special_tokens.get("pad_token") is None:
            special_tokens["pad_token"] = json_padding["pad_token"]
        self._special = {name: None if special_tokens.get(name) is None else str(special_tokens[name])
                         for name in SPECIAL_TOKEN_NAMES}
        self.additional_special_tokens = [str(token) for token in additional_special_tokens]
        self.chat_template = chat_template
        self.padding_side = padding_side
        self.truncation_side = truncation_side
        self.model_max_length = model_max_length
        self.name_or_path = name_or_path
        # Named special tokens missing from the added tokens become special added tokens, as in transformers.
        added = {token.content for token in self._tokenizer.get_added_tokens_decoder().values()}
        missing = [token for token in dict.fromkeys(self.all_special_tokens) if token not in added]
        self._tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in missing])
        # Explicit add_bos/add_eos flags (or no post-processor) replace tokenizer.json's post-processor.
        self._add_bos_token, self._add_eos_token = bool(add_bos_token), bool(add_eos_token)
        self._explicit_bos_eos = (add_bos_token is not None or add_eos_token is not None
                                  or self._tokenizer.post_processor is None)
        if self._explicit_bos_eos:
            self._update_post_processor()

    # -- special tokens -----------------------------------------------------------------------------
    def _update_post_processor(self) -> None:
        bos, eos = self.bos_token, self.eos_token
        add_bos, add_eos = self._add_bos_token and bos is not None, self._add_eos_token and eos is not None
        first = [f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos
        second = [f"{bos}:1"] * add_bos + ["$B:1"] + [f"{eos}:1"] * add_eos
        special = [(bos, self.bos_token_id)] * add_bos + [(eos, self.eos_token_id)] * add_eos
        self._tokenizer.post_processor = processors.TemplateProcessing(
            single=" ".join(first), pair=" ".join(first + second), special_tokens=special)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens that are set, e.g. ``{"bos_token": "<s>", ...}``."""
        return {name: token for name, token in self._special.items() if token is not None}

    @property
    def all_special_tokens(self) -> list[str]:
        """The named special tokens followed by the additional ones, without repeats."""
        return list(dict.fromkeys([*self.special_tokens_map.values(), *self.additional_special_tokens]))

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    # -- vocabulary ---------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Size of the base vocabulary, without added tokens."""
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def backend_tokenizer(self) -> Tokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tokenizer

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """Look tokens up; unknown ones map to ``unk_token_id`` (None without an unk token)."""
        if isinstance(tokens, str):
            index = self._tokenizer.token_to_id(tokens)
            if index is None and self.unk_token is not None:
                index = self._tokenizer.token_to_id(self.unk_token)
            return index
        return [self.convert_tokens_to_ids(token) for token in tokens]

    def convert_ids_to_tokens(self, ids: int | list[int] | torch.Tensor,
                              skip_special_tokens: bool = False) -> str | None | list[str | None]:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(int(index)) for index in ids if int(index) not in skip]

    # -- encoding -----------------------------------------------------------------------------------
    @property
    def padding_side(self) -> str:
        """``"right"`` or ``"left"`` (left is what batched generation needs)."""
        return self._padding_side

    @padding_side.setter
    def padding_side(self, value: str) -> None:
        if value not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {value!r}")
        self._padding_side = value

    def __call__(self, text: str | list[str], return_tensors: str | None = None,
                 padding: bool | str = False, truncation: bool = False, max_length: int | None = None,
                 add_special_tokens: bool = True) -> BatchEncoding:
        """Tokenize one text or a batch into ``input_ids`` and ``attention_mask``.

        ``padding``: False, True/"longest" or "max_length"; ``return_tensors``: None (lists) or "pt".
        """
        single = isinstance(text, str)
        if not single and not (isinstance(text, (list, tuple)) and all(isinstance(t, str) for t in text)):
            raise TypeError(f"text must be a string or a list of strings, got {type(text).__name__}")
        if not single and not text:
            raise ValueError("cannot tokenize an empty batch; pass at least one string")
        if return_tensors not in (None, "pt"):
            raise ValueError(f"return_tensors must be None or 'pt', got {return_tensors!r}")
        if padding not in (False, True, None, "longest", "max_length", "do_not_pad"):
            raise ValueError(f"padding must be False, True, 'longest' or 'max_length', got {padding!r}")
        if max_length is None and self.model_max_length < _LARGE_INTEGER:
            max_length = self.model_max_length
        if padding is True or padding == "longest" or (padding == "max_length" and max_length is not None):
            if self.pad_token_id is None:
                raise ValueError("asked to pad but the tokenizer has no pad token; set one first, e.g. "
                                 "`tokenizer.pad_token = tokenizer.eos_token`")
        if truncation and max_length is not None:
            self._tokenizer.enable_truncation(max_length, direction=self.truncation_side)
        try:
            encodings = self._tokenizer.encode_batch([text] if single else list(text),
                                                     add_special_tokens=add_special_tokens)
        finally:
            self._tokenizer.no_truncation()
        ids = [encoding.ids for encoding in encodings]
        masks = [[1] * len(row) for row in ids]
        target = None
        if padding is True or padding == "longest":
            target = max(map(len, ids), default=0)
        elif padding == "max_length":
            target = max_length
        if target is not None:
            pad_id = self.pad_token_id
            for i, row in enumerate(ids):
                extra = max(target - len(row), 0)
                if self.padding_side == "left":
                    ids[i], masks[i] = [pad_id] * extra + row, [0] * extra + masks[i]
                else:
                    ids[i], masks[i] = row + [pad_id] * extra, masks[i] + [0] * extra
        if return_tensors == "pt":
            lengths = sorted({len(row) for row in ids})
            if len(lengths) > 1:
                raise ValueError(f"cannot make a tensor from sequences of different lengths {lengths}; pass "
                                 "padding=True (and set `tokenizer.pad_token = tokenizer.eos_token` if the "
                                 "tokenizer has no pad token), or return_tensors=None for lists")
            return BatchEncoding(input_ids=torch.tensor(ids, dtype=torch.long).reshape(len(ids), -1),
                                 attention_mask=torch.tensor(masks, dtype=torch.long).reshape(len(ids), -1))
        if single:
            return BatchEncoding(input_ids=ids[0], attention_mask=masks[0])
        return BatchEncoding(input_ids=ids, attention_mask=masks)

    def encode(self, text: str, add_special_tokens: bool = True, return_tensors: str | None = None,
               truncation: bool = False, max_length: int | None = None) -> list[int] | torch.Tensor:
        """Token ids of one text: a list, or a ``[1, n]`` tensor with ``return_tensors="pt"``."""
        return self(text, return_tensors=return_tensors, truncation=truncation, max_length=max_length,
                    add_special_tokens=add_special_tokens)["input_ids"]

    # -- decoding -----------------------------------------------------------------------------------
    def decode(self, token_ids: int | list[int] | torch.Tensor, skip_special_tokens: bool = False) -> str | list[str]:
        """Text of a sequence of ids (a list or 1-D tensor); a 2-D input decodes as a batch."""
        ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids
        if isinstance(ids, int):
            ids = [ids]
        if ids and isinstance(ids[0], (list, tuple)):
            return self.batch_decode(ids, skip_special_tokens=skip_special_tokens)
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: list[list[int]] | torch.Tensor, skip_special_tokens: bool = False) -> list[str]:
        """Texts of a batch of sequences (a list of lists or a 2-D tensor)."""
        rows = sequences.tolist() if isinstance(sequences, torch.Tensor) else sequences
        return [self.decode(row, skip_special_tokens=skip_special_tokens) for row in rows]

    # -- chat templates -----------------------------------------------------------------------------
    def _select_chat_template(self, chat_template: str | None, tools: list | None) -> str:
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template in templates:
                return templates[chat_template]
            if chat_template is None:
                name = "tool_use" if tools and "tool_use" in templates else "default"
                if name not in templates:
                    raise ValueError(f"this tokenizer has chat templates {sorted(templates)} and none is 'default'; "
                                     "pass chat_template= with one of those names")
                return templates[name]
        template = chat_template or templates
        if not template:
            raise ValueError("this tokenizer has no chat template; pass chat_template= (a jinja template string) "
                             "or set `tokenizer.chat_template`")
        return template

    def apply_chat_template(self, conversation: list[dict] | list[list[dict]], add_generation_prompt: bool = False,
                            tokenize: bool = True, return_tensors: str | None = None, return_dict: bool = False,
                            padding: bool | str = False, truncation: bool = False, max_length: int | None = None,
                            chat_template: str | None = None, tools: list[dict] | None = None,
                            documents: list[dict] | None = None, **template_vars: Any):
        """Render a conversation (or a batch of them) with the chat template, optionally tokenized.

        Returns the text (``tokenize=False``), the ids, or a :class:`BatchEncoding` (``return_dict=True``).
        Extra keyword arguments are passed to the template as variables.

        Example:
            >>> messages = [{"role": "user", "content": "Hi!"}]
            >>> ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        """
        template = compile_chat_template(self._select_chat_template(chat_template, tools))
        if not conversation:
            raise ValueError("cannot apply a chat template to an empty conversation; pass at least one message")
        batched = isinstance(conversation[0], (list, tuple))
        variables = {**self.special_tokens_map, **template_vars}
        rendered = [
            render_chat_template(template, messages=[{k: v for k, v in message.items() if v is not None}
                                                     for message in chat],
                                 tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
                                 **variables)
            for chat in (conversation if batched else [conversation])
        ]
        text = rendered if batched else rendered[0]
        if not tokenize:
            return text
        out = self(text, return_tensors=return_tensors, padding=padding, truncation=truncation,
                   max_length=max_length, add_special_tokens=False)
        return out if return_dict else out["input_ids"]

    # -- saving -------------------------------------------------------------------------------------
    def save_pretrained(self, save_directory: str | os.PathLike) -> tuple[str, str]:
        """Write ``tokenizer.json`` and ``tokenizer_config.json``; both kvgen and transformers load the folder."""
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **self.special_tokens_map,
                                  "padding_side": self.padding_side, "truncation_side": self.truncation_side,
                                  "model_max_length": self.model_max_length, "clean_up_tokenization_spaces": False}
        if self.additional_special_tokens:
            config["additional_special_tokens"] = self.additional_special_tokens
        if self._explicit_bos_eos:
            config.update(add_bos_token=self.add_bos_token, add_eos_token=self.add_eos_token)
        if isinstance(self.chat_template, dict):
            config["chat_template"] = [{"name": k, "template": v} for k, v in self.chat_template.items()]
        elif self.chat_template:
            config["chat_template"] = self.chat_template
        self._tokenizer.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        return str(folder / "tokenizer_config.json"), str(folder / "tokenizer.json")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name_or_path={self.name_or_path!r}, vocab_size={self.vocab_size}, "
                f"padding_side={self.padding_side!r}, special_tokens={self.special_tokens_map})")


#: fill-in-the-middle tokens (prefix, suffix, middle) by family: Qwen2.5-Coder, StarCoder and its kin, Code Llama
FILL_IN_THE_MIDDLE = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>",
                      "<fim_middle>"), ("▁<PRE>", "▁<SUF>", "▁<MID>"), ("<PRE>", "<SUF>", "<MID>"))


def fill_in_the_middle_tokens(tokenizer: PreTrainedTokenizerFast) -> tuple[int, int, int] | None:
    """The ids of ``tokenizer``'s fill-in-the-middle tokens (prefix, suffix, middle), or None where it has none.
    A model fills in the middle from ``prefix_token + prefix + suffix_token + suffix + middle_token``.

    Example:
        >>> fill_in_the_middle_tokens(AutoTokenizer.from_pretrained("Qwen2.5-Coder.gguf"))  # doctest: +SKIP
        (151659, 151661, 151660)
    """
    vocab = tokenizer.get_vocab()
    for names in FILL_IN_THE_MIDDLE:
        if all(name in vocab for name in names):
            return tuple(vocab[name] for name in names)
    return None


# -- loading ----------------------------------------------------------------------------------------
def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _read_folder_config(folder: Path) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if (folder / name).is_file():
            config.update(json.loads((folder / name).read_text(encoding="utf-8")))
    template = config.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    elif (folder / "chat_template.json").is_file():
        template = json.loads((folder / "chat_template.json").read_text(encoding="utf-8"))["chat_template"]
    if isinstance(template, list):
        template = {entry["name"]: entry["template"] for entry in template}
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
    extra = extra.values() if isinstance(extra, dict) else extra
    kwargs = {name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
    kwargs.update(chat_template=template, additional_special_tokens=[_token_text(t) for t in extra])
    # add_bos_token/add_eos_token are ignored here as in transformers: tokenizer.json's post-processor decides.
    for key in ("padding_side", "truncation_side", "model_max_length"):
        if config.get(key) is not None:
            kwargs[key] = config[key]
    return kwargs


def _load_gguf(path: Path, **overrides: Any) -> PreTrainedTokenizerFast:
    """Build the tokenizer embedded in a GGUF file's metadata (no tensor data is read)."""
    backend, settings = read_gguf_vocabulary(path)
    return PreTrainedTokenizerFast(backend, **{**settings, "name_or_path": str(path), **overrides})


def _load_gguf_cached(path: Path, **overrides: Any) -> PreTrainedTokenizerFast:
    """:func:`_load_gguf`, built once per file and then read from kvgen's cache as ``tokenizer.json``."""
    import shutil
    import tempfile

    from kvgen.loading.gguf_index import cache_folder

    folder = cache_folder(path) / "tokenizer"
    if not (folder / "tokenizer.json").is_file():
        print(f"kvgen: building the tokenizer of {path.name} (once per file)", file=sys.stderr)
        tokenizer = _load_gguf(path)
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=folder.parent))
            tokenizer.save_pretrained(staging)
            try:
                staging.rename(folder)
            except OSError:  # another process finished first
                shutil.rmtree(staging, ignore_errors=True)
        except OSError:  # a read-only cache: build it every time
            return _load_gguf(path, **overrides)
    saved = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    flags = {key: saved[key] for key in ("add_bos_token", "add_eos_token") if key in saved}  # explicit in the GGUF
    return PreTrainedTokenizerFast(tokenizer_file=folder / "tokenizer.json", **{
        **_read_folder_config(folder), **flags, "name_or_path": str(path), **overrides})


class AutoTokenizer:
    """Entry point mirroring ``transformers.AutoTokenizer``.

    Example:
        >>> tok = AutoTokenizer.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")
        >>> tok = AutoTokenizer.from_pretrained("models/", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        >>> tok.decode(tok("Hello world").input_ids)
        'Hello world'
    """

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, gguf_file: str | None = None,
                        revision: str = "main", **kwargs: Any) -> PreTrainedTokenizerFast:
        """Load from a folder, a hub id, a folder plus ``gguf_file``, or a ``.gguf`` path.

        Keyword arguments such as ``padding_side="left"`` override the saved configuration.
        """
        overrides = {k: v for k, v in kwargs.items() if k not in _IGNORED_LOAD_KWARGS}
        path = Path(pretrained_model_name_or_path).expanduser()
        if gguf_file is None and path.suffix == ".gguf":
            if not path.is_file():
                raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
            return _load_gguf_cached(path, **overrides)
        folder = resolve_model_dir(pretrained_model_name_or_path, revision=revision)
        if gguf_file is not None:
            if not (folder / gguf_file).is_file():
                raise FileNotFoundError(f"GGUF file {gguf_file!r} not found in {str(folder)!r}; found "
                                        f"{sorted(p.name for p in folder.glob('*.gguf')) or 'no .gguf files'}")
            return _load_gguf_cached(folder / gguf_file, **overrides)
        if not (folder / "tokenizer.json").is_file():
            ggufs = sorted(p.name for p in folder.glob("*.gguf"))
            hint = f"; to use an embedded GGUF vocabulary pass gguf_file= one of {ggufs}" if ggufs else ""
            raise FileNotFoundError(f"no tokenizer.json in {str(folder)!r}{hint}")
        return PreTrainedTokenizerFast(tokenizer_file=folder / "tokenizer.json", name_or_path=str(folder),
                                       **{**_read_folder_config(folder), **overrides})
