"""LoRA adapter routes (vLLM's): POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Owns only the HTTP side: who may change adapters, which paths they may name, and the body. The
scheduler process reads and checks the files on a side thread while steps go on
(``EngineClient.change_adapter``, ``EngineCore.read_adapter_aside``) and answers; the API's list of
adapters (``/v1/models``, the ``model`` field's meaning) follows that answer. A bad adapter is a
400 saying what is wrong, an unknown name on unload a 404, and neither disturbs the requests in
flight. Success answers 200 with vLLM's plain-text line.

Rules (a client names a directory on the server's machine, so these routes are guarded):

* run-time changes are off (403 naming the flags) unless ``--api-key`` is set (only key holders
  reach the route) or ``--allow-runtime-lora-updating`` / vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``;
* with ``--lora-root``, ``lora_path`` must resolve (symlinks followed) inside one of the roots; any
  other path gets the same 400 whether it exists or not, so the route tells nothing of the disk;
* the name must not be the served model's own (a request naming it would be ambiguous); names and
  paths carry no control characters (the body's schema).

An unload takes the name away at once (new requests naming it get a 404); requests already sent
keep the adapter until they end.
"""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from lockgate.checkpoint.peft import inside
from lockgate.ipc.messages import LoadAdapter, UnloadAdapter
from lockgate.server.context import APIError, ServerContext, parse_body
from lockgate.server.frontend import EngineUnavailable
from lockgate.server.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest

router = APIRouter()
ADAPTER_CHANGE_TIMEOUT = 120.0  # seconds the scheduler may take to read and check an adapter


async def _change(ctx: ServerContext, msg: LoadAdapter | UnloadAdapter) -> None:
    try:
        reply = await ctx.client.change_adapter(msg, ADAPTER_CHANGE_TIMEOUT)
    except EngineUnavailable as e:
        raise APIError(503, str(e)) from None
    if reply.error is not None:
        raise APIError(reply.status, reply.error, param="lora_path" if reply.status == 400 else "lora_name")


VLLM_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def check_allowed(ctx: ServerContext) -> None:
    """403 unless run-time adapter changes are on (see the module docstring)."""
    env = os.environ.get(VLLM_ENV, "").strip().lower() in ("1", "true", "yes")
    if ctx.api_key is None and not ctx.cfg.allow_runtime_lora_updating and not env:
        raise APIError(403, "loading and unloading LoRA adapters at run time is off on this server: start it with "
                            "--api-key (only key holders may then) or --allow-runtime-lora-updating "
                            f"({VLLM_ENV}=True); adapters can also be given at start with --lora-modules")


def check_path(ctx: ServerContext, path: str) -> None:
    roots = ctx.cfg.lora_root
    if roots and not any(inside(Path(path).expanduser(), Path(r)) for r in roots):
        raise APIError(400, f"lora_path must be an adapter directory inside --lora-root ({', '.join(roots)})",
                       param="lora_path")


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    check_allowed(ctx)
    body = await parse_body(request, LoadLoraAdapterRequest)
    check_path(ctx, body.lora_path)
    name = body.lora_name.strip()
    if name in (ctx.model_name, ctx.client.model_spec):
        raise APIError(400, f"the adapter name {name!r} is the served model's own name; choose another",
                       param="lora_name")
    if name in ctx.client.adapters and not body.load_inplace:
        raise APIError(400, f"The lora adapter '{name}' has already been loaded (load_inplace replaces it)",
                       param="lora_name")
    await _change(ctx, LoadAdapter("", name, body.lora_path, replace=body.load_inplace))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    check_allowed(ctx)
    body = await parse_body(request, UnloadLoraAdapterRequest)
    name = body.lora_name.strip()
    if name not in ctx.client.adapters:
        raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name")
    await _change(ctx, UnloadAdapter("", name))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
