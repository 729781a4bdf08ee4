"""A first start a person can watch: ``lockgate.progress`` phases (bars on a terminal, phase lines in
a log file) and the server's ``lockgate ready:`` line, printed when ``/health`` turns 200 and not
before."""

from __future__ import annotations

import io
import logging
import re
import time

import httpx
import pytest
from server_util import ServerProc

from lockgate import progress
from lockgate.progress import phase


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_phase(stream: io.StringIO, caplog: pytest.LogCaptureFixture, **kw: object) -> None:
    log = logging.getLogger("lockgate.test_progress")
    with caplog.at_level(logging.INFO, logger=log.name), phase(log, "doing the thing", total=4, unit="parts",
                                                               stream=stream, **kw) as p:  # type: ignore[arg-type]
        for i in range(4):
            p.at(i, f"part {i}")
            time.sleep(0.15)
        p.to(4)


def test_a_file_gets_a_start_and_an_end_line_and_no_bar(caplog) -> None:
    out = io.StringIO()
    run_phase(out, caplog)
    assert out.getvalue() == ""  # not a terminal: no bar, no carriage return
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "doing the thing ..."
    assert re.fullmatch(r"doing the thing: done in 0\.[5-9]s|doing the thing: done in [1-9]\.\ds", lines[-1])
    assert len(lines) == 2


def test_a_long_phase_logs_its_progress_at_the_interval_given(caplog) -> None:
    run_phase(io.StringIO(), caplog, every=0.2)
    middle = [r.getMessage() for r in caplog.records][1:-1]
    assert middle, "no progress line in 0.6 s with every=0.2"
    assert all(re.match(r"doing the thing: \d/4 parts, part \d, \d+s so far", m) for m in middle), middle


def test_a_terminal_gets_a_bar_redrawn_in_place_that_says_what_and_how_long(caplog) -> None:
    term = Terminal()
    run_phase(term, caplog, expected_s=60.0)
    drawn = term.getvalue()
    assert "\r" in drawn and "doing the thing" in drawn
    assert re.search(r"\d/4 parts, part \d, \d+s so far, ~\d+s left", drawn), drawn[-300:]
    assert [r.getMessage() for r in caplog.records][-1].startswith("doing the thing: done in")  # the log still says it


def test_lockgate_progress_0_turns_bars_off_on_a_terminal(monkeypatch, caplog) -> None:
    monkeypatch.setenv(progress.ENV, "0")
    term = Terminal()
    run_phase(term, caplog)
    assert term.getvalue() == ""


def test_a_failed_phase_says_so_and_the_error_goes_on(caplog) -> None:
    log = logging.getLogger("lockgate.test_progress")
    with pytest.raises(RuntimeError), caplog.at_level(logging.INFO, logger=log.name), phase(log, "breaking"):
        raise RuntimeError("boom")
    assert re.fullmatch(r"breaking: failed after 0\.\ds", caplog.records[-1].getMessage())


def test_time_left_follows_the_steps_once_a_third_are_done() -> None:
    p = progress.Phase(logging.getLogger("x"), "w", total=10, unit="", expected_s=1000.0, every=None,
                       stream=io.StringIO())
    p.t0 -= 10.0  # 10 s in
    assert p.left_s() == pytest.approx(990.0, abs=1)  # nothing done: the expected duration
    p.to(5)
    assert p.left_s() == pytest.approx(10.0, abs=1)  # half done in 10 s: 10 s more
    p._close(True)


READY = re.compile(r"lockgate ready: (http://127\.0\.0\.1:\d+) \(model sim, .*\); /health answers 200 "
                   r"\((\d+\.\d)s after start\)")


def test_the_ready_line_comes_when_health_turns_200_and_not_before() -> None:
    s = ServerProc("--model", "sim", "--max-model-len", "512", "--max-total-tokens", "4096")
    try:
        deadline = time.monotonic() + 120
        first_200 = None
        while time.monotonic() < deadline:
            assert s.proc.poll() is None, s.log()[-3000:]
            said_ready = READY.search(s.log()) is not None  # read before asking: a line seen must mean 200
            try:
                status = httpx.get(s.url + "/health", timeout=5).status_code
            except httpx.HTTPError:
                status = None
            if said_ready:
                assert status == 200, f"ready line logged while /health answers {status}"
                break
            if status == 200 and first_200 is None:
                first_200 = time.monotonic()
            if first_200 is not None:
                assert time.monotonic() - first_200 < 5, "/health is 200 but no ready line within 5 s"
            time.sleep(0.05)
        log = s.log()
        m = READY.search(log)
        assert m is not None, log[-3000:]
        assert m.group(1) == s.url
        listening = log.find(f"listening on {s.url}; /health answers 503")
        assert 0 <= listening < m.start(), "no 503 notice before the ready line"
        assert "\r" not in log
    finally:
        s.stop()
