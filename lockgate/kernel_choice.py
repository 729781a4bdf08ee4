"""Which kernel serves a matmul: the kernel choice as one typed object, torch-free.

Owns ``FORM_NAMES`` (every form a projection's weight can be multiplied in, most exact first;
the forms themselves are ``lockgate.layers.forms``), ``FormChoice`` (row ranges and the form of
each), ``PromptForm`` (the one form serving a projection's prompt rows), ``serving_form`` (the
one function that says which form serves a call: ``Linear`` runs what it says, the whole-step
operator's packs in ``lockgate.layers.ops`` are built from what it says) and ``TuningTable``
(a model's whole kernel choice on one machine, per role and for attention, with the figures it
was decided on; its JSON layout, ``TABLE_VERSION``, is written and read here alone). Kept free
of torch so that configuration parsing (``--matmul-forms``) in processes that never load a model
does not import it.

One matmul, from the table to the kernel: ``TuningTable.choices[role]`` (here; measured by
``lockgate.runner.tuning``, applied by ``lockgate.runner.form_choice``) -> ``serving_form`` (here)
-> ``Linear.__call__`` or ``KernelOps.whole_step`` (``lockgate.layers.linear``,
``lockgate.layers.ops``) -> the form's kernel call (``lockgate.layers.forms``).

Invariants: a call's form depends only on its row count and whether it has prompt rows, never on
the values; ``TuningTable.from_json(t.to_json()) == t``; a table in a layout other than
``TABLE_VERSION`` or the unversioned one before it is refused (``TableVersionError``), never
guessed at.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Every form's name, most exact first: where two measure within noise, the earlier one is kept
# (``lockgate.runner.tuning``). bf16-gemm, f32-dot, dense and fp32 are exact in their dtype (the
# bf16 kernels take subnormals as zero); bf16-gemm and f32-dot (lockgate's kernels) make the same
# products as dense and are row-invariant at every row count (oneDNN's bf16 kernel is not at one
# row of some shapes, MKL's sgemm below 16 rows here), so a tie goes to them; group-quant does
# float32 math on exact codes; int-gemm rounds x to int16 per block; torch-int4 rounds x to bf16.
FORM_NAMES = ("bf16-gemm", "f32-dot", "dense", "fp32", "group-quant", "int-gemm", "torch-int4")
QUANTIZED_FORMS = ("group-quant", "int-gemm", "torch-int4")

# What serves a call whose chosen form a projection lacks: dense, else (a projection kept in its
# file's blocks, with no dense weight) its fastest quantized form in general
FALLBACK_ORDER = ("dense", "int-gemm", "group-quant", "torch-int4", "bf16-gemm", "f32-dot", "fp32")


def fallback_form(forms: Iterable[str]) -> str:
    have = set(forms)
    return next((f for f in FALLBACK_ORDER if f in have), "dense")


STATIC_SMALL_ROWS = 16  # FormChoice.static: quantized forms up to this many rows (decode), dense above
UNBOUNDED = 1 << 62  # the last span of a choice covers every larger call


@dataclass(frozen=True)
class FormChoice:
    """Row ranges and the form serving each: ``spans`` ((max_rows, form name), ...) with ascending
    max_rows; a call of r rows takes the first span whose max_rows >= r, the last span every call
    beyond. Written and parsed as ``int-gemm:64,dense`` (the last span without a bound)."""

    spans: tuple[tuple[int, str], ...]

    def __post_init__(self) -> None:
        if not self.spans:
            raise ValueError("a form choice needs at least one span")
        bounds = [b for b, _ in self.spans]
        if bounds != sorted(set(bounds)) or bounds[0] < 1:
            raise ValueError(f"form choice spans must have increasing row bounds >= 1, got {bounds}")
        unknown = [f for _, f in self.spans if f not in FORM_NAMES]
        if unknown:
            raise ValueError(f"unknown matmul form(s) {unknown}: forms are {', '.join(FORM_NAMES)}")
        object.__setattr__(self, "_bounds", bounds)

    @staticmethod
    def single(form: str) -> FormChoice:
        return FormChoice(((UNBOUNDED, form),))

    @staticmethod
    def parse(text: str) -> FormChoice:
        """``dense``, ``int-gemm:64,dense``, ``torch-int4:3,int-gemm:48,dense`` (bounds are the
        largest row count of each span; the last span has none)."""
        spans: list[tuple[int, str]] = []
        parts = [p.strip() for p in str(text).split(",") if p.strip()]
        if not parts:
            raise ValueError("--matmul-forms: empty")
        for i, part in enumerate(parts):
            name, sep, bound = part.partition(":")
            last = i == len(parts) - 1
            if bool(sep) == last:
                raise ValueError(f"--matmul-forms {text!r}: every span but the last needs ':max_rows' "
                                 "(e.g. int-gemm:64,dense)")
            if last:
                spans.append((UNBOUNDED, name.strip()))
                continue
            if not bound.strip().isdigit():
                raise ValueError(f"--matmul-forms {text!r}: {bound!r} is not a row count")
            spans.append((int(bound), name.strip()))
        return FormChoice(tuple(spans))

    @staticmethod
    def static(forms: Iterable[str]) -> FormChoice:
        """The choice without a measurement: the first quantized form a projection has (int-gemm,
        torch-int4, group-quant) for calls of up to STATIC_SMALL_ROWS rows, dense above (a
        projection without dense, kept in its file's blocks: that form for every call)."""
        have = set(forms)
        small = next((f for f in ("int-gemm", "torch-int4", "group-quant") if f in have), None)
        if small is None:
            return FormChoice.single(fallback_form(have))
        if "dense" not in have:
            return FormChoice.single(small)
        return FormChoice(((STATIC_SMALL_ROWS, small), (UNBOUNDED, "dense")))

    def pick(self, rows: int) -> str:
        bounds: list[int] = object.__getattribute__(self, "_bounds")
        return self.spans[min(bisect.bisect_left(bounds, rows), len(bounds) - 1)][1]

    def names(self) -> set[str]:
        return {f for _, f in self.spans}

    def restricted_to(self, forms: Iterable[str]) -> FormChoice:
        """The same spans with every form not in ``forms`` replaced by ``fallback_form(forms)``
        (dense where the projection has it), merged."""
        have = set(forms)
        fallback = fallback_form(have)
        return FormChoice.merged([(b, f if f in have else fallback) for b, f in self.spans])

    def from_rows(self, rows: int, form: str) -> FormChoice:
        """Calls of ``rows`` rows or more take ``form``; smaller ones keep this choice."""
        below: list[tuple[int, str]] = []
        for b, f in self.spans:
            top = min(b, rows - 1)
            if top >= 1 and (not below or top > below[-1][0]):
                below.append((top, f))
            if b >= rows - 1:
                break
        return FormChoice.merged([*below, (UNBOUNDED, form)])

    @staticmethod
    def merged(spans: list[tuple[int, str]]) -> FormChoice:
        """Adjacent spans of one form joined; the last bound made unbounded."""
        out: list[tuple[int, str]] = []
        for b, f in spans:
            if out and out[-1][1] == f:
                out[-1] = (b, f)
            elif not out or b > out[-1][0]:
                out.append((b, f))
        out[-1] = (UNBOUNDED, out[-1][1])
        return FormChoice(tuple(out))

    def __str__(self) -> str:
        return ",".join(f if b == UNBOUNDED else f"{f}:{b}" for b, f in self.spans)

    def describe(self) -> str:
        """``int-gemm 1-64, dense 65+``: for logs and ``lockgate tune``."""
        out, lo = [], 1
        for b, f in self.spans:
            out.append(f"{f} {lo}+" if b == UNBOUNDED else f"{f} {lo}-{b}" if b > lo else f"{f} {lo}")
            lo = b + 1
        return ", ".join(out)


@dataclass(frozen=True)
class PromptForm:
    """The form serving a projection's prompt rows and the fewest rows it is called with (smaller
    calls are padded with zero rows: the form's rows agree bitwise from that many rows on)."""

    name: str
    min_rows: int = 1


def serving_form(choice: FormChoice, prompt: PromptForm | None, rows: int, prompt_rows: bool = False) -> tuple[str, int]:
    """(the form that serves a call of ``rows`` rows, the rows it runs: ``rows``, or more when the
    call is padded up to the prompt form's ``min_rows``). ``prompt_rows``: the call has prompt rows.
    A projection with a prompt form runs a call with prompt rows on it whatever the count, and a
    call of decode rows only on the form its row count picks (padded when that is the prompt form);
    one without runs every call on the form its row count picks."""
    if prompt is not None and (prompt_rows or choice.pick(rows) == prompt.name):
        return prompt.name, max(rows, prompt.min_rows)
    return choice.pick(rows), rows


# ---- the tuning table ----

TABLE_VERSION = 1  # TuningTable's JSON layout: bump when a field changes, and convert or refuse the old one

Samples = dict[str, dict[str, dict[str, list[float]]]]  # role -> form -> rows (as text) -> per-round ms
Timings = dict[str, list[float]]  # candidate -> per-round ms


class TableVersionError(ValueError):
    """A stored table in a layout this version cannot read (it is measured again)."""


@dataclass(frozen=True)
class TuningTable:
    """One model's kernel choice on one machine: per projection role (qkv, o, gate_up, down, head)
    the ``FormChoice`` and, where prompt rows run on one row-invariant form, its ``PromptForm``;
    the attention paths; and the figures the choice was made from. A stored table (the
    measurement, ``lockgate.runner.tuning_cache``) has no prompt forms and says what was measured;
    the table a start runs (``Paths.table``, what ``lockgate tune`` prints) is that table with
    ``--matmul-forms``, ``--fp32-matmul-rows``, the row-invariance check and the kernels'
    presence applied, and ``source`` saying how it came about."""

    choices: dict[str, FormChoice]  # role -> which form serves a call of r rows
    prompt_forms: dict[str, PromptForm] = field(default_factory=dict)  # role -> its prompt rows' form (or none)
    decode_attention: str = "kernel"  # "kernel" (lockgate's decode_attention) or "sdpa" (gathers + SDPA)
    prefill_attention: str = "sdpa"  # "kernel" (lockgate's prefill_attention for the whole step) or "sdpa"
    attention_lookahead: str = "off"  # "on": the attention kernel prefetches its next item's K/V rows
    forms: dict[str, list[str]] = field(default_factory=dict)  # role -> the forms its projections had when measured
    samples: Samples = field(default_factory=dict)  # the matmul figures (lockgate.runner.tuning.measure_forms)
    attention_ms: Timings = field(default_factory=dict)  # decode attention figures, kernel vs sdpa
    prefill_attention_ms: Timings = field(default_factory=dict)
    attention_lookahead_ms: Timings = field(default_factory=dict)
    exact_prefill: str = ""  # the prompt rows' forms, or why prompt rows go by row count
    source: str = ""  # how this table came about: measured, cached (and where), a flag
    cached: bool = False  # read from the cache rather than measured by this start
    seconds: float = 0.0  # how long the measurement took
    measured_at: str = ""
    version: int = TABLE_VERSION

    def __post_init__(self) -> None:
        for name, value, allowed in (("decode_attention", self.decode_attention, ("kernel", "sdpa")),
                                     ("prefill_attention", self.prefill_attention, ("kernel", "sdpa")),
                                     ("attention_lookahead", self.attention_lookahead, ("on", "off"))):
            if value not in allowed:
                raise ValueError(f"tuning table: {name} is {value!r}, not one of {', '.join(allowed)}")

    def to_json(self) -> dict[str, Any]:
        """The table as JSON values (``FormChoice`` as its ``int-gemm:64,dense`` text)."""
        return {"version": self.version, "choices": {role: str(c) for role, c in self.choices.items()},
                "prompt_forms": {role: {"form": p.name, "min_rows": p.min_rows} for role, p in self.prompt_forms.items()},
                "decode_attention": self.decode_attention, "prefill_attention": self.prefill_attention,
                "attention_lookahead": self.attention_lookahead, "forms": {r: list(f) for r, f in self.forms.items()},
                "samples": self.samples, "attention_ms": self.attention_ms,
                "prefill_attention_ms": self.prefill_attention_ms, "attention_lookahead_ms": self.attention_lookahead_ms,
                "exact_prefill": self.exact_prefill, "source": self.source, "cached": self.cached,
                "seconds": self.seconds, "measured_at": self.measured_at}

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> TuningTable:
        """The table ``to_json`` wrote; a table stored before the layout had a version (no
        ``version``: the decode attention under ``attention``) is converted, choosing the same
        forms and paths; another version raises ``TableVersionError``, a malformed field
        ValueError naming it."""
        version = data.get("version", 0)
        if version == 0:
            data = {**data, "decode_attention": data.get("attention", "kernel"), "version": TABLE_VERSION}
        elif version != TABLE_VERSION:
            raise TableVersionError(f"tuning table: version {version!r}, this lockgate reads {TABLE_VERSION} "
                                    "(and the unversioned layout before it)")
        try:
            return TuningTable(
                choices={str(role): FormChoice.parse(text) for role, text in dict(data.get("choices", {})).items()},
                prompt_forms={str(role): PromptForm(str(p["form"]), int(p["min_rows"]))
                              for role, p in dict(data.get("prompt_forms", {})).items()},
                decode_attention=str(data.get("decode_attention", "kernel")),
                prefill_attention=str(data.get("prefill_attention", "sdpa")),
                attention_lookahead=str(data.get("attention_lookahead", "off")),
                forms={str(role): [str(f) for f in fs] for role, fs in dict(data.get("forms", {})).items()},
                samples=dict(data.get("samples", {})), attention_ms=dict(data.get("attention_ms", {})),
                prefill_attention_ms=dict(data.get("prefill_attention_ms", {})),
                attention_lookahead_ms=dict(data.get("attention_lookahead_ms", {})),
                exact_prefill=str(data.get("exact_prefill", "")), source=str(data.get("source", "")),
                cached=bool(data.get("cached", False)), seconds=float(data.get("seconds", 0.0)),
                measured_at=str(data.get("measured_at", "")))
        except (TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"tuning table: a malformed field ({type(e).__name__}: {e})") from e

    def describe(self) -> list[str]:
        """One line per role (``int-gemm 1-64, dense 65+``), then the attention paths and the
        prompt rows' forms: the table as the start-up log and ``lockgate tune`` show it."""
        lines = [f"  {role:<8} {choice.describe()}" for role, choice in self.choices.items()]
        lines.append(f"  decode attention: {'lockgate kernel' if self.decode_attention == 'kernel' else 'gathers + SDPA'}"
                     f"{' (look-ahead on)' if self.attention_lookahead == 'on' else ''}; prefill attention: "
                     f"{'lockgate kernel' if self.prefill_attention == 'kernel' else 'SDPA'}")
        if self.exact_prefill:
            lines.append(f"  prompt rows: {self.exact_prefill}")
        return lines
