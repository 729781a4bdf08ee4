"""Where torch's intra-op threads run: pinning them one per CPU (``LOCKGATE_PIN_THREADS``).

Owns ``cpus_to_pin`` (the rule) and ``pin_torch_threads`` (applying it through
``lockgate::bind_threads``), called by the scheduler process once it is ready and by each
tensor-parallel rank on its own CPU group (``runner/tensor_parallel.py``).
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("lockgate.runner")


PIN_ENV = "LOCKGATE_PIN_THREADS"  # "0": leave torch's threads where Linux puts them


def pin_opted_out(env: str | None) -> bool:
    """``LOCKGATE_PIN_THREADS``: unset or "1" pins where ``cpus_to_pin`` says, "0" never; anything
    else is a ValueError naming the variable (checked when the scheduler process starts)."""
    if env is None or env.strip() == "1":
        return False
    if env.strip() == "0":
        return True
    raise ValueError(f"{PIN_ENV} must be 0 or 1, got {env!r}")


def cpus_to_pin(threads: int, allowed: set[int], env: str | None) -> list[int] | None:
    """The CPU for each of torch's ``threads`` intra-op threads, or None to leave them unpinned:
    pinned only when they are as many as the process's ``allowed`` CPUs (the whole of what it may
    use: ``serve --dp N`` gives each replica fewer threads, and then nothing is pinned), at least
    two, and ``LOCKGATE_PIN_THREADS`` (``env``) is not "0"."""
    if pin_opted_out(env) or threads < 2 or threads != len(allowed):
        return None
    return sorted(allowed)


def pin_torch_threads() -> None:
    """Pin torch's intra-op threads one per CPU (``lockgate::bind_threads`` says why: two of them
    woken onto one CPU while another idles made c = 1's slow first tokens) where ``cpus_to_pin``
    says so and lockgate's kernels are loaded; called once the scheduler process has started its
    own threads (they keep every CPU). A process without torch (the sim runner) has nothing to pin
    and must not load it."""
    if "torch" not in sys.modules:
        return
    import torch

    from lockgate import kernels

    cpus = cpus_to_pin(torch.get_num_threads(), os.sched_getaffinity(0), os.environ.get(PIN_ENV))
    if cpus is None or not kernels.loaded():
        return
    tids = torch.ops.lockgate.bind_threads(cpus)
    if tids:
        log.info("pinned torch's %d threads to CPUs %s (%s=0 to leave them unpinned)", len(cpus), cpus, PIN_ENV)
    else:
        log.warning("could not pin torch's threads to CPUs %s; they stay unpinned", cpus)
