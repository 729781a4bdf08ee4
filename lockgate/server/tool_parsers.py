"""Tool-call formats: how a model family writes its calls into its text, and reading them back.

Owns one ``ToolParser`` per format, under the names vLLM's ``--tool-call-parser`` uses (``PARSERS``),
and ``detect``: the format a chat template teaches its model (``--tool-call-parser auto``).

* ``hermes`` (Hermes, Qwen 2.5, Qwen3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
  blocks anywhere in the answer.
* ``qwen3_coder`` (alias ``qwen3_xml``; Qwen3-Coder): ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\n
  VALUE\\n</parameter>\\n...</function>\\n</tool_call>`` blocks; a value is raw text, typed by the
  function's JSON schema (a string stays text; other types are read as JSON when they parse).
* ``llama3_json`` (alias ``llama4_json``; Llama 3.1-3.3): ``{"name": ..., "parameters": {...}}`` objects
  separated by ``;``, the whole answer or everything after ``<|python_tag|>``.
* ``mistral``: after ``[TOOL_CALLS]``, a JSON list of ``{"name", "arguments"}`` (tokenizers before
  v11) or ``NAME[ARGS]{...}`` (v11 on, ``[CALL_ID]id`` optional), once per call. With special tokens
  skipped from the text (the default), an answer that starts with such a list or ``NAME{...}`` naming
  one of the request's functions is read the same way. Call ids are 9 letters and digits, the only ids
  Mistral's chat templates accept back.
* ``pythonic`` (Llama 3.2 / 4 pythonic templates): ``[f(a=1, b="x"), g()]``, a Python list of calls with
  keyword arguments of literals, as the whole answer (optionally between ``<|python_start|>`` and
  ``<|python_end|>``).

Streams come in two shapes. Block formats (hermes, qwen3_coder) emit each call when its block closes;
text around the blocks is content, and a block that does not parse is content too. Tail formats
(llama3_json, mistral, pythonic) run to the end of the answer: once their start is seen the rest is
held and read at the end, all calls, or, if any part of it does not parse, the whole rest as content.
Text that may still become the start of a call (``<tool_`` ...) is held until it is known.

Each parser also writes its format: ``instructions`` (the system text for templates that do not
render tools), ``calls_text`` (earlier calls in an assistant turn) and ``grammar`` (the one call that
``tool_choice`` ``required`` / named forces). Formats whose values cannot carry a JSON schema
(qwen3_coder, pythonic) force calls in the JSON form of their family (``forced``: hermes, llama3_json).

Invariants: parsing is total (any text gives content and calls, never an exception); a call names one
of the request's functions and its ``arguments`` is the JSON text of an object within ``jsonsafe``'s
limits; however the text is split, the stream gives the calls and content the whole text gives; no
text of a parsed call is in the content. Imports ``jsonsafe`` and the stdlib only.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lockgate import jsonsafe

Tools = Mapping[str, Any]  # function name -> its parameters' JSON schema (None / {}: unknown)


def _openai_id() -> str:
    return "call_" + secrets.token_hex(12)


def _mistral_id() -> str:
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=_openai_id)

    def wire(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


# ---- shared readers ------------------------------------------------------------------------------
_DECODER = json.JSONDecoder()


def _json_at(text: str, at: int) -> tuple[Any, int] | None:
    """The JSON value starting at ``text[at]`` and the index after it, within ``jsonsafe``'s limits; None if there is none."""
    try:
        value, end = _DECODER.raw_decode(text, at)
    except (ValueError, RecursionError):
        return None
    return None if jsonsafe.problem(value) is not None else (value, end)


def _args_text(args: Any) -> str | None:
    """A call's arguments (an object, or JSON text of one) as JSON text; None if they are neither."""
    if isinstance(args, str):
        try:
            args = jsonsafe.loads(args)
        except ValueError:
            return None
    return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None


