"""LoRA adapter routes (vLLM's): POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Owns only the HTTP side: the body is checked here, the scheduler process loads or unloads the
adapter between two steps (``EngineClient.change_adapter``; the files are read and checked there)
and answers; the API's list of adapters (``/v1/models``, the ``model`` field's meaning) follows
that answer. A bad adapter is a 400 saying what is wrong, an unknown name on unload a 404, and
neither disturbs the requests in flight. Success answers 200 with vLLM's plain-text line.

The name must not be the served model's own name (a request naming it would be ambiguous).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

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


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    body = await parse_body(request, LoadLoraAdapterRequest)
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
    body = await parse_body(request, UnloadLoraAdapterRequest)
    name = body.lora_name.strip()
    if name not in ctx.client.adapters:
        raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name")
    await _change(ctx, UnloadAdapter("", name))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
