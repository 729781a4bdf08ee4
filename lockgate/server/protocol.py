"""HTTP request schemas (OpenAI-compatible and TGI-native) and their mapping to SamplingParams.

Owns: parsing request bodies (pydantic v2), normalizing prompt/message forms, turning a
request into ``SamplingParams``, and which top-level fields a request model knows
(``request_fields``, for errors.py's ``param``). Invariants:

* Every model ignores unknown fields (other clients send them; they are not a 400) and every
  optional field accepts JSON ``null`` meaning "use the default".
* Wrong types fail at parse time with a ``pydantic.ValidationError``; numeric ranges are
  checked by ``SamplingParams`` itself (``ValueError``), except limits it does not know
  (n, logprobs counts, TGI-specific ranges). ``errors.error_message`` makes one readable line of
  either.
* Booleans are never accepted where a number is expected.
* Imports only pydantic, the stdlib, ``lockgate.sampling`` and the constraint fields' reader
  (``lockgate.server.constraints``); no torch, no zmq.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, cast

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationInfo,
    field_validator,
    model_validator,
)

from lockgate.sampling import MAX_LOGPROBS, SamplingParams, StructuredOutput
from lockgate.server.constraints import CONSTRAINT_FIELDS, read_constraints, tgi_grammar

MAX_N = 16


def _no_bool(v: Any) -> Any:
    if isinstance(v, bool):
        raise ValueError(f"expected a number, got a boolean ({v!r})")
    return v


Int = Annotated[int, BeforeValidator(_no_bool)]
Float = Annotated[float, BeforeValidator(_no_bool)]


def _empty(v: Any) -> bool:
    return v in ({}, [], "", False)


class _Model(BaseModel):
    """Base: unknown fields ignored; ``null`` for a field that has a default means the default.
    ``_refused``: fields of other servers' APIs that would change the output and that lockgate does
    not implement; a request giving one is a 400 naming it, unless its value asks for nothing
    (the predicate), so clients that always send the default keep working."""

    model_config = ConfigDict(extra="ignore")
    _refused: ClassVar[dict[str, Callable[[Any], bool]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, harmless in cls._refused.items():
                if data.get(name) is not None and not harmless(data[name]):
                    raise ValueError(f"{name} is not supported by lockgate: it would change the output, so it "
                                     f"is refused rather than ignored (omit it, or send null)")
        return data

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}


def _stop_list(v: Any) -> list[str]:
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return list(v)
    raise ValueError(f"stop must be a string or a list of strings, got {v!r:.60}")


StopList = Annotated[list[str], PlainValidator(_stop_list, json_schema_input_type=str | list[str])]  # a string is accepted as [string]


class StreamOptions(_Model):
    include_usage: bool = False


class _SamplingFields(_Model):
    """Knobs shared by the OpenAI endpoints; ranges are checked by SamplingParams. The output
    constraints (``constraints.read_constraints``) are read into ``structured`` (at most one per request)."""

    _refused = {
        "functions": _empty, "logit_bias": _empty, "lora_request": _empty, "function_call": lambda v: v == "none",
        "structural_tag": _empty,
    }
    _read_fields: ClassVar[frozenset[str]] = CONSTRAINT_FIELDS

    @model_validator(mode="before")
    @classmethod
    def _read_constraints(cls, data: Any) -> Any:
        return read_constraints(data) if isinstance(data, dict) else data

    structured: StructuredOutput | None = None  # from one of CONSTRAINT_FIELDS
    structured_field: str | None = None  # which one (errors name it)

    model: str | None = None
    temperature: Float = 1.0
    top_p: Float = 1.0
    top_k: Int = -1
    min_p: Float = 0.0
    frequency_penalty: Float = 0.0
    presence_penalty: Float = 0.0
    repetition_penalty: Float = 1.0
    seed: Int | None = None
    stop: StopList = Field(default_factory=list)
    stop_token_ids: list[Int] = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: Int = 0
    n: Int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    skip_special_tokens: bool = True

    def _params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            seed=self.seed, stop=tuple(self.stop), stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens, structured=self.structured,
        )  # fmt: skip

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. Unknown fields are ignored; ``suffix`` (insertion) is refused."""

    _refused = {**_SamplingFields._refused, "suffix": _empty, "tools": _empty,
                "tool_choice": lambda v: v == "none"}  # tools are a chat feature

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Int | None = None  # None: max_tokens_default, else 16 (OpenAI)
    logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: Int | None = None

    @field_validator("prompt", mode="plain", json_schema_input_type=str | list[int] | list[str] | list[list[int]])
    @classmethod
    def _check_prompt(cls, v: Any) -> str | list[int] | list[str] | list[list[int]]:
        def ids(x: Any) -> bool:
            return isinstance(x, list) and all(type(t) is int and t >= 0 for t in x)

        if isinstance(v, str) or (isinstance(v, list) and ids(v)):
            pass
        elif isinstance(v, list) and (all(isinstance(p, str) for p in v) or all(ids(p) for p in v)):
            if any(len(p) == 0 for p in v):
                raise ValueError("prompt must not be empty (a prompt in the batch is empty)")
        else:
            raise ValueError(
                "prompt must be a string, a list of token ids (>= 0), a list of strings or a list of "
                f"token id lists, got {v!r:.60}"
            )
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        return cast(str | list[int] | list[str] | list[list[int]], v)

    @model_validator(mode="after")
    def _check_best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(
                f"best_of is not supported: omit it or set it equal to n (got best_of={self.best_of}, n={self.n})"
            )
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch: a string or a list of ints is one prompt; a list of either is a batch."""
        p = self.prompt
        if isinstance(p, str) or all(isinstance(t, int) for t in p):
            return [cast(str | list[int], p)]
        return [cast(str | list[int], x) for x in p]

    def sampling_params(self, max_tokens_default: int | None = None) -> SamplingParams:
        mt = self.max_tokens if self.max_tokens is not None else max_tokens_default
        return self._params(16 if mt is None else mt, self.logprobs)


class ContentPart(_Model):
    """A chat content part; only ``{"type": "text", "text": ...}`` is supported."""

    type: Literal["text"]
    text: str


class FunctionCall(_Model):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends JSON text; some clients an object


class ToolCallIn(_Model):
    """An earlier call in an assistant message (sent back with the conversation)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this answers

    @field_validator("content", mode="plain", json_schema_input_type=str | list[ContentPart] | None)
    @classmethod
    def _check_content(cls, v: Any) -> str | list[ContentPart] | None:
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list):
            return [p if isinstance(p, ContentPart) else _part(p) for p in v]
        raise ValueError(f"content must be a string or a list of content parts, got {v!r:.60}")

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(p.text for p in self.content)