def _call_of(obj: Any, tools: Tools, new_id: Callable[[], str]) -> ToolCall | None:
    """``{"name": ..., "arguments" | "parameters": ...}`` as a call, or None if it is not one."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or name not in tools:
        return None
    args = _args_text(obj.get("arguments", obj.get("parameters", {})))
    return None if args is None else ToolCall(name, args, new_id())


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _strip_markers(text: str, head: Iterable[str], tail: Iterable[str]) -> str:
    text = text.strip()
    for m in head:
        if text.startswith(m):
            text = text[len(m):].lstrip()
    changed = True
    while changed:
        changed = False
        for m in tail:
            if text.endswith(m):
                text, changed = text[:-len(m)].rstrip(), True
    return text


def _tool_list(tools: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)


def _preamble(tools: list[dict[str, Any]]) -> str:
    return ("You can call functions to help answer the user. The functions you can call are listed "
            f"between <tools> and </tools>, one JSON object each:\n<tools>\n{_tool_list(tools)}\n</tools>\n")


# ---- streams -------------------------------------------------------------------------------------
class ToolCallStream:
    """Incremental parsing: ``feed`` text pieces as they are generated, get back the content that can
    be shown now and the calls completed so far; ``finish`` at the end of the answer."""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError


class BlockStream(ToolCallStream):
    """Calls between an open and a close tag, anywhere in the text; each one emitted when it closes."""

    def __init__(self, parser: BlockParser, tools: Tools) -> None:
        self.p, self.tools, self.buf = parser, tools, ""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buf += text
        out, calls = [], []
        opening, closing = self.p.open, self.p.close
        while True:
            start = self.buf.find(opening)
            if start < 0:
                keep = _partial_suffix(self.buf, opening)  # "...<tool_" might become a call
                out.append(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            end = self.buf.find(closing, start)
            if end < 0:
                out.append(self.buf[:start])
                self.buf = self.buf[start:]
                break
            call = self.p.block(self.buf[start + len(opening):end].strip(), self.tools)
            if call is None:  # not a call: shown as text
                out.append(self.buf[:end + len(closing)])
                self.buf = self.buf[end + len(closing):]
            else:
                out.append(self.buf[:start].rstrip("\n"))
                calls.append(call)
                self.buf = self.buf[end + len(closing):].lstrip("\n")
        return "".join(out), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is held is content (an unclosed call is not a call)."""
        rest, self.buf = self.buf, ""
        return rest, []


class TailStream(ToolCallStream):
    """Calls that run to the end of the answer: content until their start, the rest held and read at the end."""

    def __init__(self, parser: TailParser, tools: Tools) -> None:
        self.p, self.tools = parser, tools
        self.buf = ""
        self.leading = True  # nothing but whitespace so far: a call may start the answer
        self.started = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buf += text
        if self.started:
            return "", []
        start, keep = self.p.start(self.buf, self.leading, self.tools)
        if start is not None:
            out, self.buf, self.started = self.buf[:start], self.buf[start:], True
            return out, []
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        if out.strip():
            self.leading = False
        return out, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self.buf = self.buf, ""
        if not self.started:
            return rest, []
        calls = self.p.tail(rest, self.tools)
        return ("", calls) if calls else (rest, [])


# ---- parsers -------------------------------------------------------------------------------------
class ToolParser:
    """One tool-call format (see the module docstring)."""

    name = ""
    args_key = "arguments"  # the call object's key for the arguments, where the format has one
    forced_by: str | None = None  # the format forced calls are written in (None: this one)

    def new_id(self) -> str:
        return _openai_id()

    def stream(self, tools: Tools) -> ToolCallStream:
        raise NotImplementedError

    def parse(self, text: str, tools: Tools) -> tuple[str | None, list[ToolCall]]:
        """(content without the parsed calls, or None if nothing is left; the calls, in order). Without
        calls the content is ``text`` unchanged."""
        s = self.stream(tools)
        content, calls = s.feed(text)
        rest, more = s.finish()
        content += rest
        calls += more
        return (content.strip() or None) if calls else content, calls

    @property
    def forced(self) -> ToolParser:
        """The parser whose format ``grammar`` writes (and whose reading the forced output needs)."""
        return self if self.forced_by is None else PARSERS[self.forced_by]

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        """The system text that lists ``tools`` and this format, for templates that do not render tools."""
        return _preamble(tools) + self.how_to()

    def how_to(self) -> str:
        raise NotImplementedError

    def calls_text(self, calls: list[tuple[str, Any]]) -> str:
        """Earlier calls (name, arguments object) as the assistant wrote them."""
        raise NotImplementedError

    def grammar(self, call_schema: dict[str, Any]) -> str:
        """The lark grammar of one call whose JSON object (``name`` and ``args_key``) follows ``call_schema``."""
        raise NotImplementedError


