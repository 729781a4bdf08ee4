"""lockgate's own CPU kernels (C++, ``lockgate/kernels/csrc``), built on first use and cached.

Owns compiling and loading the kernels and telling callers whether they are there. The kernels
register torch operators in the ``lockgate`` namespace (``torch.ops.lockgate.<name>``); their
contracts are documented at the top of each source file:

* ``decode_attention`` (``decode_attention.cpp``): one query token per sequence against its
  keys, read from the slot-indexed KV pool in place by slot (no gathered copy, no padding).
* ``add_rms_norm_``, ``silu_mul``, ``rope_write_kv`` (``fused_ops.cpp``): the element-wise runs
  between a layer's matmuls in one call each, rounding where the torch ops they replace round.
* ``quant_linear`` (``quant_linear.cpp``): GGUF Q8_0 / Q4_1 blocks multiplied as they are (few rows).
* ``int_linear`` (``int_gemm.cpp``): the same blocks against x rounded to int16 per 32 columns, on
  AVX512-VNNI int16 dot products (any row count; its few-row path streams the weights at batch-1
  decode), float32 / bf16 / fp16 x in, the same dtype out.
* ``bf16_linear`` (``bf16_gemm.cpp``): a bf16 weight times bf16 rows on AVX512-BF16 dot products
  (built only where the CPU has them; ``bf16_linear_available``), any row count; and
  ``bf16_linear_silu``: a gate/up weight's product with ``silu_mul`` applied in registers (the same bits).
* ``f32_linear`` (``f32_gemm.cpp``): a float32 weight as it is times float32 rows, each output one
  dot product in a fixed order (AVX2 + FMA or AVX-512; ``f32_linear_available``): row-invariant
  at any row count, where MKL's sgemm is not below 16 rows.
* ``argmax_rows`` (``argmax.cpp``): each row's argmax of float32 or bf16 logits, torch's rules
  (greedy steps take it on the LM head's own output instead of float32 logits).
* ``decode_layers_`` (``decode_layers.cpp``): a step's layers in one call (decode, prompt and mixed steps).
* ``bind_threads`` (``threads.cpp``): torch's intra-op threads pinned one per CPU (the server's
  scheduler process, ``lockgate.engine.process.pin_torch_threads``).

Building: ``torch.utils.cpp_extension.load`` compiles the sources with the machine's C++
compiler (``-O3 -march=native``: the code is built where it runs; ``$LOCKGATE_KERNEL_MARCH`` names
another target, e.g. ``haswell``, to run a CPU without AVX-512's paths here) into
``$LOCKGATE_CACHE_DIR/kernels/<name>`` (default ``~/.cache/lockgate/kernels``), where ``<name>``
carries a hash of the sources' content, the flags, the torch version, the compiler and the CPU's
feature flags, so a changed source, torch, compiler or CPU builds anew and no stale build is ever
shared, while every checkout of the same code shares one build: the sources are copied into the
build directory and compiled from there (ninja rebuilds whenever a command line changes, and a
command line names its sources' paths), and a finished build (marked by ``BUILT``) is loaded with
``torch.ops.load_library`` without asking ninja at all. The sources are compiled as a few units,
one per CPU (``unity_groups``: ``src/unity_<i>.cpp`` includes a group of them, the groups balanced
by ``COMPILE_SECONDS``), because the torch headers cost most of a small source's compile: parsed
once per unit instead of once per source, and only the light ones (``ATen/core/Tensor.h`` and the
single ops used, not ``ATen/ATen.h``), a build takes about half the CPU time (Zen 3 class, 2
cores: ~254 s of CPU in nine units -> ~130 s in two). So a source keeps its helpers in its own
namespace (``lockgate::<file>_impl``, an anonymous one inside), never at file scope, and
``#undef``s its macros at its end: nothing of one source is seen by the next in its unit.
A build is a ``lockgate.progress`` phase:
on a terminal a bar of the compiled units (ninja's log) and the time likely left (from the last
build this cache saw, else ``EXPECTED_BUILD_SECONDS``); in a log file a line when it starts, one
every ``PROGRESS_EVERY`` seconds while it runs (a first build takes minutes on 2 cores) and how
long it took. ``start(mode)`` begins the build on a side thread at once (the engine calls it
before it prepares the model, so the compiler and the conversion overlap); ``load`` then joins
it. Concurrent processes build one at a time under an ``flock`` the OS releases if
the builder dies (torch's own lock file would be left behind and waited on forever); a lock won
on a build directory ``lockgate cache --prune`` moved away meanwhile is taken again on a new one. The
interpreter's bin directory goes on PATH first, so the ``ninja`` the package installs is found in
a venv that is not activated.

Invariants: ``load()`` runs the build at most once per process and never raises: on a machine
without a compiler (or any build error) it logs why and returns False, and callers keep their
pure-torch path. ``LOCKGATE_CPU_KERNELS=0`` in the environment disables the kernels, as does
``--cpu-kernels off``. Called by ``lockgate.runner.model_runner`` and ``lockgate.runner.form_choice`` (at
start-up) and tests.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from lockgate.paths import cache_home
from lockgate.progress import phase

log = logging.getLogger("lockgate.kernels")

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(sorted(CSRC.glob("*.cpp")))
HEADERS = tuple(sorted(CSRC.glob("*.h")))
MARCH_ENV = "LOCKGATE_KERNEL_MARCH"  # the -march the kernels are built for; default native


def march() -> str:
    """The target the kernels are compiled for: ``native`` (this CPU), or ``$LOCKGATE_KERNEL_MARCH``
    (e.g. ``haswell`` or ``x86-64-v3`` for AVX2 + FMA without AVX-512, ``x86-64-v2`` for neither),
    to run and test the paths of a CPU without the instructions this one has."""
    value = os.environ.get(MARCH_ENV, "").strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", value):
        raise ValueError(f"{MARCH_ENV} must name a compiler target such as native, haswell or x86-64-v3; "
                         f"got {value!r}")
    return value


def cflags() -> tuple[str, ...]:
    return ("-O3", f"-march={march()}", "-fopenmp", "-fno-math-errno", "-fno-trapping-math")


# the compiler's macros for the instruction sets the kernels use, by /proc/cpuinfo's names
TARGET_MACROS = {"__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c", "__AVXVNNI__": "avx_vnni",
                 "__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw", "__AVX512VNNI__": "avx512_vnni",
                 "__AVX512BF16__": "avx512_bf16", "__AMX_BF16__": "amx_bf16"}


def target_flags(target: str) -> set[str]:
    """The instruction sets (cpuinfo names, of ``TARGET_MACROS``) the compiler enables for
    ``-march=target``; ValueError with the compiler's words when it rejects the target."""
    cxx = os.environ.get("CXX", "c++")
    try:
        r = subprocess.run([cxx, f"-march={target}", "-dM", "-E", "-x", "c++", os.devnull],
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise ValueError(f"cannot ask the compiler ({cxx}) about -march={target}: {e}") from e
    if r.returncode != 0:
        said = (r.stderr.strip().splitlines() or ["no message"])[0]
        raise ValueError(f"{MARCH_ENV}={target}: the compiler rejects it ({said})")
    macros = set(r.stdout.split())
    return {flag for macro, flag in TARGET_MACROS.items() if macro in macros}


def _check_march() -> None:
    """An explicit target must be one this CPU can run (else the library would load and die on an
    illegal instruction); it is logged, so a variable left set in a shell is seen."""
    target = march()
    if target == "native":
        return
    missing = target_flags(target) - set(_cpu_flags().split())
    if missing:
        raise ValueError(f"{MARCH_ENV}={target} needs {' '.join(sorted(missing))}, which this CPU lacks")
    log.warning("lockgate CPU kernels built for -march=%s (%s), not for this CPU's own instructions",
                target, MARCH_ENV)


MODES = ("auto", "off")
BUILT = "BUILT"  # written into a build directory once its library compiled and loaded
BUILD_LOCK = "lockgate.lock"  # in a build directory: held (flock) while it is built or loaded
PROGRESS_EVERY = 30.0  # seconds between progress lines in a log (no terminal)
EXPECTED_BUILD_SECONDS = 90.0  # a first build's guess when this cache holds no earlier one (2 cores)

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "error": str, "compiling": bool
_decided = threading.Event()  # set once a load knows whether it compiles (or has ended)


def cache_dir() -> Path:
    """Where builds live: ``kernels/`` under ``lockgate.paths.cache_home()``."""
    return cache_home() / "kernels"


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for), "" when unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _compiler_version() -> str:
    cxx = os.environ.get("CXX", "c++")
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return cxx


