"""Structured outputs: which tokens keep a reply valid JSON for a schema, from llguidance (the grammar engine
llama.cpp's server and vLLM use; ``pip install kvgen[serve]``).

A request's ``response_format`` becomes a grammar (:func:`response_grammar`); each of its sequences gets its
own matcher (:meth:`Grammars.matcher`), which follows the tokens chosen. Before each step the runner starts
the masks of the step's constrained sequences (:class:`Masks`: llguidance's threads, without the GIL) and
runs the model meanwhile; then every token a mask refuses gets a logit of -inf before the choice
(:func:`mask_refused_`).

Example:
    >>> grammar = response_grammar({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}})
    >>> grammars = Grammars(tokenizer, vocab_size=49152, eos_token_ids=[2])   # doctest: +SKIP
    >>> matcher = grammars.matcher(grammar)                                   # doctest: +SKIP
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from kvgen.kernels import kernels_available

#: JSON as ``json.dumps`` writes it (", " and ": ", no other whitespace): a reply cannot run on in blank space
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A ``response_format`` that names no valid grammar (an unknown type, a schema llguidance cannot compile)."""


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise GrammarError("structured outputs need llguidance: pip install 'kvgen[serve]'") from None
    return llguidance


def response_grammar(response_format: dict | None) -> str | None:
    """The llguidance grammar of an OpenAI ``response_format``: ``{"type": "text"}`` (or None) none,
    ``{"type": "json_object"}`` any JSON object, ``{"type": "json_schema", "json_schema": {"name", "schema",
    "strict"}}`` JSON valid against ``schema`` (always strictly). Raises :class:`GrammarError` saying what is wrong."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise GrammarError('json_schema must be {"name": ..., "schema": {...}}, the schema a JSON object')
        schema = spec.get("schema", {})
    else:
        raise GrammarError(f"response_format type must be text, json_object or json_schema, not {kind!r}")
    return schema_grammar(schema)


def schema_grammar(schema: dict) -> str:
    """The llguidance grammar of JSON valid against ``schema``; :class:`GrammarError` where it cannot compile."""
    llguidance = _llguidance()
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_STYLE)
    except ValueError as error:
        raise GrammarError(f"the JSON schema cannot be compiled: {error}") from None
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise GrammarError(f"the JSON schema cannot be compiled: {problem}")
    return grammar


class Grammars:
    """A tokenizer's vocabulary as llguidance reads it (built once: ~0.4 s for 49k tokens), and matchers over it.

    ``vocab_size``: the model's logits (which may hold more rows than the tokenizer has tokens);
    ``eos_token_ids``: the tokens that end a reply, the only ones allowed once the grammar is complete.
    The last :attr:`KEPT` grammars are kept compiled: a request with one of them (a server's clients send the
    same schemas again and again; ``n`` > 1 asks for several at once) gets a copy of a matcher at its start.
    """

    KEPT = 64

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        llguidance = _llguidance()
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend_tokenizer.to_str(),
                                                n_vocab=max(vocab_size, len(tokenizer)), eos_token=eos_token_ids)
        self.executor = llguidance.LLExecutor()
        # one thread that outlives the steps: starting one per step made the engine wait ~1 ms for the GIL
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgen-grammar-masks")
        self._compiled: OrderedDict[str, object] = OrderedDict()  # grammar -> a matcher at its start, never fed
        self._lock = threading.Lock()  # requests arrive on the server's threads

    def matcher(self, grammar: str):
        """A fresh ``LLMatcher`` of ``grammar`` (at the start of a reply); :class:`GrammarError` if it fails.
        A grammar seen lately is copied, not compiled again (16 matchers of a JSON schema over Qwen2.5-Coder's
        vocabulary: ~11 ms compiled, ~0.2 ms copied)."""
        with self._lock:
            start = self._compiled.get(grammar)
            if start is not None:
                self._compiled.move_to_end(grammar)
                return start.deep_copy()
        start = _llguidance().LLMatcher(self.tokenizer, grammar, log_level=0)
        if start.is_error():
            raise GrammarError(f"the grammar cannot be used: {start.get_error()}")
        with self._lock:
            self._compiled[grammar] = start
            while len(self._compiled) > self.KEPT:
                self._compiled.popitem(last=False)
        return start.deep_copy()


class Masks:
    """The tokens several matchers allow at their next step, computed in the background (:meth:`start`) while the
    caller runs the model, then read as llguidance's bitmask (:meth:`wait`) that :func:`mask_refused_` applies."""

    def __init__(self, grammars: Grammars, matchers: list):
        self.grammars, self.matchers = grammars, matchers
        self.bits = torch.zeros(len(matchers), -(-grammars.tokenizer.vocab_size // 32), dtype=torch.int32)  # (m, words)
        self.done: Future | None = None

    def start(self) -> Masks:
        self.done = self.grammars.thread.submit(
            self.grammars.executor.unsafe_compute_mask_ptr, [(m, i) for i, m in enumerate(self.matchers)],
            self.bits.data_ptr(), self.bits.shape[1] * 4, len(self.matchers))
        return self

    def wait(self, ends: list[list[int]]) -> torch.Tensor:
        """(matchers, words) int32: bit ``t % 32`` of word ``t // 32`` set where token ``t`` is allowed. A matcher
        that allows nothing (its reply is complete) gets the tokens ``ends[i]`` that end its reply."""
        self.done.result()
        words = self.bits.numpy().view(np.uint32)  # (m, words), the same memory
        for i in np.flatnonzero(~words.any(axis=1)):
            for token in ends[i]:
                words[i, token // 32] |= np.uint32(1 << (token % 32))
        return self.bits


def mask_refused_(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Set to -inf, in place, the logits (V,) float32 of every token whose bit is 0 in ``allowed`` (words,) int32
    (a row of :meth:`Masks.wait`); returns ``logits``. kvgen's kernel reads the bits as they are: 16 rows of
    Qwen2.5-Coder's 151k tokens take ~2.5 ms a step, Python included, where unpacking the bits and torch's
    ``masked_fill_`` over the gathered rows took ~18 ms a step over Gemma 3's 262k."""
    if logits.device.type == "cpu" and kernels_available():
        torch.ops.kvgen.mask_refused_(logits, allowed)
        return logits
    # bit j of word w is token 32 w + j: little-endian words, each byte's bits from the lowest
    refused = np.unpackbits((~allowed).numpy().view(np.uint8), bitorder="little")[:logits.numel()]  # (V,) 0 / 1
    return logits.masked_fill_(torch.from_numpy(refused).view(torch.bool).to(logits.device), float("-inf"))


class GrammarLogitsProcessor:
    """A logits processor ``(input_ids, scores) -> scores`` for ``generate()`` (kvgen's or transformers') that holds
    every row's new tokens to an llguidance ``grammar``: the first call takes the rows' length as the prompt's, each
    call feeds each row's matcher the tokens chosen since (rolled back where beam search reordered rows) and sets
    every token it refuses to -inf. A finished reply allows only ``eos_token_id`` (default: the tokenizer's).

    Example:
        >>> processor = GrammarLogitsProcessor(response_grammar({"type": "json_object"}), tokenizer)  # doctest: +SKIP
        >>> model.generate(**inputs, logits_processor=[processor])                                    # doctest: +SKIP
    """

    def __init__(self, grammar: str, tokenizer, eos_token_id: int | list[int] | None = None):
        eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        self.ends = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.grammar, self.tokenizer = grammar, tokenizer
        self.grammars: Grammars | None = None
        self.prompt_length = 0
        self.rows: list[tuple[object, list[int]]] = []  # per row: its matcher and the tokens it was fed

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.grammars is None:  # the logits' width: the model may have more rows than the tokenizer tokens
            self.grammars = Grammars(self.tokenizer, scores.shape[-1], self.ends)
            self.prompt_length = input_ids.shape[1]
        if len(self.rows) != input_ids.shape[0]:
            self.rows = [(self.grammars.matcher(self.grammar), []) for _ in range(input_ids.shape[0])]
        live = [i for i, row in enumerate(input_ids[:, self.prompt_length:].tolist()) if self._follow(i, row)]
        if not live:
            return scores
        masks = Masks(self.grammars, [self.rows[i][0] for i in live]).start()
        allowed = masks.wait([self.ends] * len(live))  # (live rows, words)
        scores = scores.float().clone()  # (B, V): the caller's raw logits stay as they are
        for row, i in enumerate(live):
            mask_refused_(scores[i], allowed[row])
        return scores

    def _follow(self, i: int, tokens: list[int]) -> bool:
        """Bring row ``i``'s matcher to ``tokens``; False where the grammar refuses them (a row that ended and is
        padded), which then goes unconstrained."""
        matcher, fed = self.rows[i]
        common = next((n for n, (a, b) in enumerate(zip(fed, tokens)) if a != b), min(len(fed), len(tokens)))
        if common < len(fed) and not matcher.rollback(len(fed) - common):
            matcher, common = self.grammars.matcher(self.grammar), 0
        self.rows[i] = (matcher, tokens)
        return not matcher.is_error() and matcher.consume_tokens(tokens[common:]) and not matcher.is_error()


class JsonSchemaLogitsProcessor(GrammarLogitsProcessor):
    """A logits processor that holds ``generate()``'s replies to JSON valid against ``schema`` (a JSON schema dict;
    ``{"type": "object"}`` for any object), written as ``json.dumps`` writes it; :class:`GrammarError` where
    llguidance cannot compile the schema. kvgen's ``generate(response_format=..., tokenizer=...)`` builds one.

    Example:
        >>> schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
        >>> processor = JsonSchemaLogitsProcessor(schema, tokenizer)                    # doctest: +SKIP
        >>> out = model.generate(**inputs, logits_processor=[processor])               # doctest: +SKIP
    """

    def __init__(self, schema: dict, tokenizer, eos_token_id: int | list[int] | None = None):
        super().__init__(schema_grammar(schema), tokenizer, eos_token_id)
