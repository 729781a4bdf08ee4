"""Constrained decoding: a request's ``StructuredOutput`` -> a grammar -> an allowed-token bitmask
per sampled row, advanced with every accepted token. Built on llguidance (Earley parser + lazy
lexer over the tokenizer's token trie).

Why llguidance and not xgrammar (``benchmarks/grammar_engines.py``, one run on the default
model's 49,152-token vocabulary, 2 cores; docs/structured_output.md): both fill a mask in a few
microseconds at the median (2-16 us; p99 50-130 us) and advance in 1-2 us, far below a 10-200 ms
step, so the step cost does not decide. Compile time and footprint do: llguidance compiles lazily
(1.3-12 ms for every grammar measured, a nested schema with bounded arrays included; xgrammar 312
ms on that one), ships as one dependency-free wheel that needs no torch (so the API process can
validate a grammar before queueing it without loading torch), while xgrammar pulls in triton and
apache-tvm-ffi; and llguidance can check speculative guesses (``validate_tokens``) and roll back.

Owns:

* ``grammar_text``: ``StructuredOutput`` -> llguidance grammar text, checked; a bad schema, regex or
  grammar raises ``GrammarError`` carrying llguidance's message. In the server, client text is parsed
  and compiled only in the grammar sandbox's worker processes (``grammar.sandbox``,
  ``grammar.worker``), which hand the scheduler the ``llguidance`` text to build its matcher from.
* ``GrammarCompiler``: one per process. Builds the llguidance tokenizer from the model's tokenizer
  (once, lazily: ~0.5 s for a 49k vocabulary) and caches compiled matchers by grammar text (LRU,
  ``cache_size``); ``matcher`` hands out a fresh copy per request.
* ``RequestGrammar``: one request's grammar state: ``fill`` writes the allowed tokens after some
  not-yet-accepted guesses into a bitmask row, ``valid_prefix`` says how many guesses the grammar
  allows, ``accept`` advances it, ``done`` says it can take nothing but EOS.

Invariants: a bitmask row is int32 ``[W]``, ``W = ceil(V / 32)``, ``V`` the model's logits width;
token ``t`` is allowed iff bit ``t % 32`` of word ``t // 32`` is set; ids the tokenizer does not
have (padding up to ``V``) are never allowed. A matcher only consumes tokens its own masks allowed or
that ``valid_prefix`` cleared, so it never enters an error state in normal operation; if it does,
``accept`` returns False and the caller ends the request. JSON schemas compile with ``", "`` and
``": "`` separators and no free whitespace (a small model given free whitespace can pad forever);
a schema's own ``x-guidance`` options override that.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from lockgate import jsonsafe
from lockgate.sampling import StructuredOutput

if TYPE_CHECKING:
    import llguidance

    from lockgate.tokenizer.tokenizer import Tokenizer

__all__ = ["GrammarBusy", "GrammarCompiler", "GrammarError", "RequestGrammar", "grammar_text", "mask_words"]

log = logging.getLogger("lockgate.grammar")

JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A schema, regex or grammar llguidance cannot use; the message is llguidance's, prefixed with what it was."""


class GrammarBusy(RuntimeError):
    """Too many constraints are waiting to be compiled (the grammar sandbox's queue is full)."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def mask_words(vocab: int) -> int:
    return (vocab + 31) // 32


def grammar_text(so: StructuredOutput) -> str:
    """llguidance grammar text for ``so``; ``GrammarError`` if it is not valid (checked without a tokenizer).

    Parses client text (JSON, Lark, GBNF): in the server it runs in the grammar sandbox's worker
    processes only (``grammar.sandbox``), never in the API or the scheduler process. An
    ``llguidance`` constraint is such text already and is returned as it is."""
    import llguidance

    if so.kind == "llguidance":
        return so.value
    what = {"json": "JSON schema", "regex": "regex", "choice": "choice list", "lark": "grammar"}[so.kind]
    try:
        if so.kind == "json":
            schema = jsonsafe.loads(so.value, "the schema")
            if not isinstance(schema, dict | bool):
                raise GrammarError(f"invalid JSON schema: must be an object, got {type(schema).__name__}")
            text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)  # type: ignore[arg-type]
        elif so.kind == "regex":
            text = llguidance.LLMatcher.grammar_from_regex(so.value)
        elif so.kind == "choice":
            choices = jsonsafe.loads(so.value, "the list")
            if (not isinstance(choices, list) or not choices
                    or not all(isinstance(c, str) and c for c in choices)):
                raise GrammarError("invalid choice list: must be a non-empty list of non-empty strings")
            # One lark rule whose alternatives are the choices as JSON string literals (lark's escapes).
            text = llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
        else:
            from llguidance.gbnf_to_lark import any_to_lark

            try:
                lark = any_to_lark(so.value)
            except Exception as e:  # noqa: BLE001  (the converter's errors have several types)
                raise GrammarError(f"invalid grammar: {e}") from None
            text = llguidance.LLMatcher.grammar_from_lark(lark)
    except ValueError as e:
        if isinstance(e, GrammarError):
            raise
        raise GrammarError(f"invalid {what}: {e}") from None
    except RecursionError:
        raise GrammarError(f"invalid {what}: nested too deeply") from None
    err = llguidance.LLMatcher.validate_grammar(text)
    if err and not err.startswith("WARNING"):
        raise GrammarError(f"invalid {what}: {err}")
    return text


def llguidance_tokenizer(tokenizer: Tokenizer, vocab: int, eos_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """The llguidance view of a lockgate tokenizer, padded to the model's logits width ``vocab``."""
    import llguidance

    from lockgate.tokenizer.tokenizer import FastTokenizer, HFTokenizer, SimTokenizer

    eos = list(eos_ids) or list(tokenizer.eos_token_ids)
    if isinstance(tokenizer, FastTokenizer):
        return llguidance.LLTokenizer(tokenizer.tok.to_str(), n_vocab=vocab, eos_token=eos)
    if isinstance(tokenizer, HFTokenizer):
        import llguidance.hf

        return llguidance.hf.from_tokenizer(tokenizer.tok, n_vocab=vocab, eos_token=eos)  # type: ignore[arg-type]
    if isinstance(tokenizer, SimTokenizer):
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_SimView(tokenizer, vocab, eos)), n_vocab=vocab)
    raise TypeError(f"no llguidance tokenizer for {type(tokenizer).__name__}")


