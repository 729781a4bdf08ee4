"""Drop-in: the clients users of TGI and the Hugging Face Hub already have, driving lockgate.

Real clients (``text-generation`` 0.7, TGI's own Python client; ``huggingface_hub``'s
``InferenceClient``) against a real ``lockgate serve`` on the default model (the session's
shared server). Every answer is checked against the OpenAI-compatible route's greedy answer to
the same request, so these tests compare two paths of the server rather than fixed strings.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import text_generation
from huggingface_hub import InferenceClient

# text-generation 0.7 calls pydantic's deprecated .dict(): the client's business, not ours
pytestmark = pytest.mark.filterwarnings("ignore:The `dict` method is deprecated:DeprecationWarning")

PROMPT = "The three primary colors are"
MESSAGES = [{"role": "user", "content": "Name one planet of the solar system."}]


@pytest.fixture(scope="module")
def oai(smol_server):
    return openai.OpenAI(base_url=smol_server.url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def greedy(oai):
    """The OpenAI route's greedy completion of PROMPT: 12 tokens, their ids via /generate's details."""
    r = oai.completions.create(model="default", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2)
    return r


@pytest.fixture
def hub_online(monkeypatch):
    """The suite runs with HF_HUB_OFFLINE=1 (nothing may reach the Hub), which huggingface_hub also
    applies to a base_url; these calls only ever go to the loopback server."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def test_text_generation_client_generate_and_top_n_tokens(smol_server, greedy) -> None:
    client = text_generation.Client(smol_server.url, timeout=300)
    r = client.generate(PROMPT, max_new_tokens=12, top_n_tokens=2, decoder_input_details=False)
    assert r.generated_text == greedy.choices[0].text
    d = r.details
    assert d.finish_reason.value == "length" and d.generated_tokens == 12 == len(d.tokens)
    assert [t.text for t in d.tokens] == greedy.choices[0].logprobs.tokens
    assert len(d.top_tokens) == 12
    for tok, alts in zip(d.tokens, d.top_tokens, strict=True):
        assert len(alts) == 2 and alts[0].logprob >= alts[1].logprob
        assert alts[0].id == tok.id and alts[0].logprob == pytest.approx(tok.logprob, abs=1e-5)  # greedy: the top


def test_text_generation_client_stream_and_async(smol_server, greedy) -> None:
    client = text_generation.Client(smol_server.url, timeout=300)
    events = list(client.generate_stream(PROMPT, max_new_tokens=12, top_n_tokens=2))
    assert "".join(e.token.text for e in events) == greedy.choices[0].text == events[-1].generated_text
    assert all(e.top_tokens and e.top_tokens[0].id == e.token.id for e in events)
    assert events[-1].details.finish_reason.value == "length" and events[-1].details.generated_tokens == 12
    assert all(e.details is None and e.generated_text is None for e in events[:-1])

    async def both() -> list[str]:
        a = text_generation.AsyncClient(smol_server.url, timeout=300)
        whole = await a.generate(PROMPT, max_new_tokens=12)
        streamed = "".join([e.token.text async for e in a.generate_stream(PROMPT, max_new_tokens=12)])
        return [whole.generated_text, streamed]

    assert asyncio.run(both()) == [greedy.choices[0].text] * 2


def test_text_generation_client_sees_errors_as_its_own_exceptions(smol_server) -> None:
    client = text_generation.Client(smol_server.url, timeout=300)
    with pytest.raises(text_generation.errors.ValidationError):
        client.generate(PROMPT, max_new_tokens=10**9)  # beyond the context: TGI's 422


def test_huggingface_hub_text_generation(smol_server, greedy, hub_online) -> None:
    hub = InferenceClient(base_url=smol_server.url, timeout=300)
    out = hub.text_generation(PROMPT, max_new_tokens=12, details=True, top_n_tokens=2)
    assert out.generated_text == greedy.choices[0].text
    assert out.details.top_tokens is not None and len(out.details.top_tokens) == 12
    streamed = list(hub.text_generation(PROMPT, max_new_tokens=12, stream=True, details=True))
    assert "".join(e.token.text for e in streamed) == greedy.choices[0].text
    assert streamed[-1].details.finish_reason == "length"
    assert streamed[-1].details.input_length == greedy.usage.prompt_tokens


def test_huggingface_hub_chat_completion_with_a_placeholder_model_name(smol_server, oai, hub_online) -> None:
    """InferenceClient(base_url=...) names the model "dummy" (or nothing): one model served, so that
    means it (TGI's behaviour); the answer equals the OpenAI client's with the served name."""
    want = oai.chat.completions.create(model="default", messages=MESSAGES, max_tokens=16, temperature=0)
    hub = InferenceClient(base_url=smol_server.url, timeout=300)
    got = hub.chat_completion(MESSAGES, max_tokens=16, temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.model == want.model
    chunks = list(hub.chat_completion(MESSAGES, max_tokens=16, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.choices[0].message.content
    named = httpx.post(smol_server.url + "/v1/chat/completions", timeout=300,
                       json={"model": "dummy", "messages": MESSAGES, "max_tokens": 16, "temperature": 0}).json()
    assert named["choices"][0]["message"]["content"] == want.choices[0].message.content
