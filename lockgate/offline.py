"""Offline API: ``LLM(model=...).generate(prompts, params)`` and ``.chat(messages)``, as vLLM's.

Owns nothing of its own but the glue: it tokenizes, submits to the same ``EngineCore``
(scheduler + runner) the server uses, steps it until every request is done, detokenizes
incrementally (stop strings included) and returns vLLM-shaped ``RequestOutput`` objects in
the order of the inputs. A prompt that can never run (too long for the context or the KV
pool, or names an adapter that is not loaded) raises ``ValueError`` before anything runs.
LoRA: ``LLM(..., lora_modules=("name=path",))`` or ``load_lora``, then ``generate(..., lora=name)``.

vLLM's quickstart runs with only the import changed: ``LLM(model=..., **kwargs)`` takes vLLM's
keyword arguments (``vllm_compat``: mapped, refused with a reason, or accepted with a log line when
they mean nothing here; an unknown one is vLLM's TypeError), prompts may be vLLM's dicts
(``{"prompt": ...}``, ``{"prompt_token_ids": [...]}``), ``SamplingParams(n=...)`` gives n outputs
per prompt (n engine requests, choice i seeded ``seed + i`` as the server does), ``get_tokenizer()``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from lockgate.checkpoint.peft import AdapterInfo
from lockgate.config import EngineConfig, read_chat_template
from lockgate.engine.core import EngineCore
from lockgate.sampling import SamplingParams, per_choice_params
from lockgate.scheduler.request import FinishReason, Request
from lockgate.tokenizer.output import Delta, OutputProcessor
from lockgate.tokenizer.tokenizer import Message, Tokenizer, load_tokenizer
from lockgate.vllm_compat import engine_options

log = logging.getLogger("lockgate.offline")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class RequestMetrics:
    """Seconds since the request was submitted (time.monotonic based)."""

    time_to_first_token: float | None = None
    queue_time: float | None = None  # until the scheduler admitted it
    e2e: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    metrics: RequestMetrics = field(default_factory=RequestMetrics)


PromptInput = str | dict[str, Any]
PROMPT_KEYS = ("prompt", "prompt_token_ids")  # what a prompt dict may hold (vLLM's TextPrompt / TokensPrompt)


class LLM:
    def __init__(self, model: str = "default", *, config: EngineConfig | None = None,
                 check_invariants: bool = False, **options: Any) -> None:
        """``LLM("default", max_total_tokens=4096, dtype="float32")`` or ``LLM(config=cfg)``.

        ``options``: the engine's options (``config.py``'s fields, by lockgate's or vLLM's name) and
        vLLM's other ``LLM`` keyword arguments (``vllm_compat``); an unknown one is a TypeError."""
        if config is not None and options:
            raise TypeError(f"LLM(config=...) takes no other options, got {sorted(options)}")
        if config is None:
            flat, notes = engine_options(model, options)
            for line in notes:
                log.info("%s", line)
            config = EngineConfig.build(model=model, **flat)
        cfg = config
        self.engine = EngineCore(cfg, check_invariants=check_invariants)
        template = None if cfg.model.chat_template is None else read_chat_template(cfg.model.chat_template)
        self.tokenizer: Tokenizer = load_tokenizer(cfg.model.model, self.engine.runner.model_dir,
                                                   template)

    def get_tokenizer(self) -> Tokenizer:
        """The tokenizer prompts go through (``encode``, ``decode``, ``apply_chat_template``)."""
        return self.tokenizer

    def generate(self, prompts: PromptInput | Sequence[PromptInput] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None,
                 use_tqdm: bool = False, lora: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """``prompts``: text, ``{"prompt": text}`` or ``{"prompt_token_ids": [...]}``, or a list of them.
        ``sampling_params``: one for all or one per prompt; its ``n`` outputs per prompt. ``lora``: the
        LoRA adapter (by name: ``--lora-modules`` / ``load_lora``) for every prompt, or one per prompt
        (None: the base model)."""
        if prompts is None and prompt_token_ids is None:
            raise ValueError("give prompts or prompt_token_ids")
        texts: list[str | None]
        if prompts is not None:
            items = [prompts] if isinstance(prompts, str | dict) else list(prompts)
            texts, ids = [], []
            for i, item in enumerate(items):
                text, p_ids = self._prompt(i, item)
                texts.append(text)
                ids.append(p_ids)
        else:
            assert prompt_token_ids is not None
            ids = [list(p) for p in prompt_token_ids]
            texts = [None] * len(ids)
        params = self._with_lora(self._params(sampling_params, len(ids)), lora)
        return self._run(texts, ids, params, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, lora: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        convs: list[list[Message]] = [messages] if messages and isinstance(messages[0], dict) else messages  # type: ignore[assignment,list-item]
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in convs]
        ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        params = self._with_lora(self._params(sampling_params, len(ids)), lora)
        return self._run(list(texts), ids, params, use_tqdm)

    def load_lora(self, name: str, path: str) -> AdapterInfo:
        """Load the PEFT adapter at ``path`` as ``name`` (ValueError saying what is wrong)."""
        return self.engine.load_adapter(name, path)

    def unload_lora(self, name: str) -> None:
        if name not in self.engine.adapters:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")
        self.engine.unload_adapter(name)

    # ---- internals -------------------------------------------------------------------
    def _with_lora(self, params: list[SamplingParams], lora: str | Sequence[str | None] | None) -> list[SamplingParams]:
        if lora is None:
            return params
        names = [lora] * len(params) if isinstance(lora, str) else list(lora)
        if len(names) != len(params):
            raise ValueError(f"got {len(names)} adapters for {len(params)} prompts")
        for name in names:
            if name is not None and name not in self.engine.adapters:
                raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {', '.join(sorted(self.engine.adapters)) or 'none'})")
        return [p if n is None else dataclasses.replace(p, lora=n) for p, n in zip(params, names, strict=True)]

    def _prompt(self, i: int, item: object) -> tuple[str | None, list[int]]:
        """One prompt -> (its text if given, its token ids); ValueError naming what is wrong."""
        if isinstance(item, str):
            return item, self.tokenizer.encode(item)
        if not isinstance(item, dict):
            raise ValueError(f"prompt {i}: expected a string or a dict with 'prompt' or 'prompt_token_ids', got "
                             f"{type(item).__name__}")
        unknown = sorted(set(item) - set(PROMPT_KEYS))
        if unknown:
            raise ValueError(f"prompt {i}: {', '.join(map(repr, unknown))} not supported (a prompt dict takes "
                             f"{' and '.join(map(repr, PROMPT_KEYS))})")
        text = item.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"prompt {i}: 'prompt' must be a string, got {type(text).__name__}")
        if "prompt_token_ids" in item:
            p_ids = item["prompt_token_ids"]
            if not isinstance(p_ids, list | tuple) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                              for t in p_ids):
                raise ValueError(f"prompt {i}: 'prompt_token_ids' must be a list of integers")
            return text, list(p_ids)
        if text is None:
            raise ValueError(f"prompt {i}: a prompt dict needs 'prompt' or 'prompt_token_ids'")
        return text, self.tokenizer.encode(text)

    @staticmethod
    def _params(p: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if p is None:
            return [SamplingParams()] * n
        if isinstance(p, SamplingParams):
            return [p] * n
        if len(p) != n:
            raise ValueError(f"got {len(p)} sampling params for {n} prompts")
        return list(p)

    def _run(self, texts: list[str | None], ids: list[list[int]], params: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        for i, (p_ids, p) in enumerate(zip(ids, params, strict=True)):
            try:
                self.engine.validate(p_ids, p.max_tokens)
                if p.structured is not None:  # compiled (and cached) now: a bad one fails before any is queued
                    self.engine.grammars.compile(p.structured)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        outs = [RequestOutput("", text, list(p_ids)) for text, p_ids in zip(texts, ids, strict=True)]
        live: dict[str, _Pending] = {}
        for i, (p_ids, p) in enumerate(zip(ids, params, strict=True)):
            for k, choice in enumerate(per_choice_params(p, p.n)):
                req = self.engine.add_request(p_ids, choice)
                if k == 0:
                    outs[i].request_id = req.rid
                live[req.rid] = _Pending(i, k, choice, req, OutputProcessor(self.tokenizer, p.stop,
                                                                            p.skip_special_tokens))
        choices: list[dict[int, CompletionOutput]] = [{} for _ in outs]
        bar = tqdm(total=len(live), desc="generate", unit="req") if use_tqdm else None
        while self.engine.has_work or self.engine.num_compiling:
            if not self.engine.has_work:
                self.engine.grammar_wait.wait()
            for rid, why in self.engine.rejected:
                raise ValueError(f"request {rid}: {why}")
            for ev in self.engine.step():
                pend = live[ev.rid]
                d = pend.proc.process(ev.new_token_ids, ev.new_logprobs, ev.new_top,
                                      ev.finish_reason.value if ev.finish_reason is not None else None)
                pend.add(d)
                if pend.choice == 0:
                    outs[pend.prompt].num_cached_tokens = ev.cached_tokens
                if d.abort_engine:
                    self.engine.abort(ev.rid)
                if d.finish_reason is not None:
                    metrics = outs[pend.prompt].metrics if pend.choice == 0 else None
                    choices[pend.prompt][pend.choice] = pend.finish(FinishReason(d.finish_reason), metrics)
                    del live[ev.rid]
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        for out, done in zip(outs, choices, strict=True):
            out.outputs = [done[k] for k in sorted(done)]
        return outs


@dataclass
class _Pending:
    """One engine request: choice ``choice`` of prompt ``prompt``."""

    prompt: int
    choice: int
    params: SamplingParams
    req: Request
    proc: OutputProcessor
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)

    def add(self, d: Delta) -> None:
        self.token_ids += d.ids  # tokens after a stop string are already left out
        self.logprobs += d.logprobs or []
        self.top += d.top or []
        self.pieces.append(d.text)

    def finish(self, reason: FinishReason, m: RequestMetrics | None) -> CompletionOutput:
        """Its output; ``m`` (the prompt's metrics, filled from this request) when it is choice 0."""
        r = self.req
        if m is not None:
            m.e2e = time.monotonic() - r.arrival_time
            if r.first_token_time is not None:
                m.time_to_first_token = r.first_token_time - r.arrival_time
            if r.admit_time is not None:
                m.queue_time = r.admit_time - r.arrival_time
        want = self.params.logprobs
        return CompletionOutput(self.choice, "".join(self.pieces), self.token_ids, reason.value,
                                logprobs=self.logprobs if want is not None else None,
                                top_logprobs=self.top if want else None)
