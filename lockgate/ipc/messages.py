"""Every message that crosses a process boundary, as typed msgspec structs (no pickle, no dicts).

Three processes (docs/design.md, Processes), three one-way PUSH -> PULL channels:

    API ----------- ToScheduler ----------> scheduler
    detokenizer --- ToScheduler ----------> scheduler   (abort when a stop string matched)
    scheduler ----- ToDetokenizer --------> detokenizer
    detokenizer --- ToApi ----------------> API

Liveness: once ready, the scheduler and the detokenizer each send a ``Heartbeat`` every second
toward the API (the scheduler's travel through the detokenizer), so the API process can tell a
frozen or stopped child from an idle one.

Messages are batched: one ``StepBatch`` per engine step carries every request's new tokens
plus the engine's load figures, so per-token traffic is one message per step, not per
request. Each union is tagged (``type`` field) so a receiver decodes exactly one of the
listed structs or fails loudly.

LoRA adapters loaded or unloaded at run time: the API sends ``LoadAdapter`` / ``UnloadAdapter``
with a ticket; the scheduler answers ``AdapterReply`` (same ticket, the adapters now loaded or the
error) through the detokenizer, which forwards it unchanged.

Ordering invariant: a channel is FIFO, and the scheduler forwards ``Register`` for a request
to the detokenizer before any of its tokens, on the same channel.
"""

from __future__ import annotations

import msgspec

from lockgate.sampling import SamplingParams


class _Msg(msgspec.Struct, tag=True, array_like=False, omit_defaults=True):
    pass


# ---- API / detokenizer -> scheduler ------------------------------------------------------
class AddRequest(_Msg):
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.time() when the API accepted it
    tenant: str = "default"  # who it is served for (the scheduler's fair share between tenants)


class AbortRequest(_Msg):
    rid: str
    reason: str = "abort"


class Shutdown(_Msg):
    pass


class LoadAdapter(_Msg):
    ticket: str
    name: str
    path: str
    replace: bool = False  # an adapter of that name is swapped for this one (vLLM's load_inplace)


class UnloadAdapter(_Msg):
    ticket: str
    name: str


class Wake(_Msg):
    """The scheduler process to itself, from a side thread: work finished off the loop (a grammar
    compiled, an adapter read) waits to be taken in; an idle loop blocked on its socket wakes."""


ToScheduler = AddRequest | AbortRequest | Shutdown | LoadAdapter | UnloadAdapter | Wake


# ---- scheduler -> detokenizer ------------------------------------------------------------
class Register(_Msg):
    """Sent once per request before its first token: what the detokenizer must know."""

    rid: str
    stop: list[str]
    skip_special_tokens: bool


class TokenOut(_Msg):
    """One request's share of a step: new tokens (or none, with an error / finish)."""

    rid: str
    ids: list[int]
    logprobs: list[float] | None = None  # one per id when the request asked for logprobs
    top: list[list[tuple[int, float]]] | None = None  # per id: [(token id, logprob)] descending
    finish_reason: str | None = None  # stop | length | abort | error
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    cached_tokens: int = 0
    queue_seconds: float | None = None  # on the first output: arrival -> first scheduled
    error: str | None = None  # with finish_reason "error": what went wrong
    status: int = 0  # with an error: the HTTP status it means (404 an adapter gone, 400 a refused request); 0: 500


class AdapterCard(msgspec.Struct, omit_defaults=True):
    """A loaded LoRA adapter, as /v1/models shows it."""

    name: str
    path: str
    rank: int
    modules: list[str] = []


class AdapterReply(_Msg):
    """The scheduler's answer to ``LoadAdapter`` / ``UnloadAdapter``: the adapters loaded now, or
    ``error`` (``status`` 400 bad adapter or name, 404 no such adapter) and nothing changed."""

    ticket: str
    adapters: list[AdapterCard]
    error: str | None = None
    status: int = 200