class BlockParser(ToolParser):
    open, close = "<tool_call>", "</tool_call>"

    def stream(self, tools: Tools) -> ToolCallStream:
        return BlockStream(self, tools)

    def block(self, body: str, tools: Tools) -> ToolCall | None:
        raise NotImplementedError


class TailParser(ToolParser):
    markers: tuple[str, ...] = ()  # tags that start the calls anywhere in the answer
    leads: tuple[str, ...] = ()  # characters that start calls at the start of the answer
    ends: tuple[str, ...] = ()  # end-of-turn tags that may close the answer's text

    def stream(self, tools: Tools) -> ToolCallStream:
        return TailStream(self, tools)

    def start(self, buf: str, leading: bool, tools: Tools) -> tuple[int | None, int]:
        """(where the calls start in ``buf``, or None; else how many trailing characters to hold)."""
        found = [i for m in self.markers if (i := buf.find(m)) >= 0]
        if found:
            return min(found), 0
        if leading:
            body = buf.lstrip()
            if not body:
                return None, len(buf)
            if body.startswith(self.leads):
                return 0, 0  # the leading whitespace goes with the calls (and back with them if they do not parse)
            if self.lead_unknown(body, tools):
                return None, len(buf)
            if self.leads_with(body, tools):
                return 0, 0
        return None, max((_partial_suffix(buf, m) for m in self.markers), default=0)

    def lead_unknown(self, body: str, tools: Tools) -> bool:
        """The answer so far (``body``, not blank) could still become a leading call."""
        return any(m.startswith(body) for m in self.markers)

    def leads_with(self, body: str, tools: Tools) -> bool:
        """The answer starts with a call in a form ``leads`` does not cover."""
        return False

    def tail(self, text: str, tools: Tools) -> list[ToolCall] | None:
        """The calls ``text`` (from the start of the calls to the end) holds; None unless all of it parses."""
        raise NotImplementedError


