"""Tensor parallelism across processes: the ranks, their all-reduce, and the steps rank 0 sends them.

Owns ``TensorParallelGroup`` (rank 0's side: starting ranks 1..N-1, sending each step's
``RankStep``, watching the ranks, stopping them) and ``main`` (ranks 1..N-1: ``python -m
lockgate.runner.tensor_parallel ARGS_JSON``), and the CPU groups each rank's threads run on
(``cpu_groups``).

How a step runs: rank 0's ``ModelRunner`` (in the scheduler process, or the offline ``LLM``'s)
validates the plan, sends every other rank a ``RankStep`` (the plan's token and KV-slot arrays,
which rows are sampled, how many are decode rows: no sampling settings, no requests) over a ZeroMQ
PUSH socket, and runs its own part of the forward; each rank runs the same layers on its own
heads and MLP columns (``models/shard.py``), and the ranks sum their partial O / down outputs
with a gloo all-reduce (``reduce``, the model's hook) twice per layer. Only rank 0 computes the
LM head and samples. The slot ledger, prefix cache and admission are the scheduler's, single, in
rank 0's process; every rank's KV pool has the same capacity (``capacity``: what every rank can
hold) and holds its own heads at the same slots.

The one-call fused step (``KernelOps.whole_step``, ``decode_layers_``) is bypassed on every rank:
the all-reduces fall inside a layer (after the O projection, before the MLP's norm reads its sum),
so a step runs the layer loop on the fused element-wise kernels; ``benchmarks/tensor_parallel.py``
measures what that costs.

Failure rules (docs/design.md, "Processes"): a rank that exits while rank 0 runs is reported by a
watcher thread naming the rank, its pid and how it ended (``on_death``: the scheduler process
sends a ``Fatal`` naming it and exits with ``TENSOR_PARALLEL_EXIT_CODE``, after killing the
other ranks; elsewhere the next ``execute`` raises the message). Ranks exit when rank 0 goes: a
parent-death signal (SIGKILL) set at their start, and a check of the parent once a second while
idle. A rank whose step raises exits (its peers would wait in the all-reduce forever otherwise).
A rank that hangs holds rank 0 in its all-reduce, where the scheduler's watchdog ends the process
and its message lists every rank's state (``describe``). A rank that fails to load reports why
before it exits; rank 0's start raises that as a ValueError naming the rank.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import msgspec
import numpy as np
import torch
import torch.distributed as dist
import zmq

from lockgate.config import CacheConfig, ModelConfig
from lockgate.ipc.channel import Receiver, Sender

log = logging.getLogger("lockgate.runner")

WORKER_MODULE = "lockgate.runner.tensor_parallel"
START_TIMEOUT = 1800.0  # seconds rank 0 waits for the other ranks to load (a first start measures its forms)
COLLECTIVE_TIMEOUT = timedelta(hours=1)  # gloo's own limit; a hung rank is the watchdog's
STOP_SECONDS = 5.0
I64 = np.int64


class RankStep(msgspec.Struct, tag="step", frozen=True):
    """One forward for ranks 1..N-1: int64 arrays as raw bytes (``ForwardPlan``'s token and KV
    fields), ``rows``: the sampled rows (their count decides whether the last layer runs whole),
    ``decode_rows``: -1 for None."""

    input_ids: bytes
    positions: bytes
    out_slots: bytes
    query_lens: bytes
    seq_lens: bytes
    kv_slots: bytes
    kv_offsets: bytes
    rows: bytes
    decode_rows: int


class RankStop(msgspec.Struct, tag="stop", frozen=True):
    pass


class RankReady(msgspec.Struct, tag="ready", frozen=True):
    rank: int
    pid: int


class RankFailed(msgspec.Struct, tag="failed", frozen=True):
    rank: int
    message: str


ToRank = RankStep | RankStop
ToLeader = RankReady | RankFailed


class RankArgs(msgspec.Struct, frozen=True):
    model: ModelConfig  # dtype and quantization as rank 0 resolved them
    capacity: int
    kv_cache_dtype: str  # the pool's format, as rank 0 resolved it
    rank: int
    size: int
    cpus: list[int]  # this rank's CPUs (empty: leave the affinity alone)
    step_endpoint: str  # PULL, bound by the rank
    leader_endpoint: str  # PUSH to rank 0 (ready / failed)
    store_port: int  # rank 0's TCPStore (the gloo rendezvous)
    parent_pid: int
    log_level: str = "INFO"


def encode_step(input_ids: np.ndarray, positions: np.ndarray, out_slots: np.ndarray, query_lens: np.ndarray,
                seq_lens: np.ndarray, kv_slots: np.ndarray, kv_offsets: np.ndarray, rows: np.ndarray,
                decode_rows: int | None) -> RankStep:
    def raw(a: np.ndarray) -> bytes:
        return np.ascontiguousarray(a, dtype=I64).tobytes()

    return RankStep(raw(input_ids), raw(positions), raw(out_slots), raw(query_lens), raw(seq_lens), raw(kv_slots),
                    raw(kv_offsets), raw(rows), -1 if decode_rows is None else decode_rows)


def decode_array(b: bytes) -> np.ndarray:
    return np.frombuffer(b, dtype=I64)


# ---- CPU groups ------------------------------------------------------------------------------

def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8]; ValueError naming ``--tp-cpus``."""
    cpus: list[int] = []
    for item in text.split(","):
        item = item.strip()
        lo, sep, hi = item.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ValueError(f"--tp-cpus: {item!r} is not a CPU number or range (e.g. 0-3,8)") from None
        if a < 0 or b < a:
            raise ValueError(f"--tp-cpus: {item!r} is not a CPU range (e.g. 0-3)")
        cpus.extend(range(a, b + 1))
    return cpus


