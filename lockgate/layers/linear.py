"""Linear projections (``y = x @ W^T + b``): a projection's forms and the table that picks one per call.

Owns ``Linear`` (one projection's weight, bias, forms, ``FormChoice`` and ``PromptForm``, and
the call: it runs the form ``kernel_choice.serving_form`` names, the one rule the whole-step
operator's packs in ``lockgate.layers.ops`` follow too). The forms themselves and
which ones a weight gets live in ``lockgate.layers.forms``; which form is fastest for which row
counts on this CPU is measured by ``lockgate.runner.tuning`` and handed to ``Linear.choose``.
Without a measured table a projection follows ``FormChoice.static`` (quantized forms for calls
of up to ``STATIC_SMALL_ROWS`` rows, dense above), which is what models built outside the
runner (tests) get.

Invariants: ``shape`` is [N, K]; every projection with a ``weight`` (run dtype) has the ``dense``
form, and one without (kept in its GGUF blocks: issue 49) has at least one quantized form; a choice
only ever names forms the projection has (``choose`` replaces a missing one by
``kernel_choice.fallback_form``: dense where there is one); a call's form depends only on its row count, never on the values, so
a row's result does not depend on what the other rows are for a given row count. Each form equals
``F.linear`` with its weight (dequantized, the float32 source, ``weight``) up to accumulation
order and the rounding the form documents.

Prompt rows (``PromptForm``, issue 19): a step's rows are of two kinds, the decode rows of
requests generating and the prompt rows of prefill chunks. A call told it has prompt rows runs
them, on a projection with a ``prompt`` form, on that one form whatever their number, padded to
its ``min_rows``: a form the tuning checked to be row-invariant
(a row's bits never depend on how many rows share the call, at least ``min_rows`` rows), so a
prompt token's result does not depend on the chunk it is prefilled in or on how much of its prompt
came from the prefix cache. A call with prompt rows runs its decode rows in the same call (a
second call on the decode rows' own form measured 6% slower on mixed workloads: the prompt
form is the fastest at the row counts such steps have); a call of decode rows only keeps the
per-row-count choice (the fastest form), padded too when that is the prompt form.

Called by ``lockgate.models.decoder`` (every projection and the LM head).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from lockgate.kernel_choice import QUANTIZED_FORMS, FormChoice, PromptForm, serving_form
from lockgate.layers.forms import DenseWeight, Form

__all__ = ["Linear", "PromptForm"]


class Linear:
    """One projection: weight [N, K] (run dtype), optional bias [N], its forms (``dense`` always)
    and the choice between them; call with x [..., K] -> [..., N] in x's dtype. A projection kept
    in its file's quantized blocks (``weight`` None, ``shape`` given) has only its quantized forms."""

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None = None,
                 forms: Mapping[str, Form] | None = None, choice: FormChoice | None = None,
                 shape: tuple[int, int] | None = None) -> None:
        self.weight = weight
        self.bias = bias
        if weight is not None:
            self.shape: tuple[int, int] = (int(weight.shape[0]), int(weight.shape[1]))
            self.forms: dict[str, Form] = {"dense": DenseWeight(weight), **(forms or {})}
        else:
            if shape is None or not forms:
                raise ValueError("a projection without a dense weight needs its shape and at least one form")
            self.shape = (int(shape[0]), int(shape[1]))
            self.forms = dict(forms)
        self.choice = FormChoice.static(self.forms)
        self.prompt: PromptForm | None = None  # the prompt rows' form (None: prompt rows go by count too)
        if choice is not None:
            self.choose(choice)

    def choose(self, choice: FormChoice) -> None:
        """Take ``choice`` (forms this projection lacks become dense)."""
        self.choice = choice.restricted_to(self.forms)

    def set_prompt_form(self, prompt: PromptForm | None) -> None:
        """Serve prompt rows on ``prompt`` (a form this projection has), or by count (None)."""
        if prompt is not None and prompt.name not in self.forms:
            raise ValueError(f"prompt form {prompt.name!r} is not one of this projection's forms {sorted(self.forms)}")
        self.prompt = prompt

    def drop_unchosen(self) -> None:
        """Free the forms the choice and the prompt form never call (dense stays: it is the weight
        itself; where nothing calls it, its oneDNN-packed copy goes and it would run as F.linear)."""
        called = self.choice.names() | ({self.prompt.name} if self.prompt else set())
        self.forms = {n: f for n, f in self.forms.items() if n in called | {"dense"}}
        dense = self.forms.get("dense")
        if "dense" not in called and isinstance(dense, DenseWeight):
            dense.packed = None

    @property
    def quantized(self) -> list[Form]:
        """This projection's quantized forms (for logs and tests)."""
        return [f for n, f in self.forms.items() if n in QUANTIZED_FORMS]

    def __call__(self, x: torch.Tensor, prompt_rows: bool = False) -> torch.Tensor:
        """x [..., K] -> [..., N]. ``prompt_rows``: some rows are prompt rows (see the module
        docstring): the whole call runs on the prompt form; else the form by row count (padded
        when that is the prompt form)."""
        flat = x.reshape(-1, x.shape[-1])
        rows = flat.shape[0]
        name, run_rows = serving_form(self.choice, self.prompt, rows, prompt_rows)
        form = self.forms[name]
        if run_rows == rows:
            y = form(flat, self.bias)
        else:  # padded up to the prompt form's min_rows: a row's bits do not depend on the others from there
            y = form(torch.cat([flat, flat.new_zeros(run_rows - rows, flat.shape[1])]), self.bias)[:rows]
        return y.view(*x.shape[:-1], y.shape[-1])