class _SimView:
    """The sim tokenizer as llguidance's ``TokenizerWrapper`` expects it: each id's bytes."""

    def __init__(self, tok: Any, vocab: int, eos: list[int]) -> None:  # tok: a SimTokenizer
        off = tok.OFFSET
        self.eos_token_id = eos[0]
        self.bos_token_id = 1
        self.special_token_ids = list(range(off))
        names = {0: b"<pad>", 1: b"<bos>", 2: b"<eos>"}
        # ids off .. off + 255 are the bytes; the sim decodes ids above them as letters (a-z)
        self.tokens = [names.get(i, b"<%d>" % i) if i < off else bytes([i - off]) if i < off + 256
                       else bytes([97 + (i - off) % 26]) for i in range(vocab)]
        self._tok = tok

    def __call__(self, s: bytes) -> list[int]:
        return [b + self._tok.OFFSET for b in s]


class RequestGrammar:
    """One request's grammar state (an llguidance matcher of its own)."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int) -> None:
        self.m = matcher
        self.words = words  # bitmask row length (int32 words)

    def fill(self, row: np.ndarray, guesses: Sequence[int] = ()) -> None:
        """Write into ``row`` (int32 [W], C-contiguous) the tokens allowed after the accepted
        tokens and then ``guesses`` (which ``valid_prefix`` cleared); the state is left as it was."""
        m = self.m
        if guesses and not m.consume_tokens(list(guesses)):
            raise RuntimeError(f"grammar refused guesses it had cleared: {m.get_error()}")
        m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if guesses:
            m.rollback(len(guesses))

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (from the front) the grammar would accept next."""
        return int(self.m.validate_tokens(list(tokens))) if tokens else 0

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar refused it (the matcher is then broken)."""
        return bool(self.m.consume_token(token))

    @property
    def done(self) -> bool:
        """Nothing but the end can follow (the output matched the whole grammar)."""
        return bool(self.m.is_stopped())

    @property
    def error(self) -> str:
        return str(self.m.get_error()) if self.m.is_error() else ""


class GrammarCompiler:
    """Compiles ``StructuredOutput``s for one model's tokenizer and caches the result by grammar text."""

    def __init__(self, make_tokenizer: Callable[[], Tokenizer], vocab: int, eos_ids: Sequence[int] = (),
                 cache_size: int = 256) -> None:
        self._make_tokenizer = make_tokenizer
        self.vocab = vocab
        self.words = mask_words(vocab)
        self._eos = tuple(eos_ids)
        self._lltok: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # compiles run on a side thread (engine.grammar_wait, grammar.worker)

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._lltok is None:
                try:
                    self._lltok = llguidance_tokenizer(self._make_tokenizer(), self.vocab, self._eos)
                except (TypeError, ValueError) as e:
                    raise GrammarError(f"constrained decoding is not available for this model's tokenizer: {e}") from None
            return self._lltok

    def prepare(self) -> None:
        """Build the llguidance tokenizer now (~0.5 s for a 49k vocabulary) rather than on the first
        constrained request; safe to call from another thread."""
        self._tokenizer()

    def compile(self, so: StructuredOutput) -> llguidance.LLMatcher:
        """The pristine compiled matcher for ``so`` (cached); ``GrammarError`` if it cannot be built."""
        return self._compile(so)[1]

    def check(self, so: StructuredOutput) -> str:
        """Compile ``so`` as ``compile`` does and return its llguidance text (the ``llguidance``
        constraint the grammar sandbox hands back); ``GrammarError`` if it cannot be built."""
        return self._compile(so)[0]

    def cached(self, so: StructuredOutput) -> bool:
        """Whether ``so`` (an ``llguidance`` constraint) compiled here before and is still cached."""
        with self._lock:
            return so.kind == "llguidance" and so.value in self._cache

    def _compile(self, so: StructuredOutput) -> tuple[str, llguidance.LLMatcher]:
        import llguidance

        text = grammar_text(so)
        with self._lock:
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                return text, hit
        matcher = llguidance.LLMatcher(self._tokenizer(), text, log_level=0,
                                       limits=llguidance.LLParserLimits(verbose_errors=False))
        if matcher.is_error():
            raise GrammarError(f"invalid {so.kind} constraint: {matcher.get_error()}")
        # Compute the first mask now: the lexer's start state is built lazily, and a grammar too
        # big for the parser's limits fails here, before any request is queued with it.
        probe = np.zeros(self.words, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(probe.ctypes.data, probe.nbytes)
        if matcher.is_error():
            raise GrammarError(f"invalid {so.kind} constraint: {matcher.get_error()}")
        if not probe.any():
            raise GrammarError(f"the {so.kind} constraint allows no token of this model's vocabulary")
        with self._lock:
            self._cache[text] = matcher
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return text, matcher

    def matcher(self, so: StructuredOutput) -> RequestGrammar:
        """A fresh grammar state for one request."""
        return RequestGrammar(self.compile(so).deep_copy(), self.words)
