"""The pages a person opens in a browser: the chat page at ``/`` and the API reference at ``/docs``.

Owns the GET routes of ``/`` (``static/chat.html``: one self-contained file, HTML + inline CSS and JS,
that streams ``/v1/chat/completions`` and shows the model and tokens/s; ``POST /`` stays TGI's
generate route), ``/docs`` (Swagger UI over ``/openapi.json``) and the Swagger UI files it loads.

Invariants: nothing here loads from another host, so both pages work offline and on a network that
blocks CDNs. Swagger UI's JS and CSS are the copies the ``fastapi-offline`` package ships (a
dependency; Swagger UI 5, which renders the OpenAPI 3.1 document FastAPI writes) and are served from
``/docs/...``; its validator badge (which calls an outside service) is off. The pages hold no data, so
they are readable without the API key (``httpguard.PAGES``); what they call is not.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from pathlib import Path

from fastapi import APIRouter
from fastapi.openapi.docs import get_swagger_ui_html
from starlette.responses import FileResponse, HTMLResponse, Response

from lockgate.httpguard import PAGES

CHAT_PAGE = "static/chat.html"
# /docs/<name> -> (the file in fastapi-offline's static directory, its media type)
DOCS_ASSETS = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css", "favicon.png": "image/png"}

router = APIRouter()


@cache
def _chat_html() -> str:
    return resources.files("lockgate.server").joinpath(CHAT_PAGE).read_text(encoding="utf-8")


def _docs_dir() -> Path:
    return Path(str(resources.files("fastapi_offline").joinpath("static")))


@router.get("/", include_in_schema=False)
async def chat_page() -> Response:
    return HTMLResponse(_chat_html(), headers={"Cache-Control": "no-cache"})


@router.get("/docs", include_in_schema=False)
async def docs_page() -> Response:
    return get_swagger_ui_html(openapi_url="/openapi.json", title="lockgate API",
                               swagger_js_url="/docs/swagger-ui-bundle.js", swagger_css_url="/docs/swagger-ui.css",
                               swagger_favicon_url="/docs/favicon.png",
                               swagger_ui_parameters={"validatorUrl": None, "defaultModelsExpandDepth": 0})


def _asset_route(name: str, media_type: str) -> None:
    async def asset() -> Response:
        return FileResponse(_docs_dir() / name, media_type=media_type,
                            headers={"Cache-Control": "public, max-age=86400"})

    router.add_api_route(f"/docs/{name}", asset, methods=["GET"], include_in_schema=False, name=f"docs_{name}")


for _name, _type in DOCS_ASSETS.items():
    _asset_route(_name, _type)
assert {"/", "/docs", "/openapi.json", *(f"/docs/{n}" for n in DOCS_ASSETS)} == set(PAGES)  # httpguard's list
