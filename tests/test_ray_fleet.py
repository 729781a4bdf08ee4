"""``lockgate serve --ray`` on a real local Ray cluster: the test process is the cluster's head and a
driver (``ray.init``), and ``serve --ray --ray-address`` joins it as a second driver that places the
replicas as actors.

Everything stays on loopback (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: Ray's switch that makes a node
use 127.0.0.1). The replica servers are stopped through the gateway (SIGTERM drains them), by Ray
(``ray.shutdown`` ends the actors, and a server dies with its actor), and any left over by pid.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_util import ServerProc, pid_alive

LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
os.environ.update(LOOPBACK)  # read when ray is imported: before the import below

import ray  # noqa: E402  (in the test extra: a missing Ray fails here rather than skipping)


@pytest.fixture(scope="module")
def cluster():
    from lockgate.fleet.ray_fleet import private_ray_dir

    temp = private_ray_dir()  # a new cluster, whatever another run left in /tmp/ray
    ray.init(address="local", _temp_dir=temp, num_cpus=6, include_dashboard=False, log_to_driver=False,
             object_store_memory=100 * 1024 * 1024, namespace="lockgate-tests")
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def members(url: str) -> list[dict]:
    return httpx.get(url + "/admin/replicas", timeout=10).json()["members"]


def healthy(url: str) -> list[str]:
    body = httpx.get(url + "/health", timeout=10).json()
    return sorted(r["url"] for r in body.get("replicas", []) if isinstance(r, dict) and r["healthy"])


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


class RayServe:
    """``serve --ray`` on a free port, joined to ``cluster``; stopped by pid, its replicas too."""

    def __init__(self, address: str, *args: str) -> None:
        self.server = ServerProc("--ray", "--ray-address", address, *args, env=LOOPBACK)
        self.url = self.server.url
        self.seen_pids: set[int] = set()

    def ready(self, n: int, timeout: float = 120.0) -> list[dict]:
        self.server.wait_ready(timeout)
        got = wait_for(lambda: len(healthy(self.url)) == n and len(ms := members(self.url)) == n and ms,
                       timeout, f"{n} healthy replicas")
        self.seen_pids |= {m["pid"] for m in got if m.get("pid")}
        return got

    def stop(self) -> int:
        try:
            self.seen_pids |= {m["pid"] for m in members(self.url) if m.get("pid")}
        except (httpx.HTTPError, ValueError):
            pass
        code = self.server.stop()
        deadline = time.monotonic() + 30
        while any(pid_alive(p) for p in self.seen_pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        for p in self.seen_pids:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
        return code


def complete(url: str, prompt: str, max_tokens: int = 16, timeout: float = 60) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=timeout,
                      json={"model": "sim", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})


SIM = ("--model", "sim", "--replica-cpus", "1", "--sim-step-ms", "5")


def test_replicas_are_ray_actors_the_gateway_finds_and_scales(cluster) -> None:
    s = RayServe(cluster, "--replicas", "2", *SIM)
    try:
        ms = s.ready(2)
        urls = sorted(m["url"] for m in ms)
        assert len(set(urls)) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls)
        assert all(m["node"] == "127.0.0.1" and m["actor_pid"] != m["pid"] for m in ms)
        seen = {complete(s.url, f"hello {i}").headers["x-lockgate-replica"] for i in range(12)}
        assert seen == set(urls)  # both replicas take traffic
        # grow to 3
        r = httpx.post(s.url + "/admin/replicas", json={"replicas": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["replicas"] == 3
        s.ready(3)
        # shrink to 1 while a long request runs on a replica that is drained: it still finishes
        long_result: dict[str, httpx.Response] = {}
        t = threading.Thread(target=lambda: long_result.setdefault("r", complete(s.url, "long", max_tokens=600)))
        t.start()
        time.sleep(0.5)
        r = httpx.post(s.url + "/admin/replicas", json={"replicas": 1}, timeout=30)
        assert r.status_code == 200 and r.json()["replicas"] == 1
        t.join(90)
        assert long_result["r"].status_code == 200, long_result["r"].text
        assert long_result["r"].json()["usage"]["completion_tokens"] == 600
        ms = wait_for(lambda: len(m := members(s.url)) == 1 and m, 60, "the drained replicas to stop")
        wait_for(lambda: healthy(s.url) == [ms[0]["url"]], 30, "the gateway to drop the drained replicas")
        assert complete(s.url, "after").status_code == 200
        for bad in ({"replicas": -1}, {"replicas": "2"}, {"n": 2}, {"replicas": 10_000}):
            r = httpx.post(s.url + "/admin/replicas", json=bad, timeout=10)
            assert r.status_code == 400 and "replicas" in r.text, bad
    finally:
        assert s.stop() == 0
    assert not any(pid_alive(p) for p in s.seen_pids)  # no replica server outlives serve --ray


def test_a_killed_replica_is_restarted_and_a_stopped_one_routed_around(cluster) -> None:
    s = RayServe(cluster, "--replicas", "2", *SIM)
    try:
        ms = s.ready(2)
        victim = ms[0]
        results: list[tuple[float, int, str]] = []  # (sent at, status, replica)
        lock = threading.Lock()
        killed_at: list[float] = []

        def one(i: int) -> None:
            sent = time.monotonic()
            try:
                r = complete(s.url, f"load {i}", max_tokens=40)
                status, rep = r.status_code, r.headers.get("x-lockgate-replica", "")
            except httpx.HTTPError as e:
                status, rep = 0, type(e).__name__
            with lock:
                results.append((sent, status, rep))

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(one, i) for i in range(16)]
            time.sleep(0.3)
            os.kill(victim["pid"], signal.SIGKILL)  # the replica's server process dies under load
            killed_at.append(time.monotonic())
            futures += [pool.submit(one, i) for i in range(16, 48)]
            for f in futures:
                f.result()
        after = [(st, rep) for sent, st, rep in results if sent > killed_at[0] + 0.05]
        assert after and all(st == 200 for st, _ in after), after  # nothing sent after the kill failed
        # Ray restarts the actor, which starts a new server on a new port: it rejoins the fleet
        ms2 = wait_for(lambda: len(h := healthy(s.url)) == 2 and victim["url"] not in h and members(s.url), 90,
                       "the killed replica to come back")
        s.seen_pids |= {m["pid"] for m in ms2}
        assert victim["pid"] not in {m["pid"] for m in ms2}
        # a partition: SIGSTOP a replica; health checks time out and traffic goes around it
        frozen = ms2[0]
        os.kill(frozen["pid"], signal.SIGSTOP)
        try:
            wait_for(lambda: frozen["url"] not in healthy(s.url), 30, "the stopped replica to be seen unhealthy")
            rs = [complete(s.url, f"around {i}", timeout=30) for i in range(6)]
            assert all(r.status_code == 200 and r.headers["x-lockgate-replica"] != frozen["url"] for r in rs)
        finally:
            os.kill(frozen["pid"], signal.SIGCONT)
        wait_for(lambda: len(healthy(s.url)) == 2, 30, "the resumed replica to be healthy again")
    finally:
        assert s.stop() == 0


@pytest.mark.slow
def test_a_real_model_replica_on_ray(cluster) -> None:
    import openai

    s = RayServe(cluster, "--replicas", "1", "--model", "default", "--replica-cpus", "2", "--max-total-tokens", "4096")
    try:
        s.ready(1, timeout=300)
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x")
        out = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Say hi."}],
                                             max_tokens=8, temperature=0)
        assert out.choices[0].message.content and out.usage.completion_tokens > 0
    finally:
        assert s.stop() == 0


def _descendants(roots: set[int]) -> set[int]:
    """``roots`` and every process below them (from /proc's parent links)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = set(roots), set(roots)
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - found
        found |= frontier
    return found


def _using(text: str) -> set[int]:
    """Processes whose command line mentions ``text`` (Ray's head processes name their temp dir)."""
    pids = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        pids.add(int(d))
            except OSError:
                pass
    return pids


def test_a_local_cluster_is_private_and_a_hard_kill_leaves_nothing_that_stops_the_next(tmp_path) -> None:
    """``serve --ray`` with no --ray-address starts a cluster of its own: a stale ``RAY_ADDRESS`` does not
    send it elsewhere, and after SIGTERM then SIGKILL to its process group a second later (a supervisor's
    way), its Ray processes go and the next ``serve --ray`` starts and serves."""
    env = {**LOOPBACK, "RAY_ADDRESS": "127.0.0.1:9"}  # a cluster that is not there
    first = ServerProc("--ray", "--replicas", "1", *SIM, env=env)
    started: set[int] = set()
    try:
        first.wait_ready(180)
        ms = wait_for(lambda: len(healthy(first.url)) == 1 and members(first.url), 120, "a healthy replica")
        temp = f"lockgate-ray-{first.proc.pid}-"
        started = _descendants({first.proc.pid, *_using(temp), ms[0]["actor_pid"], ms[0]["pid"]})
        assert len(started) > 3, started  # the server, Ray's head processes, the actor, its server
        group = os.getpgid(first.proc.pid)
        os.killpg(group, signal.SIGTERM)
        time.sleep(1.0)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
        first.proc.wait(10)
        deadline = time.monotonic() + 60
        while any(pid_alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = {p for p in started if pid_alive(p)}
        assert not left, f"processes of the killed server still run: {left}"
        second = RayServe.__new__(RayServe)
        second.server, second.seen_pids = ServerProc("--ray", "--replicas", "1", *SIM, env=env), set()
        second.url = second.server.url
        try:
            second.ready(1, timeout=180)
            assert complete(second.url, "after a hard kill").status_code == 200
        finally:
            assert second.stop() == 0
    finally:
        first.stop()
        for p in started:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
