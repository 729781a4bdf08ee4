"""Where lockgate keeps files between runs: ``cache_home()``.

Owns the one rule for it: ``$LOCKGATE_CACHE_DIR`` when set, else ``~/.cache/lockgate``. Each
subdirectory belongs to the unit that writes it: ``models/`` (``lockgate.checkpoint.loader``),
``kernels/`` (``lockgate.kernels``), ``tuning/`` (``lockgate.runner.tuning_cache``, which
``$LOCKGATE_TUNING_DIR`` moves alone), ``peers/`` (``benchmarks/compare_peers.py``'s vLLM);
``lockgate cache`` (``lockgate.cache_admin``) lists and prunes them. Torch-free, no I/O.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    """``$LOCKGATE_CACHE_DIR`` (``~`` expanded), else ``~/.cache/lockgate``; read on every call."""
    return Path(os.environ.get("LOCKGATE_CACHE_DIR") or Path.home() / ".cache" / "lockgate").expanduser()
