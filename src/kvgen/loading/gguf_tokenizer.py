"""The vocabulary embedded in a GGUF file as a ``tokenizers`` tokenizer, built as transformers' GGUF converter
builds it (so that the ids match): ``tokenizer.ggml.model`` "gpt2" (byte-level BPE, split by
``tokenizer.ggml.pre``) or "llama" (SentencePiece-style BPE, Gemma's included).

Example:
    >>> backend, settings = read_gguf_vocabulary(Path("SmolLM2-135M-Instruct.Q4_1.gguf"))   # doctest: +SKIP
    >>> settings["eos_token"]                                                             # doctest: +SKIP
    '<|im_end|>'
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from kvgen.loading.consistency import check_config
from kvgen.loading.errors import ModelFileError
from kvgen.loading.gguf_file import TOKEN_ID_KEYS, read_gguf_header

# Pre-tokenizer splits by `tokenizer.ggml.pre`, as transformers' GGUF converter uses them;
# any other value (e.g. "smollm") keeps the plain GPT-2 byte-level split.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GGUF_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
}
# Architectures whose SentencePiece vocabularies transformers rebuilds differently (not supported here).
_UNSUPPORTED_SENTENCEPIECE_ARCHS = {"phi3"}
_GEMMA_ARCHS = {"gemma", "gemma2", "gemma3"}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary, best score first (transformers' generate_merges)."""
    merges = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def gguf_backend(kind: str, architecture: str, pre: str | None, tokens: list[str], merges: list[str] | None,
                  scores: list[float] | None, path: Path) -> Tokenizer:
    if kind == "gpt2":
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
                 for i, t in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges or []]
        backend = Tokenizer(models.BPE(vocab, pairs, dropout=None, continuing_subword_prefix="",
                                       end_of_word_suffix="", fuse_unk=False))
        split = _GGUF_SPLITS.get(pre)
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else (
            pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
        backend.decoder = decoders.ByteLevel()
        return backend
    if kind == "llama" and architecture in _GEMMA_ARCHS:
        return _gemma_backend(tokens)
    if kind == "llama" and architecture not in _UNSUPPORTED_SENTENCEPIECE_ARCHS:
        vocab = {t: i for i, t in enumerate(tokens)}
        if merges is not None:
            pairs = [tuple(m.split(" ", 1)) for m in merges]
        elif scores is not None:
            pairs = _merges_from_scores(vocab, dict(zip(tokens, scores)))
        else:
            raise ValueError(f"{path}: the SentencePiece vocabulary has neither merges nor scores to rebuild them")
        backend = Tokenizer(models.BPE(vocab, pairs, fuse_unk=True, byte_fallback=True, dropout=None))
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                             decoders.Strip(content=" ", left=1, right=0)])
        return backend
    raise ValueError(f"{path}: cannot build a tokenizer for tokenizer.ggml.model={kind!r} (architecture "
                     f"{architecture!r}); supported are 'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE, "
                     f"not {sorted(_UNSUPPORTED_SENTENCEPIECE_ARCHS)}). Use a folder with tokenizer.json instead.")


def _gemma_backend(tokens: list[str]) -> Tokenizer:
    """Gemma's SentencePiece BPE as transformers builds it from a GGUF (``GemmaTokenizer``).

    Tokens of two or more spaces are stored as real spaces and are respelled with "▁"; the
    file has no merges, and Gemma's scores do not follow its merge order, so merges are
    rebuilt best-first by the tokens' order in the file. No prefix space; spaces become "▁".
    """
    tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = _merges_from_scores(vocab, {t: -i for i, t in enumerate(tokens)})
    backend = Tokenizer(models.BPE(vocab, pairs, unk_token="<unk>", fuse_unk=True, byte_fallback=True, dropout=None))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def _check_vocabulary(path: Path, metadata: dict[str, Any]) -> None:
    """Refuse a vocabulary whose parts disagree: a token twice, per-token lists of another length, special
    token ids outside it, merges that are not two tokens."""
    tokens = metadata["tokenizer.ggml.tokens"]
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ModelFileError(path, "key tokenizer.ggml.tokens", "an array of strings", type(tokens).__name__)
    if len(set(tokens)) != len(tokens):
        seen: dict[str, int] = {}
        for i, token in enumerate(tokens):
            if token in seen:
                raise ModelFileError(path, f"key tokenizer.ggml.tokens[{i}]", "each token once",
                                     f"{token!r}, token {seen[token]} again")
            seen[token] = i
    for key in ("token_type", "scores"):
        values = metadata.get(f"tokenizer.ggml.{key}")
        if values is not None and (not isinstance(values, list) or len(values) != len(tokens)):
            raise ModelFileError(path, f"key tokenizer.ggml.{key}", f"one entry per token ({len(tokens)})",
                                 f"{len(values) if isinstance(values, list) else type(values).__name__}")
    names = {hf: f"tokenizer.ggml.{key}" for key, hf in TOKEN_ID_KEYS.items()}
    check_config({hf: metadata.get(key) for hf, key in names.items()}, path, names, vocabulary=len(tokens))
    merges = metadata.get("tokenizer.ggml.merges")
    for i, merge in enumerate(merges or []):
        if not isinstance(merge, str) or " " not in merge.strip(" "):
            raise ModelFileError(path, f"key tokenizer.ggml.merges[{i}]", "two tokens separated by a space",
                                 repr(merge))


def read_gguf_vocabulary(path: Path) -> tuple[Tokenizer, dict[str, Any]]:
    """(the tokenizer, its special tokens, chat template and BOS/EOS flags) of the vocabulary in a GGUF's
    metadata (no tensor data is read); a ``ValueError`` for a file without one or of a kind not supported."""
    metadata = read_gguf_header(path).metadata

    def field(key: str, default: Any = None) -> Any:
        return metadata.get(key, default)

    tokens = field("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{path} has no embedded tokenizer (no tokenizer.ggml.tokens); load the tokenizer "
                         "from a folder with tokenizer.json instead")
    kind, types = field("tokenizer.ggml.model"), field("tokenizer.ggml.token_type", [])
    _check_vocabulary(path, metadata)
    try:
        backend = gguf_backend(kind, field("general.architecture"), field("tokenizer.ggml.pre"), tokens,
                               field("tokenizer.ggml.merges"), field("tokenizer.ggml.scores"), path)
    except ValueError:
        raise
    except Exception as e:  # tokenizers' own check: a merge of tokens outside the vocabulary
        raise ModelFileError(path, "key tokenizer.ggml.merges", "merges of tokens in tokenizer.ggml.tokens",
                             str(e)) from None
    # Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain added tokens.
    # In a byte-level vocabulary a "control" token outside the byte alphabet is a mislabel and is skipped.
    alphabet = set(_bytes_to_unicode().values()) if kind == "gpt2" else None
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types)
                                if ty == 3 and (alphabet is None or set(t) <= alphabet)])
    vocab = backend.get_vocab()
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types)
                        if ty == 4 and t in vocab])
    ids = {name: field(f"tokenizer.ggml.{key}") for name, key in (
        ("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))}
    kwargs: dict[str, Any] = {name: None if i is None else tokens[i] for name, i in ids.items()}
    kwargs.update(chat_template=field("tokenizer.chat_template"),
                  add_bos_token=field("tokenizer.ggml.add_bos_token", True if kind == "llama" else None),
                  add_eos_token=field("tokenizer.ggml.add_eos_token"))
    return backend, kwargs
