"""The 8-bit KV pool in torch (``--kv-cache-dtype int8 / fp8``): its tensors' dtype and shape, the
quantization of rows as they are written, and reading rows back as float32.

Owns the torch side of ``lockgate.kvcache.kv_dtype``'s format (the C++ side: kernels/csrc/kv_quant.h,
the same bytes): a pool tensor of an 8-bit tier is [..., D + 4] of torch.int8 (int8) or
torch.float8_e4m3fn (fp8), each row D codes followed by its float32 scale's four bytes. ``quantize``
rounds exactly as the kernels' write path does (products and quotients in float32, round half to
even; e4m3fn by torch's conversion, which is c10's), so tests compare the two bit for bit.

``dequantize`` reads gathered rows back (``code * scale``): ``masked_attention`` uses it on the rows
of the step's contexts it gathers (never the whole pool); the attention kernels read the codes in
place. Invariant: a row's codes and scale depend on that row's own values only.
"""

from __future__ import annotations

import torch

from lockgate.kvcache.kv_dtype import FP8_MAX, INT8_MAX, SCALE_BYTES

POOL_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def is_quantized(pool: torch.Tensor) -> bool:
    return pool.dtype in (torch.int8, torch.float8_e4m3fn)


def head_dim(pool: torch.Tensor) -> int:
    """The head size of a pool tensor's rows (the last dimension less the scale for an 8-bit pool)."""
    return int(pool.shape[-1]) - (SCALE_BYTES if is_quantized(pool) else 0)


def pool_shape(kv_shape: tuple[int, ...], kind: str) -> tuple[int, ...]:
    """The shape of a pool tensor for the model's [..., D] K/V shape: [..., D + 4] for an 8-bit tier."""
    return (*kv_shape[:-1], kv_shape[-1] + SCALE_BYTES) if kind in POOL_DTYPES else tuple(kv_shape)


def quantize(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x [..., D] (float32 or bf16: the run dtype's values) -> [..., D + 4] rows of ``kind``'s pool."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    top = INT8_MAX if kind == "int8" else FP8_MAX
    scale = amax / top
    # top / amax as one float32 division (a Python number over a tensor is a reciprocal times it in torch)
    inv = torch.where(amax > 0, torch.full_like(amax, top) / amax, torch.zeros_like(amax))
    v = xf * inv
    if kind == "int8":
        codes = torch.round(v).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    else:
        codes = v.to(torch.float8_e4m3fn).view(torch.int8)
    tail = scale.contiguous().view(torch.int8)  # [..., 4]: the float32 scale's bytes
    return torch.cat([codes, tail], dim=-1).view(POOL_DTYPES[kind])


def dequantize(rows: torch.Tensor) -> torch.Tensor:
    """Rows of an 8-bit pool [..., D + 4] -> their values [..., D] float32 (code * scale)."""
    d = head_dim(rows)
    codes = rows[..., :d].float()
    scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return codes * scale


def read_rows(pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``pool[index]`` as float32 values, whatever the pool's dtype."""
    rows = pool[index]
    return dequantize(rows) if is_quantized(pool) else rows.float()