def _part(p: Any) -> ContentPart:
    if not isinstance(p, dict):
        raise ValueError(f"a content part must be an object with 'type' and 'text', got {p!r:.60}")
    if p.get("type") != "text":
        raise ValueError(f"only text content parts are supported (got type {p.get('type')!r})")
    if not isinstance(p.get("text"), str):
        raise ValueError("a text content part needs a 'text' string")
    return ContentPart(type="text", text=p["text"])


def _conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None and m.role == "tool":
            d["name"] = m.name
        out.append(d)
    return out


class FunctionDef(_Model):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (an object)
    strict: bool | None = None


class ToolDef(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: FunctionCall | dict[str, Any]

    @property
    def name(self) -> str:
        f = self.function
        return f.name if isinstance(f, FunctionCall) else str(f.get("name"))


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. ``continue_final_message`` and unknown fields are ignored."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: two functions have the same name")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.name not in names:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools ({', '.join(names)})")
        if self.tool_mode in ("required", "named") and self.structured is not None:
            raise ValueError(f"tool_choice {'required' if choice == 'required' else 'naming a function'} "
                             f"constrains the output, and so does {self.structured_field}: give one")
        return self

    @property
    def tool_mode(self) -> str:
        """none (no tools, or tool_choice none), auto (the default with tools), required, named."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if self.tool_choice in (None, "auto"):
            return "auto"
        return "required" if self.tool_choice == "required" else "named"

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def conversation(self) -> list[dict[str, Any]]:
        """[{"role", "content"}] for the chat template; text parts joined by "\\n"; developer -> system."""
        return _conversation(self.messages)

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens wins over max_tokens; None: up to the context (the app decides)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return self._params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


class TGIParameters(_Model):
    """TGI ``parameters``. Refused unless they ask for nothing: watermark, truncate,
    typical_p < 1, best_of > 1, decoder_input_details (the prompt's own logprobs). ``adapter_id``
    names a LoRA adapter (checked by the app)."""

    _refused = {
        "watermark": _empty, "truncate": lambda v: False,
        "typical_p": lambda v: v == 1, "best_of": lambda v: v == 1, "decoder_input_details": _empty,
    }

    @model_validator(mode="before")
    @classmethod
    def _read_grammar(cls, data: Any) -> Any:
        """TGI's ``grammar``: {"type": "json", "value": schema} or {"type": "regex", "value": pattern}
        (also "json_schema" with {"name", "schema"})."""
        if not isinstance(data, dict):
            return data
        g = data.get("grammar")
        data = {k: v for k, v in data.items() if k not in ("grammar", "structured")}
        if g is None:
            return data
        data["structured"] = tgi_grammar(g)
        return data

    structured: StructuredOutput | None = None  # from grammar
    adapter_id: str | None = None  # a LoRA adapter's name (TGI / LoRAX); None or "" : the base model

    max_new_tokens: Int = 20
    temperature: Float | None = Field(default=None, gt=0)
    top_k: Int | None = Field(default=None, gt=0)
    top_p: Float | None = Field(default=None, gt=0, lt=1)
    repetition_penalty: Float | None = None
    frequency_penalty: Float | None = None
    stop: StopList = Field(default_factory=list)
    seed: Int | None = None
    do_sample: bool = False
    details: bool = False
    return_full_text: bool = False
    top_n_tokens: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @property
    def sampling(self) -> bool:
        """TGI: sample if do_sample, or implicitly when temperature != 1, top_k or top_p is given."""
        t = self.temperature
        return self.do_sample or t not in (None, 1.0) or self.top_k is not None or self.top_p is not None


class TGIGenerateRequest(_Model):
    """POST /generate, /generate_stream and / (TGI-native)."""

    inputs: str
    parameters: TGIParameters = Field(default_factory=lambda: TGIParameters())
    stream: bool = False

    @field_validator("inputs")
    @classmethod
    def _non_empty(cls, v: str) -> str:
        if not v:
            raise ValueError("inputs must not be empty")
        return v

    def sampling_params(self) -> SamplingParams:
        p = self.parameters
        logprobs = p.top_n_tokens if p.top_n_tokens else (0 if p.details else None)
        return SamplingParams(
            max_tokens=p.max_new_tokens,
            temperature=(p.temperature or 1.0) if p.sampling else 0.0,
            top_p=p.top_p if p.top_p is not None else 1.0,
            top_k=p.top_k if p.top_k is not None else -1,
            repetition_penalty=p.repetition_penalty if p.repetition_penalty is not None else 1.0,
            frequency_penalty=p.frequency_penalty if p.frequency_penalty is not None else 0.0,
            seed=p.seed, stop=tuple(p.stop), logprobs=logprobs, structured=p.structured,
            lora=p.adapter_id or None,
        )  # fmt: skip


class LoadLoraAdapterRequest(_Model):
    """POST /v1/load_lora_adapter (vLLM's body): load the PEFT adapter at ``lora_path`` (a
    directory on the server's machine) as ``lora_name``; ``load_inplace`` replaces a loaded one."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False

    @field_validator("lora_name", "lora_path")
    @classmethod
    def _printable(cls, v: str, info: ValidationInfo) -> str:
        return printable(v, info.field_name or "value")


class UnloadLoraAdapterRequest(_Model):
    """POST /v1/unload_lora_adapter (vLLM's body; its ``lora_int_id`` is ignored: names are unique)."""

    lora_name: str = Field(min_length=1, max_length=256)

    @field_validator("lora_name")
    @classmethod
    def _printable(cls, v: str) -> str:
        return printable(v, "lora_name")


def printable(v: str, name: str) -> str:
    """``v`` if it has no control or format character (NUL, newlines, escapes, bidirectional
    overrides such as U+202E, zero-width ones) and is not only spaces."""
    bad = next((c for c in v if unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")), None)
    if bad is not None:
        raise ValueError(f"{name} must not contain control or format characters (found U+{ord(bad):04X})")
    if not v.strip():
        raise ValueError(f"{name} must not be blank")
    return v


class TokenizeRequest(_Model):
    """POST /tokenize: exactly one of ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _exactly_one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt or messages must be given")
        return self

    def conversation(self) -> list[dict[str, str]] | None:
        return None if self.messages is None else _conversation(self.messages)


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[Annotated[Int, Field(ge=0)]]


def request_fields(*models: type[BaseModel]) -> frozenset[str]:
    """The top-level request fields of these models: declared, refused (``_Model._refused``) and
    read before validation (``_SamplingFields._read_fields``: the output constraints)."""
    return frozenset(name for m in models
                     for name in (*m.model_fields, *getattr(m, "_refused", {}), *getattr(m, "_read_fields", ())))
