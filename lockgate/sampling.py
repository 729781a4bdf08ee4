"""SamplingParams: what a request asks of the sampler and the stop logic.

Owns validation of every per-request generation knob. Construction fails with a
``ValueError`` naming the field and the limit it broke, so the server can turn it into a
4xx verbatim. Instances are frozen; ``temperature == 0`` means greedy. vLLM's forms are taken
as they are written for vLLM: ``stop`` a string or a list (held as a tuple), ``n`` outputs per
prompt (``per_choice_params`` gives each its params: choice i is seeded ``seed + i``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field


def is_text(s: str) -> bool:
    """True if ``s`` is valid Unicode text (encodable as UTF-8: no lone surrogates)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


MAX_LOGPROBS = 20
MAX_N = 128  # most outputs one prompt may ask for (vLLM's n)
_U64 = 2**64
MAX_TOKEN_ID = 2**31  # no vocabulary is larger; ids travel as int32/int64 tensors
MAX_GRAMMAR_CHARS = 256 * 1024  # a JSON schema, regex or grammar text longer than this is refused
STRUCTURED_KINDS = ("json", "regex", "choice", "lark", "llguidance")
MAX_COMPILED_GRAMMAR_CHARS = 16 * MAX_GRAMMAR_CHARS  # an ``llguidance`` text (made from a checked constraint)


@dataclass(frozen=True)
class StructuredOutput:
    """What a constrained request's output must match (the grammar package compiles it).

    ``kind``: ``json`` (``value`` is a JSON schema as JSON text; ``{"type": "object"}`` for
    OpenAI's ``json_object``), ``regex`` (the whole output matches the regular expression),
    ``choice`` (``value`` is a JSON list of strings: the output is exactly one of them) or
    ``lark`` (a Lark grammar, llguidance's dialect; GBNF is converted to it on the way in) or
    ``llguidance`` (``value`` is llguidance's own grammar text, what ``grammar.grammar_text`` makes of
    one of the others: the server's API process checks a client's constraint in its grammar sandbox
    and sends the scheduler this form, so the scheduler never parses client text)."""

    kind: str
    value: str

    @classmethod
    def json(cls, schema: dict[str, object] | str) -> StructuredOutput:
        """Output matching a JSON schema (an object, or its JSON text)."""
        import json

        return cls("json", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str]) -> StructuredOutput:
        import json

        return cls("choice", json.dumps(list(options)))

    @classmethod
    def grammar(cls, text: str) -> StructuredOutput:
        """A Lark grammar (llguidance's dialect); GBNF / EBNF text is converted."""
        return cls("lark", text)

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")
        if not isinstance(self.value, str) or not self.value:
            raise ValueError(f"the {self.kind} constraint must be a non-empty string")
        limit = MAX_COMPILED_GRAMMAR_CHARS if self.kind == "llguidance" else MAX_GRAMMAR_CHARS
        if len(self.value) > limit:
            raise ValueError(f"the {self.kind} constraint is {len(self.value)} characters long; at most "
                             f"{limit} are accepted")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k cut
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF style, over prompt + output tokens
    frequency_penalty: float = 0.0  # OpenAI style, over output tokens
    presence_penalty: float = 0.0  # OpenAI style, over output tokens
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings, matched on detokenized text (a str or list is taken too)
    stop_token_ids: tuple[int, ...] = ()  # (a list is taken too)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: none; 0: chosen token only; N: chosen + top N
    skip_special_tokens: bool = True
    structured: StructuredOutput | None = None  # constrained decoding: the output matches this
    lora: str | None = None  # the LoRA adapter (its name) to run under; None: the base model
    n: int = 1  # outputs per prompt (offline ``LLM``; the HTTP APIs read their own ``n``)
    extra: dict[str, object] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        # vLLM's forms: ``stop="x"`` or a list, ``stop_token_ids`` a list; held as tuples (hashable, frozen)
        stop: object = self.stop
        if isinstance(stop, str):
            object.__setattr__(self, "stop", (stop,))
        elif isinstance(stop, list) or stop is None:
            object.__setattr__(self, "stop", tuple(stop or ()))
        ids: object = self.stop_token_ids
        if isinstance(ids, list) or ids is None:
            object.__setattr__(self, "stop_token_ids", tuple(ids or ()))
        self._check()

    def _check(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

        need(is_int(self.max_tokens) and self.max_tokens >= 1, f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        need(is_num(self.temperature) and 0.0 <= self.temperature <= 100.0, f"temperature must be in [0, 100], got {self.temperature!r}")
        need(is_num(self.top_p) and 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p!r}")
        need(is_int(self.top_k) and self.top_k >= -1, f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        need(is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p!r}")
        need(is_num(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
             f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        need(is_num(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        need(is_num(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        need(self.seed is None or (is_int(self.seed) and -(2**63) <= self.seed < 2**64),
             f"seed must be an integer, got {self.seed!r}")
        need(isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop),
             "stop must be a string or a list of non-empty strings")
        need(is_int(self.n) and 1 <= self.n <= MAX_N, f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        need(len(self.stop) <= 16, f"stop takes at most 16 strings, got {len(self.stop)}")
        need(all(is_text(s) for s in self.stop),
             "stop strings must be valid Unicode text (no lone surrogates)")
        need(isinstance(self.stop_token_ids, tuple)
             and all(is_int(t) and 0 <= t < MAX_TOKEN_ID for t in self.stop_token_ids),
             f"stop_token_ids must be integers in [0, {MAX_TOKEN_ID}), got {list(self.stop_token_ids)!r:.80}")
        need(is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        need(self.lora is None or (isinstance(self.lora, str) and bool(self.lora) and is_text(self.lora)),
             f"lora must be an adapter's name, got {self.lora!r}")
        need(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def per_choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """Params for choices 0..n-1 of one prompt: choice i gets ``seed + i`` (wrapped mod 2**64).

    Unseeded params are shared as is. Numbering is per prompt, so a prompt gives the same
    choices alone or inside a batch prompt.
    """
    if params.seed is None:
        return [params] * n
    seeds = [params.seed + i if params.seed + i < _U64 else params.seed + i - _U64 for i in range(n)]
    return [dataclasses.replace(params, seed=s) for s in seeds]
