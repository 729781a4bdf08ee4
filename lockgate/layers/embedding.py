"""A token embedding kept in its GGUF blocks: rows de-quantized when a step looks them up.

Owns ``PackedEmbedding``: the [V, hidden] table as the file holds it (any GGUF type, Q4_0 to Q6_K),
read from its own memory map of the file's bytes for that tensor. A step's lookup gathers its
tokens' rows of blocks and de-quantizes just those (``gguf.quants.dequantize``, the reference
de-quantization: the values are exactly the file's). The map is opened on the first lookup, so
a table the loader read while packing a tied LM head holds no pages then: only the rows steps
touch become resident (a 128k-token vocabulary of an 8B model is 0.3-0.4 GB in the file,
2.1 GB as float32).

Invariant: ``lookup(ids)`` equals ``F.embedding(ids, dense)`` for the float32 de-quantized table,
cast to ``dtype``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


class PackedEmbedding:
    def __init__(self, path: Path, offset: int, qtype: str, shape: tuple[int, int], row_bytes: int,
                 dtype: torch.dtype) -> None:
        self.path, self.offset, self.qtype = Path(path), int(offset), qtype
        self.shape = (int(shape[0]), int(shape[1]))
        self.row_bytes = int(row_bytes)
        self.dtype = dtype
        self._map: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes

    def _rows(self) -> np.ndarray:
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.offset,
                                  shape=(self.shape[0], self.row_bytes))
        return self._map

    def dense(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Rows [lo, hi) de-quantized, float32 (for a tied head that has no packed form, and tests)."""
        return self._dequantize(np.asarray(self._rows()[lo:hi]))

    def _dequantize(self, raw: np.ndarray) -> torch.Tensor:
        import gguf

        w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[self.qtype]).astype(np.float32, copy=False)
        return torch.from_numpy(np.ascontiguousarray(w.reshape(raw.shape[0], self.shape[1])))

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] int64 -> [T, hidden] in ``dtype``."""
        raw = np.take(self._rows(), ids.cpu().numpy(), axis=0)
        return self._dequantize(raw).to(self.dtype)
