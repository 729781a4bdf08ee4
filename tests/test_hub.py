"""Hugging Face model ids (issue 49): ``--model org/name`` through huggingface_hub, offline, against
an HF cache built in the test (nothing is downloaded: HF_HUB_OFFLINE=1 and a private HF_HUB_CACHE).

The cache is laid out as huggingface_hub writes it (``models--org--name/refs/main`` naming a
commit, ``snapshots/<commit>/`` holding the files), so the library's own lookup finds it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lockgate.checkpoint.loader import default_gguf_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(cache: Path, repo: str, files: dict[str, Path | str]) -> Path:
    """Put ``files`` (name -> source file, or text) into ``cache`` as snapshot ``COMMIT`` of ``repo``."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    for name, src in files.items():
        if isinstance(src, Path):
            os.symlink(src, snap / name)  # the cache's snapshots hold links (to blobs) too
        else:
            (snap / name).write_text(src)
    return snap


def run(code: str, cache: Path, lockgate_cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "LOCKGATE_CACHE_DIR": str(lockgate_cache)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> tuple[Path, Path]:
    """(HF cache, lockgate cache): repos smol/one (one GGUF), smol/two (two GGUFs), and a
    safetensors repo written by transformers."""
    cache = tmp_path_factory.mktemp("hf-cache")
    ours = tmp_path_factory.mktemp("lockgate-cache")
    home = Path(os.environ.get("LOCKGATE_CACHE_DIR", Path.home() / ".cache" / "lockgate"))
    if (home / "kernels").is_dir():  # built once per machine; the test is about models
        shutil.copytree(home / "kernels", ours / "kernels")
    gguf = default_gguf_path()
    # the default model's conversion, where an earlier run left it: the tests here are about
    # resolving ids to files, and a conversion is keyed by the file's content, so all three specs
    # below still come to this one entry (a converted entry is tested in test_gguf_families.py)
    for entry in (home / "models").glob(f"{gguf.stem}-*") if (home / "models").is_dir() else ():
        if (entry / "lockgate_source.json").is_file():
            shutil.copytree(entry, ours / "models" / entry.name)
    cache_repo(cache, "smol/one", {gguf.name: gguf, "README.md": "a GGUF repository"})
    cache_repo(cache, "smol/two", {"a-Q4_1.gguf": gguf, "b-Q4_1.gguf": gguf})
    return cache, ours


def test_a_gguf_repository_id_resolves_to_its_file(hub) -> None:
    """``org/name`` with one GGUF, and ``org/name:file`` naming one of several, come to the very
    model the file itself gives; serving one end to end is
    ``test_serve_takes_a_hub_id_with_revision_and_gguf_file_flags``."""
    cache, ours = hub
    code = ("import json\nfrom lockgate.checkpoint.loader import prepare_model_dir, gguf_weights_of\n"
            f"dirs = [prepare_model_dir(s) for s in ('smol/one', 'smol/two:b-Q4_1.gguf', {str(default_gguf_path())!r})]\n"
            "print(json.dumps([str(d) for d in dirs] + [str(gguf_weights_of(dirs[0]))]))\n")
    r = run(code, cache, ours)
    assert r.returncode == 0, r.stderr[-3000:]
    one, two, file, weights = json.loads(r.stdout.strip().splitlines()[-1])
    # entries are named by the file's stem, keyed by its content: the same key for the same bytes
    assert len({Path(d).name.rsplit("-", 1)[1] for d in (one, two, file)}) == 1 and Path(weights).is_file()


def test_a_safetensors_repository_id_resolves_to_its_snapshot(hub, tmp_path) -> None:
    cache, ours = hub
    from lockgate.checkpoint.loader import convert_gguf_cached

    converted = convert_gguf_cached(default_gguf_path())  # a config.json and tokenizer to stand in
    snap = cache_repo(cache, "org/dense", {"config.json": converted / "config.json",
                                           "model.safetensors": Path(__file__)})  # contents not read here
    code = ("from lockgate.checkpoint.loader import prepare_model_dir\n"
            "print(prepare_model_dir('org/dense'))\n")
    r = run(code, cache, ours)
    assert r.returncode == 0, r.stderr[-3000:]
    assert Path(r.stdout.strip().splitlines()[-1]) == snap


@pytest.mark.parametrize(("spec", "needle"), [
    ("smol/two", "holds 2 GGUF files (a-Q4_1.gguf, b-Q4_1.gguf): name one as smol/two:FILE or with --gguf-file"),
    ("nobody/nothing", "model nobody/nothing: not found in the Hugging Face cache"),
    ("smol/one:missing.gguf", "model smol/one: not found in the Hugging Face cache"),
])
def test_an_id_that_cannot_be_served_names_it_and_what_was_tried(hub, spec, needle) -> None:
    cache, ours = hub
    r = run(f"from lockgate.checkpoint.loader import prepare_model_dir\nprepare_model_dir({spec!r})", cache, ours)
    assert r.returncode != 0 and needle in r.stderr, r.stderr[-2000:]
    if "not found" in needle:
        assert "HF_HUB_OFFLINE is set" in r.stderr and str(cache) in r.stderr


def test_serve_takes_a_hub_id_with_revision_and_gguf_file_flags(hub) -> None:
    from server_util import ServerProc

    cache, _ = hub
    s = ServerProc("--model", "smol/two", "--gguf-file", "a-Q4_1.gguf", "--revision", "main", "--tuning", "off",
                   "--max-total-tokens", "2048", env={"HF_HUB_CACHE": str(cache)})  # the usual lockgate cache
    try:
        s.wait_ready(300)
        import httpx

        r = httpx.post(s.url + "/v1/completions", json={"model": "smol/two", "prompt": "Hi", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        s.stop()