class EngineStats(_Msg):
    running: int
    waiting: int
    slots_used: int
    slots_free: int
    slots_evictable: int
    capacity: int
    headroom: int  # capacity minus the admission peak estimate
    num_steps: int
    draft_tokens: int = 0  # speculation since start: guesses fed to the model
    retractions: int = 0  # running requests retracted since start (--admission ratio)
    recomputed_tokens: int = 0  # tokens retracted requests computed again, since start
    accepted_tokens: int = 0  # of those, the ones it agreed with
    drafts: int = 0  # (request, step) pairs fed at least one guess, since start
    accepted_per_pos: list[int] = []  # accepted guesses by their position in a draft, since start
    step_tokens: int = 0  # tokens step number ``num_steps`` computed (prompt tokens prefilled + tokens generated)
    lora_running: dict[str, int] = {}  # LoRA adapter name -> running requests (loaded adapters only)
    lora_waiting: dict[str, int] = {}  # -> waiting requests
    lora_loads: int = 0  # adapters put into a runner slot since start
    lora_evictions: int = 0  # adapters taken out of a slot for another
    max_loras: int = 0
    # the queue forecast (engine/forecast.py) and when it was made (time.monotonic(), one clock per host)
    queue_eta_s: float | None = None  # before a request sent now starts its prefill
    drain_eta_s: float | None = None  # until everything there now is done
    prefill_backlog_tokens: int = 0
    decode_backlog_tokens: int = 0
    prefill_tokens_per_s: float | None = None
    decode_step_s: float | None = None
    queue_blocked: bool = False
    forecast_time: float = 0.0


class StepBatch(_Msg):
    outs: list[TokenOut]
    stats: EngineStats


class Ready(_Msg):
    """The scheduler loaded the model and ran a warm-up step (forwarded to the API)."""

    model: str
    model_dir: str | None
    max_model_len: int
    capacity: int
    vocab_size: int
    eos_token_ids: list[int]
    dtype: str
    scheduler_pid: int
    adapters: list[AdapterCard] = []  # LoRA adapters loaded at start (--lora-modules)
    kv_cache_dtype: str = "auto"  # what the KV pool stores: the run dtype's name, int8 or fp8_e4m3


class Fatal(_Msg):
    """A process is about to exit because of an error it cannot recover from."""

    process: str
    message: str


class Heartbeat(_Msg):
    """Sent every ``HEARTBEAT_SECONDS`` by the scheduler (from a side thread, so a long step does not
    silence it) and the detokenizer once ready; the detokenizer forwards the scheduler's to the API."""

    process: str  # "scheduler" or "detokenizer"
    pid: int


ToDetokenizer = Register | StepBatch | Ready | Fatal | Shutdown | Heartbeat | AdapterReply


# ---- detokenizer -> API ------------------------------------------------------------------
class TextOut(TokenOut):
    """A ``TokenOut`` plus its text delta (stop strings already cut, never emitted): every field of
    the scheduler's output travels on unchanged except what the stop-string cut shortened."""

    text: str = ""
    stop_matched: str | None = None  # the stop string (or None) when finish_reason is "stop"
    pieces: list[str] | None = None  # several ids in one step: each id's share of ``text``, in order


class TextBatch(_Msg):
    outs: list[TextOut]
    stats: EngineStats


class DetokenizerReady(_Msg):
    ready: Ready
    detokenizer_pid: int


ToApi = TextBatch | DetokenizerReady | Fatal | Heartbeat | AdapterReply


# ---- API <-> grammar worker (the grammar sandbox: one worker's stdin and stdout) -----------------
class CompileJob(_Msg):
    """A client's constraint to check: ``StructuredOutput`` (kind, value) as the request gave it."""

    kind: str
    value: str


class CompileResult(_Msg):
    """The worker's answer: ``text`` (the constraint as llguidance grammar text, compiled and probed
    against the model's tokenizer) or ``error`` (what is wrong with it); ``seconds`` it took."""

    text: str | None = None
    error: str | None = None
    seconds: float = 0.0


class WorkerReady(_Msg):
    """A grammar worker loaded the tokenizer and waits for jobs."""

    pid: int


ToGrammarWorker = CompileJob
FromGrammarWorker = CompileResult | WorkerReady
