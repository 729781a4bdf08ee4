"""The KV pool's memory (lockgate.runner.pool_memory): zero-filled and resident from the start,
refused with a clear error when it cannot fit."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import pytest
import torch

from lockgate.runner.pool_memory import allocate_pool, available_memory_bytes


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * mmap.PAGESIZE


def _resident_share(t: torch.Tensor) -> float:
    """The share of the whole pages inside ``t``'s memory that are resident (mincore(2))."""
    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    pages = (end - start) // page
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) / pages


def test_the_pool_is_resident_and_zeroed() -> None:
    nbytes = 128 * 2**20  # per tensor
    shape = (4, nbytes // (4 * 3 * 64 * 2), 3, 64)  # [layers, capacity, Hkv, D] in bf16
    k, v = allocate_pool(shape, torch.bfloat16, torch.device("cpu"), "--kv-cache-memory 256MiB")
    # every page faulted in now, not by the first steps that write it (a fresh torch.empty: none)
    assert _resident_share(k) == 1.0 and _resident_share(v) == 1.0
    assert k.shape == v.shape == shape and k.dtype == v.dtype == torch.bfloat16
    assert k.data_ptr() != v.data_ptr() and not k.any() and not v.any()


def test_a_pool_larger_than_the_memory_available_is_refused_before_allocating() -> None:
    available = available_memory_bytes()
    assert available is not None and available > 0  # Linux: /proc/meminfo has MemAvailable
    capacity = available // (2 * 30 * 3 * 64 * 2) + 1  # K and V of 30 layers just over it
    before = _rss_bytes()
    with pytest.raises(ValueError, match=r"KV pool \(--kv-cache-memory 999GiB\) needs .* GiB but .* GiB of "
                                         r"memory is available .*--kv-cache-memory or --max-total-tokens"):
        allocate_pool((30, capacity, 3, 64), torch.bfloat16, torch.device("cpu"), "--kv-cache-memory 999GiB")
    assert _rss_bytes() - before < 64 * 2**20
