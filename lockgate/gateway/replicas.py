"""The live fleet of engine replicas: membership, health and load, as the gateway sees them.

Owns one ``Replica`` per URL and two background loops:

* health: every ``health_interval`` seconds ``GET /health`` on every replica; 200 = healthy.
  A replica enters the fleet unhealthy and takes traffic from its first good check on; a failed
  check (or a refused connection seen by the proxy) takes it out until a check passes again.
  Going unhealthy also drops its blocks from the prefix index (it may come back restarted, cold).
* load: every ``load_interval`` seconds ``GET /v1/loads`` on healthy replicas. A replica's load
  is the gateway's own count of requests it has in flight there, plus ``external``: what the
  replica reports beyond that (traffic that does not come through this gateway). The own count
  is exact and immediate; the poll corrects it once a second.
* forecast (``Replica.forecast``): the replica's reported ``queue_eta_s`` less the time since the
  poll that read it, plus the estimated prefill seconds of every request the gateway sent there
  after that poll was sent and whose answer has not begun (``note_sent`` / ``done_sent``; the
  replica's next report counts them itself), and its reported ``prefill_tokens_per_s`` and
  ``decode_step_s``. A replica that reports no forecast has an ETA of just what the
  gateway sent there since its last poll. ``Fleet.retry_after`` is the smallest such ETA over the
  healthy replicas, rounded up, at least 1 s: the ``Retry-After`` of a request every replica refused.

Membership is the ``--replica`` URLs plus, if given, the lines of ``--replicas-file`` (one URL per
line, ``#`` comments), re-read every poll and applied once a changed text reads the same twice, plus,
if given, what a ``MembershipSource`` answers every poll (``serve --ray``: the live Ray replicas; an
answer of None keeps the last one). A removed replica takes no new requests; those already running
there finish.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from lockgate.gateway.policy import ReplicaForecast

log = logging.getLogger("lockgate.gateway")


def normalize_url(text: str) -> str:
    """A replica URL without trailing slash; raises ValueError naming what is wrong."""
    url = text.strip().rstrip("/")
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as e:
        raise ValueError(f"replica URL {text!r} is not a URL: {e}") from e
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"replica URL {text!r} must look like http://HOST:PORT")
    if parsed.path not in ("", "/") or parsed.query:
        raise ValueError(f"replica URL {text!r} must not have a path or query (the gateway adds the route)")
    return url


def parse_replicas(text: str, path: Path) -> list[str]:
    """URLs listed in a replicas file's ``text``: one per line, blank lines and ``#`` comments ignored."""
    urls = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            urls.append(normalize_url(line))
        except ValueError as e:
            raise ValueError(f"{path}:{n}: {e}") from e
    return urls


@dataclass
class Replica:
    url: str
    healthy: bool = False
    in_flight: int = 0  # requests this gateway has open there now
    external: int = 0  # the replica's reported in-flight count minus ours, at the last poll (may be < 0)
    last_error: str | None = None
    reported: dict[str, Any] = field(default_factory=dict)  # last /v1/loads body
    reported_at: float | None = None  # time.monotonic() when that body was read
    sent: list[tuple[float, float]] = field(default_factory=list)  # (when, est. prefill s) routed here since

    @property
    def load(self) -> int:
        """What the replica reported at the last poll plus what we opened (or closed) there since."""
        return max(0, self.in_flight + self.external)

    @property
    def adapters(self) -> set[str]:
        """The LoRA adapters the replica reported loaded at the last poll (or adapter change)."""
        names = self.reported.get("adapters")
        return set(names) if isinstance(names, list) else set()

    def note_sent(self, prefill_s: float, now: float | None = None) -> tuple[float, float]:
        """The gateway sent a request here whose own prefill should take ``prefill_s`` seconds; the
        entry to give ``done_sent`` once its answer begins (its prefill is then behind it)."""
        entry = (time.monotonic() if now is None else now, max(0.0, prefill_s))
        self.sent.append(entry)
        if len(self.sent) > 4096:  # polls failing for long: keep the newest
            del self.sent[:2048]
        return entry

    def done_sent(self, entry: tuple[float, float] | None) -> None:
        if entry is None:
            return
        for i in range(len(self.sent) - 1, -1, -1):  # by identity: equal entries are separate requests
            if self.sent[i] is entry:
                del self.sent[i]
                return

    def forecast(self, now: float | None = None) -> ReplicaForecast:
        """The queue ETA and prefill rate the gateway expects here now (module docstring)."""
        now = time.monotonic() if now is None else now
        eta = self.reported.get("queue_eta_s")
        left = 0.0
        if isinstance(eta, (int, float)) and self.reported_at is not None:
            left = max(0.0, float(eta) - (now - self.reported_at))
        return ReplicaForecast(queue_eta_s=left + sum(s for _, s in self.sent),
                               prefill_tokens_per_s=self._positive("prefill_tokens_per_s"),
                               decode_step_s=self._positive("decode_step_s"))

    def _positive(self, name: str) -> float | None:
        v = self.reported.get(name)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None

    def view(self) -> dict[str, Any]:
        fc = self.forecast()
        return {"url": self.url, "healthy": self.healthy, "load": self.load, "in_flight": self.in_flight,
                "external": self.external, "last_error": self.last_error,
                "forecast": {"queue_eta_s": round(fc.queue_eta_s, 4), "prefill_tokens_per_s": fc.prefill_tokens_per_s,
                             "decode_step_s": fc.decode_step_s},
                "reported": self.reported}