class Hermes(BlockParser):
    name = "hermes"

    def block(self, body: str, tools: Tools) -> ToolCall | None:
        try:
            obj = jsonsafe.loads(body)
        except ValueError:
            return None
        return _call_of(obj, tools, self.new_id)

    def how_to(self) -> str:
        return ("To call one, answer with a JSON object holding the function's name and its arguments "
                "between <tool_call> and </tool_call>, like this:\n"
                '<tool_call>\n{"name": "function_name", "arguments": {"argument": "value"}}\n</tool_call>')

    def calls_text(self, calls: list[tuple[str, Any]]) -> str:
        return "\n".join(f"{self.open}\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n{self.close}"
                         for n, a in calls)

    def grammar(self, call_schema: dict[str, Any]) -> str:
        return f'start: "{self.open}\\n" call "\\n{self.close}"\ncall: %json {json.dumps(call_schema)}'


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _schema_types(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    types = {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()
    if not types and isinstance(schema.get("enum"), list) and schema["enum"] and \
            all(isinstance(v, str) for v in schema["enum"]):
        types = {"string"}
    return types


class Qwen3Coder(BlockParser):
    name = "qwen3_coder"
    forced_by = "hermes"

    def block(self, body: str, tools: Tools) -> ToolCall | None:
        m = _FUNCTION.fullmatch(body)
        if m is None or m.group(1).strip() not in tools:
            return None
        name = m.group(1).strip()
        schema = tools[name] if isinstance(tools[name], dict) else {}
        found = schema.get("properties")
        props: dict[str, Any] = found if isinstance(found, dict) else {}
        args: dict[str, Any] = {}
        at, inner = 0, m.group(2)
        for p in _PARAMETER.finditer(inner):
            if inner[at:p.start()].strip():
                return None  # text between parameters: not this format
            at = p.end()
            key, raw = p.group(1).strip(), p.group(2)
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            args[key] = self._value(raw, props.get(key))
        if inner[at:].strip():
            return None
        if jsonsafe.problem(args) is not None:
            return None
        return ToolCall(name, json.dumps(args, ensure_ascii=False), self.new_id())

    @staticmethod
    def _value(raw: str, schema: Any) -> Any:
        """A parameter's text as its schema's type: text for strings; JSON where it parses otherwise."""
        types = _schema_types(schema)
        if "string" in types and not (raw.strip() == "null" and "null" in types):
            return raw
        text = raw.strip()
        if types & {"boolean"} and text.lower() in ("true", "false"):
            return text.lower() == "true"
        try:
            return jsonsafe.loads(text)
        except ValueError:
            return raw

    def how_to(self) -> str:
        return ("To call one, answer with the function's name and each argument between <tool_call> and "
                "</tool_call>, like this:\n<tool_call>\n<function=function_name>\n<parameter=argument>\nvalue\n"
                "</parameter>\n</function>\n</tool_call>")

    def calls_text(self, calls: list[tuple[str, Any]]) -> str:
        def param(k: str, v: Any) -> str:
            return f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"

        return "\n".join(f"{self.open}\n<function={n}>\n"
                         + "".join(param(k, v) for k, v in (a.items() if isinstance(a, dict) else ()))
                         + f"</function>\n{self.close}" for n, a in calls)


class Llama3Json(TailParser):
    name = "llama3_json"
    args_key = "parameters"
    markers = ("<|python_tag|>",)
    leads = ("{",)
    ends = ("<|eom_id|>", "<|eot_id|>")

    def tail(self, text: str, tools: Tools) -> list[ToolCall] | None:
        text = _strip_markers(text, self.markers, self.ends)
        calls, at = [], 0
        while True:
            while at < len(text) and text[at].isspace():
                at += 1
            got = _json_at(text, at)
            if got is None:
                return None
            call = _call_of(got[0], tools, self.new_id)
            if call is None:
                return None
            calls.append(call)
            at = got[1]
            rest = text[at:].lstrip()
            if not rest:
                return calls
            if not rest.startswith(";"):
                return None
            at = len(text) - len(rest) + 1

    def how_to(self) -> str:
        return ("To call one, answer with only a JSON object holding the function's name and its parameters, "
                'like this:\n{"name": "function_name", "parameters": {"argument": "value"}}')

    def calls_text(self, calls: list[tuple[str, Any]]) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)

    def grammar(self, call_schema: dict[str, Any]) -> str:
        return f"start: call\ncall: %json {json.dumps(call_schema)}"


_MISTRAL_NAME = re.compile(r"([a-zA-Z0-9_.\-]{1,64})(?:\[CALL_ID\][a-zA-Z0-9]*)?(?:\[ARGS\])?\s*")
_MISTRAL_LEAD = re.compile(r"([a-zA-Z0-9_.\-]{1,64})\s*\{")


class Mistral(TailParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    leads = ("[",)
    ends = ("</s>",)

    def new_id(self) -> str:
        return _mistral_id()

    def lead_unknown(self, body: str, tools: Tools) -> bool:
        return super().lead_unknown(body, tools) or any(
            n.startswith(body) or (body.startswith(n) and not body[len(n):].strip()) for n in tools)

    def leads_with(self, body: str, tools: Tools) -> bool:
        """``NAME{...}``: a v11 call whose ``[TOOL_CALLS]`` and ``[ARGS]`` were skipped as special tokens."""
        m = _MISTRAL_LEAD.match(body)
        return m is not None and m.group(1) in tools

    def tail(self, text: str, tools: Tools) -> list[ToolCall] | None:
        text = _strip_markers(text, (), self.ends)
        pieces = [p.strip() for p in text.split(self.markers[0])]
        calls: list[ToolCall] = []
        for piece in pieces:
            if not piece:
                continue
            got = self._piece(piece, tools)
            if got is None:
                return None
            calls += got
        return calls or None

    def _piece(self, piece: str, tools: Tools) -> list[ToolCall] | None:
        """The calls of one ``[TOOL_CALLS]`` section: a JSON list (or object) of calls, or ``NAME[ARGS]{...}``s."""
        calls: list[ToolCall] = []
        if piece.startswith(("[", "{")):
            got = _json_at(piece, 0)
            if got is None or piece[got[1]:].strip():
                return None
            for obj in got[0] if isinstance(got[0], list) else [got[0]]:
                call = _call_of(obj, tools, self.new_id)
                if call is None:
                    return None
                calls.append(call)
            return calls
        at = 0
        while at < len(piece):
            m = _MISTRAL_NAME.match(piece, at)
            if m is None or m.group(1) not in tools:
                return None
            got = _json_at(piece, m.end())
            if got is None or not isinstance(got[0], dict):
                return None
            calls.append(ToolCall(m.group(1), json.dumps(got[0], ensure_ascii=False), self.new_id()))
            at = got[1]
            while at < len(piece) and piece[at].isspace():
                at += 1
        return calls

    def how_to(self) -> str:
        return ("To call one, answer with [TOOL_CALLS] followed by a JSON list of calls, each holding the "
                'function\'s name and its arguments, like this:\n'
                '[TOOL_CALLS][{"name": "function_name", "arguments": {"argument": "value"}}]')

    def calls_text(self, calls: list[tuple[str, Any]]) -> str:
        return self.markers[0] + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)

    def grammar(self, call_schema: dict[str, Any]) -> str:
        return f'start: "{self.markers[0]}[" call "]"\ncall: %json {json.dumps(call_schema)}'


_PY_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _py_value(node: ast.expr) -> Any:
    """A literal's JSON value (lists for tuples); ValueError for anything else."""
    if isinstance(node, ast.Name) and node.id in _PY_NAMES:
        return _PY_NAMES[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_py_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values, strict=True):
            key = _py_value(k) if k is not None else None
            if not isinstance(key, str):
                raise ValueError("a dict key that is not a string")
            out[key] = _py_value(v)
        return out
    value = ast.literal_eval(node)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise ValueError(f"{type(value).__name__} is not a JSON value")


def _py_text(v: Any) -> str:
    """A JSON value as a Python literal."""
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {_py_text(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_py_text(x) for x in v) + "]"
    if isinstance(v, bool) or v is None:
        return repr(v)
    return json.dumps(v, ensure_ascii=False)


class Pythonic(TailParser):
    name = "pythonic"
    markers = ("<|python_start|>",)
    leads = ("[",)
    ends = ("<|python_end|>", "<|eom|>", "<|eot|>", "<|eot_id|>", "<|eom_id|>")
    forced_by = "llama3_json"

    def tail(self, text: str, tools: Tools) -> list[ToolCall] | None:
        text = _strip_markers(text, self.markers, self.ends)
        try:
            tree = ast.parse(text, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return None
            calls = []
            for node in tree.elts:
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                        and node.func.id in tools and all(k.arg is not None for k in node.keywords)):
                    return None
                args = {k.arg: _py_value(k.value) for k in node.keywords}
                if jsonsafe.problem(args) is not None:
                    return None
                calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False), self.new_id()))
            return calls
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return None

    def how_to(self) -> str:
        return ("To call one, answer with only a Python list of calls with keyword arguments, like this:\n"
                '[function_name(argument="value")]')

    def calls_text(self, calls: list[tuple[str, Any]]) -> str:
        return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={_py_text(v)}" for k, v in (a.items() if isinstance(a, dict)
                                                                                     else ())) + ")"
                               for n, a in calls) + "]"


