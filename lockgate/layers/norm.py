"""RMSNorm as Llama-family checkpoints define it.

Owns one function. The normalisation itself runs in float32 and is cast back to the input
dtype before the weight multiply, exactly like Hugging Face's ``LlamaRMSNorm``, so our bf16
numbers track the reference implementation. Called by ``lockgate.models.decoder``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., hidden], weight [hidden] -> [..., hidden] in x's dtype."""
    y = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)  # [..., hidden] f32
    return weight * y.to(x.dtype)
