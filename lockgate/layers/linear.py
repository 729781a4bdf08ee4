"""Linear projections (``y = x @ W^T + b``): a projection's forms and the table that picks one per call.

Owns ``Linear`` (one projection's weight, bias, forms and ``FormChoice``: which form serves a
call of r rows, ``lockgate.kernel_choice``). The forms themselves and
which ones a weight gets live in ``lockgate.layers.forms``; which form is fastest for which row
counts on this CPU is measured by ``lockgate.runner.tuning`` and handed to ``Linear.choose``.
Without a measured table a projection follows ``FormChoice.static`` (quantized forms for calls
of up to ``STATIC_SMALL_ROWS`` rows, dense above), which is what models built outside the
runner (tests) get.

Invariants: ``weight`` (run dtype) stays the source of truth for shapes; every projection has
the ``dense`` form; a choice only ever names forms the projection has (``choose`` replaces a
missing one by ``dense``); a call's form depends only on its row count, never on the values, so
a row's result does not depend on what the other rows are for a given row count. Each form equals
``F.linear`` with its weight (dequantized, the float32 source, ``weight``) up to accumulation
order and the rounding the form documents.

Called by ``lockgate.models.decoder`` (every projection and the LM head).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from lockgate.kernel_choice import QUANTIZED_FORMS, FormChoice
from lockgate.layers.forms import DenseWeight, Form


class Linear:
    """One projection: weight [N, K] (run dtype), optional bias [N], its forms (``dense`` always)
    and the choice between them; call with x [..., K] -> [..., N] in x's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 forms: Mapping[str, Form] | None = None, choice: FormChoice | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self.forms: dict[str, Form] = {"dense": DenseWeight(weight), **(forms or {})}
        self.choice = FormChoice.static(self.forms)
        if choice is not None:
            self.choose(choice)

    def choose(self, choice: FormChoice) -> None:
        """Take ``choice`` (forms this projection lacks become dense)."""
        self.choice = choice.restricted_to(self.forms)

    def drop_unchosen(self) -> None:
        """Free the forms the choice never calls (dense stays: it is the weight itself)."""
        keep = self.choice.names() | {"dense"}
        self.forms = {n: f for n, f in self.forms.items() if n in keep}

    def form_for(self, rows: int) -> Form:
        return self.forms[self.choice.pick(rows)]

    @property
    def quantized(self) -> list[Form]:
        """This projection's quantized forms (for logs and tests)."""
        return [f for n, f in self.forms.items() if n in QUANTIZED_FORMS]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        y = self.form_for(rows)(x.reshape(-1, x.shape[-1]), self.bias)
        return y.view(*x.shape[:-1], y.shape[-1])