def cpu_groups(size: int, spec: str | None, allowed: set[int]) -> list[list[int]]:
    """Each rank's CPUs: ``spec`` ("0-31|32-63", one group per rank, within the process's allowed
    CPUs), else the allowed CPUs cut into ``size`` contiguous groups, as even as they go; empty
    groups (fewer CPUs than ranks) leave every rank on all of them. ValueError naming ``--tp-cpus``."""
    if spec is not None:
        groups = [parse_cpu_list(g) for g in spec.split("|")]
        if len(groups) != size:
            raise ValueError(f"--tp-cpus {spec!r} gives {len(groups)} CPU groups for --tensor-parallel-size {size}: "
                             "give one per rank, separated by '|'")
        seen: set[int] = set()
        for g in groups:
            outside = sorted(set(g) - allowed)
            if outside:
                raise ValueError(f"--tp-cpus {spec!r}: CPUs {outside} are not available to this process "
                                 f"(available: {sorted(allowed)})")
            if seen & set(g):
                raise ValueError(f"--tp-cpus {spec!r}: CPUs {sorted(seen & set(g))} are in two groups")
            seen |= set(g)
        return [sorted(set(g)) for g in groups]
    cpus = sorted(allowed)
    if len(cpus) < size:
        return [[] for _ in range(size)]
    return [cpus[len(cpus) * r // size:len(cpus) * (r + 1) // size] for r in range(size)]


def take_cpus(cpus: list[int], num_threads: int | None) -> None:
    """Run this process on ``cpus`` (none: leave it) with ``num_threads`` torch threads (default:
    one per CPU of the group)."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    if num_threads is not None or cpus:
        torch.set_num_threads(num_threads or len(cpus))


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _rank_ended(rank: int, proc: subprocess.Popen[bytes], code: int) -> str:
    """How a rank that exited is named in logs and errors."""
    return f"tensor-parallel rank {rank} (pid {proc.pid}) {_exit_text(code)}"


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


# ---- rank 0 ----------------------------------------------------------------------------------

class TensorParallelGroup:
    """Rank 0's view of the group: ``start`` the other ranks, ``wait_ready``, then ``send`` each
    step and ``reduce`` in the forward; ``close`` stops them (also at exit)."""

    def __init__(self, model_cfg: ModelConfig, capacity: int, kv_cache_dtype: str, cpus: list[list[int]]) -> None:
        self.size = model_cfg.tensor_parallel_size
        self.dead: str | None = None  # why the group cannot run (a rank died)
        self.on_death: Callable[[str], None] | None = None  # set by the scheduler process
        self._closing = False
        self._dir = tempfile.mkdtemp(prefix="lockgate-tp-")
        self._ctx = zmq.Context()
        self._inbox: Receiver[ToLeader] = Receiver(self._ctx, f"ipc://{self._dir}/leader", ToLeader)
        # rank 0 hosts the rendezvous; its port is known before the others start
        self._store = dist.TCPStore("127.0.0.1", 0, self.size, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=START_TIMEOUT))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self._outs: dict[int, Sender] = {}
        self.pg: Any = None  # dist.ProcessGroupGloo (its stubs lack ``allreduce``)
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        for rank in range(1, self.size):
            args = RankArgs(model=model_cfg, capacity=capacity, kv_cache_dtype=kv_cache_dtype, rank=rank, size=self.size,
                            cpus=cpus[rank],
                            step_endpoint=f"ipc://{self._dir}/rank{rank}", leader_endpoint=f"ipc://{self._dir}/leader",
                            store_port=self._store.port, parent_pid=os.getpid(),
                            log_level=level if isinstance(level, str) else "INFO")
            self.procs[rank] = subprocess.Popen([sys.executable, "-m", WORKER_MODULE,
                                                 msgspec.json.encode(args).decode()])
        log.info("tensor parallelism: started ranks %s", ", ".join(f"{r} (pid {p.pid}, CPUs {cpus[r] or 'all'})"
                                                               for r, p in self.procs.items()))
        atexit.register(self.close)

    def wait_ready(self) -> None:
        """Wait until every other rank has loaded its part, then join the gloo group; ValueError
        naming a rank that failed or died meanwhile (the others are stopped)."""
        waiting = set(self.procs)
        deadline = time.monotonic() + START_TIMEOUT
        while waiting:
            msg = self._inbox.recv(timeout_ms=200)
            if isinstance(msg, RankReady):
                waiting.discard(msg.rank)
            elif isinstance(msg, RankFailed):
                self.close()
                raise ValueError(f"tensor-parallel rank {msg.rank} failed to start: {msg.message}")
            for rank in list(waiting):
                code = self.procs[rank].poll()
                if code is not None:
                    self.close()
                    raise ValueError(f"{_rank_ended(rank, self.procs[rank], code)} while loading "
                                     "(its log lines above say why)")
            if time.monotonic() > deadline:
                self.close()
                raise ValueError(f"tensor-parallel ranks {sorted(waiting)} did not load within {START_TIMEOUT:.0f}s")
        for rank in self.procs:
            self._outs[rank] = Sender(self._ctx, f"ipc://{self._dir}/rank{rank}")
        self.pg = dist.ProcessGroupGloo(self._store, 0, self.size, COLLECTIVE_TIMEOUT)
        for rank, proc in self.procs.items():
            threading.Thread(target=self._watch, args=(rank, proc), name=f"tp-rank{rank}", daemon=True).start()
        log.info("tensor parallelism: %d ranks ready (gloo all-reduce)", self.size)

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if self._closing:
            return
        self.dead = _rank_ended(rank, proc, code)
        log.critical("%s; the model cannot run without it", self.dead)
        if self.on_death is not None:
            self.on_death(self.dead)

    def _dead_rank(self, wait: float) -> str | None:
        """The first other rank that has exited, named as the watcher names it, waiting up to
        ``wait`` seconds for one (a killed rank breaks rank 0's all-reduce before its exit is seen)."""
        deadline = time.monotonic() + wait
        while True:
            for rank, proc in self.procs.items():
                code = proc.poll()
                if code is not None:
                    return _rank_ended(rank, proc, code)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def broken(self, why: str) -> None:
        """Rank 0 failed inside a step (the others may wait in an all-reduce that will never come):
        end them and report, as for a rank that died. A rank that did die is named instead."""
        if self.dead is not None:
            return
        self.dead = self._dead_rank(wait=1.0) or f"tensor parallelism: {why}"
        self.kill()
        log.critical("%s; the other ranks were stopped", self.dead)
        if self.on_death is not None:
            self.on_death(self.dead)

    def send(self, step: RankStep) -> None:
        if self.dead is not None:
            raise RuntimeError(self.dead)
        for out in self._outs.values():
            out.send(step)

    def reduce(self, x: torch.Tensor) -> None:
        """Sum ``x`` over the ranks, in place (every rank gets the same bits)."""
        assert self.pg is not None
        try:
            self.pg.allreduce([x]).wait()
        except RuntimeError as e:
            raise RuntimeError(self.dead or self._dead_rank(wait=1.0) or f"tensor-parallel all-reduce failed: {e}") from e

    def describe(self) -> str:
        """Every other rank's pid and process state (R running, S sleeping, T stopped, Z dead)."""
        return ", ".join(f"rank {r}: pid {p.pid} state {_proc_state(p.pid)}" for r, p in self.procs.items())

    def kill(self) -> None:
        """End every other rank now (rank 0 is about to exit on a failure)."""
        self._closing = True
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()

    def close(self) -> None:
        """Stop the other ranks (a stop message, then SIGKILL after ``STOP_SECONDS``)."""
        if self._closing and all(p.poll() is not None for p in self.procs.values()):
            return
        self._closing = True
        for out in self._outs.values():
            out.try_send(RankStop())
        deadline = time.monotonic() + STOP_SECONDS
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for out in self._outs.values():
            out.close()
        self._inbox.close()


# ---- ranks 1..N-1 ----------------------------------------------------------------------------

def _die_with_parent() -> None:
    """SIGKILL this process when the process that started it ends (Linux's PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = msgspec.json.decode(argv[0], type=RankArgs)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [tp-rank{args.rank}] %(name)s: %(message)s")
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # rank 0 stops this process (a message, else SIGKILL)
    _die_with_parent()
    if os.getppid() != args.parent_pid:
        return 1
    ctx = zmq.Context()
    leader = Sender(ctx, args.leader_endpoint)
    inbox: Receiver[ToRank] = Receiver(ctx, args.step_endpoint, ToRank)
    try:
        from lockgate.runner.model_runner import ModelRunner

        take_cpus(args.cpus, args.model.num_threads)
        runner = ModelRunner(args.model, CacheConfig(max_total_tokens=args.capacity, kv_cache_dtype=args.kv_cache_dtype),
                             rank=args.rank)
        from lockgate.runner.threads import pin_torch_threads

        pin_torch_threads()
        store = dist.TCPStore("127.0.0.1", args.store_port, args.size, is_master=False,
                              timeout=timedelta(seconds=START_TIMEOUT))
    except Exception as e:  # noqa: BLE001  (whatever stops the load is reported to rank 0)
        log.exception("tensor-parallel rank %d failed to start", args.rank)
        leader.send(RankFailed(args.rank, f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)))
        time.sleep(0.2)  # let the message leave before the socket goes
        return 1
    leader.send(RankReady(args.rank, os.getpid()))
    pg: Any = dist.ProcessGroupGloo(store, args.rank, args.size, COLLECTIVE_TIMEOUT)

    def reduce(x: torch.Tensor) -> None:
        pg.allreduce([x]).wait()

    runner.model.reduce = reduce
    while True:
        msg = inbox.recv(timeout_ms=1000)
        if msg is None:
            if os.getppid() != args.parent_pid:
                log.error("rank 0 (pid %d) is gone; exiting", args.parent_pid)
                return 1
            continue
        if isinstance(msg, RankStop):
            return 0
        try:
            runner.run_part(msg)
        except Exception:
            log.exception("tensor-parallel rank %d: a step failed; exiting (rank 0 cannot go on without it)", args.rank)
            return 1


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    os._exit(code)  # no interpreter teardown: a gloo group whose peers are gone may block in it
