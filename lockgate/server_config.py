"""The server's configuration: what ``lockgate serve`` and ``lockgate gateway`` take beyond the
engine's tree (``config.py``). Owns ``ServerConfig`` (HTTP, API keys, limits, tool-call format,
the watchdog), ``CorsConfig`` (browser origins) and the flag groups that build them
(``ServerFlags``, ``CorsFlags``, ``server_config_from_args``, ``cors_from_args``).

Values are validated when a config is built (a bad flag fails at start naming the flag and the
limit), as the engine's are; flags come from the dataclass fields through ``config.add_config_args``.
Imports only ``config``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from lockgate.config import HEARTBEAT_SECONDS, option, parse_size

# vLLM's names of the tool-call formats lockgate reads (server.tool_parsers owns them), "auto" first
TOOL_CALL_PARSERS = ("auto", "hermes", "qwen3_coder", "llama3_json", "mistral", "pythonic", "qwen3_xml", "llama4_json")


@dataclass(frozen=True)
class ServerConfig:
    """Options of ``lockgate serve`` beyond the engine's (the API and process supervision)."""

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on")
    served_model_name: tuple[str, ...] = option((), "model names clients use: each is accepted as a request's "
                                                "model, the first is the one answers and /metrics report "
                                                "(default: the --model value)", nargs="+")
    tool_call_parser: str | None = option(None, "the format tool calls are read from in the model's text (vLLM's "
                                          f"flag): {', '.join(TOOL_CALL_PARSERS)} (default: auto, the format the "
                                          "chat template teaches, hermes when the template does not render tools)",
                                          choices=list(TOOL_CALL_PARSERS))
    strict_model_name: bool = option(False, "answer 404 to a request naming another model (vLLM's behaviour); "
                                     "by default, serving one model, any name is taken as it (TGI's, SGLang's)")
    api_key: tuple[str, ...] = option((), "require 'Authorization: Bearer KEY' on every route but /health; "
                                      "NAME=KEY names the key's tenant (repeatable, one key per tenant; default: "
                                      "$LOCKGATE_API_KEY, one entry per line)", nargs="+", action="extend")
    api_key_file: str | None = option(None, "more API keys, one NAME=KEY (or KEY) per line, '#' comments")
    max_queued_per_tenant: int | None = option(None, "requests of one tenant waiting for their first token beyond "
                                               "which that tenant's new ones get 429 (others are not affected)")
    default_max_tokens: int = option(2048, "max_tokens of a chat request that gives none (capped by the context): "
                                   "an unbounded request makes peak admission reserve the whole context")
    max_queued_requests: int = option(1024, "requests waiting for their first token beyond which new ones get 429")
    watchdog_timeout: float = option(300.0, "seconds a single engine step may take before the scheduler "
                                   "logs its batch and exits (the server then exits)")
    decode_log_interval: int = option(40, "log a decode summary every N decode steps")
    skip_server_warmup: bool = option(False, "report ready without the warm-up prefill and decode steps "
                                      "(SGLang's flag): /health turns 200 a few seconds sooner, and the "
                                      "first long prompt pays the memory faults the warm-up would have taken")
    max_request_bytes: str | None = option(None, "largest request body accepted (413 beyond it), e.g. 8MiB "
                                           "(default: 4 MiB or 128 bytes per context token, the larger)")
    heartbeat_timeout: float = option(30.0, "seconds without a heartbeat from the scheduler or detokenizer "
                                      "(frozen, stopped) after which /health answers 503, in-flight requests "
                                      "fail and the server exits for its supervisor to restart it")
    shutdown_timeout: float = option(10.0, "seconds in-flight requests get to finish on SIGINT/SIGTERM")
    dp: int = option(1, "data parallel: N engine replicas on the N ports after --port, behind a gateway on "
                     "--port (routing flags below)")
    grammar_compile_timeout: float = option(10.0, "seconds a request's JSON schema, regex or grammar may take to "
                                            "compile before the request is refused (400); compiles run in the "
                                            "grammar sandbox's worker processes, so nothing else waits for them")
    grammar_workers: int = option(2, "worker processes that compile requests' JSON schemas, regexes and grammars "
                                  "(~100 MB each; one starts with the server, more when compiles wait)")
    grammar_queue_size: int = option(64, "constraints that may wait for a grammar worker; one more is a 429")
    grammar_memory: str = option("2GiB", "memory one grammar compile may take in its worker (beyond it the "
                                 "request is refused)")
    http_header_timeout: float = option(10.0, "seconds a client has to send a request's headers, from connecting "
                                        "or from its previous response; a slower connection is closed")
    http_keep_alive_timeout: float = option(5.0, "seconds an idle keep-alive connection stays open")
    http_body_timeout: float = option(60.0, "seconds a client has to send a request's body once its headers "
                                      "arrived; a slower connection is closed")
    http_max_connections: int = option(0, "connections (or requests) served at once; more get a 503 at once "
                                       "(0: half the open-file limit, which is raised to its hard limit)")
    allow_runtime_lora_updating: bool = option(False, "let clients load and unload LoRA adapters at run time "
                                               "(POST /v1/load_lora_adapter, /v1/unload_lora_adapter) without "
                                               "--api-key; with a key they may (vLLM's "
                                               "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True is honoured too)")
    lora_root: tuple[str, ...] = option((), "directories run-time LoRA loads may read from (a lora_path elsewhere "
                                        "is refused with the same 400 whether it exists or not); default: any "
                                        "directory the server can read", nargs="+")
    ray: bool = option(False, "place the engine replicas on a Ray cluster (pip install 'lockgate[ray]'): "
                       "--replicas of them as Ray actors, behind a gateway on --host/--port that finds them through Ray")
    ray_address: str | None = option(None, "with --ray: the cluster to join (host:port of its head, or 'auto'); "
                                     "default: start a local one")
    replicas: int = option(1, "with --ray: how many engine replicas (changed at run time by POST /admin/replicas)")
    replica_cpus: float = option(1.0, "with --ray: CPUs each replica reserves on its node (and its torch threads, "
                                 "rounded up)")
    listen_fd: int | None = option(None, "serve on this inherited listening socket's file descriptor instead of "
                                   "binding --host/--port (how serve --dp hands each replica the port it reserved)")

    def __post_init__(self) -> None:
        names = self.served_model_name
        object.__setattr__(self, "served_model_name", (names,) if isinstance(names, str) else tuple(names or ()))
        if not all(isinstance(n, str) and n for n in self.served_model_name):
            raise ValueError(f"--served-model-name takes non-empty names, got {list(self.served_model_name)!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r} is not available: the supported parsers "
                             f"are {', '.join(TOOL_CALL_PARSERS)}")
        object.__setattr__(self, "lora_root", tuple(self.lora_root or ()))
        object.__setattr__(self, "api_key", tuple(self.api_key or ()))
        if self.max_queued_per_tenant is not None and self.max_queued_per_tenant < 1:
            raise ValueError(f"--max-queued-per-tenant must be >= 1, got {self.max_queued_per_tenant}")
        for root in self.lora_root:
            if not os.path.isdir(root):
                raise ValueError(f"--lora-root {root}: not a directory")
        if not (math.isfinite(self.grammar_compile_timeout) and self.grammar_compile_timeout > 0):
            raise ValueError(f"--grammar-compile-timeout must be > 0 seconds, got {self.grammar_compile_timeout}")
        for flag, v in (("--http-header-timeout", self.http_header_timeout),
                        ("--http-keep-alive-timeout", self.http_keep_alive_timeout),
                        ("--http-body-timeout", self.http_body_timeout)):
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{flag} must be > 0 seconds, got {v}")
        if self.http_max_connections < 0:
            raise ValueError(f"--http-max-connections must be >= 0, got {self.http_max_connections}")
        if self.grammar_workers < 1:
            raise ValueError(f"--grammar-workers must be >= 1, got {self.grammar_workers}")
        if self.grammar_queue_size < 1:
            raise ValueError(f"--grammar-queue-size must be >= 1, got {self.grammar_queue_size}")
        try:
            if parse_size(self.grammar_memory) < 64 * 1024**2:
                raise ValueError("at least 64MiB")
        except ValueError as e:
            raise ValueError(f"--grammar-memory: {e}, got {self.grammar_memory!r}") from None
        if self.listen_fd is not None and self.listen_fd < 0:
            raise ValueError(f"--listen-fd must be a file descriptor >= 0, got {self.listen_fd}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.default_max_tokens < 1:
            raise ValueError(f"--default-max-tokens must be >= 1, got {self.default_max_tokens}")
        if self.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests must be >= 1, got {self.max_queued_requests}")
        if self.watchdog_timeout <= 0:
            raise ValueError(f"--watchdog-timeout must be > 0 seconds, got {self.watchdog_timeout}")
        if self.decode_log_interval < 1:
            raise ValueError(f"--decode-log-interval must be >= 1, got {self.decode_log_interval}")
        if self.dp < 1:
            raise ValueError(f"--dp must be >= 1, got {self.dp}")
        if self.replicas < 0:
            raise ValueError(f"--replicas must be >= 0, got {self.replicas}")
        if not (math.isfinite(self.replica_cpus) and self.replica_cpus > 0):
            raise ValueError(f"--replica-cpus must be > 0, got {self.replica_cpus}")
        if self.ray and self.dp > 1:
            raise ValueError("--ray and --dp are two ways to run replicas: give one (--ray uses --replicas)")
        if self.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        if not (math.isfinite(self.heartbeat_timeout) and self.heartbeat_timeout >= 2 * HEARTBEAT_SECONDS):
            raise ValueError(f"--heartbeat-timeout must be >= {2 * HEARTBEAT_SECONDS:g} seconds (two heartbeats), "
                             f"got {self.heartbeat_timeout}")
        if self.max_request_bytes is not None:
            try:
                size = parse_size(self.max_request_bytes)
            except ValueError as e:
                raise ValueError(f"--max-request-bytes: {e}") from None
            if size < 1024:
                raise ValueError(f"--max-request-bytes must be at least 1KiB, got {self.max_request_bytes}")

    def model_name(self, model: str) -> str:
        """The name answers report: the first --served-model-name, else the --model value."""
        return self.served_model_name[0] if self.served_model_name else model

    def request_bytes_limit(self, max_model_len: int | None) -> int:
        """The body limit in bytes: the flag's, else 4 MiB or 128 bytes per context token, the larger."""
        if self.max_request_bytes is not None:
            return parse_size(self.max_request_bytes)
        return max(4 * 1024**2, 128 * (max_model_len or 0))


def parse_json_list(text: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """vLLM's list flags (``--allowed-origins '["https://a.example"]'``): a JSON list of strings, or one
    bare value (``--allowed-origins '*'``) -> a tuple of strings."""
    if isinstance(text, list | tuple):
        items: Any = list(text)
    else:
        t = str(text).strip()
        if not t.startswith("["):
            items = [t]
        else:
            import json

            try:
                items = json.loads(t)
            except json.JSONDecodeError as e:
                raise ValueError(f"not a JSON list: {t!r} ({e.msg})") from None
    if not isinstance(items, list) or not all(isinstance(x, str) and x.strip() for x in items):
        raise ValueError(f"expected a JSON list of non-empty strings (e.g. '[\"https://app.example\"]'), got {text!r}")
    return tuple(x.strip() for x in items)


@dataclass(frozen=True)
class CorsConfig:
    """Cross-origin access (CORS) of the server or gateway, with vLLM's flags. Unlike vLLM, whose
    default lets every origin in, none is given by default: no CORS header is sent, so a web page
    from elsewhere cannot read this server's answers through a visitor's browser (the page at ``/``
    is same-origin and needs none). ``--allowed-origins '["*"]'`` is vLLM's default."""

    allowed_origins: tuple[str, ...] = option((), "origins whose web pages may call this server from a browser "
                                              "(CORS), as a JSON list ('[\"https://app.example\"]', '[\"*\"]' "
                                              "for any) or one origin; default: none, no CORS headers (vLLM's "
                                              "default is '[\"*\"]')", parse=parse_json_list)
    allowed_methods: tuple[str, ...] = option(("*",), "with --allowed-origins: the methods allowed (JSON list; "
                                              'default: ["*"])',
                                              parse=parse_json_list)
    allowed_headers: tuple[str, ...] = option(("*",), "with --allowed-origins: the request headers allowed "
                                              '(JSON list; default: ["*"])', parse=parse_json_list)
    allow_credentials: bool = option(False, "with --allowed-origins: let browsers send cookies and "
                                     "Authorization headers they hold")

    def __post_init__(self) -> None:
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            try:
                object.__setattr__(self, name, parse_json_list(getattr(self, name)))
            except ValueError as e:
                raise ValueError(f"--{name.replace('_', '-')}: {e}") from None
        for origin in self.allowed_origins:
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                raise ValueError(f"--allowed-origins: {origin!r} is not an origin (scheme://host[:port], no path, "
                                 "e.g. https://app.example:8443) nor '*'")

    def middleware_options(self) -> dict[str, Any] | None:
        """Keyword arguments of Starlette's ``CORSMiddleware``; None when no origin is allowed."""
        if not self.allowed_origins:
            return None
        return {"allow_origins": list(self.allowed_origins), "allow_methods": list(self.allowed_methods),
                "allow_headers": list(self.allowed_headers), "allow_credentials": self.allow_credentials}


@dataclass(frozen=True)
class CorsFlags:
    """Flag container for ``add_config_args(parser, CorsFlags)`` (serve and gateway)."""

    cors: CorsConfig = field(default_factory=CorsConfig)


def cors_from_args(ns: argparse.Namespace) -> CorsConfig:
    return CorsConfig(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(CorsConfig)})


@dataclass(frozen=True)
class ServerFlags:
    """Flag container for ``add_config_args(parser, ServerFlags)``."""

    server: ServerConfig = field(default_factory=ServerConfig)


def server_config_from_args(ns: argparse.Namespace) -> ServerConfig:
    return ServerConfig(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerConfig)})
