"""Structured output (issue 20): JSON schemas, regexes, choices and grammars that the output always matches.

The grammar side (llguidance through ``lockgate.grammar``) is checked directly; the request fields of
every API that carries a constraint are parsed as the clients send them; the engine is driven on the
real model (offline, with and without n-gram speculation, which must give the same tokens) and over
HTTP with the official ``openai`` client and TGI's own client on the session's shared server, where
50 varied prompts must all give JSON that parses and validates against a non-trivial schema, streamed
and not. Error paths (bad schemas, two constraints, a compile that runs out of time) run on the sim
model, in seconds.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import text_generation
from server_util import ServerProc

from lockgate import LLM, SamplingParams
from lockgate.grammar import GrammarCompiler, GrammarError
from lockgate.sampling import StructuredOutput
from lockgate.server.protocol import ChatCompletionRequest, CompletionRequest, TGIGenerateRequest
from lockgate.tokenizer.tokenizer import SimTokenizer

pytestmark = pytest.mark.filterwarnings("ignore:The `dict` method is deprecated:DeprecationWarning")

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
SUBJECTS = ["a librarian in Oslo", "a retired pilot", "a chess player", "my neighbour", "a young chef", "a farmer",
            "a software engineer", "a nurse from Lyon", "the mayor", "a student of physics", "an old fisherman",
            "a painter", "a bus driver", "a famous singer", "a carpenter", "a tennis coach", "a baker in Rome",
            "a math teacher", "a park ranger", "a new employee", "a poet", "an astronaut", "a doctor",
            "a museum guide", "a taxi driver"]
PROMPTS = [f"Describe {s} as a user record." for s in SUBJECTS] + [f"Make up a profile for {s}." for s in SUBJECTS]


def bits_to_ids(row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


# ---- the grammar side ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sim_grammars() -> GrammarCompiler:
    tok = SimTokenizer()
    return GrammarCompiler(lambda: tok, tok.vocab_size, tok.eos_token_ids)


@pytest.mark.parametrize("kind,value,needle", [
    ("json", "{nope", "invalid JSON schema: not JSON"),
    ("json", json.dumps({"type": "objekt"}), "invalid JSON schema: Invalid type: objekt"),
    ("json", "[1, 2]", "must be an object"),
    ("regex", "((", "unclosed group"),
    ("lark", "start: foo", 'unknown name: "foo"'),
    ("choice", "[1]", "non-empty list of non-empty strings"),
])
def test_a_bad_constraint_names_what_is_wrong(sim_grammars, kind, value, needle) -> None:
    with pytest.raises(GrammarError, match=re.escape(needle)):
        sim_grammars.matcher(StructuredOutput(kind, value))


def test_masks_follow_the_grammar_and_guesses_are_checked(sim_grammars) -> None:
    off = SimTokenizer.OFFSET
    g = sim_grammars.matcher(StructuredOutput("regex", r"ab[0-9]{2}"))
    row = np.zeros(sim_grammars.words, np.int32)
    g.fill(row)
    first = bits_to_ids(row)
    assert off + ord("a") in first and {SimTokenizer().decode([int(i)]) for i in first} == {"a"}
    # guesses: "a", "b", "x" -> the grammar takes the first two only
    assert g.valid_prefix([off + ord("a"), off + ord("b"), off + ord("x")]) == 2
    ahead = np.zeros_like(row)
    g.fill(ahead, [off + ord("a"), off + ord("b")])  # the mask after two guesses, state unchanged
    assert {chr(i - off) for i in bits_to_ids(ahead) if i < off + 256} == set("0123456789")
    again = np.zeros_like(row)
    g.fill(again)
    assert np.array_equal(again, row)
    for ch in "ab1":
        assert g.accept(off + ord(ch)) and not g.done
    assert g.accept(off + ord("7")) and g.done
    g.fill(row)
    assert set(bits_to_ids(row)) == {2}  # only EOS is left
    assert not sim_grammars.matcher(StructuredOutput("regex", "a")).accept(off + ord("b"))


def test_compiled_grammars_are_cached_and_each_request_gets_its_own_state(sim_grammars) -> None:
    so = StructuredOutput("choice", json.dumps(["yes", "no"]))
    assert sim_grammars.compile(so) is sim_grammars.compile(so)
    a, b = sim_grammars.matcher(so), sim_grammars.matcher(so)
    assert a.accept(SimTokenizer.OFFSET + ord("y"))
    assert b.valid_prefix([SimTokenizer.OFFSET + ord("n")]) == 1  # b never saw a's token


# ---- the request fields ------------------------------------------------------------------------
@pytest.mark.parametrize("fields,kind", [
    ({"response_format": {"type": "json_object"}}, "json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": RECORD, "strict": True}}}, "json"),
    ({"structured_outputs": {"json": RECORD}}, "json"),
    ({"structured_outputs": {"regex": "[a-z]+", "disable_any_whitespace": True}}, "regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice"),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, "lark"),
    ({"structured_outputs": {"json_object": True}}, "json"),
    ({"guided_json": json.dumps(RECORD)}, "json"),
    ({"guided_regex": "[0-9]+", "guided_decoding_backend": "xgrammar"}, "regex"),
    ({"guided_choice": ["a"]}, "choice"),
    ({"guided_grammar": 'start: "x"'}, "lark"),
    ({"json_schema": json.dumps(RECORD)}, "json"),  # SGLang's
    ({"regex": "x"}, "regex"),
    ({"ebnf": 'root ::= "x"'}, "lark"),
    ({"structured_outputs": {"json": RECORD, "whitespace_pattern": "[ ]?"}}, "json"),
    ({"guided_json": RECORD, "guided_whitespace_pattern": r"\s*"}, "json"),
])
def test_every_api_field_for_a_constraint_is_read(fields, kind) -> None:
    for model, base in ((CompletionRequest, {"prompt": "hi"}),
                        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})):
        r = model.model_validate({**base, **fields})
        assert r.sampling_params(8).structured.kind == kind
        assert r.structured_field == next(iter(fields))


def test_no_constraint_two_constraints_and_unsupported_ones() -> None:
    base = {"prompt": "hi"}
    for fields in ({}, {"response_format": {"type": "text"}}, {"response_format": None, "guided_json": None},
                   {"structured": {"kind": "regex", "value": "x"}}):  # (a client cannot set the parsed field)
        assert CompletionRequest.model_validate({**base, **fields}).sampling_params(8).structured is None
    for fields, needle in (({"guided_regex": "a", "response_format": {"type": "json_object"}}, "only one output constraint"),
                           ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "takes one constraint"),
                           ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag is not supported"),
                           ({"response_format": {"type": "xml"}}, "response_format.type must be one of"),
                           ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema is required"),
                           ({"guided_choice": []}, "non-empty list"),
                           ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "applies to a JSON constraint"),
                           ({"structured_outputs": {"choice": ["a"], "whitespace_pattern": " "}},
                            "applies to a JSON constraint"),
                           ({"structural_tag": {"x": 1}}, "structural_tag is not supported")):
        with pytest.raises(ValueError, match=needle):
            CompletionRequest.model_validate({**base, **fields})


def test_tgi_grammar_parameter() -> None:
    def so(grammar):
        return TGIGenerateRequest.model_validate({"inputs": "x", "parameters": {"grammar": grammar}}).sampling_params().structured

    assert so({"type": "json", "value": RECORD}).kind == "json"
    assert json.loads(so({"type": "json", "value": json.dumps(RECORD)}).value) == RECORD
    assert so({"type": "regex", "value": "[0-9]+"}) == StructuredOutput("regex", "[0-9]+")
    assert so(None) is None
    for bad in ({"type": "ebnf", "value": "x"}, {"value": "x"}, "json"):
        with pytest.raises(ValueError, match="grammar"):
            so(bad)


# ---- the engine on the real model --------------------------------------------------------------
def test_constrained_greedy_is_the_same_with_and_without_speculation() -> None:
    """Guesses are cut where the grammar forbids them and verify rows carry the grammar's mask after
    the guesses before them: the same tokens and log-probabilities as one token per step (float32
    integer GEMM, whose rows do not depend on each other), in fewer steps."""
    from lockgate.layers.forms import int_gemm_available

    schema = {"type": "array", "minItems": 6, "maxItems": 6, "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "color": {"enum": ["red", "green", "blue"]}},
        "required": ["id", "color"], "additionalProperties": False}}
    sp = SamplingParams(max_tokens=120, temperature=0.0, logprobs=1,
                        structured=StructuredOutput("json", json.dumps(schema)))
    prompts = ["List six colored items as JSON.", "Items:"]
    runs = {}
    for k in (0, 3):
        llm = LLM("default", dtype="float32", quantization="int4", max_total_tokens=2048, speculative_tokens=k,
                  check_invariants=True, matmul_forms="int-gemm" if int_gemm_available() else "group-quant")
        outs = [llm.generate(p, sp)[0].outputs[0] for p in prompts]  # one at a time: room for guesses
        runs[k] = (outs, llm.engine.num_steps, llm.engine.scheduler.speculator.num_accepted_tokens)
        del llm
    (off, off_steps, _), (on, on_steps, accepted) = runs[0], runs[3]
    for o in off:
        assert o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), schema)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.logprobs for o in on] == [o.logprobs for o in off]
    assert accepted > 0 and on_steps == off_steps - accepted


# ---- over HTTP, the real model -----------------------------------------------------------------
@pytest.fixture(scope="module")
def oai(smol_server):
    return openai.OpenAI(base_url=smol_server.url + "/v1", api_key="none", max_retries=0, timeout=600)


def _record(oai, i: int) -> tuple[str, str | None]:
    """Prompt i: chat, json_schema; even ones greedy, odd ones sampled (seeded); every third streamed."""
    kw = dict(model="default", messages=[{"role": "user", "content": PROMPTS[i]}], max_tokens=256,
              response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD}},
              temperature=0.0 if i % 2 == 0 else 0.8, seed=i)
    if i % 3 == 0:
        parts, finish = [], None
        for chunk in oai.chat.completions.create(stream=True, **kw):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish
    r = oai.chat.completions.create(**kw)
    return r.choices[0].message.content, r.choices[0].finish_reason


# 24 of the 50 prompts, both phrasings (12 each); i runs over every (greedy or sampled, streamed or
# not) pair four times, as it does over all 50
SOME = [i for i in range(len(PROMPTS)) if i % len(SUBJECTS) < 12]


def test_two_dozen_prompts_all_give_json_that_validates(oai) -> None:
    with ThreadPoolExecutor(16) as ex:
        results = list(ex.map(lambda i: _record(oai, i), SOME))
    assert len(results) == 24
    for text, finish in results:
        assert finish == "stop", (text, finish)
        jsonschema.validate(json.loads(text), RECORD)
    assert len({t for t, _ in results}) > 10  # the prompts and the sampling made them differ


def test_regex_choice_and_json_object_on_completions(oai) -> None:
    for prompt in ("Call me at", "The support line is", "Phone:"):
        r = oai.completions.create(model="default", prompt=prompt, max_tokens=20, temperature=0.7, seed=3,
                                   extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
        assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text), r.choices[0].text
    r = oai.completions.create(model="default", prompt="Is the sky blue? Answer:", max_tokens=10, temperature=0,
                               extra_body={"guided_choice": ["yes", "no", "it depends"]})
    assert r.choices[0].text in ("yes", "no", "it depends") and r.choices[0].finish_reason == "stop"
    r = oai.completions.create(model="default", prompt="A JSON object describing a cat:", max_tokens=120,
                               temperature=0, extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(r.choices[0].text), dict)


def test_tgi_client_grammar(smol_server) -> None:
    from text_generation.types import Grammar, GrammarType

    client = text_generation.Client(smol_server.url, timeout=300)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "rank": {"type": "integer"}},
              "required": ["city", "rank"], "additionalProperties": False}
    r = client.generate("The best city to live in, as JSON:", max_new_tokens=60,
                        grammar=Grammar(type=GrammarType.Json, value=schema))
    jsonschema.validate(json.loads(r.generated_text), schema)
    text = "".join(e.token.text for e in client.generate_stream(
        "My zip code is", max_new_tokens=10, grammar=Grammar(type=GrammarType.Regex, value="[0-9]{5}")))
    assert re.fullmatch("[0-9]{5}", text), text


# ---- errors, on the sim model ------------------------------------------------------------------
def test_bad_constraints_are_refused_before_queueing_and_nothing_else_suffers() -> None:
    s = ServerProc("--model", "sim", "--sim-step-ms", "5", "--grammar-compile-timeout", "1e-9")
    ok = ServerProc("--model", "sim")
    try:
        s.wait_ready()
        ok.wait_ready()
        url = s.url + "/v1/completions"
        cases = [({"guided_regex": "(("}, 400, "guided_regex", "unclosed group"),
                 ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
                  400, "response_format", "Invalid type: nope"),
                 ({"guided_regex": "a", "guided_json": {}}, 400, None, "only one output constraint")]
        for fields, status, param, needle in cases:
            r = httpx.post(ok.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4, **fields})
            assert r.status_code == status and needle in r.json()["error"]["message"], r.text
            assert r.json()["error"]["param"] == param
        # a compile that does not finish within --grammar-compile-timeout is a 400 naming the flag
        r = httpx.post(url, json={"prompt": "hi", "max_tokens": 4, "guided_regex": "[a-z]+"})
        assert r.status_code == 400 and "--grammar-compile-timeout" in r.json()["error"]["message"], r.text
        r = httpx.post(s.url + "/generate", json={"inputs": "hi", "parameters": {"grammar": {"type": "regex", "value": "a"}}})
        assert r.status_code == 422 and "--grammar-compile-timeout" in r.text
        r = httpx.post(ok.url + "/generate", json={"inputs": "hi", "parameters": {"grammar": {"type": "regex", "value": "(("}}})
        assert r.status_code == 422 and "unclosed group" in r.text
        # the same server keeps serving unconstrained requests, and nothing was queued or leaked
        r = httpx.post(url, json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        loads = httpx.get(s.url + "/v1/loads").json()
        assert loads["in_flight"] == 0 and loads["slots_used"] == 0
        # constrained requests on the sim model, all APIs: the output matches
        c = openai.OpenAI(base_url=ok.url + "/v1", api_key="none", max_retries=0)
        schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
                  "required": ["n", "ok"], "additionalProperties": False}
        r = c.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=60,
                                      response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        assert r.choices[0].finish_reason == "stop"
        r = httpx.post(ok.url + "/generate", json={"inputs": "hi", "parameters": {
            "max_new_tokens": 20, "grammar": {"type": "regex", "value": "[a-c]{4}"}}})
        assert re.fullmatch("[a-c]{4}", r.json()["generated_text"])
        # vLLM's whitespace options: compact by default (", " and ": "), none at all, or a pattern
        texts = {}
        for name, so in (("default", {"json": schema}), ("none", {"json": schema, "disable_any_whitespace": True}),
                         ("pattern", {"json": schema, "whitespace_pattern": "[ ]{2}"})):
            r = c.completions.create(model="sim", prompt="hi", max_tokens=60, extra_body={"structured_outputs": so})
            texts[name] = r.choices[0].text
            jsonschema.validate(json.loads(texts[name]), schema)
        assert ", " in texts["default"] and ": " in texts["default"]
        assert " " not in texts["none"]
        assert "  " in texts["pattern"] and not re.search(r"(?<! ) (?! )", texts["pattern"])  # spaces only in pairs
    finally:
        s.stop()
        ok.stop()
