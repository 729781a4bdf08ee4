"""Llama 3.1 rotary frequency scaling in plain numpy, for the GGUF converter (torch-free), which
must recognise the scaling parameters from the per-frequency factors llama.cpp stores.

The model itself uses ``layers.rope.llama3_inv_freq`` (torch): the same formula, kept in torch
there because it matches transformers' float32 rounding bit for bit (this version differs in
the last bit of a few frequencies, well inside the converter's matching tolerance)."""

from __future__ import annotations

import math

import numpy as np


def llama3_inv_freq(inv_freq: np.ndarray, factor: float, low_freq_factor: float, high_freq_factor: float,
                    old_context_len: float) -> np.ndarray:
    """Llama 3.1 frequency scaling of ``inv_freq`` [D/2] float32: long wavelengths divided by
    ``factor``, short ones kept, a smooth blend between."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32, copy=False)
