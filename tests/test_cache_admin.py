"""``lockgate cache``: which entries it calls stale, and that ``--prune`` removes exactly those.

The cache is a temporary ``LOCKGATE_CACHE_DIR`` holding one real conversion (a small GGUF
written by ``test_gguf_families``' writer, converted by lockgate) next to entries shaped like what
older versions, dead conversions, other kernel builds and the benchmark leave; the command runs
as a real process.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time

from test_gguf_families import CASES

from lockgate.cache_admin import scan
from lockgate.checkpoint.gguf_convert import CONVERTER_VERSION
from lockgate.checkpoint.loader import SOURCE_RECORD, prepare_model_dir
from lockgate.kernels import build_name


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lockgate.cli", "cache", *args], env=env, capture_output=True,
                          text=True, timeout=300)


def test_cache_lists_stale_entries_and_prune_removes_only_them(tmp_path, monkeypatch) -> None:
    home = tmp_path / "cache"
    monkeypatch.setenv("LOCKGATE_CACHE_DIR", str(home))
    gguf = tmp_path / "m.gguf"
    CASES["llama"]().write(gguf)
    current = prepare_model_dir(str(gguf))
    record = json.loads((current / SOURCE_RECORD).read_text())
    assert record["converter"] == CONVERTER_VERSION and record["source"] == str(gguf.resolve())

    models = home / "models"
    unrecorded = models / "old-path-keyed-000000000000"  # what versions before the content key left
    shutil.copytree(current, unrecorded)
    (unrecorded / SOURCE_RECORD).unlink()
    older = models / "older-converter-000000000000"
    shutil.copytree(current, older)
    (older / SOURCE_RECORD).write_text(json.dumps({**record, "converter": CONVERTER_VERSION - 1}))
    dead, live = models / ".tmp-dead-conversion", models / ".tmp-live-conversion"
    for d in (dead, live):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x" * 4096)
    hour_ago = time.time() - 2 * 3600
    os.utime(dead, (hour_ago, hour_ago))
    (models / "packaged").mkdir()
    (models / "packaged" / "some.gguf").write_bytes(b"gguf")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the cache's")
    (models / "link-to-outside").symlink_to(outside)
    kernels = home / "kernels"
    this_build, other_build, building = (kernels / n for n in (build_name(), "lockgate_cpu_000000000000",
                                                               "lockgate_cpu_111111111111"))
    for d in (this_build, other_build, building):
        d.mkdir(parents=True)
        (d / "lib.so").write_bytes(b"\0" * 1000)
        (d / "lockgate.lock").write_text("")
    for d in ("tuning", "peers", "notes"):
        (home / d).mkdir()
        (home / d / "f").write_text("x")

    stale = {e.path.name for e in scan(home) if e.stale}
    assert stale == {unrecorded.name, older.name, dead.name, "link-to-outside", other_build.name, building.name}

    env = {**os.environ, "LOCKGATE_CACHE_DIR": str(home)}
    with open(building / "lockgate.lock") as held:  # another process compiling that build now
        fcntl.flock(held, fcntl.LOCK_EX)
        listed = _run([], env)
        assert listed.returncode == 0, listed.stderr
        assert "5 stale entries" in listed.stdout and "lockgate cache --prune" in listed.stdout
        assert unrecorded.is_dir()  # listing removes nothing
        pruned = _run(["--prune"], env)
        assert pruned.returncode == 0, pruned.stderr
        assert "removed 5 stale entries" in pruned.stdout
    assert sorted(p.name for p in models.iterdir()) == sorted([".digests", current.name, live.name, "packaged"])
    assert sorted(p.name for p in kernels.iterdir()) == sorted([this_build.name, building.name])
    assert (outside / "keep.txt").is_file()  # a link is removed, never what it points to
    assert all((home / d / "f").is_file() for d in ("tuning", "peers", "notes"))
    assert prepare_model_dir(str(gguf)) == current and (current / "config.json").is_file()
    # the build whose compiler has finished (its lock released) is now an ordinary other build
    assert {e.path.name for e in scan(home) if e.stale} == {building.name}
    assert _run(["--prune"], env).returncode == 0
    again = _run([], env)
    assert again.returncode == 0 and "nothing stale" in again.stdout, again.stdout


def test_cache_on_an_absent_directory_says_so(tmp_path) -> None:
    r = _run(["--prune"], {**os.environ, "LOCKGATE_CACHE_DIR": str(tmp_path / "none")})
    assert r.returncode == 0 and "empty or absent" in r.stdout
