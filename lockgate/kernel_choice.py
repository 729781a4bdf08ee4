"""Which matmul form serves a call of r rows: the table type, torch-free.

Owns ``FORM_NAMES`` (every form a projection's weight can be multiplied in, most exact first;
the forms themselves are ``lockgate.layers.forms``) and ``FormChoice`` (row ranges and the form
of each). Kept free of torch so that configuration parsing (``--matmul-forms``) in processes that
never load a model does not import it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

# Every form's name, most exact first: where two measure within noise, the earlier one is kept
# (``lockgate.runner.tuning``). bf16-gemm, dense and fp32 are exact in their dtype (the bf16
# kernels take subnormals as zero); bf16-gemm (lockgate's kernel) makes the same products as
# dense and is row-invariant at every row count (oneDNN's is not at one row of some shapes), so a
# tie goes to it; group-quant does float32 math on exact codes; int-gemm rounds x to int16 per
# block; torch-int4 rounds x to bf16.
FORM_NAMES = ("bf16-gemm", "dense", "fp32", "group-quant", "int-gemm", "torch-int4")
QUANTIZED_FORMS = ("group-quant", "int-gemm", "torch-int4")

# What serves a call whose chosen form a projection lacks: dense, else (a projection kept in its
# file's blocks, with no dense weight) its fastest quantized form in general
FALLBACK_ORDER = ("dense", "int-gemm", "group-quant", "torch-int4", "bf16-gemm", "fp32")


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
