"""The CPU a tuning was measured on, the key every tuning is stored under, and the files they live in.

Owns describing the CPU (``cpu_description``: model name with family, model and stepping numbers,
and the full flag list), torch's build with any instruction-set switches (``torch_build``),
``TuningKey`` and its cache files: ``peek`` reads a stored result, ``cached`` reads it or measures
and stores it, ``peek_table`` and ``cached_table`` do the same for the matmul forms' and attention
paths' ``kernel_choice.TuningTable`` (the one place such a table is loaded and saved); ``TABLE_NAME``, ``lock_of`` and ``stored_key`` tell ``lockgate cache`` which files
are tables, their locks, and what each was keyed by. What is measured and how it is decided are ``lockgate.runner.tuning``'s (matmul
forms, dtype), ``tuning_attention``'s and ``row_invariance``'s; ``form_choice`` builds the keys.

Cache: ``$LOCKGATE_CACHE_DIR/tuning/<kind>-<hash>.json`` (default ``~/.cache/lockgate``;
``$LOCKGATE_TUNING_DIR`` moves the tuning files alone), the hash
over ``TuningKey``: the CPU's model name (with its family, model and stepping numbers) and full
flag list, torch's thread count and version,
the kernels' build name (their sources' hash), ``TUNING_VERSION``, the model's shape and what
decides the forms each role has (the checkpoint's content fingerprint, ``--quantization``, float32
copies). That key is known before the weights load, so a cached table (``peek``) tells the loader
which forms to build at all. One process measures at a time under an ``flock`` (replicas of one server
start together: the second finds the first's result).

Invariants: a stored result is returned only for a key equal to the one it was stored under (a
corrupt or foreign file reads as missing, so it is measured again; so does a table in a layout
``TuningTable.from_json`` refuses, while one stored before the layout had a version is read
through its converter and gives the same choices); one process measures a key at
a time; a cache that cannot be written costs a warning and a measurement next start, never the
start.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from lockgate.kernel_choice import TuningTable
from lockgate.paths import cache_home

log = logging.getLogger("lockgate.tuning")

TUNING_VERSION = 7  # bump when what is measured or how it is decided changes (every key carries it)


# torch's, oneDNN's and MKL's own instruction-set switches: what is measured under one setting does
# not hold under another (docs/serving.md, "Another CPU's paths on this one")
ISA_SWITCHES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def torch_build() -> str:
    """torch's version, then every instruction-set switch set in the environment (none: the
    version alone, so a plain start keeps the key it always had)."""
    return " ".join([torch.__version__, *(f"{k}={os.environ[k]}" for k in ISA_SWITCHES if os.environ.get(k))])


def cpu_description(cpuinfo: str | None = None) -> dict[str, str]:
    """The CPU's model name with its family, model and stepping numbers, and its flags, from
    ``cpuinfo`` (default: /proc/cpuinfo's text; what is known elsewhere). The numbers are part of
    the name because a hypervisor may show two cores as the same "AMD EPYC" with nearly the same
    flags: a Zen 4 (family 25) and a Zen 5 (family 26) part differ by half in bf16 matmul rate, so
    their measurements must not share a cache entry."""
    name, flags = platform.processor() or platform.machine(), ""
    if cpuinfo is None:
        cpuinfo = ""
        with contextlib.suppress(OSError):
            cpuinfo = Path("/proc/cpuinfo").read_text()
    ids: dict[str, str] = {}
    for line in cpuinfo.splitlines():  # the first processor's block: it ends at its flags
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and name in ("", platform.machine(), platform.processor()):
            name = value.strip()
        elif key in ("cpu family", "model", "stepping") and key not in ids:
            ids[key] = value.strip()
        elif key == "flags":
            flags = value.strip()
            break
    if ids:
        name += " (" + ", ".join(f"{'family' if k == 'cpu family' else k} {v}" for k, v in ids.items()) + ")"
    return {"cpu": name, "flags": flags}


def notable_flags(flags: str) -> str:
    """The flags that tell CPU classes apart, for logs (the key keeps all of them)."""
    keep = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16",
            "amx_tile")
    have = set(flags.split())
    return " ".join(f for f in keep if f in have) or "none of avx2/avx512/amx"


@dataclass(frozen=True)
class TuningKey:
    """Everything a measurement depends on. Two runs with equal keys may share a result."""

    kind: str  # "forms" or "dtype"
    cpu: str
    flags: str
    threads: int
    torch: str
    kernels: str  # the kernels' build name (hash of their sources, flags, compiler) or "none"
    shape: dict[str, int]  # the model's dimensions
    dtype: str
    # kind "forms": what decides which forms the projections have (checkpoint fingerprint,
    # --quantization, float32 copies), known before the weights are loaded
    weights: dict[str, Any] = field(default_factory=dict)
    version: int = TUNING_VERSION

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def cache_dir() -> Path:
    """``$LOCKGATE_TUNING_DIR``, else ``$LOCKGATE_CACHE_DIR/tuning`` (default ``~/.cache/lockgate/tuning``)."""
    if os.environ.get("LOCKGATE_TUNING_DIR"):
        return Path(os.environ["LOCKGATE_TUNING_DIR"]).expanduser()
    return cache_home() / "tuning"


TABLE_NAME = re.compile(r"[a-z_]+-[0-9a-f]{16}\.json")  # a table's file name: <kind>-<TuningKey.digest()>.json


def lock_of(table: Path) -> Path:
    """The lock file held while ``table`` is read, measured or written."""
    return table.with_suffix(".lock")


def stored_key(table: Path) -> dict[str, Any] | None:
    """The key a table file was stored under (``asdict(TuningKey)``), or None when it cannot be read."""
    try:
        data = json.loads(table.read_text())
    except (OSError, ValueError):
        return None
    key = data.get("key") if isinstance(data, dict) else None
    return key if isinstance(key, dict) else None


def _table_path(key: TuningKey) -> Path:
    return cache_dir() / f"{key.kind}-{key.digest()}.json"


@contextlib.contextmanager
def _locked(key: TuningKey) -> Iterator[Path]:
    """The cache file of ``key``, held under an exclusive lock (the OS drops it if we die)."""
    path = _table_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_of(path), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield path


def _read(path: Path, key: TuningKey) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("key") == asdict(key) else None


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


def peek(key: TuningKey) -> dict[str, Any] | None:
    """The stored result for ``key``, or None (never measures). A key with no table returns None
    at once, taking no lock: a lookup would otherwise leave a lock file for every key it asked
    about (a table is replaced whole, so reading one needs the lock only to wait for a writer).
    A table another process is measuring right now is then not waited for: the caller builds
    every form, and ``cached`` waits for that table later."""
    if not _table_path(key).exists():
        return None
    with _locked(key) as path:
        data = _read(path, key)
    if data is not None:
        data["path"] = str(path)
    return data


def cached(key: TuningKey, measure: Callable[[], dict[str, Any]], refresh: bool = False,
           readable: Callable[[dict[str, Any]], bool] = lambda data: True) -> tuple[dict[str, Any], bool]:
    """(the stored result for ``key``, whether it came from the cache); measured (and stored) when
    missing, unreadable (``readable`` says no) or ``refresh``."""
    with _locked(key) as path:
        data = None if refresh else _read(path, key)
        if data is not None and readable(data):
            data["path"] = str(path)
            return data, True
        t0 = time.perf_counter()
        result = measure()
        data = {**result, "key": asdict(key), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "seconds": round(time.perf_counter() - t0, 2)}
        try:
            _write(path, data)
        except OSError as e:  # a read-only cache: keep going with what was measured
            log.warning("could not store the tuning result in %s: %s", path, e)
        data["path"] = str(path)
        return data, False


# ---- the kernel choice's table (kind "forms") ----

_NOT_STORED = ("source", "cached")  # what a table says about this start, not about the measurement


def _table_of(data: dict[str, Any]) -> TuningTable | None:
    try:
        return TuningTable.from_json(data)
    except ValueError as e:
        log.info("a stored tuning table cannot be read (%s): it is measured again", e)
        return None


def peek_table(key: TuningKey) -> TuningTable | None:
    """The stored table for ``key`` (``peek``), or None: none stored, or in a layout this version
    does not read."""
    data = peek(key)
    if data is None or (table := _table_of(data)) is None:
        return None
    return replace(table, source=f"cached {data['path']}", cached=True)


def cached_table(key: TuningKey, measure: Callable[[], TuningTable], refresh: bool = False) -> TuningTable:
    """The stored table for ``key``, else (missing, unreadable, in another layout, or ``refresh``)
    ``measure()``'s, stored; ``source`` says which and where, ``seconds`` how long it took."""
    def measured() -> dict[str, Any]:
        return {k: v for k, v in measure().to_json().items() if k not in _NOT_STORED}

    data, hit = cached(key, measured, refresh, readable=lambda d: _table_of(d) is not None)
    table = TuningTable.from_json(data)
    how = "cached " if hit else f"measured in {table.seconds:.1f}s, "
    return replace(table, source=how + data["path"], cached=hit)
