"""The KV pool's memory: allocated and faulted in at start-up.

Owns ``allocate_pool``. Invariant: the pool's pages are all resident (zero-filled) when the server
starts serving. Left to first touch (``torch.empty``), each page was faulted in by the first step
that wrote a slot in it: a fresh server's first bursts paid it inside their steps (6.6% of a
32-request burst's scheduler time, in the kernel's page zeroing), and the memory a user sized the
pool for was not really taken until used.

The pool takes whatever pages the process's malloc gives large allocations: under ``lockgate
serve`` transparent huge pages where the kernel allows them (``lockgate.server.launch``). They cost
more to fault in (on this project's VM 1.9 GiB took 2.4 s on 2 MB pages, 0.33 s on 4 KB ones), once
at start, and decode attention over long contexts reads the scattered slots faster from them (a
pool advised off huge pages lost 12-16% of shared-prefix throughput: docs/performance.md, round 14).
"""

from __future__ import annotations

import torch


def allocate_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One pool tensor (K or V) of ``shape``, zero-filled, its pages resident."""
    return torch.zeros(shape, dtype=dtype, device=device)
