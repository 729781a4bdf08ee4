"""Build llama.cpp's ``llama-server`` from the llama.cpp sources vendored in the ``llama-cpp-python`` sdist: the
peer ``compare_peers.py --servers llama-server`` runs (issue 49).

Steps: ``pip download --no-deps --no-binary :all: llama-cpp-python==VERSION`` (or ``--sdist FILE``, an sdist
already downloaded), extract its ``vendor/llama.cpp``, configure it with CMake and build the one target
``llama-server`` with ``-j JOBS`` (default 2) into ``--cache-dir`` (default
``~/.cache/lockgate/peers/llama.cpp-VERSION``: ``src/`` the sources, ``build/`` the tree, ``bin/llama-server``
the binary). Idempotent: if ``bin/llama-server`` exists and answers ``--version``, nothing is rebuilt
(``--force`` rebuilds). Prints the binary's path and ``--version`` on stderr and, last, one JSON line
(binary, version text, llama-cpp-python version, CMake flags, seconds, machine, command).

CMake flags: Release; ``GGML_NATIVE=ON`` (the host's instruction set: AVX2/FMA/F16C, AVX-512 where present);
``BUILD_SHARED_LIBS=OFF`` (one self-contained binary, movable); ``LLAMA_BUILD_TESTS/EXAMPLES/APP=OFF``,
``LLAMA_BUILD_TOOLS=ON`` and ``LLAMA_BUILD_SERVER=ON`` (the server lives under tools/; only its target is built);
``LLAMA_CURL=OFF`` and ``LLAMA_OPENSSL=OFF`` (no model downloads: the benchmark serves a local GGUF);
``LLAMA_BUILD_UI=OFF`` and ``LLAMA_USE_PREBUILT_UI=OFF`` (the web UI is neither built with npm nor fetched
from a Hugging Face bucket at build time: the server runs without it). ``--cmake-args`` adds flags.
Ninja is used when on PATH. Measured on an AMD EPYC (Zen 3 class, 2 vCPUs, AVX2, shared with other jobs):
about 9 minutes with ``-j 2``.

Usage: .venv/bin/python benchmarks/build_llama_server.py [--version 0.3.36] [--sdist FILE.tar.gz]
           [--cache-dir DIR] [--jobs 2] [--force] [--cmake-args="-DGGML_OPENMP=OFF"]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_VERSION = "0.3.36"
DEFAULT_CACHE = "~/.cache/lockgate/peers/llama.cpp-{version}"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
               "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF")
VENDOR = "vendor/llama.cpp/"


def log(msg: str) -> None:
    print(f"[build_llama_server] {msg}", file=sys.stderr, flush=True)


def default_cache(version: str) -> Path:
    return Path(DEFAULT_CACHE.format(version=version)).expanduser()


def server_version(binary: Path) -> str | None:
    """``llama-server --version`` (it prints on stderr), or None if the binary does not run."""
    try:
        r = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (r.stdout + r.stderr).strip()
    return text if r.returncode == 0 and text else None


def fetch_sdist(version: str, into: Path) -> Path:
    """The llama-cpp-python sdist of ``version``, downloaded with pip (never a wheel)."""
    spec = f"llama-cpp-python=={version}"
    log(f"pip download {spec} (sdist only)")
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                    "--dest", str(into), spec], check=True)
    found = sorted(into.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise SystemExit(f"pip download {spec} left no llama_cpp_python-*.tar.gz in {into}")
    return found[0]


def extract_llama_cpp(sdist: Path, dest: Path) -> None:
    """``vendor/llama.cpp`` of the sdist into ``dest`` (replaced if present)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    n = 0
    with tarfile.open(sdist) as tf:
        for m in tf.getmembers():
            _, _, rel = m.name.partition("/")  # drop the sdist's top directory
            if not rel.startswith(VENDOR) or rel == VENDOR:
                continue
            m.name = rel[len(VENDOR):]
            tf.extract(m, dest, filter="data")
            n += 1
    if not (dest / "CMakeLists.txt").exists():
        raise SystemExit(f"{sdist} has no {VENDOR}CMakeLists.txt: not a llama-cpp-python sdist with vendored sources")
    log(f"extracted {n} entries of {VENDOR} into {dest}")


def build(src: Path, build_dir: Path, jobs: int, extra: list[str]) -> list[str]:
    flags = [*CMAKE_FLAGS, *extra]
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    cfg = ["cmake", "-S", str(src), "-B", str(build_dir), *gen, *flags]
    log(shlex.join(cfg))
    subprocess.run(cfg, check=True)
    cmd = ["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)]
    log(shlex.join(cmd))
    subprocess.run(cmd, check=True)
    return flags


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default=DEFAULT_VERSION, help="llama-cpp-python version (default %(default)s)")
    ap.add_argument("--sdist", type=Path, default=None,
                    help="use this llama_cpp_python-VERSION.tar.gz instead of downloading it")
    ap.add_argument("--cache-dir", type=Path, default=None,
                    help=f"where to build (default {DEFAULT_CACHE.format(version='VERSION')})")
    ap.add_argument("--jobs", "-j", type=int, default=2, help="parallel compile jobs (default %(default)s)")
    ap.add_argument("--force", action="store_true", help="rebuild even if the binary is there")
    ap.add_argument("--cmake-args", default="", help="more CMake configure flags, one string")
    a = ap.parse_args(argv)
    if a.jobs < 1:
        ap.error("--jobs must be at least 1")
    if a.sdist is not None and not a.sdist.is_file():
        ap.error(f"--sdist {a.sdist}: no such file")
    if a.sdist is not None and f"-{a.version}." not in a.sdist.name:
        ap.error(f"--sdist {a.sdist.name} does not look like llama-cpp-python {a.version} (pass --version)")
    try:
        extra = shlex.split(a.cmake_args)
    except ValueError as e:
        ap.error(f"--cmake-args: {e}")
    if shutil.which("cmake") is None:
        raise SystemExit("cmake is not on PATH (Debian: apt-get install cmake build-essential)")
    cache = (a.cache_dir or default_cache(a.version)).expanduser().absolute()
    binary = cache / "bin" / "llama-server"
    t0 = time.monotonic()
    flags: list[str] | None = None
    built = False
    version = None if a.force else server_version(binary)
    if version is None:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="llama-cpp-sdist-") as tmp:
            sdist = a.sdist or fetch_sdist(a.version, Path(tmp))
            extract_llama_cpp(sdist, cache / "src")
        flags = build(cache / "src", cache / "build", a.jobs, extra)
        out = cache / "build" / "bin" / "llama-server"
        if not out.exists():
            raise SystemExit(f"the build finished but left no {out}")
        binary.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(out, binary)
        version = server_version(binary)
        if version is None:
            raise SystemExit(f"{binary} --version failed after the build")
        built = True
        log(f"built in {time.monotonic() - t0:.0f} s")
    else:
        log(f"already built (--force to rebuild): {binary}")
    log(f"binary: {binary}")
    log(f"--version: {version}")
    from _common import command, machine

    result: dict[str, Any] = {"benchmark": "build_llama_server", "binary": str(binary), "version": version,
                              "llama_cpp_python": a.version, "built": built, "seconds": round(time.monotonic() - t0, 1),
                              "cmake_flags": flags, "jobs": a.jobs, "command": command(), "machine": machine()}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
