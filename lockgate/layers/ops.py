"""The ops a decoder layer is made of, in two backends: plain torch and lockgate's fused CPU kernels.

Owns the three places where the two ways of running a layer differ; everything else (the
projections, attention over the pool) is shared. An architecture writes its layer loop once
against ``LayerOps`` and runs on either backend:

* ``add_norm(x, delta, weight, eps)``: ``x += delta`` (the residual stream, in place; ``delta``
  None adds nothing), then RMS-normalise ``x``;
* ``rope_qkv(qkv, cos, sin, ...)``: split the fused q/k/v projection, rotate q and k; the torch
  backend returns ``(q, k, v)`` for attention to write into the pool, the kernel backend writes
  K/V into the pool itself and returns ``(q, None, None)``;
* ``silu_mul(gate_up)``: ``silu(gate) * up`` of the fused gate/up projection.

Invariant: both backends round where the other does (each fused kernel rounds at the points the
torch ops round), so a model gives the same results on either, up to the kernels' documented
reduction order. The kernel backend needs ``lockgate.kernels`` loaded.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from lockgate.layers.norm import rms_norm
from lockgate.layers.rope import apply_rope

QKV = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


class LayerOps(Protocol):
    name: str

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor: ...

    def rope_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, out_slots: torch.Tensor) -> QKV: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


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


class KernelOps:
    """lockgate's fused CPU ops (``torch.ops.lockgate``): per layer two add + norm calls, one rope +
    K/V write and one silu * up, instead of a dozen torch ops and their temporaries."""

    name = "kernels"

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
