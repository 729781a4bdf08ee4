"""Rotary position embeddings (rotate-half convention, as in Hugging Face Llama).

Owns the inverse-frequency table (plain, ``linear``, ``llama3`` and ``longrope`` scaling) and
applying the rotation. LongRoPE (Phi-3) has two tables: a token at a position below
``original_max_position_embeddings`` rotates by the short factors, one at or past it by the long
ones (per token, so a token's rotation never depends on the rest of the batch; transformers picks
one table per forward call by its longest position, which agrees for every prompt that fits the
original context and for every token generated past it), and cos/sin are scaled by its
``attention_factor``. Invariant: weights use Hugging Face's q/k row order (the GGUF loader undoes
llama.cpp's interleaving permutation before we get here). cos/sin are computed once per
step in float32 and cast to the activations' dtype, like the reference implementation.
Called by ``lockgate.models.decoder`` (one ``RotaryEmbedding`` per model).
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] f32 for the given rope parameters.

    ``scaling`` is the Hugging Face ``rope_scaling`` / ``rope_parameters`` dict (or None);
    its ``rope_type`` (or legacy ``type``) selects the variant.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        return inv_freq
    assert scaling is not None
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "longrope":
        return inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float32)
    if rope_type == "llama3":
        return llama3_inv_freq(inv_freq, float(scaling["factor"]), float(scaling["low_freq_factor"]),
                               float(scaling["high_freq_factor"]),
                               float(scaling["original_max_position_embeddings"]))
    raise ValueError(f"unsupported rope type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                    old_context_len: float) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths / factor, short ones kept, smooth between."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Holds inv_freq [D/2] f32 on the model's device; ``cos_sin`` runs once per step."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, device: torch.device):
        self.head_dim = head_dim
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)  # [D/2] f32
        self.long_inv_freq: torch.Tensor | None = None  # longrope: from this position on
        self.long_from = 0
        self.attention_factor = 1.0
        if rope_type_of(scaling) == "longrope":
            assert scaling is not None
            base = rope_inv_freq(head_dim, theta)
            if len(scaling["short_factor"]) != head_dim // 2 or len(scaling["long_factor"]) != head_dim // 2:
                raise ValueError(f"longrope short_factor / long_factor must have head_dim / 2 = {head_dim // 2} entries")
            self.long_inv_freq = (base / torch.tensor(scaling["long_factor"], dtype=torch.float32)).to(device)
            self.long_from = int(scaling["original_max_position_embeddings"])
            self.attention_factor = float(scaling["attention_factor"])

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] i64 -> (cos, signed sin), each [T, 1, D] in ``dtype`` (broadcast over heads).

        The signed sin is (-sin, sin) over the two halves, so ``apply_rope`` needs no negation.
        """
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2] f32
        if self.long_inv_freq is not None:
            long = positions.float()[:, None] * self.long_inv_freq[None, :]
            freqs = torch.where((positions >= self.long_from)[:, None], long, freqs)
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return (torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :],
                torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/signed_sin [T, 1, D] from ``cos_sin`` -> rotated x [T, heads, D].

    Rotate-half form ``x * cos + cat(-x2, x1) * sin``, written as ``x * cos + roll(x) * signed_sin``
    (three ops instead of six; the same products, only the last add is fused).
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