PARSERS: dict[str, ToolParser] = {p.name: p for p in (Hermes(), Qwen3Coder(), Llama3Json(), Mistral(), Pythonic())}
ALIASES = {"qwen3_xml": "qwen3_coder", "llama4_json": "llama3_json"}  # vLLM's other names of the same formats
NAMES = ("auto", *PARSERS, *ALIASES)

_PYTHONIC_TEMPLATE = re.compile(r"\[func_name\d*\(|<\|python_start\|>")


def detect(template: str | None) -> tuple[str, str]:
    """(the format a chat template teaches its model, why): what ``auto`` picks."""
    if not template or "tools" not in template:
        return "hermes", "the chat template does not render tools, so lockgate writes the Hermes format into the prompt"
    for name, found in (("mistral", "[TOOL_CALLS]" in template), ("qwen3_coder", "<function=" in template),
                        ("hermes", "<tool_call>" in template), ("pythonic", bool(_PYTHONIC_TEMPLATE.search(template))),
                        ("llama3_json", "<|python_tag|>" in template or '"parameters"' in template)):
        if found:
            return name, "from the chat template"
    return "hermes", "no known tool-call format in the chat template"


def resolve(name: str | None, template: str | None) -> tuple[ToolParser, str]:
    """(the parser ``--tool-call-parser name`` means for a model with ``template``, a log line)."""
    if name in (None, "auto"):
        found, why = detect(template)
        return PARSERS[found], f"tool calls read as {found} (auto: {why})"
    canonical = ALIASES.get(name, name)
    if canonical not in PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not available: the supported parsers are {', '.join(NAMES)}")
    return PARSERS[canonical], f"tool calls read as {canonical} (--tool-call-parser {name})"