def build_name() -> str:
    """A name unique to the sources, the flags (the -march target among them), the torch build, the
    compiler and the CPU's features: a cache shared between machines (or restored onto another
    CPU) never hands out a library built for instructions this CPU lacks (an explicit target is
    checked against the CPU first: ``_check_march``)."""
    h = hashlib.sha256()
    for src in (*SOURCES, *HEADERS):
        h.update(src.name.encode())
        h.update(src.read_bytes())
    for part in (" ".join(cflags()), torch.__version__, _compiler_version(), _cpu_flags()):
        h.update(part.encode())
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


def start(mode: str = "auto") -> None:
    """Begin ``load(mode)`` on a side thread and return at once; a later ``load`` waits for it.
    Does nothing when the kernels are off or already loaded (or failed)."""
    if mode not in MODES:
        raise ValueError(f"--cpu-kernels must be one of {MODES}, got {mode!r}")
    if mode == "off" or os.environ.get("LOCKGATE_CPU_KERNELS", "1") == "0" or "ok" in _state:
        return
    threading.Thread(target=load, args=(mode,), name="kernel-build", daemon=True).start()
    _decided.wait(DECIDE_SECONDS)  # so that ``building()`` answers for it


DECIDE_SECONDS = 5.0  # ``start`` waits at most this long for the build thread to know whether it compiles


