"""Linear projections (``y = x @ W^T + b``) on the fastest kernel torch has for the weight's dtype.

Owns one projection's weight and bias and the choice of kernel, made once at load:

* bfloat16 on a CPU with oneDNN bf16 support: the weight is reordered once into oneDNN's
  blocked layout (``mkldnn._reorder_linear_weight``, the packed form inductor uses for frozen
  CPU graphs) and every call runs ``mkldnn._linear_pointwise`` on it. ``F.linear`` re-packs the
  weight on every call; measured on the 2-core AVX512-BF16 machine (docs/performance.md), the
  packed form is 1.6-2x faster at 1 row (the batch-1 decode case, memory-bound) and about as fast
  from 256 rows up. Results are bit-identical to ``F.linear`` (the same oneDNN kernel family).
* everything else (float32, where MKL's sgemm is already the fastest path, CUDA, a torch
  without oneDNN): ``F.linear`` on the weight as loaded.

Invariant: ``Linear(w, b)(x)`` equals ``F.linear(x, w, b)`` for x [..., K]; the packed copy is
read-only and derived from ``weight``, which stays the source of truth (shape checks, tests).
Called by ``lockgate.models.llama`` (every projection and the LM head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def onednn_packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether projections of ``dtype`` on ``device`` run on oneDNN-packed weights."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


class Linear:
    """One projection: weight [N, K], optional bias [N]; call with x [..., K] -> [..., N]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self.packed: torch.Tensor | None = None  # oneDNN blocked copy of weight, or None
        if onednn_packs(weight.dtype, weight.device):
            with torch.no_grad():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
