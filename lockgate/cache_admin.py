"""``lockgate cache``: what lockgate keeps on disk, and removing what this version will not use again.

Owns listing and pruning ``$LOCKGATE_CACHE_DIR`` (default ``~/.cache/lockgate``). What lives there
is written by lower layers, each keyed so that a stale entry is never read, only left behind:

* ``models/<stem>-<hash>``: converted GGUFs (``lockgate.checkpoint.loader``), ~0.5 GB for the
  default model. *Stale*: the entry records an older converter version, or records nothing (made
  before entries recorded their source, when the key was the GGUF's path, so every fresh install
  of the default model made another one); also a ``.tmp-*`` directory untouched for an hour (a
  conversion that died).
* ``models/packaged/``: GGUFs assembled from PyPI wheels (``gemma-3-270m``). Kept.
* ``kernels/lockgate_cpu_<hash>``: compiled CPU kernels (``lockgate.kernels``), a few MB each.
  *Stale*: any build but this machine's current one (older sources, another torch, compiler or
  CPU); a build some process is compiling (its lock held) is skipped. A cache shared by several
  machines loses their builds too; each rebuilds once (15-60 s).
* ``tuning/``: the measured kernel tables (``lockgate.runner.tuning``), kilobytes. Kept.
* ``peers/``: ``benchmarks/compare_peers.py``'s vLLM install. Kept (delete it by hand).

Invariants: ``prune`` removes only entries ``scan`` marks stale and nothing outside the cache
directory; a directory is first renamed to ``.tmp-prune-*`` (one atomic step) and then deleted, so
a removal that fails midway leaves a temporary directory no run reads (a later prune takes it),
never an entry with some of its files gone. A running server keeps what it loaded (Linux keeps
a removed file's open or mapped pages).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

STALE_TMP_SECONDS = 3600.0  # a conversion's temporary directory untouched this long is a leftover


@dataclass(frozen=True)
class Entry:
    path: Path
    kind: str  # "model", "kernels", "packaged", "tuning", "peers", "other"
    bytes: int
    stale: bool
    why: str  # what it is, or why it is stale


def cache_home() -> Path:
    return Path(os.environ.get("LOCKGATE_CACHE_DIR") or Path.home() / ".cache" / "lockgate").expanduser()


def disk_bytes(path: Path) -> int:
    """Bytes ``path`` takes on disk (allocated blocks; a directory's whole tree)."""
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_blocks * 512
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def _model_entries(models: Path) -> list[Entry]:
    from lockgate.checkpoint.gguf_convert import CONVERTER_VERSION
    from lockgate.checkpoint.loader import entry_converter

    out = []
    for p in sorted(models.iterdir()):
        if p.name == ".digests":
            out.append(Entry(p, "model", disk_bytes(p), False, "content digests of GGUF files seen (memos)"))
        elif p.name == "packaged":
            out.append(Entry(p, "packaged", disk_bytes(p), False, "GGUFs assembled from PyPI wheels"))
        elif p.name.startswith(".tmp-"):
            idle = time.time() - p.stat().st_mtime
            out.append(Entry(p, "model", disk_bytes(p), idle > STALE_TMP_SECONDS,
                             f"a conversion's temporary directory, untouched for {idle / 60:.0f} min"))
        elif p.is_dir():
            version = entry_converter(p)
            if version == CONVERTER_VERSION:
                out.append(Entry(p, "model", disk_bytes(p), False, f"converted model (converter v{version})"))
            else:
                made = "an older lockgate (no source record)" if version is None else f"converter v{version}"
                out.append(Entry(p, "model", disk_bytes(p), True,
                                 f"made by {made}; this version converts with v{CONVERTER_VERSION}"))
    return out


def _building(build: Path) -> bool:
    """Whether some process holds the build's lock (compiling it now)."""
    lock = build / "lockgate.lock"
    if not lock.is_file():
        return False
    with open(lock) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


def _kernel_entries(kernels: Path) -> list[Entry]:
    from lockgate.kernels import build_name

    current = build_name()
    out = []
    for p in sorted(kernels.iterdir()):
        if p.name == current:
            out.append(Entry(p, "kernels", disk_bytes(p), False, "this machine's current kernel build"))
        elif _building(p):
            out.append(Entry(p, "kernels", disk_bytes(p), False, "a kernel build being compiled now"))
        else:
            out.append(Entry(p, "kernels", disk_bytes(p), True,
                             "another kernel build (older sources, another torch, compiler or CPU)"))
    return out


def scan(home: Path | None = None) -> list[Entry]:
    """Every top-level entry of the cache, each marked stale or not (module docstring)."""
    home = cache_home() if home is None else home
    if not home.is_dir():
        return []
    out: list[Entry] = []
    for p in sorted(home.iterdir()):
        if p.name == "models" and p.is_dir():
            out += _model_entries(p)
        elif p.name == "kernels" and p.is_dir():
            out += _kernel_entries(p)
        elif p.name == "tuning":
            out.append(Entry(p, "tuning", disk_bytes(p), False, "measured kernel tables"))
        elif p.name == "peers":
            out.append(Entry(p, "peers", disk_bytes(p), False, "benchmarks/compare_peers.py's peer servers"))
        else:
            out.append(Entry(p, "other", disk_bytes(p), False, "not lockgate's: left alone"))
    return out


def prune(entries: list[Entry]) -> tuple[list[Entry], list[tuple[Entry, str]]]:
    """Remove the stale entries: (removed, [(entry, error) for those that could not be])."""
    removed, failed = [], []
    for e in entries:
        if not e.stale:
            continue
        try:
            if e.path.is_dir() and not e.path.is_symlink():
                # out of the way first (one rename): a removal that fails midway leaves a .tmp-
                # directory no run reads, never an entry with some of its files gone
                doomed = e.path.with_name(f".tmp-prune-{os.getpid()}-{e.path.name}")
                os.rename(e.path, doomed)
                shutil.rmtree(doomed)
            else:
                e.path.unlink()
            removed.append(e)
        except OSError as err:
            failed.append((e, str(err)))
    return removed, failed


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def cache_main(do_prune: bool) -> int:
    """``lockgate cache [--prune]``: print the table; with --prune remove the stale entries."""
    home = cache_home()
    entries = scan(home)
    if not entries:
        print(f"lockgate cache: {home} is empty or absent")
        return 0
    total = sum(e.bytes for e in entries)
    print(f"lockgate cache: {home} ({human(total)})")
    width = max(len(str(e.path.relative_to(home))) for e in entries)
    for e in entries:
        mark = "stale" if e.stale else "kept "
        print(f"  {str(e.path.relative_to(home)):<{width}}  {human(e.bytes):>9}  {mark}  {e.why}")
    stale = [e for e in entries if e.stale]
    stale_bytes = sum(e.bytes for e in stale)
    if not do_prune:
        if stale:
            print(f"{len(stale)} stale entries, {human(stale_bytes)}: `lockgate cache --prune` removes them")
        else:
            print("nothing stale")
        return 0
    removed, failed = prune(entries)
    print(f"removed {len(removed)} stale entries, freed {human(sum(e.bytes for e in removed))}")
    for e, err in failed:
        print(f"lockgate: error: could not remove {e.path}: {err}")
    return 1 if failed else 0
