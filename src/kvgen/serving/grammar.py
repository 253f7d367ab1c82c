"""Structured outputs: which tokens keep a reply valid JSON for a schema, from llguidance (the grammar engine
llama.cpp's server and vLLM use; ``pip install kvgen[serve]``).

A request's ``response_format`` becomes a grammar (:func:`response_grammar`); each of its sequences gets its
own matcher (:meth:`Grammars.matcher`), which follows the tokens chosen. Before each step the runner starts
the masks of the step's constrained sequences (:class:`Masks`: llguidance's threads, without the GIL) and
runs the model meanwhile; then every token a mask refuses gets a logit of -inf before the choice.

Example:
    >>> grammar = response_grammar({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}})
    >>> grammars = Grammars(tokenizer, vocab_size=49152, eos_token_ids=[2])   # doctest: +SKIP
    >>> matcher = grammars.matcher(grammar)                                   # doctest: +SKIP
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

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
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        llguidance = _llguidance()
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend_tokenizer.to_str(),
                                                n_vocab=max(vocab_size, len(tokenizer)), eos_token=eos_token_ids)
        self.executor = llguidance.LLExecutor()
        # one thread that outlives the steps: starting one per step made the engine wait ~1 ms for the GIL
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgen-grammar-masks")

    def matcher(self, grammar: str):
        """A fresh ``LLMatcher`` of ``grammar`` (at the start of a reply); :class:`GrammarError` if it fails."""
        matcher = _llguidance().LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the grammar cannot be used: {matcher.get_error()}")
        return matcher


class Masks:
    """The tokens several matchers allow at their next step, computed in the background (:meth:`start`) while the
    caller runs the model, then read as a bool (matchers, vocab_size) tensor of the refused ones (:meth:`wait`)."""

    def __init__(self, grammars: Grammars, matchers: list):
        self.grammars, self.matchers = grammars, matchers
        self.bits = torch.zeros(len(matchers), -(-grammars.tokenizer.vocab_size // 32), dtype=torch.int32)  # (m, words)
        self.done: Future | None = None

    def start(self) -> Masks:
        self.done = self.grammars.thread.submit(
            self.grammars.executor.unsafe_compute_mask_ptr, [(m, i) for i, m in enumerate(self.matchers)],
            self.bits.data_ptr(), self.bits.shape[1] * 4, len(self.matchers))
        return self

    def wait(self) -> torch.Tensor:
        """(matchers, vocab_size) bool: True where the token is refused."""
        self.done.result()
        # bit j of word w is token 32 w + j: little-endian words, each byte's bits from the lowest
        refused = np.unpackbits((~self.bits).numpy().view(np.uint8), axis=1, bitorder="little")  # (m, 32 words)
        return torch.from_numpy(refused[:, :self.grammars.vocab_size]).view(torch.bool)  # (0 / 1 bytes as bool)
