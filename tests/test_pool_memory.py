"""The KV pool's memory (lockgate.runner.pool_memory): zero-filled and resident from the start,
refused with a clear error when it cannot fit."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from lockgate.runner.pool_memory import allocate_pool, available_memory_bytes


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * mmap.PAGESIZE


def test_the_pool_is_resident_and_zeroed() -> None:
    nbytes = 128 * 2**20  # per tensor
    shape = (4, nbytes // (4 * 3 * 64 * 2), 3, 64)  # [layers, capacity, Hkv, D] in bf16
    before = _rss_bytes()
    k, v = allocate_pool(shape, torch.bfloat16, torch.device("cpu"), "--kv-cache-memory 256MiB")
    grown = _rss_bytes() - before
    assert k.shape == v.shape == shape and k.dtype == v.dtype == torch.bfloat16
    assert k.data_ptr() != v.data_ptr() and not k.any() and not v.any()
    # every page faulted in now, not by the first steps that write it (torch.empty: ~0 bytes)
    assert grown >= 0.9 * 2 * nbytes, (grown, nbytes)


def test_a_pool_larger_than_the_memory_available_is_refused_before_allocating() -> None:
    available = available_memory_bytes()
    assert available is not None and available > 0  # Linux: /proc/meminfo has MemAvailable
    capacity = available // (2 * 30 * 3 * 64 * 2) + 1  # K and V of 30 layers just over it
    before = _rss_bytes()
    with pytest.raises(ValueError, match=r"KV pool \(--kv-cache-memory 999GiB\) needs .* GiB but .* GiB of "
                                         r"memory is available .*--kv-cache-memory or --max-total-tokens"):
        allocate_pool((30, capacity, 3, 64), torch.bfloat16, torch.device("cpu"), "--kv-cache-memory 999GiB")
    assert _rss_bytes() - before < 64 * 2**20
