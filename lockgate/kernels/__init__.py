"""lockgate's own CPU kernels (C++, ``lockgate/kernels/csrc``), built on first use and cached.

Owns compiling and loading the kernels and telling callers whether they are there. The kernels
register torch operators in the ``lockgate`` namespace (``torch.ops.lockgate.<name>``); their
contracts are documented at the top of each source file:

* ``decode_attention`` (``decode_attention.cpp``): one query token per sequence against its
  keys, read from the slot-indexed KV pool in place by slot (no gathered copy, no padding).
* ``add_rms_norm_``, ``silu_mul``, ``rope_write_kv`` (``fused_ops.cpp``): the element-wise runs
  between a layer's matmuls in one call each, rounding where the torch ops they replace round.

Building: ``torch.utils.cpp_extension.load`` compiles the sources with the machine's C++
compiler (``-O3 -march=native``: the code is built where it runs) into
``$LOCKGATE_CACHE_DIR/kernels/<name>`` (default ``~/.cache/lockgate/kernels``), where ``<name>`` carries
a hash of the sources, the flags and the torch version, so a changed source or torch builds
anew and different checkouts never share a stale build. About 15 s the first time on 2 cores,
milliseconds after; concurrent processes wait on torch's build lock instead of racing (a lock left
by a build that died is removed after ``STALE_LOCK_SECONDS``).

Invariants: ``load()`` runs the build at most once per process and never raises: on a machine
without a compiler (or any build error) it logs why and returns False, and callers keep their
pure-torch path. ``LOCKGATE_CPU_KERNELS=0`` in the environment disables the kernels, as does
``--cpu-kernels off``. Called by ``lockgate.runner.model_runner`` (at start-up) and tests.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger("lockgate.kernels")

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(sorted(CSRC.glob("*.cpp")))
HEADERS = tuple(sorted(CSRC.glob("*.h")))
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math")
MODES = ("auto", "off")

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "error": str


def cache_dir() -> Path:
    root = os.environ.get("LOCKGATE_CACHE_DIR") or str(Path.home() / ".cache" / "lockgate")
    return Path(root).expanduser() / "kernels"


def build_name() -> str:
    """A name unique to the sources, the flags and the torch build."""
    h = hashlib.sha256()
    for src in (*SOURCES, *HEADERS):
        h.update(src.name.encode())
        h.update(src.read_bytes())
    h.update(" ".join(CFLAGS).encode())
    h.update(torch.__version__.encode())
    return f"lockgate_cpu_{h.hexdigest()[:12]}"


def load(mode: str = "auto") -> bool:
    """Build (first time) and load the kernels; True when ``torch.ops.lockgate`` has them.

    ``mode``: auto (build and use them when possible) or off (never; returns False)."""
    if mode not in MODES:
        raise ValueError(f"--cpu-kernels must be one of {MODES}, got {mode!r}")
    if mode == "off" or os.environ.get("LOCKGATE_CPU_KERNELS", "1") == "0":
        return False
    with _lock:
        if "ok" not in _state:
            _state["ok"], _state["error"] = _build()
        return bool(_state["ok"])


def error() -> str | None:
    """Why the last ``load`` failed, or None."""
    err = _state.get("error")
    return None if err is None else str(err)


STALE_LOCK_SECONDS = 600.0  # a build takes ~15 s; a lock this old belongs to a build that died


def _drop_stale_lock(lock: Path) -> None:
    """torch's build lock is a file; a process killed mid-build leaves it, and every later load
    would wait on it forever. One older than STALE_LOCK_SECONDS is removed."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        log.warning("removing %s, left %.0f s ago by a kernel build that did not finish", lock, age)
        lock.unlink(missing_ok=True)


def _build() -> tuple[bool, str | None]:
    from torch.utils import cpp_extension

    name = build_name()
    where = cache_dir() / name
    t0 = time.perf_counter()
    try:
        where.mkdir(parents=True, exist_ok=True)
        _drop_stale_lock(where / "lock")
        fresh = not any(where.glob("*.so"))
        if fresh:
            log.info("compiling lockgate CPU kernels into %s (first run on this machine, ~15 s)", where)
        cpp_extension.load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=list(CFLAGS),
                           extra_include_paths=[str(CSRC)],
                           build_directory=str(where), is_python_module=False, verbose=False)
    except Exception as e:  # a missing compiler, headers or ninja: keep the torch path
        msg = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        log.warning("lockgate CPU kernels unavailable, using plain torch ops instead (%s)", msg)
        return False, msg
    if fresh:
        log.info("lockgate CPU kernels built in %.1fs", time.perf_counter() - t0)
    return True, None
