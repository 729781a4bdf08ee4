"""``lockgate cache``: which entries it calls stale, and that ``--prune`` removes exactly those.

The cache is a temporary ``LOCKGATE_CACHE_DIR`` holding one real conversion (a small GGUF
written by ``test_gguf_families``' writer, converted by lockgate) next to entries shaped like what
older and newer versions, dead and live conversions, other kernel builds and the benchmark leave;
the command runs as a real process. Locks "held by another process" are held by this one, on its
own file descriptions, which ``flock`` treats the same way.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time

from test_gguf_families import CASES

from lockgate import cache_admin
from lockgate.cache_admin import prune, scan
from lockgate.checkpoint.gguf_convert import CONVERTER_VERSION
from lockgate.checkpoint.loader import CONVERTING_LOCK, SOURCE_RECORD, entry_record, prepare_model_dir
from lockgate.kernels import _build_lock, build_name


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lockgate.cli", "cache", *args], env=env, capture_output=True,
                          text=True, timeout=300)


def _locked(path):  # type: ignore[no-untyped-def]
    f = open(path, "a")  # noqa: SIM115 (the caller closes it)
    fcntl.flock(f, fcntl.LOCK_EX)
    return f


def _copy_with_record(src, dst, **changes) -> None:  # type: ignore[no-untyped-def]
    shutil.copytree(src, dst)
    record = {k: v for k, v in {**entry_record(src), **changes}.items() if v is not None}
    (dst / SOURCE_RECORD).write_text(json.dumps(record))


def test_cache_lists_stale_entries_and_prune_removes_only_them(tmp_path, monkeypatch) -> None:
    home = tmp_path / "cache"
    monkeypatch.setenv("LOCKGATE_CACHE_DIR", str(home))
    gguf = tmp_path / "m.gguf"
    CASES["llama"]().write(gguf)
    current = prepare_model_dir(str(gguf))
    record = entry_record(current)
    assert record["converter_version"] == CONVERTER_VERSION and record["gguf"] == str(gguf.resolve())
    assert len(record["sha256"]) == 64

    models = home / "models"
    path_keyed = models / "old-path-keyed-000000000000"  # what versions before the content key left
    _copy_with_record(current, path_keyed, sha256=None)
    older, newer = models / "older-converter-000000000000", models / "newer-converter-000000000000"
    _copy_with_record(current, older, converter_version=CONVERTER_VERSION - 1)
    _copy_with_record(current, newer, converter_version=CONVERTER_VERSION + 1)  # a newer lockgate's: kept
    dead, live, fresh = models / ".tmp-dead", models / ".tmp-live", models / ".tmp-fresh"
    hour_ago = time.time() - 2 * 3600
    for d in (dead, live, fresh):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x" * 4096)
        (d / CONVERTING_LOCK).write_text("")
        if d is not fresh:
            os.utime(d, (hour_ago, hour_ago))
    foreign = models / "someone-elses"  # no lockgate_source.json: not a conversion lockgate made
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    (models / "packaged").mkdir()
    (models / "packaged" / "some.gguf").write_bytes(b"gguf")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the cache's")
    (models / "link-to-outside").symlink_to(outside)
    kernels = home / "kernels"
    this_build, other_build, busy = (kernels / n for n in (build_name(), "lockgate_cpu_000000000000",
                                                           "lockgate_cpu_111111111111"))
    for d in (this_build, other_build, busy):
        d.mkdir(parents=True)
        (d / "lib.so").write_bytes(b"\0" * 1000)
        (d / "lockgate.lock").write_text("")
    for d in ("tuning", "peers", "notes"):
        (home / d).mkdir()
        (home / d / "f").write_text("x")

    env = {**os.environ, "LOCKGATE_CACHE_DIR": str(home)}
    # a conversion still being written (old mtime, lock held) and a build being compiled
    with _locked(live / CONVERTING_LOCK), _locked(busy / "lockgate.lock"):
        stale = {e.path.name for e in scan(home) if e.stale}
        assert stale == {path_keyed.name, older.name, dead.name, "link-to-outside", other_build.name}
        listed = _run([], env)
        assert listed.returncode == 0, listed.stderr
        assert "5 stale entries" in listed.stdout and "lockgate cache --prune" in listed.stdout
        assert path_keyed.is_dir()  # listing removes nothing
        pruned = _run(["--prune"], env)
        assert pruned.returncode == 0, pruned.stderr
        assert "removed 5 stale entries" in pruned.stdout
    assert {p.name for p in models.iterdir()} - {".digests"} == {current.name, newer.name, live.name, fresh.name,
                                                                  foreign.name, "packaged"}
    assert sorted(p.name for p in kernels.iterdir()) == sorted([this_build.name, busy.name])
    assert (outside / "keep.txt").is_file()  # a link is removed, never what it points to
    assert all((home / d / "f").is_file() for d in ("tuning", "peers", "notes"))
    assert prepare_model_dir(str(gguf)) == current and (current / "config.json").is_file()
    # once their locks are released, the conversion's leftover and the other build are stale too
    assert {e.path.name for e in scan(home) if e.stale} == {live.name, busy.name}
    assert _run(["--prune"], env).returncode == 0
    again = _run([], env)
    assert again.returncode == 0 and "nothing stale" in again.stdout, again.stdout


def test_prune_moves_an_entry_away_under_its_lock_before_deleting_it(tmp_path, monkeypatch) -> None:
    home = tmp_path / "cache"
    build = home / "kernels" / "lockgate_cpu_222222222222"
    build.mkdir(parents=True)
    (build / "lockgate.lock").write_text("")
    (build / "lib.so").write_bytes(b"\0" * 100)
    entries = [e for e in scan(home) if e.path == build]
    assert entries and entries[0].stale

    with _locked(build / "lockgate.lock"):  # someone took the lock after the listing
        removed, failed = prune(entries)
    assert not removed and len(failed) == 1 and "lock" in failed[0][1] and build.is_dir()

    def dies(path: object) -> None:
        raise OSError("disk went away")

    monkeypatch.setattr(cache_admin.shutil, "rmtree", dies)
    removed, failed = prune(entries)
    assert not removed and "disk went away" in failed[0][1]
    # what is left is a temporary directory, never an entry missing some of its files
    left = sorted(p.name for p in build.parent.iterdir())
    assert len(left) == 1 and left[0].startswith(".tmp-prune-") and left[0].endswith(build.name)


def test_a_build_moved_away_while_waiting_for_its_lock_is_made_again(tmp_path) -> None:
    where = tmp_path / "kernels" / "lockgate_cpu_333333333333"
    where.mkdir(parents=True)
    got: list[tuple[int, int]] = []
    first = _locked(where / "lockgate.lock")  # the prune's hold

    def builder() -> None:
        with _build_lock(where):
            lock = where / "lockgate.lock"
            got.append((os.stat(lock).st_ino, len(list(where.iterdir()))))

    t = threading.Thread(target=builder)
    t.start()
    time.sleep(0.3)  # the builder is waiting on the lock
    assert not got
    os.rename(where, where.with_name(".tmp-prune-x"))  # as prune does, holding the lock
    first.close()
    t.join(timeout=30)
    assert got and where.is_dir(), "the builder must hold a lock inside a directory at the build's path"


def test_cache_on_an_absent_directory_says_so_and_on_a_file_refuses(tmp_path) -> None:
    r = _run(["--prune"], {**os.environ, "LOCKGATE_CACHE_DIR": str(tmp_path / "none")})
    assert r.returncode == 0 and "empty or absent" in r.stdout
    (tmp_path / "afile").write_text("x")
    r = _run(["--prune"], {**os.environ, "LOCKGATE_CACHE_DIR": str(tmp_path / "afile")})
    assert r.returncode == 2 and "is not a directory" in r.stderr and (tmp_path / "afile").is_file()


def test_an_unknown_current_build_keeps_every_build(tmp_path, monkeypatch) -> None:
    def fails() -> str:
        raise ValueError("LOCKGATE_KERNEL_MARCH=bogus: the compiler rejects it")

    build = tmp_path / "kernels" / "lockgate_cpu_444444444444"
    build.mkdir(parents=True)
    monkeypatch.setattr(cache_admin, "build_name", fails)
    entries = scan(tmp_path)
    assert [e.stale for e in entries] == [False] and "unknown" in entries[0].why


def test_tuning_tables_of_other_builds_and_versions_are_stale_and_listed_as_one_line(tmp_path) -> None:
    from lockgate.runner.tuning_cache import TUNING_VERSION, lock_of

    home = tmp_path / "cache"
    tuning = home / "tuning"
    tuning.mkdir(parents=True)

    def table(name: str, **key) -> str:  # type: ignore[no-untyped-def]
        fname = f"forms-{name}.json"
        (tuning / fname).write_text(json.dumps({"key": {"version": TUNING_VERSION, "kernels": build_name(), **key},
                                                "choices": {}}))
        lock_of(tuning / fname).write_text("")
        return fname

    current = table("0" * 16)
    no_kernels = table("1" * 16, kernels="none")  # a run with the kernels off: still this environment's
    newer = table("2" * 16, version=TUNING_VERSION + 1)
    other_build = table("3" * 16, kernels="lockgate_cpu_000000000000")
    older = table("4" * 16, version=TUNING_VERSION - 1)
    held = table("5" * 16, kernels="lockgate_cpu_111111111111")
    corrupt = "rows-" + "6" * 16 + ".json"
    (tuning / corrupt).write_text("{not json")
    (tuning / "notes.txt").write_text("mine")  # not a table: left alone
    named_like_one = tuning / ("forms-" + "7" * 16 + ".json")  # a directory is never a table: left alone
    named_like_one.mkdir()
    (named_like_one / "x").write_text("mine")
    orphan, orphan_held = "forms-" + "8" * 16 + ".lock", "rows-" + "9" * 16 + ".lock"  # locks with no table
    for name in (orphan, orphan_held):
        (tuning / name).write_text("")
    (tuning / "mine.lock").write_text("")  # not named like a table's lock: left alone

    env = {**os.environ, "LOCKGATE_CACHE_DIR": str(home)}
    with _locked(tuning / held.replace(".json", ".lock")), _locked(tuning / orphan_held):
        assert {e.path.name for e in scan(home) if e.stale} == {other_build, older, corrupt, orphan}
        listed = _run([], env)
        assert listed.returncode == 0, listed.stderr
        lines = [line for line in listed.stdout.splitlines() if "tuning/ (3 tables)" in line]
        assert len(lines) == 1 and "stale" in lines[0], listed.stdout
        lines = [line for line in listed.stdout.splitlines() if "tuning/ (1 lock files)" in line]
        assert len(lines) == 1 and "stale" in lines[0] and "no table" in lines[0], listed.stdout
        assert other_build not in listed.stdout and orphan not in listed.stdout  # one line each, not one per file
        pruned = _run(["--prune"], env)
        assert pruned.returncode == 0, pruned.stderr
        assert "removed 4 stale entries" in pruned.stdout
    left = {p.name for p in tuning.iterdir()}
    assert orphan not in left and orphan_held in left and "mine.lock" in left
    for name in (current, no_kernels, newer, held):
        assert name in left and name.replace(".json", ".lock") in left
    for name in (other_build, older):
        assert name not in left and name.replace(".json", ".lock") not in left
    assert corrupt not in left and "notes.txt" in left and (named_like_one / "x").is_file()
    # released, the other build's held table and the held lock are stale too
    assert {e.path.name for e in scan(home) if e.stale} == {held, orphan_held}


def test_digest_memos_of_files_gone_or_changed_are_stale_and_listed_as_one_line(tmp_path, monkeypatch) -> None:
    # The sha256 memos loader.file_sha256 writes, one per GGUF file state: a memo is read again only
    # while its file is as it was, so the memos of removed or rewritten files (every test run's and
    # clean clone's GGUFs) are stale; the current one and other files there are kept.
    from lockgate.checkpoint import loader

    home = tmp_path / "cache"
    monkeypatch.setenv("LOCKGATE_CACHE_DIR", str(home))
    monkeypatch.setattr(loader, "RACY_SECONDS", -1.0)  # remember the digests of files just written
    files = {name: tmp_path / f"{name}.gguf" for name in ("kept", "gone", "changed")}
    for name, f in files.items():
        f.write_bytes(name.encode() * 100)
        loader.file_sha256(f)
    digests = home / "models" / ".digests"
    assert len(list(digests.iterdir())) == 3
    kept_memo = loader.memo_path(loader.stat_key(files["kept"].resolve())).name
    gone_memo = loader.memo_path(loader.stat_key(files["gone"].resolve())).name
    changed_memo = loader.memo_path(loader.stat_key(files["changed"].resolve())).name
    files["gone"].unlink()
    files["changed"].write_bytes(b"rewritten")
    (digests / ("f" * 24)).write_text("not a digest\n")  # unreadable: it would be hashed again
    (digests / "notes.txt").write_text("mine")  # not a memo: left alone
    assert {e.path.name for e in scan(home) if e.stale} == {gone_memo, changed_memo, "f" * 24}
    env = {**os.environ, "LOCKGATE_CACHE_DIR": str(home)}
    listed = _run([], env)
    assert listed.returncode == 0, listed.stderr
    lines = [line for line in listed.stdout.splitlines() if "models/.digests/ (3 memos)" in line]
    assert len(lines) == 1 and "stale" in lines[0], listed.stdout
    assert gone_memo not in listed.stdout  # one line, not one per memo
    pruned = _run(["--prune"], env)
    assert pruned.returncode == 0 and "removed 3 stale entries" in pruned.stdout, pruned.stdout + pruned.stderr
    assert {p.name for p in digests.iterdir()} == {kept_memo, "notes.txt"}
    assert loader.file_sha256(files["kept"]) == hashlib.sha256(b"kept" * 100).hexdigest()
