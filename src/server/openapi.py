"""``/openapi.json`` from the pydantic models, and ``/docs`` served offline.

:func:`openapi_document` builds an OpenAPI 3.1 document from a list of
:class:`Operation` (path, method, request and response models); the schemas
are pydantic's own, so the document and the validation can never disagree.

``/docs`` is Swagger UI, served from the ``swagger-ui-bundle-v2`` wheel's
files (:func:`docs_asset`): no CDN, nothing fetched from outside, so it
works on an air-gapped machine. Only the few files the page needs are
served, by exact name (no paths from the client reach the file system).

Never imports trio or torch.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from .openai_protocol import ErrorResponse


@dataclass(frozen=True)
class Operation:
    """One documented endpoint."""

    path: str
    method: Literal["get", "post"]
    summary: str
    request: type[BaseModel] | None = None
    response: type[BaseModel] | None = None
    stream_chunk: type[BaseModel] | None = None  # SSE events when the request says stream
    response_type: str = "application/json"  # for responses without a model (metrics: text)
    open: bool = False  # served without the API key


def openapi_document(
    operations: Sequence[Operation], *, title: str, version: str, description: str = ""
) -> dict[str, Any]:
    """The OpenAPI 3.1 document for ``operations``."""
    models: list[tuple[type[BaseModel], Literal["validation", "serialization"]]] = [
        (ErrorResponse, "serialization")
    ]
    for op in operations:
        if op.request is not None:
            models.append((op.request, "validation"))
        for model in (op.response, op.stream_chunk):
            if model is not None:
                models.append((model, "serialization"))
    refs, defs = models_json_schema(
        list(dict.fromkeys(models)), ref_template="#/components/schemas/{model}"
    )
    error = {
        "description": "an OpenAI error body",
        "content": {"application/json": {"schema": refs[(ErrorResponse, "serialization")]}},
    }
    paths: dict[str, Any] = {}
    for op in operations:
        entry: dict[str, Any] = {"summary": op.summary, "operationId": _operation_id(op)}
        if op.request is not None:
            entry["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": refs[(op.request, "validation")]}},
            }
        content: dict[str, Any] = {}
        if op.response is not None:
            content["application/json"] = {"schema": refs[(op.response, "serialization")]}
        else:
            content[op.response_type] = {"schema": {"type": "string"}}
        if op.stream_chunk is not None:
            content["text/event-stream"] = {
                "schema": {"type": "string"},
                "description": "with stream=true: `data: <chunk>` events, then `data: [DONE]`",
                "x-chunk-schema": refs[(op.stream_chunk, "serialization")],
            }
        entry["responses"] = {"200": {"description": "OK", "content": content}}
        if op.request is not None:
            entry["responses"]["400"] = error
        if not op.open:
            entry["responses"]["401"] = error
            entry["security"] = [{"bearer": []}]
        paths.setdefault(op.path, {})[op.method] = entry
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version, "description": description},
        "paths": paths,
        "components": {
            "schemas": defs.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def _operation_id(op: Operation) -> str:
    name = op.path.strip("/").replace("/", "_").replace("-", "_") or "root"
    return f"{op.method}_{name}"


# ------------------------------------------------------------------ /docs


DOCS_ASSETS = {
    "swagger-ui.css": "text/css; charset=utf-8",
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui-standalone-preset.js": "text/javascript; charset=utf-8",
    "favicon-32x32.png": "image/png",
    "favicon-16x16.png": "image/png",
}
"""The files ``/docs/<name>`` serves, and their content types."""


def docs_asset(name: str) -> tuple[bytes, str] | None:
    """The bytes and content type of one Swagger UI file, or None if it is not one we serve."""
    content_type = DOCS_ASSETS.get(name)
    if content_type is None:
        return None
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        return None
    try:
        data = (swagger_ui_path / name).read_bytes()
    except OSError:
        return None
    return data, content_type


def docs_html(openapi_url: str, assets_url: str, title: str) -> str:
    """The ``/docs`` page: Swagger UI over ``openapi_url``, its files under ``assets_url``.

    Without the Swagger UI files (the wheel is missing) the page still lists
    the endpoints, from the document itself.
    """
    if docs_asset("swagger-ui-bundle.js") is None:
        return _plain_docs_html(openapi_url, title)
    t, spec, assets = html.escape(title), html.escape(openapi_url), html.escape(assets_url)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{t} - API docs</title>
<link rel="stylesheet" href="{assets}/swagger-ui.css">
<link rel="icon" type="image/png" href="{assets}/favicon-32x32.png" sizes="32x32">
</head>
<body>
<div id="swagger-ui"></div>
<script src="{assets}/swagger-ui-bundle.js"></script>
<script>
window.ui = SwaggerUIBundle({{
  url: "{spec}",
  dom_id: "#swagger-ui",
  deepLinking: true,
  validatorUrl: null,
  presets: [SwaggerUIBundle.presets.apis],
  layout: "BaseLayout"
}});
</script>
</body>
</html>
"""


def _plain_docs_html(openapi_url: str, title: str) -> str:
    t, spec = html.escape(title), html.escape(openapi_url)
    return f"""<!DOCTYPE html>
<html lang="en">
<head><meta charset="utf-8"><title>{t} - API docs</title></head>
<body>
<h1>{t}</h1>
<p>The OpenAPI document: <a href="{spec}">{spec}</a></p>
<ul id="ops"></ul>
<script>
fetch("{spec}").then(r => r.json()).then(doc => {{
  const ul = document.getElementById("ops");
  for (const [path, ops] of Object.entries(doc.paths)) {{
    for (const [method, op] of Object.entries(ops)) {{
      const li = document.createElement("li");
      li.textContent = method.toUpperCase() + " " + path + " - " + op.summary;
      ul.appendChild(li);
    }}
  }}
}});
</script>
</body>
</html>
"""
