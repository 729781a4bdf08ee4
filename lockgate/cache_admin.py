"""``lockgate cache``: what lockgate keeps on disk, and removing what this version will not use again.

Owns listing and pruning ``$LOCKGATE_CACHE_DIR`` (default ``~/.cache/lockgate``). What lives there
is written by lower layers, each keyed so that a stale entry is never read, only left behind:

* ``models/<stem>-<hash>``: converted GGUFs (``lockgate.checkpoint.loader``), ~0.5 GB for the
  default model. *Stale*: the entry's record (``lockgate_source.json``, which every conversion
  has) has no sha256 (made before entries were keyed by content, when every fresh install of the
  default model made another one) or names an older converter version; a directory with no record
  is not lockgate's and is left alone; an entry of a newer converter is kept (a newer lockgate sharing the cache
  reads it). Also a ``.tmp-*`` directory (a conversion's, or a prune's) that no process holds
  locked and that has been untouched for an hour: a conversion that died.
* ``models/.digests``: the GGUFs' sha256 memos, ~100 bytes per file state seen. *Stale*: a memo
  whose GGUF is gone or has changed since (its state would key another memo, so no run reads this
  one again), or that cannot be read. Every test run's and clean clone's GGUFs used to leave theirs
  behind. Listed as one line; other files there are left alone.
* ``models/packaged/``: GGUFs assembled from PyPI wheels (``gemma-3-270m``). Kept.
* ``kernels/lockgate_cpu_<hash>``: compiled CPU kernels (``lockgate.kernels``), a few MB each.
  *Stale*: every build but this environment's current one (its name hashes the sources, the
  compiler flags and ``LOCKGATE_KERNEL_MARCH``, torch, the compiler and the CPU), unless a process
  holds its lock (compiling or loading it now). Builds made under other settings or by other
  machines sharing the cache go too; each is rebuilt on its next use (15-60 s).
* ``tuning/<kind>-<hash>.json``: the measured kernel tables (``lockgate.runner.tuning_cache``), a
  few KB each, one per key (CPU, threads, torch, kernel build, model shape, ...). *Stale*: a table
  of another kernel build than this environment's (the same rule as the builds: its key names the
  build, so no run here reads it), of an older ``TUNING_VERSION``, or that cannot be read (it
  would be measured again), unless a process holds its lock; a newer version's is kept. Each kernel
  change and test run used to leave hundreds behind. Listed as one line; each goes with its lock
  file. A lock file whose table does not exist (a measurement that failed, or a lookup before
  ``peek`` stopped taking locks for absent tables, left it) is stale too unless held, listed as one
  more line. Other files there are left alone.
* ``peers/``: ``benchmarks/compare_peers.py``'s vLLM install. Kept (delete it by hand).

Invariants: ``prune`` removes only entries ``scan`` marked stale, and nothing outside the cache
directory (a symbolic link is unlinked, never followed). A directory with a lock (a kernel build's
``lockgate.lock``, a conversion's ``.converting``) is claimed first: the lock is taken without
waiting (held elsewhere: the entry is skipped) and held while the directory is renamed to
``.tmp-prune-*``; only then is it deleted. So a process that takes the lock after the prune finds
no directory at that path (it makes a new one), and a deletion that fails midway leaves a
temporary directory no run reads, never an entry with some of its files gone. A running server
keeps what it loaded (Linux keeps a removed file's open or mapped pages).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from lockgate.checkpoint.gguf_convert import CONVERTER_VERSION
from lockgate.checkpoint.loader import CONVERTING_LOCK, SOURCE_RECORD, entry_record, memo_is_current
from lockgate.kernels import BUILD_LOCK, build_name
from lockgate.paths import cache_home
from lockgate.runner.tuning_cache import TABLE_NAME, TUNING_VERSION, lock_of, stored_key

STALE_TMP_SECONDS = 3600.0  # an unlocked temporary directory untouched this long is a leftover


@dataclass(frozen=True)
class Entry:
    path: Path
    kind: str  # "model", "kernels", "packaged", "digests", "digest-memo", "tuning", "tuning-table", "tuning-lock",
    # "peers", "other"
    bytes: int
    stale: bool
    why: str  # what it is, or why it is stale
    lock: Path | None = None  # the lock file inside it that a prune must take first


def disk_bytes(path: Path) -> int:
    """Bytes ``path`` takes on disk (allocated blocks; a directory's whole tree, links not followed)."""
    if path.is_symlink() or not path.is_dir():
        return path.lstat().st_blocks * 512
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


@contextlib.contextmanager
def _claimed(lock: Path | None) -> Iterator[bool]:
    """Hold ``lock`` (a file) without waiting: yields False when another process holds it. No lock
    file (or none named): nothing to hold, yields True."""
    if lock is None:
        yield True
        return
    try:
        f = open(lock)  # noqa: SIM115 (held across the yield)
    except FileNotFoundError:
        yield True
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True  # closing the file releases the lock


def _in_use(lock: Path) -> bool:
    with _claimed(lock) as free:
        return not free


def _model_entry(p: Path) -> Entry:
    size = disk_bytes(p)
    if p.name == ".digests":
        return Entry(p, "digests", size, False, "sha256 memos of the GGUF files seen")
    if p.name == "packaged":
        return Entry(p, "packaged", size, False, "GGUFs assembled from PyPI wheels")
    if p.name.startswith(".tmp-"):
        lock = p / CONVERTING_LOCK
        if _in_use(lock):
            return Entry(p, "model", size, False, "a conversion being written now", lock)
        idle = time.time() - p.stat().st_mtime
        return Entry(p, "model", size, idle > STALE_TMP_SECONDS,
                     f"a temporary directory no process holds, untouched for {idle / 60:.0f} min", lock)
    if p.is_symlink() or not p.is_dir():
        return Entry(p, "model", size, True, "not a converted model directory")
    record = entry_record(p)
    if record is None:  # every conversion lockgate made has one
        return Entry(p, "other", size, False, f"no {SOURCE_RECORD}: not a conversion lockgate made; left alone")
    version = record.get("converter_version")
    if "sha256" not in record or not isinstance(version, int):
        return Entry(p, "model", size, True, "made by a lockgate keyed by path; no run of this version reads it")
    if version < CONVERTER_VERSION:
        return Entry(p, "model", size, True, f"converter v{version}; this version converts with v{CONVERTER_VERSION}")
    newer = " (a newer lockgate's)" if version > CONVERTER_VERSION else ""
    return Entry(p, "model", size, False, f"converted model, converter v{version}{newer}")


MEMO_NAME = re.compile(r"[0-9a-f]{24}")  # a digest memo's file name (loader.memo_path)


def _digest_memo(p: Path) -> Entry:
    current = memo_is_current(p)
    why = {True: "the memo of a GGUF file as it is", False: "a memo of a file gone or changed since",
           None: "a memo that cannot be read"}[current]
    return Entry(p, "digest-memo", disk_bytes(p), current is not True, why)


def _digest_entries(d: Path) -> list[Entry]:
    """The memo directory (kept) and each memo (module docstring)."""
    memos = [_guarded(p, "digest-memo", _digest_memo, p) for p in sorted(d.iterdir())
             if MEMO_NAME.fullmatch(p.name) and p.is_file() and not p.is_symlink()]
    rest = disk_bytes(d) - sum(m.bytes for m in memos if m.stale)
    return [Entry(d, "digests", rest, False, f"sha256 memos of the GGUF files seen ({sum(not m.stale for m in memos)} "
                                             "current)"), *memos]


def _kernel_entry(p: Path, current: str | None, unknown: str) -> Entry:
    size, lock = disk_bytes(p), p / BUILD_LOCK
    if current is None:
        return Entry(p, "kernels", size, False, f"kernel build (this environment's is unknown: {unknown})")
    if p.name == current:
        return Entry(p, "kernels", size, False, "this environment's kernel build")
    if _in_use(lock):
        return Entry(p, "kernels", size, False, "a kernel build some process holds now", lock)
    return Entry(p, "kernels", size, True,
                 "another kernel build (other sources, flags, torch, compiler or CPU)", lock)


def _tuning_table(p: Path, current: str | None) -> Entry:
    size, lock = disk_bytes(p), lock_of(p)
    key = stored_key(p)
    if key is None:
        why, stale = "a table that cannot be read (it would be measured again)", True
    elif not isinstance(key.get("version"), int) or key["version"] < TUNING_VERSION:
        why, stale = f"tuning version {key.get('version')}; this version measures v{TUNING_VERSION}", True
    elif key["version"] > TUNING_VERSION:
        why, stale = "a newer lockgate's table", False
    elif current is not None and key.get("kernels") not in (current, "none"):
        why, stale = "a table of another kernel build", True
    else:
        why, stale = "a measured kernel table", False
    if stale and _in_use(lock):
        why, stale = "a table some process holds now", False
    return Entry(p, "tuning-table", size + (disk_bytes(lock) if lock.exists() else 0), stale, why, lock)


def _orphan_lock(p: Path) -> Entry:
    if _in_use(p):
        return Entry(p, "tuning-lock", disk_bytes(p), False, "a lock some process holds now", p)
    return Entry(p, "tuning-lock", disk_bytes(p), True, "a lock file with no table", p)


def _tuning_entries(d: Path, current: str | None) -> list[Entry]:
    """The tuning directory (kept), each of its tables and each lock file without a table (module
    docstring)."""
    files = [p for p in sorted(d.iterdir()) if p.is_file() and not p.is_symlink()]
    tables = [_guarded(p, "tuning-table", _tuning_table, p, current)
              for p in files if TABLE_NAME.fullmatch(p.name)]  # what tuning_cache writes
    orphans = [_guarded(p, "tuning-lock", _orphan_lock, p) for p in files
               if p.suffix == ".lock" and TABLE_NAME.fullmatch(p.with_suffix(".json").name)
               and not p.with_suffix(".json").exists()]
    kept = sum(not t.stale for t in tables)
    rest = disk_bytes(d) - sum(t.bytes for t in (*tables, *orphans) if t.stale)
    return [Entry(d, "tuning", rest, False, f"measured kernel tables ({kept} current)"), *tables, *orphans]


def _current_build() -> tuple[str | None, str]:
    try:
        return build_name(), ""
    except Exception as e:  # e.g. a compiler that cannot be asked its version: keep every build
        return None, f"{type(e).__name__}: {e}"


def scan(home: Path | None = None) -> list[Entry]:
    """Every entry of the cache, each marked stale or not (module docstring). An entry that vanishes
    or cannot be read while it is looked at is listed as kept, with the error."""
    home = cache_home() if home is None else home
    if not home.is_dir():
        return []
    out: list[Entry] = []
    current, unknown = _current_build()  # the builds and the tables keyed by them go by this one name
    for p in sorted(home.iterdir()):
        if p.name == "models" and p.is_dir() and not p.is_symlink():
            for m in sorted(p.iterdir()):
                if m.name == ".digests" and m.is_dir() and not m.is_symlink():
                    try:
                        out += _digest_entries(m)
                    except OSError as e:
                        out.append(Entry(m, "digests", 0, False, f"unreadable now ({e.strerror or e}); left alone"))
                else:
                    out.append(_guarded(m, "model", _model_entry, m))
        elif p.name == "kernels" and p.is_dir() and not p.is_symlink():
            out += [_guarded(k, "kernels", _kernel_entry, k, current, unknown) for k in sorted(p.iterdir())]
        elif p.name == "tuning" and p.is_dir() and not p.is_symlink():
            try:
                out += _tuning_entries(p, current)
            except OSError as e:
                out.append(Entry(p, "tuning", 0, False, f"unreadable now ({e.strerror or e}); left alone"))
        else:
            kind, why = {"peers": ("peers", "benchmarks/compare_peers.py's peer servers")}.get(
                p.name, ("other", "not lockgate's: left alone"))
            out.append(_guarded(p, kind, _plain_entry, p, kind, why))
    return out


def _plain_entry(p: Path, kind: str, why: str) -> Entry:
    return Entry(p, kind, disk_bytes(p), False, why)


def _guarded(p: Path, kind: str, make: Callable[..., Entry], *args: object) -> Entry:
    """``make(*args)``, or a kept entry naming the error when ``p`` vanishes or cannot be read meanwhile."""
    try:
        return make(*args)
    except OSError as e:
        return Entry(p, kind, 0, False, f"unreadable now ({e.strerror or e}); left alone")


def prune(entries: list[Entry]) -> tuple[list[Entry], list[tuple[Entry, str]]]:
    """Remove the stale entries: (removed, [(entry, reason) for those left in place])."""
    removed, failed = [], []
    for e in entries:
        if not e.stale:
            continue
        try:
            if e.path.is_symlink() or not e.path.is_dir():
                with _claimed(e.lock) as free:  # a tuning table's lock file (others have none)
                    if not free:
                        failed.append((e, "a process took its lock since it was listed"))
                        continue
                    e.path.unlink()
                    if e.lock is not None:
                        e.lock.unlink(missing_ok=True)
                removed.append(e)
                continue
            doomed = e.path.with_name(f".tmp-prune-{secrets.token_hex(6)}-{e.path.name}")
            with _claimed(e.lock) as free:
                if not free:
                    failed.append((e, "a process took its lock since it was listed"))
                    continue
                os.rename(e.path, doomed)  # under the lock: who takes it next finds no such entry
            shutil.rmtree(doomed)
            removed.append(e)
        except OSError as err:
            failed.append((e, str(err)))
    return removed, failed


# Small files listed as one line per kind (the directory's own line counts the kept ones): the
# line's name and why they are stale.
SUMMED = {
    "digest-memo": ("models/.digests/ ({} memos)", "of GGUF files gone or changed since, or unreadable"),
    "tuning-table": ("tuning/ ({} tables)", "of other kernel builds or older tuning versions, or unreadable"),
    "tuning-lock": ("tuning/ ({} lock files)", "with no table (a failed measurement or an older lookup left it)"),
}


def human(n: float) -> str:
    for unit in ("B", "KB", "MB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def cache_main(do_prune: bool) -> int:
    """``lockgate cache [--prune]``: print the table; with --prune remove the stale entries.
    Exit 1 when some stale entry could not be removed, 2 when the cache path is not a directory."""
    home = cache_home()
    if home.exists() and not home.is_dir():
        print(f"lockgate: error: the cache directory {home} (LOCKGATE_CACHE_DIR or ~/.cache/lockgate) "
              "is not a directory", file=sys.stderr)
        return 2
    entries = scan(home)
    if not entries:
        print(f"lockgate cache: {home} is empty or absent")
        return 0
    print(f"lockgate cache: {home} ({human(sum(e.bytes for e in entries))})")
    rows = [(str(e.path.relative_to(home)), e.bytes, e.stale, e.why) for e in entries if e.kind not in SUMMED]
    for kind, (label, why) in SUMMED.items():  # hundreds of small files: one line per kind
        stale_ones = [e for e in entries if e.kind == kind and e.stale]
        if stale_ones:
            rows.append((label.format(len(stale_ones)), sum(e.bytes for e in stale_ones), True, why))
    width = max(len(r[0]) for r in rows)
    for name, size, is_stale, why in rows:
        print(f"  {name:<{width}}  {human(size):>9}  {'stale' if is_stale else 'kept '}  {why}")
    stale = [e for e in entries if e.stale]
    if not do_prune:
        if stale:
            print(f"{len(stale)} stale entries, {human(sum(e.bytes for e in stale))}: "
                  "`lockgate cache --prune` removes them")
        else:
            print("nothing stale")
        return 0
    removed, failed = prune(entries)
    print(f"removed {len(removed)} stale entries, freed {human(sum(e.bytes for e in removed))}")
    for e, why in failed:
        print(f"lockgate: error: left {e.path} in place: {why}", file=sys.stderr)
    return 1 if failed else 0
