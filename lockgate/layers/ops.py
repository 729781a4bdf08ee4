"""The ops a decoder layer is made of, in two backends: plain torch and lockgate's fused CPU kernels.

Owns the three places where the two ways of running a layer differ; everything else (the
projections, attention over the pool) is shared. An architecture writes its layer loop once
against ``LayerOps`` and runs on either backend:

* ``add_norm(x, delta, weight, eps)``: ``x += delta`` (the residual stream, in place; ``delta``
  None adds nothing), then RMS-normalise ``x``;
* ``rope_qkv(qkv, cos, sin, ...)``: split the fused q/k/v projection, rotate q and k; the torch
  backend returns ``(q, k, v)`` for attention to write into the pool, the kernel backend writes
  K/V into the pool itself and returns ``(q, None, None)``;
* ``silu_mul(gate_up)``: ``silu(gate) * up`` of the fused gate/up projection;

and one fast path: ``whole_step(...)`` runs every layer of a step in one call, or returns None
for the layer loop to run instead (always None on torch; on the kernels, a step whose attention is
one kernel call and whose projections' forms (``kernel_choice.serving_form``: the very forms
``Linear`` would call) ``lockgate::decode_layers_`` can run: decode steps,
with or without guess rows, and steps with prompt rows alike). The kernel backend packs the
layers' tensors for that operator once per step size (once for all prompt steps, when every
projection serves prompt rows on one form); ``forget()`` drops the packs when the projections'
forms or choices change. On two threads a decode step of ``SPLIT_MIN_ROWS`` rows or more whose
projections all run on lockgate's bf16 kernel goes through that operator as two halves of the batch,
one per thread (``parts=2``, decode_layers.cpp says why and what it saves): that kernel gives a row
the same bits whatever the call's row count, so the halves change no result.

Invariant: both backends round where the other does (each fused kernel rounds at the points the
torch ops round), so a model gives the same results on either, up to the kernels' documented
reduction order. The kernel backend needs ``lockgate.kernels`` loaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
import torch.nn.functional as F

from lockgate.kernel_choice import serving_form
from lockgate.layers.attention_meta import AttentionMetadata
from lockgate.layers.linear import Linear
from lockgate.layers.norm import rms_norm
from lockgate.layers.rope import apply_rope

QKV = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
Pack = tuple[list[torch.Tensor], list[int], frozenset[int]]  # decode_layers_' weights, kinds, the kinds as a set


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): [T, 2 F] gate|up -> gelu_tanh(gate) * up [T, F] (plain torch on every backend)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class LayerWeights(Protocol):
    """What the whole-step path needs of a decoder layer: its two norms and its projections in
    ``decode_layers_``' order (qkv, o, gate_up, down)."""

    @property
    def attn_norm(self) -> torch.Tensor: ...

    @property
    def mlp_norm(self) -> torch.Tensor: ...

    def projections(self) -> dict[str, Linear]: ...


class LayerOps(Protocol):
    name: str

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor: ...

    def rope_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, out_slots: torch.Tensor) -> QKV: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def whole_step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, layers: Iterable[LayerWeights], heads: int,
                   kv_heads: int, eps: float, scale: float, prompt_rows: bool = False,
                   out_rows: torch.Tensor | None = None) -> torch.Tensor | None: ...

    def forget(self) -> None: ...


class TorchOps:
    """Plain torch ops: runs anywhere torch does."""

    name = "torch"

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
        if delta is not None:
            x.add_(delta)  # [T, hidden]
        return rms_norm(x, weight, eps)

    def rope_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, out_slots: torch.Tensor) -> QKV:
        """qkv [T, (H + 2 Hkv) D], cos/sin [T, 1, D] -> q [T, H, D], k/v [T, Hkv, D] (not yet in the pool)."""
        t, d = qkv.shape[0], cos.shape[-1]
        qk = apply_rope(qkv[:, :(heads + kv_heads) * d].view(t, heads + kv_heads, d), cos, sin)  # one pass
        v = qkv[:, (heads + kv_heads) * d:].view(t, kv_heads, d)
        return qk[:, :heads], qk[:, heads:], v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # [T, F] each
        return F.silu(gate) * up

    def whole_step(self, *args: object, **kwargs: object) -> None:
        return None  # no fast path: the layer loop runs every step

    def forget(self) -> None:
        pass


