"""The KV pool's memory (lockgate.runner.pool_memory): zero-filled, resident from the start, off
transparent huge pages."""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

from lockgate.runner.pool_memory import allocate_pool


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * mmap.PAGESIZE


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping holding ``addr`` (/proc/self/smaps)."""
    flags: list[str] = []
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            flags = line.split()[1:]
    return flags


def test_the_pool_is_resident_zeroed_and_off_huge_pages() -> None:
    nbytes = 256 * 2**20
    shape = (4, nbytes // (4 * 3 * 64 * 2), 3, 64)  # [layers, capacity, Hkv, D] in bf16
    before = _rss_bytes()
    pool = allocate_pool(shape, torch.bfloat16, torch.device("cpu"))
    grown = _rss_bytes() - before
    assert pool.shape == shape and pool.dtype == torch.bfloat16
    assert not pool.any()
    # every page faulted in now, not by the first steps that write it (torch.empty: ~0 bytes)
    assert grown >= 0.9 * nbytes, (grown, nbytes)
    if Path("/sys/kernel/mm/transparent_hugepage").exists():  # a kernel with THP takes the advice
        assert "nh" in _vm_flags(pool.data_ptr() + nbytes // 2)  # MADV_NOHUGEPAGE
