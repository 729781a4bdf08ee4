"""A GGUF file's tensors under their Hugging Face names, read at load time from the file's memory map.

Owns ``GgufWeights``: what the float32 conversion used to write to disk, done per tensor when the
model asks for it, so nothing of the weights is cached on disk and nothing is de-quantized that
does not have to be. Per Hugging Face name it gives either

* ``blocks(name)``: the matrix as a ``QuantMatrix`` (``gguf_blocks``) when its type is one lockgate's
  integer kernels read as they are (Q4_0, Q4_1, Q8_0, Q5_0), with llama.cpp's q/k row permutation
  undone on the rows (a block never crosses rows, so no value changes); or
* ``dense(name)``: float32 values (``QuantMatrix.dequantize`` for the direct types, else
  ``gguf.quants.dequantize``: the same values), with the same permutation and
  Gemma's norm shift undone (``gguf_convert`` owns both rules).

A ``*_exps`` tensor is one matrix per expert; each expert has its own name (``hf_entries``).
Arrays from ``blocks`` / ``dense`` of an unpermuted 2-D tensor may view the file's map: ``close``
drops this object's reference, and the map goes once no array holds it.

The header is read by ``gguf_header.GgufHeader`` (the tokenizer's arrays stepped over: a
262,144-token vocabulary no longer costs seconds per start). Torch-free (numpy and gguf).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lockgate.checkpoint.gguf_blocks import DIRECT_TYPES, QuantMatrix
from lockgate.checkpoint.gguf_convert import (
    _CONFIG_TENSORS,
    Arch,
    arch_of,
    check_types,
    gguf_config,
    hf_entries,
    unpermute_rope_rows,
)
from lockgate.checkpoint.gguf_header import GgufHeader


@dataclass(frozen=True)
class _Entry:
    tensor: Any  # gguf ReaderTensor
    expert: int | None
    permute_heads: int | None  # llama.cpp's q/k row interleave to undo, over this many heads
    norm_shift: float


class GgufWeights:
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        try:
            reader = GgufHeader(self.path)
        except (ValueError, OSError) as e:
            raise ValueError(f"{self.path}: not a readable GGUF file ({e})") from e
        meta = reader.metadata
        name, arch = arch_of(meta, self.path)
        tensors = {t.name: t for t in reader.tensors}
        check_types(tensors, self.path)
        config = gguf_config(meta, name, arch, tensors, self.path)
        self.arch: Arch = arch
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self._entries: dict[str, _Entry] = {}
        for tname, t in tensors.items():
            if tname in _CONFIG_TENSORS:
                continue
            experts = int(t.shape[2]) if len(t.shape) >= 3 else None  # GGUF lists dims innermost-first
            permute = (heads if ".attn_q." in tname else kv_heads) if arch.permute_qk and (
                ".attn_q." in tname or ".attn_k." in tname) else None
            shift = arch.norm_shift if arch.norm_shift and tname.endswith("norm.weight") else 0.0
            for hf_name, expert in hf_entries(tname, arch, experts):
                self._entries[hf_name] = _Entry(t, expert, permute, shift)
        self._reader: Any = reader

    def table_of_contents(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(Hugging Face name, GGUF type, shape) of every tensor: what a memory plan needs."""
        return [(name, self.qtype(name), self.shape(name)) for name in self._entries]

    def names(self) -> set[str]:
        return set(self._entries)

    def has(self, name: str) -> bool:
        return name in self._entries

    def qtype(self, name: str) -> str:
        return str(self._entries[name].tensor.tensor_type.name)

    def shape(self, name: str) -> tuple[int, ...]:
        """The Hugging Face shape (outermost first; an expert's matrix for an expert's name)."""
        e = self._entries[name]
        dims = tuple(int(x) for x in reversed(e.tensor.shape))
        return dims[1:] if e.expert is not None else dims

    def nbytes(self, name: str) -> int:
        """Bytes the tensor (one expert's share) takes in the file."""
        e = self._entries[name]
        n = int(e.tensor.n_bytes)
        return n // int(e.tensor.shape[2]) if e.expert is not None else n

    def _file_blocks(self, name: str) -> QuantMatrix | None:
        """The 2-D matrix's blocks as the file stores them (rows not un-permuted, no shift), or None
        if its type is not read directly."""
        e, shape = self._entries[name], self.shape(name)
        if e.tensor.tensor_type.name not in DIRECT_TYPES or len(shape) != 2:
            return None
        raw = e.tensor.data if e.expert is None else e.tensor.data[e.expert]
        return QuantMatrix(e.tensor.tensor_type.name, (shape[0], shape[1]), np.asarray(raw, dtype=np.uint8))

    def blocks(self, name: str) -> QuantMatrix | None:
        """The matrix as blocks, or None if its type is not read directly (then use ``dense``)."""
        e, shape = self._entries[name], self.shape(name)
        qm = None if e.norm_shift else self._file_blocks(name)
        if qm is not None and e.permute_heads is not None:
            qm = qm.rows(unpermute_rope_rows(np.arange(shape[0]), e.permute_heads))
        return qm

    def table(self, name: str) -> tuple[str, int, int] | None:
        """(type, byte offset in the file, bytes per row) of a 2-D tensor stored as it is used
        (no permutation, no shift, not an expert's share), for a caller that maps its rows itself
        (``layers.embedding.PackedEmbedding``); None for any other tensor."""
        e = self._entries[name]
        if e.expert is not None or e.permute_heads is not None or e.norm_shift or len(self.shape(name)) != 2:
            return None
        rows = self.shape(name)[0]
        return str(e.tensor.tensor_type.name), int(e.tensor.data_offset), int(e.tensor.n_bytes) // rows

    def dense(self, name: str) -> np.ndarray:
        """float32 values in the Hugging Face layout."""
        import gguf

        e = self._entries[name]
        qm = self._file_blocks(name)  # lockgate's own block reader: gguf's values, ~3x faster
        if qm is not None:
            w = qm.dequantize()
        else:
            raw = e.tensor.data if e.expert is None else e.tensor.data[e.expert]
            w = gguf.quants.dequantize(raw, e.tensor.tensor_type).astype(np.float32, copy=False)
            w = w.reshape(self.shape(name))
        if e.permute_heads is not None:
            w = unpermute_rope_rows(w, e.permute_heads)
        if e.norm_shift:
            w = w - np.float32(e.norm_shift)
        return w

    def close(self) -> None:
        self._entries.clear()
        self._reader = None
