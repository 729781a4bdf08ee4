"""The KV pool's memory: allocated and faulted in at start-up, on small pages.

Owns ``allocate_pool``. Invariants:

* The pool's pages are all resident when the server starts serving (zero-filled). Left to first
  touch (``torch.empty``), each page was faulted in by the first step that wrote a slot in it: a
  fresh server's first bursts paid it inside their steps (6.6% of a 32-request burst's scheduler
  time, in the kernel's page zeroing), and the memory a user sized the pool for was not really
  taken until used.
* On CPU the pool is advised off transparent huge pages (``MADV_NOHUGEPAGE``) before it is touched,
  whatever the process's malloc was told (``lockgate serve`` asks glibc for huge pages,
  ``lockgate.server.launch``): on this VM class faulting in 2 MB pages cost ~1.2 s per GiB against
  ~0.2 s on 4 KB pages (docs/performance.md, round 14). Where ``madvise`` is not available the pool
  is still zero-filled.
"""

from __future__ import annotations

import ctypes
import logging
import mmap

import torch

log = logging.getLogger("lockgate.runner")

MADV_NOHUGEPAGE = 15  # linux/mman.h


def _no_huge_pages(t: torch.Tensor) -> bool:
    """Advise the whole pages inside ``t``'s storage off transparent huge pages; True when done."""
    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if end <= start:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_NOHUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def allocate_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One pool tensor (K or V) of ``shape``, zero-filled, its pages resident."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if device.type == "cpu" and not _no_huge_pages(t):
        log.debug("madvise(MADV_NOHUGEPAGE) not applied to the KV pool")
    return t.zero_()
