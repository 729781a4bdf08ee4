"""The KV pool's storage format (``--kv-cache-dtype``, vLLM's flag and values): names, bytes per token.

Owns what a pool slot holds per layer and kv head, torch-free (the runner allocates the tensors;
``lockgate.layers.kv_quant`` reads and writes them in torch; the kernels in C++):

* ``auto``: K and V in the run dtype (``--dtype``), exact. ``bfloat16`` / ``float16`` name that
  dtype explicitly: accepted when the run dtype is the one named (the pool is never kept in another
  16-bit dtype than the model's), else a start-up error naming both.
* ``int8`` and ``fp8`` (= ``fp8_e4m3``, vLLM's meaning: OCP e4m3fn, largest value 448): an
  inexact tier. Each (token, kv head) row of D values is stored as D one-byte codes followed by its
  own float32 scale (``SCALE_BYTES``): row bytes ``D + 4``. int8: scale = max|x| / 127, code =
  round-half-even(x * 127 / max|x|) in [-127, 127]; fp8: scale = max|x| / 448, code = e4m3fn(x * 448 /
  max|x|) (round to nearest even). A row of zeros has scale 0 and codes 0. The value read back is
  ``code * scale``.

Invariants: a row's codes and scale are a function of that token's own K (or V) values in that
layer and head only (quantized when written, per token and head), so what a token's slot holds never
depends on its batch, its chunk or which request wrote it: the prefix cache shares a slot's
quantized K/V exactly as it shares exact ones, and determinism per tier holds where the exact path
has it. Capacity is counted honestly: ``bytes_per_token`` includes the scales.
"""

from __future__ import annotations

from lockgate.config import KV_CACHE_DTYPES

QUANTIZED = ("int8", "fp8")  # canonical names of the 8-bit tiers
ALIASES = {"fp8_e4m3": "fp8"}
SCALE_BYTES = 4  # each row's float32 scale, stored after its D codes
FP8_MAX = 448.0  # e4m3fn's largest finite value
INT8_MAX = 127.0


def canonical(name: str) -> str:
    """The flag's value as lockgate names it (``fp8_e4m3`` -> ``fp8``); ValueError naming the flag."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {name!r}")
    return ALIASES.get(name, name)


def is_quantized(name: str) -> bool:
    return canonical(name) in QUANTIZED


def row_bytes(head_dim: int, name: str, elem: int) -> int:
    """Bytes of one (token, layer, kv head) row of K (or of V): ``elem``-byte values, or 8-bit codes
    plus their scale."""
    return head_dim + SCALE_BYTES if is_quantized(name) else head_dim * elem


def bytes_per_token(layers: int, kv_heads: int, head_dim: int, name: str, elem: int) -> int:
    """Pool bytes of one token slot: K and V rows in every layer and kv head (scales included)."""
    return layers * 2 * kv_heads * row_bytes(head_dim, name, elem)


def resolve(name: str, run_dtype: str) -> str:
    """The pool format for ``--kv-cache-dtype name`` with the model in ``run_dtype`` (``float32``,
    ``bfloat16`` or ``float16``): ``auto`` (the run dtype) or a quantized tier; ValueError naming the
    flag when a 16-bit name is not the run dtype."""
    kind = canonical(name)
    if kind in ("bfloat16", "float16"):
        if kind != run_dtype:
            raise ValueError(f"--kv-cache-dtype {name}: the KV pool is kept in the model's dtype ({run_dtype}) or "
                             f"at 8 bits (int8, fp8); give --dtype {kind} to keep it in {kind}, or --kv-cache-dtype "
                             f"auto")
        return "auto"
    return kind


def describe(kind: str, run_dtype: str) -> str:
    """How the log and ``/v1/loads`` name a resolved pool format."""
    if kind == "int8":
        return "int8 (per token and head scales; inexact tier)"
    if kind == "fp8":
        return "fp8_e4m3 (per token and head scales; inexact tier)"
    return f"{run_dtype} (auto: the model's dtype, exact)"
