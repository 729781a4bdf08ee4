"""Reading a checkpoint's weights and reporting their forms: the architecture-independent half of
loading a model (an architecture's ``from_pretrained`` says which tensor goes where).

``CheckpointReader``: name -> tensor over every ``*.safetensors`` shard of a Hugging Face model
directory, converted to the run dtype and device on read, remembering what was read so that
unexpected tensors can be reported. ``log_quantization``: one log line on the quantized forms a
model's projections got.
"""

from __future__ import annotations

import logging
import typing
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from lockgate.layers.grid import INT4_GROUP, LOSSLESS_TOLERANCE
from lockgate.layers.linear import Linear

log = logging.getLogger("lockgate.models")


class CheckpointReader:
    """Name -> tensor access over all safetensors shards of a directory, converted on read."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device):
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{model_dir}: no *.safetensors weights")
        self.dtype, self.device = dtype, device
        self._handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
        self._where = {k: h for h in self._handles for k in h.keys()}
        self._used: set[str] = set()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handles.clear()
        self._where.clear()

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The tensor in ``dtype`` (default: the run dtype); ``shape``: what config.json implies
        (a mismatch, or a missing tensor, is a ValueError naming the tensor and that shape)."""
        want = "" if shape is None else f" (config.json implies shape {list(shape)})"
        if name not in self._where:
            raise ValueError(f"weights are missing tensor {name!r}{want}")
        self._used.add(name)
        t = self._where[name].get_tensor(name)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {list(t.shape)}, config.json implies {list(shape)}")
        return t.to(device=self.device, dtype=dtype or self.dtype)

    def skip(self, name: str) -> None:
        self._used.add(name)

    def cat(self, names: list[str], dtype: torch.dtype | None = None,
            shapes: Sequence[tuple[int, ...]] | None = None) -> torch.Tensor:
        return torch.cat([self.get(n, dtype, None if shapes is None else shapes[i]) for i, n in enumerate(names)], dim=0)

    def unused(self) -> set[str]:
        return {k for k in self._where if k not in self._used and not k.endswith("rotary_emb.inv_freq")}


def log_quantization(lins: list[Linear], head: Linear, mode: str) -> None:
    """One line on which projections (``lins``, the LM ``head`` among them) have quantized forms, on
    which grid, and what that costs in precision (which form serves which calls is the tuning's)."""
    quantized = [lin.quantized for lin in lins if lin.quantized]
    if not quantized:
        log.info("quantization=%s: no projection has a quantized form (%s)", mode,
                 "none is already on a 4- or 8-bit grid" if mode == "auto" else "the kernel does not fit")
        return
    forms = [f for fs in quantized for f in fs]
    worst = max(typing.cast(float, getattr(f, "error", 0.0)) for f in forms)
    grids = sorted({f"{getattr(f, 'bits', 4)}-bit" for f in forms})
    names = sorted({f.name for f in forms})
    log.info("quantization=%s: %d of %d projections%s have quantized forms (%s grid, groups of %d: %s); "
             "largest re-quantization error %.3g steps (%s)", mode, len(quantized), len(lins),
             " (the LM head included)" if head.quantized else "", "/".join(grids), INT4_GROUP,
             ", ".join(names), worst, "lossless" if worst <= LOSSLESS_TOLERANCE else "lossy")
