"""Overlap scheduling (``--overlap-schedule``): the next step is built while the model computes.

The promise: the same tokens as without overlap, for every request, whatever ends it (a stop
token, max_tokens, an abort, a retraction under ``--admission ratio``), with no token after a
request's end and no KV slot left behind; a step that fails undoes its commit. Checked on the sim
model (its tokens depend on the positions and contexts it is given, so a wrong input shows) with
the scheduler's invariants after every step, then on the real default model offline and through
a server with the official ``openai`` client.
"""

from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest

from lockgate.config import EngineConfig
from lockgate.engine.core import EngineCore
from lockgate.sampling import SamplingParams
from lockgate.scheduler import overlap as overlap_ops


def _engine(overlap: bool, **kw) -> EngineCore:
    return EngineCore(EngineConfig.build(model="sim", sim_step_ms=0.0, overlap_schedule=overlap, **kw),
                      check_invariants=True)


def _workload(eng: EngineCore, seed: int, aborts: bool) -> dict[str, int]:
    """Requests sharing prefixes (the prefix cache), long prompts (chunked prefill), greedy and
    seeded sampled, stop tokens with min_tokens; returns {rid: tokens after which to abort it}."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(3, 250, size=int(rng.integers(16, 200))) for _ in range(4)]
    cut: dict[str, int] = {}
    for i in range(20):
        prompt = np.concatenate([prefixes[i % 4], rng.integers(3, 250, size=int(rng.integers(1, 120)))])
        max_tokens = int(rng.integers(4, 80))
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0 if i % 3 == 0 else 0.9, seed=i,
                            stop_token_ids=[int(rng.integers(3, 250))], min_tokens=int(rng.integers(0, 4)))
        req = eng.add_request(prompt, sp)
        if aborts and i % 4 == 1:
            cut[req.rid] = int(rng.integers(0, 20))
    return cut


def _drain(eng: EngineCore, cut: dict[str, int]) -> tuple[dict[str, list[int]], dict[str, str]]:
    tokens: dict[str, list[int]] = {}
    ended: dict[str, str] = {}
    while eng.has_work:
        for ev in eng.step():
            assert ev.rid not in ended, f"{ev.rid} got an event after it ended ({ended.get(ev.rid)})"
            tokens.setdefault(ev.rid, []).extend(ev.new_token_ids)
            if ev.finish_reason is not None:
                ended[ev.rid] = str(ev.finish_reason)
        for rid, n in list(cut.items()):  # the client goes away once it has seen n tokens
            if rid not in ended and len(tokens.get(rid, [])) >= n:
                eng.abort(rid)
                ended[rid], tokens[rid] = "abort", tokens.get(rid, [])[:n]
                del cut[rid]
    st = eng.stats()
    assert (st.running, st.waiting, st.slots_used) == (0, 0, 0), st
    return tokens, ended


@pytest.mark.parametrize("spec", [0, 2], ids=["no-guesses", "guesses"])
@pytest.mark.parametrize("admission,capacity", [("peak", 2000), ("ratio", 400)])
def test_overlap_gives_the_same_tokens_and_ends(spec: int, admission: str, capacity: int) -> None:
    retractions = 0
    for seed in range(2):
        runs = []
        for overlap in (False, True):
            eng = _engine(overlap, max_total_tokens=capacity, max_prefill_tokens=256, speculative_tokens=spec,
                          admission=admission)
            runs.append(_drain(eng, _workload(eng, seed, aborts=seed % 2 == 1)))
            if overlap:
                retractions += eng.stats().retractions
        assert runs[1] == runs[0], f"seed {seed}: overlap changed a request's tokens or end"
    if admission == "ratio":
        assert retractions > 0  # the workload did make requests give their KV back mid-flight


def test_overlap_hides_the_scheduling_of_sampled_requests(monkeypatch) -> None:
    """Sampled requests without guesses or penalties: every step after the first is built while
    the previous one computes (no step waits for a result before planning)."""
    eng = _engine(True, speculative_tokens=2)
    waits = 0
    real = overlap_ops.needs_result

    def counting(step, speculative):  # type: ignore[no-untyped-def]
        nonlocal waits
        need = real(step, speculative)
        waits += need
        return need

    monkeypatch.setattr(overlap_ops, "needs_result", counting)
    # the next step is queued on the runner thread before the one computing ends: it starts with no
    # hand-off to the scheduler's thread (each step lasts 20 ms here, so the scheduler is never late)
    queued: list[bool] = []
    real_execute = eng.runner.execute

    def slow(plan):  # type: ignore[no-untyped-def]
        time.sleep(0.02)
        out = real_execute(plan)
        queued.append(eng._runner_thread._work_queue.qsize() > 0)  # type: ignore[union-attr]
        return out

    eng.runner.execute = slow  # type: ignore[method-assign]
    for i in range(8):
        eng.add_request(np.arange(3, 40 + i), SamplingParams(max_tokens=20, temperature=0.8, seed=i, ignore_eos=True))
    tokens, _ = _drain(eng, {})
    assert sorted(len(t) for t in tokens.values()) == [20] * 8
    assert waits == 0
    assert len(queued) >= 20 and all(queued[:-2]), queued  # (the last steps have no successor)
    eng.runner.execute = real_execute  # type: ignore[method-assign]
    # greedy requests guess (speculation on): each step waits for the previous one's tokens
    eng.add_request(np.arange(3, 40), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    _drain(eng, {})
    assert waits > 0


def test_a_failed_step_undoes_its_commit_and_leaks_nothing() -> None:
    """The runner raises on one step (failure injected into the sim runner: a real kernel fault
    cannot be provoked on purpose): the engine raises it from ``step``, ``fail_running`` ends the
    running requests with every slot back in the pool, and the prefix cache keeps no KV that
    step was to compute. Requests after it run as on a fresh engine."""
    eng = _engine(True, max_total_tokens=4000, speculative_tokens=0)
    real = eng.runner.execute
    calls = 0

    def flaky(plan):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 6:
            raise RuntimeError("injected fault")
        return real(plan)

    eng.runner.execute = flaky  # type: ignore[method-assign]
    prompt = np.arange(3, 200)
    for i in range(4):
        eng.add_request(prompt, SamplingParams(max_tokens=30, temperature=0.7, seed=i, ignore_eos=True))
    with pytest.raises(RuntimeError, match="injected fault"):
        while eng.has_work:
            eng.step()
    assert calls == 6  # the step queued behind the failed one never ran (it had no tokens to read)
    victims = eng.fail_running()
    assert len(victims) == 4 and not eng.has_work
    eng.scheduler.check_invariants()
    st = eng.stats()
    assert st.slots_used == 0 and st.slots_free == st.capacity  # nothing held, nothing cached from the failed step
    fresh = _engine(False, max_total_tokens=4000, speculative_tokens=0)
    for e in (eng, fresh):
        e.add_request(prompt, SamplingParams(max_tokens=30, temperature=0.7, seed=7, ignore_eos=True))
    assert _drain(eng, {})[0].popitem()[1] == _drain(fresh, {})[0].popitem()[1]


def test_overlap_on_the_real_model_gives_the_same_tokens(smol_fp32) -> None:
    """The default model (float32), a batch of greedy, seeded and stopped requests: the same
    tokens with overlap as without (smol_fp32: speculation on, no overlap)."""
    from lockgate import LLM

    prompts = ["The capital of France is", "Write a short poem about the sea.", "List five fruits:",
               "def fibonacci(n):", "Tell me a joke.", "Count: 1, 2, 3,"]
    params = [SamplingParams(max_tokens=24, temperature=0.0),
              SamplingParams(max_tokens=20, temperature=0.9, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.0, stop=(",",)),
              SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, seed=3, min_tokens=10),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=1.0, seed=5)]
    want = [o.outputs[0] for o in smol_fp32.generate(prompts, params)]
    llm = LLM("default", dtype="float32", max_total_tokens=8192, check_invariants=True, overlap_schedule=True)
    got = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
    assert [o.text for o in got] == [o.text for o in want]


def test_overlap_server_answers_as_the_default_server(smol_server) -> None:
    """``lockgate serve --overlap-schedule`` through the official client: seeded sampled requests
    (they do not guess, so every step after the first is overlapped), streamed and not, with a stop
    string and n = 2, get the answers the shared default server gives, and the log says overlap is on."""
    import openai
    from server_util import ServerProc

    s = ServerProc("--model", "default", "--max-total-tokens", "65536", "--overlap-schedule")
    try:
        s.wait_ready(timeout=300)
        log = s.log()
        assert "overlap schedule on" in log
        # where torch's threads take every CPU, the start-up says overlap has no core of its own
        threads = int(re.search(r", (\d+) threads, torch\.", log).group(1))  # the forms table's header
        said = re.search(r"torch's (\d+) threads take all (\d+) CPUs", log)
        assert (said is not None) == (threads >= len(os.sched_getaffinity(0))), log[-3000:]
        clients = [openai.OpenAI(base_url=u + "/v1", api_key="none", max_retries=0, timeout=300)
                   for u in (smol_server.url, s.url)]
        prompt = "Write a short story about a lighthouse keeper."

        def answers(c: openai.OpenAI) -> list[object]:
            full = c.completions.create(model="default", prompt=prompt, max_tokens=40, temperature=0.8, seed=7,
                                        extra_body={"ignore_eos": True}).choices[0].text
            stop = full[10:14]
            cut = c.completions.create(model="default", prompt=prompt, max_tokens=40, temperature=0.8, seed=7,
                                       stop=[stop], extra_body={"ignore_eos": True}).choices[0]
            streamed = "".join(ch.choices[0].text for ch in c.completions.create(
                model="default", prompt=prompt, max_tokens=40, temperature=0.8, seed=7, stop=[stop], stream=True,
                extra_body={"ignore_eos": True}) if ch.choices)
            chat = c.chat.completions.create(model="default", n=2, max_tokens=24, temperature=0.9, seed=3,
                                             messages=[{"role": "user", "content": "Name three rivers."}])
            return [full, stop, cut.text, cut.finish_reason, streamed,
                    [(ch.message.content, ch.finish_reason) for ch in chat.choices], chat.usage.completion_tokens]

        want, got = answers(clients[0]), answers(clients[1])
        assert got == want
        assert got[2] == got[0][:got[0].index(got[1])] and got[3] == "stop"
    finally:
        s.stop()
