"""A GGUF file's header read fast: its metadata and tensor table, the tensors as views of the file's map.

Owns ``GgufHeader``: what a model load needs of a GGUF (every metadata value but the tokenizer's
vocabulary arrays, and each tensor's name, type, dims and bytes) without building the ``gguf``
package's per-value field objects. ``gguf.GGUFReader`` makes several numpy views per metadata
value, which for a 262,144-token vocabulary (Gemma 3) is over a million objects and 15-35 s on 2
cores; here the vocabulary arrays are stepped over by their lengths (a fraction of a second).

The tensors are ``gguf.ReaderTensor`` records as ``GGUFReader`` makes them (the same ``data`` view:
quantized types as uint8 rows of blocks, float types as their numpy dtype, dims innermost-first in
``shape``), so code written for the package's reader reads either. Metadata values are plain
Python values as ``ReaderField.contents()`` gives them (float32 scalars as their shortest
float32 repr, ``read_metadata``'s rule). Little-endian files only (what llama.cpp writes); a
file that is not GGUF, or is cut short, is a ValueError naming what was wrong.

Torch-free (numpy and gguf's constants).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = 0x46554747  # "GGUF" little-endian
DEFAULT_ALIGNMENT = 32
# value type -> (struct format, size) for the fixed-size scalars
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
          10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY, FLOAT32 = 8, 9, 6
SKIPPED_PREFIX = "tokenizer.ggml."  # arrays under it are stepped over (the vocabulary, merges, scores)


class GgufHeader:
    """``metadata`` (key -> value; arrays under ``tokenizer.ggml.`` left out), ``tensors`` (list of
    ``gguf.ReaderTensor``, in file order), ``alignment`` and ``data_offset`` of ``path``."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._map)  # type: ignore[arg-type]
        self._pos = 0
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError) as e:
            raise ValueError(f"GGUF header cut short or malformed at byte {self._pos} ({type(e).__name__})") from e

    def _take(self, fmt: str, size: int) -> Any:
        value = struct.unpack_from(fmt, self._buf, self._pos)[0]
        self._pos += size
        return value

    def _string(self) -> str:
        n = self._take("<Q", 8)
        if self._pos + n > len(self._buf):
            raise IndexError("string past the end")
        s = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8")
        self._pos += n
        return s

    def _value(self, vtype: int, keep: bool) -> Any:
        if vtype == STRING:
            return self._string()
        if vtype == ARRAY:
            etype, count = self._take("<I", 4), self._take("<Q", 8)
            if etype == STRING:
                if not keep:
                    for _ in range(count):
                        self._pos += 8 + struct.unpack_from("<Q", self._buf, self._pos)[0]
                    return None
                return [self._string() for _ in range(count)]
            if etype == ARRAY:
                return [self._value(ARRAY, keep) for _ in range(count)]
            size = _SCALARS[etype][1]
            end = self._pos + size * count
            if end > len(self._buf):
                raise IndexError("array past the end")
            values: list[Any] | None = np.frombuffer(self._buf[self._pos:end], dtype=_NUMPY[etype]).tolist() \
                if keep else None
            self._pos = end
            return values
        fmt, size = _SCALARS[vtype]
        value = self._take(fmt, size)
        return float(str(np.float32(value))) if vtype == FLOAT32 else value

    def _parse(self) -> None:
        import gguf

        if len(self._buf) < 24 or self._take("<I", 4) != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        version = self._take("<I", 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not read (2 and 3 are; a big-endian file reads as another)")
        n_tensors, n_kv = self._take("<Q", 8), self._take("<Q", 8)
        # the header's own counts, under the names GGUFReader gives them
        self.metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
        for _ in range(n_kv):
            key = self._string()
            vtype = self._take("<I", 4)
            if vtype not in _SCALARS and vtype not in (STRING, ARRAY):
                raise ValueError(f"metadata {key!r} has an unknown value type {vtype}")
            value = self._value(vtype, keep=not key.startswith(SKIPPED_PREFIX))
            if value is not None:
                self.metadata[key] = value
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._take("<I", 4)
            dims = [self._take("<Q", 8) for _ in range(n_dims)]
            infos.append((name, dims, self._take("<I", 4), self._take("<Q", 8)))
        self.alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        pad = self._pos % self.alignment
        self.data_offset = self._pos + (self.alignment - pad if pad else 0)
        self.tensors: list[Any] = []
        seen: set[str] = set()
        for name, dims, raw_type, offset in infos:
            if name in seen:
                raise ValueError(f"tensor {name!r} appears twice")
            seen.add(name)
            qtype = gguf.GGMLQuantizationType(raw_type)
            n_elems = int(np.prod(dims)) if dims else 1
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n_bytes = n_elems * type_size // block
            start = self.data_offset + offset
            if start + n_bytes > len(self._map):
                raise ValueError(f"tensor {name!r} runs past the end of the file")
            shape = tuple(reversed(dims))
            item = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
                    gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
                    gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
                    gguf.GGMLQuantizationType.I64: np.int64}.get(qtype)
            raw = self._map[start:start + n_bytes]
            if item is None:
                data = raw.reshape(gguf.quant_shape_to_byte_shape(shape, qtype))
            else:
                data = raw.view(item).reshape(shape)
            self.tensors.append(gguf.ReaderTensor(name=name, tensor_type=qtype, shape=np.array(dims, dtype=np.uint64),
                                                  n_elements=n_elems, n_bytes=n_bytes, data_offset=start,
                                                  data=data, field=None))  # type: ignore[arg-type]
