"""Linear: the packed oneDNN path (bf16 on CPU) and the plain path both equal F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lockgate.layers.linear import Linear, onednn_packs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_equals_f_linear(dtype: torch.dtype, rows: int, with_bias: bool) -> None:
    torch.manual_seed(rows)
    w = torch.randn(96, 64).to(dtype)
    b = torch.randn(96).to(dtype) if with_bias else None
    lin = Linear(w, b)
    assert (lin.packed is not None) == onednn_packs(dtype, w.device)
    x = torch.randn(rows, 64).to(dtype)
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lin(x.view(1, rows, 64)), F.linear(x, w, b).view(1, rows, 96), atol=1e-2, rtol=1e-2)


def test_float32_is_never_packed() -> None:
    assert not onednn_packs(torch.float32, torch.device("cpu"))