HealthHook = Callable[[Replica, bool], None]


class MembershipSource(Protocol):
    """Where replicas come from beyond the flags and the file (``lockgate.fleet.ray_fleet.RayFleet``)."""

    async def urls(self) -> list[str] | None: ...


class Fleet:
    def __init__(self, urls: Iterable[str], replicas_file: Path | None = None, *, health_interval: float = 2.0,
                 load_interval: float = 1.0, on_health: HealthHook | None = None,
                 on_removed: Callable[[str], None] | None = None, api_key: str | None = None,
                 source: MembershipSource | None = None) -> None:
        self.static = [normalize_url(u) for u in urls]
        self.source = source
        self._file_urls: list[str] = []
        self._source_urls: list[str] = []
        self.replicas_file = replicas_file
        self.health_interval = health_interval
        self.load_interval = load_interval
        self.on_health = on_health
        self.on_removed = on_removed
        self._poll_headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.replicas: dict[str, Replica] = {}
        self._file_seen: str | None = None  # the text of the last read
        self._file_applied: str | None = None  # the text the fleet reflects
        self._file_error: str | None = None  # the last problem logged (logged once, not every poll)
        self._tasks: list[asyncio.Task[None]] = []
        self._http: httpx.AsyncClient | None = None
        self._health_wakeup = asyncio.Event()
        if replicas_file is not None:
            self._file_applied = self._file_seen = replicas_file.read_text()
            self._file_urls = parse_replicas(self._file_applied, replicas_file)
        self._set_members()
        if not self.replicas and source is None:
            raise ValueError("no replica: give --replica URL (repeatable) or a --replicas-file listing some")

    # ---- membership -----------------------------------------------------------------------
    def _set_members(self) -> None:
        wanted = list(dict.fromkeys([*self.static, *self._file_urls, *self._source_urls]))
        for url in wanted:
            if url not in self.replicas:
                self.replicas[url] = Replica(url)
                log.info("replica %s added", url)
                self._health_wakeup.set()
        for url in [u for u in self.replicas if u not in wanted]:
            del self.replicas[url]
            log.info("replica %s removed", url)
            if self.on_removed is not None:
                self.on_removed(url)

    def _reload_file(self) -> None:
        """Apply the replicas file when its text changed and reads the same twice in a row.

        Comparing text (the file is small) catches changes within one mtime tick; waiting for two
        equal reads skips a half-written file (truncate, then write) instead of emptying the fleet.
        """
        path = self.replicas_file
        if path is None:
            return
        try:
            text = path.read_text()
        except OSError as e:
            if self._file_error != str(e):
                log.warning("replicas file not readable (keeping the current fleet): %s", e)
            self._file_error = str(e)
            return
        previous, self._file_seen = self._file_seen, text
        if text == self._file_applied or text != previous:
            return
        try:
            urls = parse_replicas(text, path)
        except ValueError as e:
            if self._file_error != str(e):
                log.warning("replicas file not applied (keeping the current fleet): %s", e)
            self._file_error = str(e)
            return
        self._file_applied, self._file_error = text, None
        log.info("replicas file %s changed: %d replicas listed", path, len(urls))
        self._file_urls = urls
        self._set_members()

    async def _ask_source(self) -> None:
        if self.source is None:
            return
        try:
            urls = await self.source.urls()
        except Exception as e:  # noqa: BLE001 (a source that fails keeps the fleet as it is)
            log.warning("replica membership source failed (keeping the current fleet): %s", e)
            return
        if urls is None:
            return
        urls = [normalize_url(u) for u in urls]
        if urls != self._source_urls:
            self._source_urls = urls
            self._set_members()

    # ---- the view the router uses ---------------------------------------------------------
    def candidates(self, exclude: Iterable[str] = (), adapter: str | None = None) -> dict[str, int]:
        """Healthy replicas (minus ``exclude``) -> load; with ``adapter``, those that have that LoRA
        adapter loaded when any does (else all: the replica will answer the unknown name)."""
        skip = set(exclude)
        healthy = {u: r.load for u, r in self.replicas.items() if r.healthy and u not in skip}
        if adapter is not None:
            having = {u: n for u, n in healthy.items() if adapter in self.replicas[u].adapters}
            if having:
                return having
        return healthy

    def forecasts(self, names: Iterable[str]) -> dict[str, ReplicaForecast]:
        now = time.monotonic()
        return {u: self.replicas[u].forecast(now) for u in names if u in self.replicas}

    def retry_after(self) -> int:
        """Seconds a client refused by every replica should wait: the smallest queue ETA among the
        healthy replicas (as ``forecast`` estimates it), rounded up, at least 1."""
        etas = [f.queue_eta_s for f in self.forecasts(u for u, r in self.replicas.items() if r.healthy).values()]
        return max(1, math.ceil(min(etas))) if etas else 1

    def known_adapters(self) -> set[str]:
        return {a for r in self.replicas.values() for a in r.adapters}

    def set_health(self, replica: Replica, healthy: bool, error: str | None = None) -> None:
        replica.last_error = error
        if replica.healthy == healthy:
            return
        replica.healthy = healthy
        if healthy:
            log.info("replica %s is healthy", replica.url)
        else:
            log.warning("replica %s is unhealthy: %s", replica.url, error)
            replica.external = 0
            replica.sent.clear()
        if self.on_health is not None:
            self.on_health(replica, healthy)

    # ---- background loops -----------------------------------------------------------------
    async def start(self) -> None:
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(2.0), trust_env=False, headers=self._poll_headers)
        self._tasks = [asyncio.create_task(self._health_loop()), asyncio.create_task(self._load_loop())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.aclose()

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(r) for r in list(self.replicas.values())))

    async def _check(self, r: Replica) -> None:
        assert self._http is not None
        try:
            resp = await self._http.get(r.url + "/health")
        except httpx.HTTPError as e:
            self.set_health(r, False, f"health check failed: {type(e).__name__}: {e}")
            return
        if resp.status_code == 200:
            self.set_health(r, True)
        else:
            self.set_health(r, False, f"health check answered {resp.status_code}: {resp.text[:200]}")

    async def _health_loop(self) -> None:
        while True:
            self._reload_file()
            await self.check_all()
            self._health_wakeup.clear()
            try:
                await asyncio.wait_for(self._health_wakeup.wait(), self.health_interval)
            except TimeoutError:
                pass

    async def poll(self, r: Replica) -> None:
        """Read ``r``'s /v1/loads now (its load and LoRA adapters)."""
        await self._poll_load(r)

    async def _poll_load(self, r: Replica) -> None:
        assert self._http is not None
        asked = time.monotonic()
        try:
            resp = await self._http.get(r.url + "/v1/loads")
            body = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return  # the health loop decides about health; a missed poll keeps the last correction
        if isinstance(body, dict):
            r.reported = body
            r.reported_at = time.monotonic()
            r.sent = [(t, s) for t, s in r.sent if t >= asked]  # the older ones are in the report
            theirs = body.get("in_flight")
            if isinstance(theirs, int):
                r.external = theirs - r.in_flight  # others' traffic (> 0), or our count running ahead (< 0)

    async def scrape_metrics(self) -> dict[str, str]:
        """Each healthy replica's /metrics text, fetched concurrently (a replica that does not answer
        within the poll timeout is left out of this scrape)."""
        assert self._http is not None
        http = self._http

        async def one(r: Replica) -> tuple[str, str | None]:
            try:
                resp = await http.get(r.url + "/metrics")
            except httpx.HTTPError:
                return r.url, None
            return r.url, resp.text if resp.status_code == 200 else None

        got = await asyncio.gather(*(one(r) for r in list(self.replicas.values()) if r.healthy))
        return {url: text for url, text in got if text is not None}

    async def _load_loop(self) -> None:
        while True:
            self._reload_file()
            await self._ask_source()
            await asyncio.gather(*(self._poll_load(r) for r in list(self.replicas.values()) if r.healthy))
            await asyncio.sleep(self.load_interval)


def file_path(text: str | None) -> Path | None:
    if text is None:
        return None
    path = Path(os.path.expanduser(text))
    if not path.is_file():
        raise ValueError(f"--replicas-file {text!r}: no such file")
    return path
