"""Tests for lockgate.server.protocol: request parsing, defaults, normalization, SamplingParams mapping,
and the error messages a client sees on a 400."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from pydantic import ValidationError

from lockgate.sampling import SamplingParams, per_choice_params
from lockgate.server.errors import error_message, error_param, openai_error
from lockgate.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TGIGenerateRequest,
    TokenizeRequest,
    request_fields,
)

MSG = [{"role": "user", "content": "hi"}]


def completion_error(**body: Any) -> str:
    """The 400 message a client gets for this completion body (parse or sampling_params)."""
    with pytest.raises((ValidationError, ValueError)) as ei:
        CompletionRequest.model_validate({"prompt": "hi", **body}).sampling_params()
    return error_message(ei.value)


def chat_error(**body: Any) -> str:
    with pytest.raises((ValidationError, ValueError)) as ei:
        req = ChatCompletionRequest.model_validate({"messages": MSG, **body})
        req.sampling_params(req.requested_max_tokens() or 100)
    return error_message(ei.value)


# ----------------------------------------------------------------------------- accept

def test_completion_defaults_match_openai() -> None:
    sp = CompletionRequest.model_validate({"prompt": "hi"}).sampling_params()
    assert sp == SamplingParams(max_tokens=16)
    assert CompletionRequest.model_validate({"prompt": "hi"}).sampling_params(max_tokens_default=77).max_tokens == 77
    assert CompletionRequest.model_validate({"prompt": "hi", "max_tokens": 5}).sampling_params(77).max_tokens == 5


def test_null_fields_mean_default() -> None:
    fields = ["model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
              "presence_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
              "min_tokens", "n", "logprobs", "echo", "stream", "stream_options", "user",
              "skip_special_tokens", "best_of"]
    req = CompletionRequest.model_validate({"prompt": "hi", **dict.fromkeys(fields)})
    assert req.n == 1 and req.stream is False and req.echo is False and req.stop == []
    assert req.sampling_params() == SamplingParams(max_tokens=16)
    assert not req.include_usage

    chat_fields = [*fields[:-3], "max_completion_tokens", "top_logprobs", "add_generation_prompt"]
    chat = ChatCompletionRequest.model_validate({"messages": MSG, **dict.fromkeys(chat_fields)})
    assert chat.requested_max_tokens() is None and chat.add_generation_prompt is True
    assert chat.sampling_params(50) == SamplingParams(max_tokens=50)

    tgi = TGIGenerateRequest.model_validate({"inputs": "x", "parameters": None, "stream": None})
    assert tgi.parameters.max_new_tokens == 20 and tgi.stream is False
    tgi = TGIGenerateRequest.model_validate({"inputs": "x", "parameters": {"max_new_tokens": None, "stop": None}})
    assert tgi.sampling_params() == SamplingParams(max_tokens=20, temperature=0.0)


def test_unknown_fields_ignored() -> None:
    req = CompletionRequest.model_validate({"prompt": "hi", "suffix": "", "foo": {"bar": 1}, "logit_bias": {}})
    assert req.prompts() == ["hi"]
    chat = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi", "tool_call_id": None, "weird": 1}],
        "tools": [], "response_format": {"type": "text"}, "continue_final_message": False,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    })
    assert chat.include_usage
    tgi = TGIGenerateRequest.model_validate({"inputs": "x", "parameters": {"typical_p": 1.0, "watermark": False,
                                                                         "truncate": None, "best_of": 1,
                                                                         "decoder_input_details": False}})
    assert tgi.sampling_params().greedy


@pytest.mark.parametrize(("model", "body", "field"), [
    (CompletionRequest, {"prompt": "hi", "suffix": "x"}, "suffix"),
    (CompletionRequest, {"prompt": "hi", "logit_bias": {"1": 5}}, "logit_bias"),
    (ChatCompletionRequest, {"messages": [], "response_format": {"type": "json_schema"}}, "response_format"),
    (ChatCompletionRequest, {"messages": [], "tools": [{"type": "function"}]}, "tools"),
    (TGIGenerateRequest, {"inputs": "x", "parameters": {"best_of": 2}}, "best_of"),
    (TGIGenerateRequest, {"inputs": "x", "parameters": {"typical_p": 0.5}}, "typical_p"),
])
def test_output_changing_fields_lockgate_lacks_are_refused(model, body, field) -> None:
    with pytest.raises(ValidationError, match=field):
        model.model_validate(body)


@pytest.mark.parametrize(("prompt", "expected"), [
    ("hello", ["hello"]),
    ([1, 2, 3], [[1, 2, 3]]),
    (["a", "b"], ["a", "b"]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_prompt_forms(prompt: Any, expected: list[Any]) -> None:
    assert CompletionRequest.model_validate({"prompt": prompt}).prompts() == expected


@pytest.mark.parametrize("prompt", ["", [], [""], [[]], ["a", ""]])
def test_empty_prompt_rejected(prompt: Any) -> None:
    with pytest.raises(ValidationError) as ei:
        CompletionRequest.model_validate({"prompt": prompt})
    assert "prompt must not be empty" in error_message(ei.value)


@pytest.mark.parametrize("prompt", [5, None, [1, "a"], [-1], [True], [["a"]], {"text": "x"}])
def test_bad_prompt_shape_rejected(prompt: Any) -> None:
    with pytest.raises(ValidationError) as ei:
        CompletionRequest.model_validate({"prompt": prompt})
    assert error_message(ei.value).startswith("prompt must be a string, a list of token ids")


def test_stop_string_or_list() -> None:
    assert CompletionRequest.model_validate({"prompt": "x", "stop": "\n"}).sampling_params().stop == ("\n",)
    sp = CompletionRequest.model_validate({"prompt": "x", "stop": ["a", "b"], "stop_token_ids": [7]}).sampling_params()
    assert sp.stop == ("a", "b") and sp.stop_token_ids == (7,)
    assert "stop must be a string or a list of strings" in completion_error(stop=5)
    assert "stop must be a string or a list of strings" in completion_error(stop=["a", 1])


def test_max_completion_tokens_precedence() -> None:
    def req(**kw: Any) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate({"messages": MSG, **kw})

    assert req(max_tokens=10, max_completion_tokens=20).requested_max_tokens() == 20
    assert req(max_tokens=10).requested_max_tokens() == 10
    assert req(max_tokens=10, max_completion_tokens=None).requested_max_tokens() == 10
    assert req().requested_max_tokens() is None
    assert req(max_completion_tokens=5).sampling_params(5).max_tokens == 5


def test_chat_conversation() -> None:
    chat = ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "tool", "content": "42", "name": "calc"},
    ]})
    assert chat.conversation() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42", "name": "calc"},  # a tool answer keeps its function's name
    ]


def test_chat_rejects_non_text_parts_and_bad_roles() -> None:
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    msg = chat_error(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, image]}])
    assert msg == "messages[0].content: only text content parts are supported (got type 'image_url')"
    assert "messages[0].content" in chat_error(messages=[{"role": "user", "content": 5}])
    msg = chat_error(messages=[{"role": "wizard", "content": "x"}])
    assert msg.startswith("messages[0].role:") and "'user'" in msg and "'wizard'" in msg
    assert chat_error(messages=[{"content": "x"}]) == "messages[0].role: Field required"


def test_chat_logprobs_mapping() -> None:
    def lp(**kw: Any) -> int | None:
        return ChatCompletionRequest.model_validate({"messages": MSG, **kw}).sampling_params(8).logprobs

    assert lp() is None
    assert lp(logprobs=False) is None
    assert lp(logprobs=True) == 0
    assert lp(logprobs=True, top_logprobs=5) == 5
    assert chat_error(top_logprobs=3) == "top_logprobs requires logprobs to be true"
    assert chat_error(logprobs=False, top_logprobs=0) == "top_logprobs requires logprobs to be true"


# ----------------------------------------------------------------------------- reject, readably

@pytest.mark.parametrize(("body", "needles"), [
    ({"max_tokens": -1}, ["max_tokens", ">= 1", "-1"]),
    ({"max_tokens": 0}, ["max_tokens", ">= 1"]),
    ({"max_tokens": 5.5}, ["max_tokens", "valid integer", "5.5"]),
    ({"max_tokens": "abc"}, ["max_tokens", "valid integer", "'abc'"]),
    ({"max_tokens": True}, ["max_tokens", "boolean"]),
    ({"top_p": 1.5}, ["top_p", "(0, 1]", "1.5"]),
    ({"temperature": "hot"}, ["temperature", "valid number", "'hot'"]),
    ({"temperature": -0.5}, ["temperature", "[0, 100]"]),
    ({"n": 0}, ["n:", "greater than or equal to 1", "got 0"]),
    ({"n": 17}, ["n:", "less than or equal to 16", "got 17"]),
    ({"logprobs": 30}, ["logprobs", "less than or equal to 20", "got 30"]),
    ({"logprobs": -1}, ["logprobs", "greater than or equal to 0"]),
    ({"best_of": 3}, ["best_of", "n", "best_of=3"]),
    ({"stop_token_ids": [1, "x"]}, ["stop_token_ids[1]", "valid integer"]),
    ({"min_tokens": 50, "max_tokens": 10}, ["min_tokens", "max_tokens=10"]),
    ({"frequency_penalty": 3}, ["frequency_penalty", "[-2, 2]"]),
    ({"stream": "maybe"}, ["stream", "boolean", "'maybe'"]),
])
def test_completion_errors_name_field_and_limit(body: dict[str, Any], needles: list[str]) -> None:
    msg = completion_error(**body)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_best_of_equal_to_n_accepted() -> None:
    assert CompletionRequest.model_validate({"prompt": "x", "n": 2, "best_of": 2}).n == 2


def test_chat_errors() -> None:
    assert chat_error(messages=[]).startswith("messages: List should have at least 1 item")
    assert "messages: Field required" in error_message(_raises(ChatCompletionRequest, {}))
    assert "top_logprobs" in chat_error(logprobs=True, top_logprobs=21)
    assert "max_completion_tokens" in chat_error(max_completion_tokens="many")
    msg = chat_error(max_tokens=-5)
    assert msg == "max_tokens must be an integer >= 1, got -5"


def _raises(model: Any, body: dict[str, Any]) -> ValidationError:
    with pytest.raises(ValidationError) as ei:
        model.model_validate(body)
    return ei.value


def test_error_message_joins_several_errors_on_one_line() -> None:
    msg = error_message(_raises(CompletionRequest, {"prompt": "x", "n": 0, "temperature": "hot"}))
    assert "n: " in msg and "temperature: " in msg and "; " in msg and "\n" not in msg
    assert error_message(ValueError("plain")) == "plain"


# ----------------------------------------------------------------------------- seeds

def test_per_choice_seeds() -> None:
    sp = CompletionRequest.model_validate({"prompt": "x", "seed": 7, "n": 3}).sampling_params()
    assert [p.seed for p in per_choice_params(sp, 3)] == [7, 8, 9]
    assert per_choice_params(sp, 3)[1] == SamplingParams(max_tokens=16, seed=8)
    unseeded = SamplingParams()
    assert per_choice_params(unseeded, 2) == [unseeded, unseeded]
    top = SamplingParams(seed=2**64 - 2)
    assert [p.seed for p in per_choice_params(top, 3)] == [2**64 - 2, 2**64 - 1, 0]  # wraps mod 2**64


# ----------------------------------------------------------------------------- TGI

def tgi(**params: Any) -> SamplingParams:
    return TGIGenerateRequest.model_validate({"inputs": "x", "parameters": params}).sampling_params()


def test_tgi_greedy_vs_sampling() -> None:
    assert tgi().greedy and tgi().max_tokens == 20
    assert tgi(temperature=1.0).greedy  # TGI: temperature 1 alone does not switch sampling on
    assert tgi(seed=3).greedy
    assert tgi(do_sample=True).temperature == 1.0
    assert tgi(temperature=0.7).temperature == pytest.approx(0.7)
    sp = tgi(top_k=40)
    assert not sp.greedy and sp.top_k == 40 and sp.temperature == 1.0
    sp = tgi(top_p=0.9, do_sample=False, seed=5, repetition_penalty=1.2, stop=["\n"], max_new_tokens=7)
    assert not sp.greedy and sp.top_p == pytest.approx(0.9) and sp.seed == 5
    assert sp.repetition_penalty == pytest.approx(1.2) and sp.stop == ("\n",) and sp.max_tokens == 7


def test_tgi_logprobs_mapping() -> None:
    assert tgi().logprobs is None
    assert tgi(details=True).logprobs == 0
    assert tgi(details=True, top_n_tokens=3).logprobs == 3


@pytest.mark.parametrize(("params", "needles"), [
    ({"temperature": 0}, ["parameters.temperature", "greater than 0"]),
    ({"temperature": -1.0}, ["parameters.temperature", "greater than 0"]),
    ({"top_p": 1.0}, ["parameters.top_p", "less than 1"]),
    ({"top_p": 0}, ["parameters.top_p", "greater than 0"]),
    ({"top_k": 0}, ["parameters.top_k", "greater than 0"]),
    ({"top_n_tokens": 50}, ["parameters.top_n_tokens", "less than or equal to 20"]),
    ({"max_new_tokens": 0}, ["max_tokens", ">= 1"]),
])
def test_tgi_errors(params: dict[str, Any], needles: list[str]) -> None:
    with pytest.raises((ValidationError, ValueError)) as ei:
        TGIGenerateRequest.model_validate({"inputs": "x", "parameters": params}).sampling_params()
    msg = error_message(ei.value)
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_tgi_empty_inputs() -> None:
    assert error_message(_raises(TGIGenerateRequest, {"inputs": ""})) == "inputs must not be empty"


# ----------------------------------------------------------------------------- tokenize, errors, imports

def test_tokenize_requests() -> None:
    t = TokenizeRequest.model_validate({"prompt": "hi", "model": "m", "extra": 1})
    assert t.prompt == "hi" and t.add_special_tokens and t.conversation() is None
    t = TokenizeRequest.model_validate({"messages": [{"role": "developer", "content": "x"}], "prompt": None})
    assert t.conversation() == [{"role": "system", "content": "x"}]
    for body in ({}, {"prompt": "a", "messages": MSG}):
        assert error_message(_raises(TokenizeRequest, body)) == "exactly one of prompt or messages must be given"
    assert DetokenizeRequest.model_validate({"tokens": [0, 5]}).tokens == [0, 5]
    assert error_message(_raises(DetokenizeRequest, {"tokens": [1, -1]})).startswith(
        "tokens[1]: Input should be greater than or equal to 0 (got -1)")


@pytest.mark.parametrize(("status", "etype"), [
    (400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
    (422, "invalid_request_error"), (429, "rate_limit_error"), (500, "server_error"), (503, "server_error"),
])
def test_openai_error(status: int, etype: str) -> None:
    assert openai_error("boom", status, param="n") == {
        "error": {"message": "boom", "type": etype, "param": "n", "code": status}}
    assert openai_error("boom", status)["error"]["param"] is None


def test_protocol_imports_no_torch_or_zmq() -> None:
    code = ("import sys, lockgate.server.protocol; "
            "bad = [m for m in ('torch', 'zmq') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_error_param_names_the_field_an_error_is_about() -> None:
    chat = request_fields(ChatCompletionRequest)
    msgs = {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    # pydantic's location, written as in the message
    err = _raises(ChatCompletionRequest, msgs)
    assert error_param(err, chat) == "messages[0].content" and error_message(err).startswith("messages[0].content:")
    # a model validator's error: the field its message opens with, declared, refused or read
    for body, field in (({"messages": MSG, "logit_bias": {"5": 1}}, "logit_bias"),
                        ({"messages": MSG, "response_format": {"type": "xml"}}, "response_format"),
                        ({"messages": MSG, "tool_choice": "required"}, "tool_choice")):
        assert error_param(_raises(ChatCompletionRequest, body), chat) == field, body
    # an ignored key the message happens to open with is not blamed; nor is a field of another model
    err = _raises(ChatCompletionRequest, {"messages": MSG, "only": 1, "guided_regex": "a", "guided_choice": ["a"]})
    assert error_param(err, chat) is None
    assert error_param(ValueError("top_p must be in (0, 1], got 2"), chat) == "top_p"
    assert error_param(ValueError("top_p must be in (0, 1], got 2"), request_fields(TokenizeRequest)) is None
    assert error_param(ValueError("the request body is not valid JSON")) is None

