"""Reading a checkpoint's weights and reporting their forms: the architecture-independent half of
loading a model (an architecture's ``from_pretrained`` says which tensor goes where).

``CheckpointReader``: name -> tensor over every ``*.safetensors`` shard of a Hugging Face model
directory (or the GGUF file a converted directory stands for), converted to the run dtype and
device on read, remembering what was read so that unexpected tensors can be reported; a GGUF's
projection matrices can come back as their blocks (``matrix``), which the decoder keeps as they are. ``log_quantization``: one log line on the quantized forms a
model's projections got.
"""

from __future__ import annotations

import logging
import typing
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from lockgate.checkpoint.gguf_blocks import Blocks, QuantMatrix, stack
from lockgate.checkpoint.gguf_tensors import GgufWeights
from lockgate.checkpoint.loader import gguf_weights_of
from lockgate.layers.grid import INT4_GROUP, LOSSLESS_TOLERANCE
from lockgate.layers.linear import Linear

log = logging.getLogger("lockgate.models")


class CheckpointReader:
    """Name -> tensor access over all safetensors shards of a directory, or over the GGUF file a
    converted directory stands for (``gguf_weights_of``), converted on read.

    ``packed``: projection matrices may come back as a GGUF file's blocks (``matrix``), unde-quantized;
    False (``--quantization none``) de-quantizes everything."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device, packed: bool = False,
                 gguf: GgufWeights | None = None):
        """``gguf``: the directory's GGUF, already opened by the caller (closed here at exit)."""
        self.dtype, self.device, self.packed = dtype, device, packed
        self._used: set[str] = set()
        self._gguf: GgufWeights | None = None
        self._handles: list[typing.Any] = []
        gguf_path = gguf_weights_of(model_dir) if gguf is None else gguf.path
        if gguf_path is not None:
            self._gguf = gguf if gguf is not None else GgufWeights(gguf_path)
            self._where: dict[str, typing.Any] = dict.fromkeys(self._gguf.names())
            return
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{model_dir}: no *.safetensors weights")
        self._handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
        self._where = {k: h for h in self._handles for k in h.keys()}

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handles.clear()
        self._where.clear()
        if self._gguf is not None:
            self._gguf.close()
            self._gguf = None

    @property
    def gguf(self) -> GgufWeights | None:
        """The GGUF file behind this checkpoint, or None (safetensors)."""
        return self._gguf

    def has(self, name: str) -> bool:
        return name in self._where

    def _check(self, name: str, shape: tuple[int, ...] | None) -> None:
        want = "" if shape is None else f" (config.json implies shape {list(shape)})"
        if name not in self._where:
            raise ValueError(f"weights are missing tensor {name!r}{want}")

    def get(self, name: str, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The tensor in ``dtype`` (default: the run dtype); ``shape``: what config.json implies
        (a mismatch, or a missing tensor, is a ValueError naming the tensor and that shape)."""
        self._check(name, shape)
        self._used.add(name)
        if self._gguf is not None:
            a = self._gguf.dense(name)
            t = torch.from_numpy(a if a.flags.writeable and a.flags.c_contiguous else np.array(a, order="C"))
        else:
            t = self._where[name].get_tensor(name)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {list(t.shape)}, config.json implies {list(shape)}")
        return t.to(device=self.device, dtype=dtype or self.dtype)

    def blocks(self, name: str, shape: tuple[int, int] | None = None) -> QuantMatrix | None:
        """The matrix as its GGUF blocks (``packed`` readers of a GGUF only, and only types the
        integer kernels read as they are), else None: then ``get`` it."""
        self._check(name, shape)
        if self._gguf is None or not self.packed:
            return None
        qm = self._gguf.blocks(name)
        if qm is not None and shape is not None and qm.shape != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {list(qm.shape)}, config.json implies {list(shape)}")
        if qm is not None:
            self._used.add(name)
        return qm

    def matrix(self, names: list[str], dtype: torch.dtype | None = None,
               shapes: Sequence[tuple[int, ...]] | None = None) -> torch.Tensor | Blocks:
        """The named matrices one under the other (a fused projection): as GGUF blocks when every
        part has them (``blocks``; parts of different types as a ``QuantStack`` where they stack
        exactly), else dense (``cat``)."""
        parts = [self.blocks(n, None if shapes is None else (int(shapes[i][0]), int(shapes[i][1])))
                 for i, n in enumerate(names)] if self._gguf is not None and self.packed else []
        blocks = [p for p in parts if p is not None]
        if parts and len(blocks) == len(parts):
            try:
                return stack(blocks)
            except ValueError:  # K-quant beside legacy blocks: no common exact table
                log.info("%s: blocks of %s do not stack exactly; held dense", names[0], "/".join(p.qtype for p in blocks))
        return self.cat(names, dtype, shapes)

    def skip(self, name: str) -> None:
        self._used.add(name)

    def cat(self, names: list[str], dtype: torch.dtype | None = None,
            shapes: Sequence[tuple[int, ...]] | None = None) -> torch.Tensor:
        parts = [self.get(n, dtype, None if shapes is None else shapes[i]) for i, n in enumerate(names)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)  # one part: no copy

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
