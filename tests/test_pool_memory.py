"""The KV pool's memory (lockgate.runner.pool_memory): zero-filled and resident from the start."""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

from lockgate.runner.pool_memory import allocate_pool


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * mmap.PAGESIZE


def test_the_pool_is_resident_and_zeroed() -> None:
    nbytes = 256 * 2**20
    shape = (4, nbytes // (4 * 3 * 64 * 2), 3, 64)  # [layers, capacity, Hkv, D] in bf16
    before = _rss_bytes()
    pool = allocate_pool(shape, torch.bfloat16, torch.device("cpu"))
    grown = _rss_bytes() - before
    assert pool.shape == shape and pool.dtype == torch.bfloat16
    assert not pool.any()
    # every page faulted in now, not by the first steps that write it (torch.empty: ~0 bytes)
    assert grown >= 0.9 * nbytes, (grown, nbytes)
