"""The HTTP API's own description: ``GET /openapi.json`` and the ``/docs`` page (Swagger UI,
served offline from the package's files; see :mod:`legato.server.openapi`).

Both are public (no API key), as the chat page and ``/health`` are. The document is built
once per process from the same pydantic models that validate requests.

Imports trio (through the handlers' helpers); never torch.
"""

from __future__ import annotations

import functools
from typing import Any

from .. import __version__
from . import openai_protocol as protocol
from .asgi import HTTPError, Request, send_body, send_json
from .messages_protocol import MessagesRequest
from .openapi import DOCS_ASSETS, Operation, docs_asset, docs_html, openapi_document
from .responses_protocol import ResponsesRequest
from .state import ServingState
from .utility_protocol import DetokenizeRequest, EmbeddingRequest, TokenizeRequest

OPERATIONS = (
    Operation(
        "/v1/chat/completions",
        "post",
        "Chat completion (tools, response_format, structured outputs; stream with SSE)",
        protocol.ChatCompletionRequest,
        protocol.ChatCompletionResponse,
        protocol.ChatCompletionChunk,
    ),
    Operation(
        "/v1/completions",
        "post",
        "Text completion (structured outputs; stream with SSE)",
        protocol.CompletionRequest,
        protocol.CompletionResponse,
    ),
    Operation(
        "/v1/responses",
        "post",
        "OpenAI's Responses API (tools, text.format; stream with named SSE events)",
        ResponsesRequest,
    ),
    Operation(
        "/v1/messages",
        "post",
        "Anthropic's Messages API (tools, output_config; stream with named SSE events)",
        MessagesRequest,
    ),
    Operation(
        "/v1/messages/count_tokens",
        "post",
        "The prompt tokens of a Messages API request",
        MessagesRequest,
    ),
    Operation(
        "/v1/chat/completions/render",
        "post",
        "A chat completions body rendered and checked, not generated: [conversation, prompts]",
        protocol.ChatCompletionRequest,
    ),
    Operation(
        "/v1/completions/render",
        "post",
        "A completions body's prompts as token ids, not generated",
        protocol.CompletionRequest,
    ),
    Operation("/v1/embeddings", "post", "Embeddings", EmbeddingRequest),
    Operation("/tokenize", "post", "A prompt or a chat as token ids", TokenizeRequest),
    Operation("/detokenize", "post", "Token ids as text", DetokenizeRequest),
    Operation("/v1/models", "get", "The served model", response=protocol.ModelList),
    Operation("/health", "get", "200 while serving", open=True),
    Operation("/metrics", "get", "Prometheus metrics", response_type="text/plain"),
    Operation("/version", "get", "The server's version"),
)

DOCS_PATH = "/docs"


@functools.cache
def _document() -> dict[str, Any]:
    return openapi_document(
        OPERATIONS,
        title="legato",
        version=__version__,
        description="An OpenAI-compatible API (vLLM's extras included) over a legato engine.",
    )


async def openapi_json(request: Request, state: ServingState) -> None:
    """``GET /openapi.json``."""
    await send_json(request.send, 200, _document())


DOCS_HEADERS = [
    (b"content-security-policy", b"frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]
"""The page may not be framed (clickjacking); Swagger UI's own scripts stay allowed."""


async def docs_page(request: Request, state: ServingState) -> None:
    """``GET /docs``: Swagger UI over ``/openapi.json``."""
    page = docs_html("/openapi.json", DOCS_PATH, "legato")
    await send_body(request.send, 200, page.encode(), "text/html; charset=utf-8", DOCS_HEADERS)


async def docs_file(request: Request, state: ServingState) -> None:
    """``GET /docs/<one of DOCS_ASSETS>``."""
    found = docs_asset(request.path.removeprefix(DOCS_PATH + "/"))
    if found is None:
        raise HTTPError(404, f"no route for {request.path}", code="not_found")
    data, content_type = found
    await send_body(request.send, 200, data, content_type)


DOCS_ROUTES = {
    "/openapi.json": openapi_json,
    DOCS_PATH: docs_page,
    **{f"{DOCS_PATH}/{name}": docs_file for name in DOCS_ASSETS},
}
"""Path -> GET handler (behind ``--api-key`` like every route but ``/health``)."""