class KernelOps:
    """lockgate's fused CPU ops (``torch.ops.lockgate``): per layer two add + norm calls, one rope +
    K/V write and one silu * up, instead of a dozen torch ops and their temporaries."""

    name = "kernels"

    def __init__(self) -> None:
        # decode_layers_' weights and kinds (and the kinds as a set, for SPLIT_KINDS and
        # ROW_INVARIANT_KINDS), packed on first use from the forms the layer loop would call: per (rows,
        # prompt_rows) key, or under PROMPT_KEY for every prompt step when each projection serves
        # prompt rows on its one prompt form; () when some cannot go through it
        self._packs: dict[tuple[int, bool] | str, Pack | tuple[()]] = {}
        self._prompt_min_rows = 0  # the most rows any prompt form pads to (PROMPT_KEY's pack is for steps >= it)

    PROMPT_KEY = "prompt"
    SPLIT_MIN_ROWS = 32  # decode steps from this many rows run as two halves (measured: c = 32 and c = 128 gain)
    SPLIT_KINDS = frozenset({202})  # decode_layers_ kinds measured to gain from it (lockgate's bf16 kernel)
    # kinds that give a row the same bits whatever the call's rows (lockgate's bf16 and float32 kernels
    # and integer GEMM, by construction: row_invariance.py): a step all on them may run its last layer on the
    # sampled rows alone at any row count (whole_step's out_rows)
    ROW_INVARIANT_KINDS = frozenset({202, 203, 104, 108})
    MAX_PACKS = 256  # packs kept in all (least recently used dropped first; steps by count: one per size)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
        return torch.ops.lockgate.add_rms_norm_(x, delta, weight, eps)  # type: ignore[no-any-return]

    def rope_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, out_slots: torch.Tensor) -> QKV:
        t, d = qkv.shape[0], cos.shape[-1]
        q = torch.ops.lockgate.rope_write_kv(qkv, cos.view(t, d), sin.view(t, d), heads, kv_heads, k_cache, v_cache,
                                             out_slots)  # [T, H, D]; the step's K/V are in the pool
        return q, None, None

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.lockgate.silu_mul(gate_up)  # type: ignore[no-any-return]

    def forget(self) -> None:
        self._packs.clear()
        self._prompt_min_rows = 0

    def whole_step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, layers: Iterable[LayerWeights], heads: int,
                   kv_heads: int, eps: float, scale: float, prompt_rows: bool = False,
                   out_rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """The step's layers in one call (``lockgate::decode_layers_``: the layer loop's very ops on
        this backend, without returning to Python between them), or None when the step cannot take
        it: its attention must be one kernel group (every sequence read by slot, no cascade over a
        shared prefix), and every projection's form for the step (``prompt_rows``: its prompt form,
        as ``Linear`` calls it) one the operator runs, on the step's rows as they are (no padding
        up to a prompt form's ``min_rows``).

        ``out_rows`` (int64 [K], ascending; None: all): the only rows of the result the caller
        reads. In a step with several new tokens per sequence the operator then runs the last
        layer's attention, o projection and MLP on those rows alone (decode_layers.cpp, "The last
        layer"), where that gives them the same bits as the full layer: every projection on its
        prompt form, checked row-invariant from ``min_rows`` <= K rows, or on a kind that gives a
        row the same bits at any row count (``ROW_INVARIANT_KINDS``); with no row wanted (K = 0)
        on any form. The other rows of the result then hold no meaning."""
        t = x.shape[0]
        if len(meta.groups) != 1:
            return None
        g = meta.groups[0]
        if g.kernel_slots is None or g.kernel_offsets is None or g.prefixes or g.token_idx is not None:
            return None
        one_each = g.kernel_offsets.shape[0] - 1 == t  # one new token per sequence: the decode kernel
        if not one_each and g.kernel_q_offsets is None:
            return None
        packed = self._pack_for(list(layers), t, prompt_rows)
        if not packed:
            return None
        weights, kinds, kind_set = packed
        d = cos.shape[-1]
        split = self.SPLIT_KINDS.issuperset(kind_set) and one_each and t >= self.SPLIT_MIN_ROWS
        parts = 2 if split and torch.get_num_threads() == 2 else 1
        # the last layer on the sampled rows only, where that changes none of their bits
        # (no sampled row at all, a middle chunk: nothing past the K/V is needed, on any form)
        same_bits = self.ROW_INVARIANT_KINDS.issuperset(kind_set) or (
            out_rows is not None and (out_rows.shape[0] == 0 or (
                packed is self._packs.get(self.PROMPT_KEY) and out_rows.shape[0] >= self._prompt_min_rows)))
        trim = out_rows if out_rows is not None and not one_each and out_rows.shape[0] < t and same_bits else None
        return torch.ops.lockgate.decode_layers_(x, cos.view(t, d), sin.view(t, d), k_cache, v_cache, meta.out_slots,
                                                 g.kernel_slots, g.kernel_offsets,
                                                 None if one_each else g.kernel_q_offsets, weights, kinds, heads,
                                                 kv_heads, eps, scale, parts, trim)

    def _pack_for(self, layers: list[LayerWeights], rows: int,
                  prompt_rows: bool) -> Pack | tuple[()]:
        if prompt_rows and self.PROMPT_KEY in self._packs:
            return self._packs[self.PROMPT_KEY] if rows >= self._prompt_min_rows else ()
        key = (rows, prompt_rows)
        if key not in self._packs:
            if prompt_rows and all(lin.prompt is not None for layer in layers for lin in layer.projections().values()):
                # one pack for every prompt step: the same forms whatever the rows (padded below min_rows)
                self._prompt_min_rows = max(lin.prompt.min_rows for layer in layers  # type: ignore[union-attr]
                                            for lin in layer.projections().values())
                self._packs[self.PROMPT_KEY] = self._pack(layers, self._prompt_min_rows, True)
                return self._packs[self.PROMPT_KEY] if rows >= self._prompt_min_rows else ()
            if len(self._packs) >= self.MAX_PACKS:
                self._packs.pop(next(k for k in self._packs if k != self.PROMPT_KEY))  # least recently used
            self._packs[key] = self._pack(layers, rows, prompt_rows)
        else:
            self._packs[key] = self._packs.pop(key)  # most recently used last
        return self._packs[key]

    @classmethod
    def _pack(cls, layers: Iterable[LayerWeights], rows: int, prompt_rows: bool) -> Pack | tuple[()]:
        """The layers' tensors in ``decode_layers_``' order, and each projection's kind, for the
        forms ``Linear`` calls at ``rows`` rows (``kernel_choice.serving_form``, the rule ``Linear``
        follows; ``prompt_rows``: a step with prompt rows); () when
        some such form has no kind (the float32 copy of a 16-bit run) or the call would be padded."""
        weights: list[torch.Tensor] = []
        kinds: list[int] = []
        for layer in layers:
            weights += [layer.attn_norm, layer.mlp_norm]
            for lin in layer.projections().values():
                name, run_rows = serving_form(lin.choice, lin.prompt, rows, prompt_rows)  # as Linear calls it
                if run_rows != rows:
                    return ()  # the layer loop pads such calls (Linear), the operator would not
                args = lin.forms[name].decode_layers_args()
                if args is None:
                    return ()
                kinds.append(args[0])
                weights += [*args[1], torch.empty(0) if lin.bias is None else lin.bias]
        return weights, kinds, frozenset(kinds)
