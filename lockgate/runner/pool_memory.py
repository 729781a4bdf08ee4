"""The KV pool's memory: checked against the memory available, allocated and faulted in at start-up.

Owns ``allocate_pool``. Invariants:

* The pool's pages are all resident (zero-filled) when the server starts serving. Left to first
  touch (``torch.empty``), each page was faulted in by the first step that wrote a slot in it: a
  fresh server's first bursts paid it inside their steps (6.6% of a 32-request burst's scheduler
  time, in the kernel's page zeroing), and the memory a user sized the pool for was not really
  taken until used.
* A CPU pool larger than the memory available now (``MemAvailable``) is refused with a
  ``ValueError`` naming the size, the limit and the flag that set it, before anything is allocated
  (zero-filling it would otherwise end in the allocator's error or the kernel's OOM killer).

The pool takes whatever pages the process's malloc gives large allocations: under ``lockgate
serve`` transparent huge pages where the kernel allows them (``lockgate.server.launch``). They cost
more to fault in (on an AMD EPYC Zen 5 class VM, 1.9 GiB took 2.4 s on 2 MB pages,
0.33 s on 4 KB ones), once at start, and decode attention over long contexts reads the scattered
slots faster from them (a pool advised off huge pages lost 12-16% of shared-prefix throughput on
that CPU).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch


def available_memory_bytes() -> int | None:
    """``MemAvailable`` from /proc/meminfo, or None where it is not known."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def allocate_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                  sized_by: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool's K and V tensors, each of ``shape``, zero-filled, pages resident. ``sized_by``:
    the flag and value the size came from, for the error."""
    nbytes = 2 * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    available = available_memory_bytes() if device.type == "cpu" else None
    if available is not None and nbytes > available:
        raise ValueError(f"the KV pool ({sized_by}) needs {nbytes / 2**30:.2f} GiB but {available / 2**30:.2f} GiB "
                         f"of memory is available (MemAvailable); give a smaller --kv-cache-memory or "
                         f"--max-total-tokens")
    return (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