def building() -> bool:
    """Whether a compiler is running for this process's kernels now."""
    return bool(_state.get("compiling"))


def loaded() -> bool:
    """Whether an earlier ``load`` put the kernels in ``torch.ops.lockgate`` (never builds)."""
    return bool(_state.get("ok"))


def error() -> str | None:
    """Why the last ``load`` failed, or None."""
    err = _state.get("error")
    return None if err is None else str(err)


def _ninja_on_path() -> None:
    """torch finds ninja on PATH; the ``ninja`` package puts it in this interpreter's bin directory,
    which is not on PATH when the venv is not activated (``.venv/bin/python -m pytest``, servers
    started by path)."""
    dirs = [str(Path(sys.executable).parent)]
    try:
        import ninja  # the PyPI package; its BIN_DIR holds the executable

        dirs.append(str(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        pass
    path = os.environ.get("PATH", "").split(os.pathsep)
    os.environ["PATH"] = os.pathsep.join([*[d for d in dirs if d not in path], *path])


@contextlib.contextmanager
def _build_lock(where: Path) -> Iterator[None]:
    """Hold ``where``'s build lock (``where`` made if missing). ``lockgate cache --prune`` moves a
    stale build away while holding its lock, so a lock won after such a move is on a file no longer
    at that path: then the directory is made again and its new lock taken."""
    while True:
        where.mkdir(parents=True, exist_ok=True)
        held = open(where / BUILD_LOCK, "a")  # noqa: SIM115 (returned held)
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            if os.stat(where / BUILD_LOCK).st_ino == os.fstat(held.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        held.close()
    with held:
        yield


def _build() -> tuple[bool, str | None]:
    t0 = time.perf_counter()
    try:
        _check_march()
        name = build_name()
        where = cache_dir() / name
        _state["compiling"] = not (where / BUILT).is_file()  # (or waits on another process's build)
        _decided.set()
        # One builder at a time, through a lock the OS releases when its holder dies: torch's own
        # lock is a plain file that a killed build leaves behind, and it waits on that forever.
        # Holding ours, any torch lock file present is such a leftover.
        with _build_lock(where):
            library = where / f"{name}.so"
            if (where / BUILT).is_file() and library.is_file():
                torch.ops.load_library(str(library))
                return True, None
            _compile(name, where)
            (where / BUILT).write_text(f"built in {time.perf_counter() - t0:.1f}s\n")
    except Exception as e:  # a missing compiler, headers or ninja: keep the torch path
        msg = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        log.warning("lockgate CPU kernels unavailable, using plain torch ops instead (%s)", msg)
        return False, msg
    finally:
        _state["compiling"] = False
        _decided.set()
    return True, None


def _compile(name: str, where: Path) -> None:
    """Compile (or finish compiling) the kernels in ``where`` from copies of the sources, and load
    them; logs progress while the compiler runs."""
    from torch.utils import cpp_extension

    (where / "lock").unlink(missing_ok=True)
    src = where / "src"
    src.mkdir(exist_ok=True)
    for f in (*SOURCES, *HEADERS):  # the build's name is their content's hash: same name, same bytes
        if not (src / f.name).is_file() or (src / f.name).read_bytes() != f.read_bytes():
            (src / f.name).write_bytes(f.read_bytes())
    _ninja_on_path()
    log.info("building lockgate CPU kernels in %s (once per machine, compiler, torch and kernel source)", where)
    done = threading.Event()
    groups = unity_groups(SOURCES, _ninja_jobs_wanted())
    unity = _write_units(src, groups)
    objects = [f"{u.stem}.o" for u in unity]
    units = len(objects) + 1  # the objects and the library
    with phase(log, "compiling lockgate CPU kernels", total=units, unit="units", expected_s=expected_build_seconds(),
               every=PROGRESS_EVERY, left=lambda elapsed: _build_left(where, elapsed, objects)) as p:

        def count() -> None:  # ninja logs each finished command: the bar's steps
            while not done.wait(1.0):
                p.to(min(sum(out in objects for out in _ninja_log(where)), units - 1))

        threading.Thread(target=count, name="kernel-build-progress", daemon=True).start()
        try:
            cpp_extension.load(name=name, sources=[str(u) for u in unity], extra_cflags=list(cflags()),
                               extra_include_paths=[str(src)], build_directory=str(where),
                               is_python_module=False, verbose=False)
        finally:
            done.set()


# Seconds of CPU each source's own compile takes beyond the torch headers (measured with them
# precompiled, Zen 3 class, -march=native: AVX2). Only balances the units: a source missing here is
# estimated from its size.
COMPILE_SECONDS = {"decode_attention.cpp": 23.0, "int_gemm.cpp": 20.0, "fused_ops.cpp": 16.0,
                   "decode_layers.cpp": 9.0, "lora.cpp": 8.0, "bf16_gemm.cpp": 8.0, "argmax.cpp": 8.0,
                   "quant_linear.cpp": 6.0, "threads.cpp": 6.0, "f32_gemm.cpp": 6.0}


def compile_seconds(source: Path) -> float:
    """``COMPILE_SECONDS`` of ``source``, else an estimate from its size (6 s + 1 s per 4 KB)."""
    return COMPILE_SECONDS.get(source.name, 6.0 + source.stat().st_size / 4096)


def unity_groups(sources: tuple[Path, ...], n: int) -> list[list[Path]]:
    """``sources`` split into at most ``n`` groups of about equal compile time (``compile_seconds``;
    the costliest first, each onto the group with the least so far), each group in ``sources``'
    order; no empty group. A group is one compiler run: the torch headers, which cost most of a
    small source's compile, are parsed once a group."""
    n = max(1, min(n, len(sources)))
    groups: list[list[Path]] = [[] for _ in range(n)]
    sizes = [0.0] * n
    for f in sorted(sources, key=lambda f: (-compile_seconds(f), f.name)):
        i = sizes.index(min(sizes))
        groups[i].append(f)
        sizes[i] += compile_seconds(f)
    order = {f: i for i, f in enumerate(sources)}
    return [sorted(g, key=order.__getitem__) for g in groups if g]


def _write_units(src: Path, groups: list[list[Path]]) -> list[Path]:
    """One ``unity_<i>.cpp`` in ``src`` per group, including the group's sources (copied beside it);
    a file is rewritten only when its text changes, so ninja does not rebuild an unchanged unit."""
    units = []
    for i, group in enumerate(groups):
        unit = src / f"unity_{i}.cpp"
        text = "// generated by lockgate.kernels: one compiler run for these sources\n" + "".join(
            f'#include "{f.name}"\n' for f in group)
        if not unit.is_file() or unit.read_text() != text:
            unit.write_text(text)
        units.append(unit)
    return units


def _ninja_log(where: Path) -> dict[str, tuple[int, int]]:
    """The build's finished commands from ninja's ``.ninja_log``: output -> (start, end) in ms
    since the build began."""
    try:
        lines = (where / ".ninja_log").read_text().splitlines()
    except OSError:
        return {}
    done = {}
    for parts in (ln.split("\t") for ln in lines if not ln.startswith("#")):
        if len(parts) > 3 and parts[0].isdigit() and parts[1].isdigit():
            done[parts[3]] = (int(parts[0]), int(parts[1]))
    return done


def _build_left(where: Path, elapsed: float, objects: list[str]) -> float | None:
    """Seconds the build likely has left, once one of ``objects`` is compiled: every object costs
    about the mean of those done (the groups are of about equal cost), ninja runs as many at once
    as it has been seen to, and it has kept them all busy since the start. None before an object
    is done."""
    done = {out: t for out, t in _ninja_log(where).items() if out in objects}
    if not done:
        return None
    each = sum(end - start for start, end in done.values()) / len(done) / 1000
    left = len(objects) - len(done)
    waves = -(-left // _ninja_jobs())  # the objects not done, run as many at a time as ninja runs
    latest = max(start for start, _ in done.values()) / 1000  # the newest wave began about then
    return max(waves * each - (elapsed - latest) * (left > 0), 1.0) + 1.0  # and linking


def _ninja_jobs_wanted() -> int:
    """How many compiler runs the build is split into: ``$MAX_JOBS`` when set, else the CPUs this
    process may use (one run per CPU; more would parse the torch headers more often for no gain)."""
    try:
        return max(1, int(os.environ["MAX_JOBS"]))
    except (KeyError, ValueError):
        return max(1, len(os.sched_getaffinity(0)))


def _ninja_jobs() -> int:
    """How many commands ninja runs at once: ``$MAX_JOBS`` (torch passes it on), else ninja's own
    guess from the CPUs (2 for one, 3 for two, CPUs + 2 beyond)."""
    try:
        return max(1, int(os.environ["MAX_JOBS"]))
    except (KeyError, ValueError):
        n = len(os.sched_getaffinity(0))
        return 2 if n <= 1 else 3 if n == 2 else n + 2


def expected_build_seconds() -> float:
    """How long a build likely takes here: the newest finished build in the cache (its ``BUILT``
    says how long it took), else ``EXPECTED_BUILD_SECONDS``."""
    newest: tuple[float, float] | None = None
    try:
        for built in cache_dir().glob(f"*/{BUILT}"):
            m = re.search(r"built in ([0-9.]+)s", built.read_text())
            if m and (newest is None or built.stat().st_mtime > newest[0]):
                newest = (built.stat().st_mtime, float(m.group(1)))
    except OSError:
        pass
    return EXPECTED_BUILD_SECONDS if newest is None else newest[1]
