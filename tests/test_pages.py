"""The pages a person opens (server/pages.py) and CORS (``--allowed-origins``), on real servers.

Over HTTP (httpx): ``GET /`` is the chat page and ``POST /`` is still TGI's generate; ``/docs`` and every
file it loads come from this server (no outside URL); the pages are readable without the API key and
nothing else is; without ``--allowed-origins`` no CORS header is sent (a cross-origin preflight is
refused), with it the preflight and the answers carry the allowed origin, on the server and the gateway.

In a real browser (Debian's ``chromium`` + ``chromium-driver``, driven by Selenium; ``make test``
installs them): the chat page streams an answer (seen part-way, then whole), shows the model and
tokens/s, and sends the conversation back with the next message; ``/docs`` renders the routes from
``/openapi.json`` with nothing loaded from another host.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time

import httpx
import pytest
from server_util import ServerProc

# a slow sim step, so a 30-token answer streams over ~1 s and the browser sees it part-way
SIM = ("--model", "sim", "--max-model-len", "512", "--max-total-tokens", "4096", "--sim-step-ms", "40")
ORIGIN = "http://app.example:3000"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


@pytest.fixture(scope="module")
def server():
    s = ServerProc(*SIM)
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def keyed():
    """A server with an API key and one allowed origin."""
    s = ServerProc(*SIM, "--api-key", "secret", "--allowed-origins", json.dumps([ORIGIN]))
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def _urls(html: str) -> list[str]:
    return re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)""", html)


def test_the_chat_page_is_one_self_contained_file(server) -> None:
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in r.text and "/v1/models" in r.text
    assert not re.search(r"https?://", r.text), "the page must load nothing from another host"
    assert all(u.startswith("/") for u in _urls(r.text))
    # POST / is still TGI's generate route
    t = httpx.post(server.url + "/", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}, timeout=30)
    assert t.status_code == 200 and isinstance(t.json()[0]["generated_text"], str)


def test_docs_and_everything_it_loads_are_served_here(server) -> None:
    r = httpx.get(server.url + "/docs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert not re.search(r"https?://", r.text), "the docs page must load nothing from another host"
    urls = _urls(r.text)
    assert {"/docs/swagger-ui-bundle.js", "/docs/swagger-ui.css"} <= set(urls)
    for u in urls:
        a = httpx.get(server.url + u)
        assert a.status_code == 200 and len(a.content) > 1000, u
    assert "url: '/openapi.json'" in r.text and httpx.get(server.url + "/openapi.json").json()["paths"]


def test_without_allowed_origins_no_cors_header_is_sent(server) -> None:
    pre = httpx.options(server.url + "/v1/chat/completions", headers=PREFLIGHT)
    assert pre.status_code == 405 and "access-control-allow-origin" not in pre.headers
    r = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_allowed_origins_answer_preflights_before_the_key_is_asked_for(keyed) -> None:
    pre = httpx.options(keyed.url + "/v1/chat/completions", headers=PREFLIGHT)
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert {"authorization", "content-type"} <= {h.strip() for h in pre.headers["access-control-allow-headers"].split(",")}
    other = httpx.options(keyed.url + "/v1/chat/completions", headers={**PREFLIGHT, "Origin": "http://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    # a refusal carries the header too, so the page can read why
    denied = httpx.get(keyed.url + "/v1/models", headers={"Origin": ORIGIN})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN
    ok = httpx.get(keyed.url + "/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer secret"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN


def test_the_pages_need_no_key_and_nothing_else_is_opened(keyed) -> None:
    for path in ("/", "/docs", "/docs/swagger-ui-bundle.js", "/openapi.json"):
        assert httpx.get(keyed.url + path).status_code == 200, path
    assert httpx.get(keyed.url + "/v1/models").status_code == 401
    assert httpx.post(keyed.url + "/", json={"inputs": "Hi"}).status_code == 401  # TGI's POST / is not a page
    assert httpx.get(keyed.url + "/docs/../v1/models").status_code == 401
    assert httpx.get(keyed.url + "/metrics").status_code == 401


def test_the_gateway_passes_the_pages_through_and_answers_cors_itself(keyed) -> None:
    gw = ServerProc("--replica", keyed.url, "--api-key", "secret", "--allowed-origins", f'["{ORIGIN}"]',
                    "--health-interval", "0.5", command="gateway")
    try:
        gw.wait_ready(30)
        page = httpx.get(gw.url + "/")
        assert page.status_code == 200 and "/v1/chat/completions" in page.text
        assert httpx.get(gw.url + "/docs").status_code == 200
        assert httpx.get(gw.url + "/v1/models").status_code == 401
        pre = httpx.options(gw.url + "/v1/chat/completions", headers=PREFLIGHT)
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    finally:
        gw.stop()


# ---- a real browser -------------------------------------------------------------------------
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def browser():
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: the chat page is tested in Debian's chromium; install it with "
                    "'apt-get install -y chromium chromium-driver' ('make test' does when it runs as root with apt)")
    offline = os.environ.get("SE_OFFLINE")
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not look for a driver or browser online
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="lockgate-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1000,800"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(options=opts, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
        if offline is None:
            os.environ.pop("SE_OFFLINE", None)


def _wait(what: str, check, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not seen within {timeout}s: {what}")
        time.sleep(0.02)


def _resources(driver) -> list[str]:
    return driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")


def test_the_chat_page_streams_in_a_browser(server, browser) -> None:
    from selenium.webdriver.common.by import By

    d = browser
    d.get(server.url + "/")
    _wait("the model name", lambda: d.find_element(By.ID, "model").text == "sim")
    # record what the page sends, to see the conversation go back with the next message
    d.execute_script("window.sent = []; const f = window.fetch; window.fetch = (u, o) => "
                     "{ if (o && o.body) window.sent.push(JSON.parse(o.body)); return f(u, o); };")
    tokens = d.find_element(By.ID, "max_tokens")
    tokens.clear()
    tokens.send_keys("30")
    d.find_element(By.ID, "msg").send_keys("Hello there")
    d.find_element(By.ID, "send").click()

    def answer() -> str:
        found = d.find_elements(By.CSS_SELECTOR, ".msg.assistant")
        return found[-1].text if found else ""

    partial = _wait("part of the answer while it streams",
                    lambda: answer() and d.find_element(By.ID, "stats").text.endswith("…") and answer())
    stats = _wait("the final stats", lambda: (s := d.find_element(By.ID, "stats").text) and not s.endswith("…") and s)
    first = answer()
    assert len(first) > len(partial) > 0 and first.startswith(partial)
    m = re.fullmatch(r"30 tokens · ([\d.]+) s to first token · ([\d.]+) tok/s", stats)
    assert m and float(m.group(2)) > 0, stats
    assert not d.find_elements(By.CSS_SELECTOR, ".msg.error")

    d.find_element(By.ID, "msg").send_keys("And again")
    d.find_element(By.ID, "send").click()
    _wait("the second answer", lambda: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 2
          and not d.find_element(By.ID, "stats").text.endswith("…") and answer())
    sent = d.execute_script("return window.sent")
    assert [b["stream"] for b in sent] == [True, True] and sent[0]["max_tokens"] == 30
    # sim's text is bytes the browser may render differently: compare the roles and the user turns
    assert [m["role"] for m in sent[1]["messages"]] == ["user", "assistant", "user"]
    assert [sent[1]["messages"][i]["content"] for i in (0, 2)] == ["Hello there", "And again"]
    assert sent[1]["messages"][1]["content"].strip()
    assert all(u.startswith(server.url) for u in _resources(d))


def test_docs_render_in_a_browser_from_this_server_only(server, browser) -> None:
    from selenium.webdriver.common.by import By

    d = browser
    d.get(server.url + "/docs")
    paths = _wait("the routes rendered by Swagger UI", lambda: [e.text for e in d.find_elements(
        By.CSS_SELECTOR, ".opblock-summary-path")] or None)
    assert "/v1/chat/completions" in paths and "/health" in paths
    loaded = _resources(d)
    assert any(u.endswith("/openapi.json") for u in loaded)
    assert all(u.startswith(server.url) for u in loaded), loaded

