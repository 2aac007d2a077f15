"""The OpenAI-compatible HTTP API as a plain ASGI app (served by ``http_server``).

``OpenAIApp`` answers the ``lifespan`` scope (for ASGI servers that send
it), checks the API key, routes by method and path to the handlers in
``openai_handlers`` (and to the chat page of ``web_ui``: public, like
``/health``), and turns what they raise into OpenAI's error body:

====================================  ======  ===========================
raised                                status  ``code``
====================================  ======  ===========================
malformed JSON / not an object        400     ``invalid_json``
ValidationError (``param`` = field)   400     ``invalid_value``
unknown route / unknown model         404     ``not_found`` / ``model_not_found``
wrong method                          405     ``method_not_allowed``
body over ``max_body_bytes``          413     ``body_too_large``
missing or wrong API key              401     ``invalid_api_key``
  (``Authorization: Bearer KEY`` or Anthropic's ``x-api-key: KEY``)
draining / engine dead                503     ``shutting_down`` / ``engine_dead``
anything else                         500     ``internal_error``
====================================  ======  ===========================

A response that ends before the request body was read (an error, or a GET
with a body) says ``Connection: close`` and holds its last byte back while
``Request.linger`` drops the rest of the body (up to ``LINGER_FACTOR`` x
``max_body_bytes``), so that a client still sending gets the answer rather
than a connection reset.

Imports trio; never torch.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING

from ..protocol.errors import (
    EngineBusyError,
    EngineDeadError,
    EngineGenerateError,
    ValidationError,
)
from . import lora_routes
from . import openai_handlers as handlers
from .api_docs import DOCS_ROUTES
from .asgi import (
    ClientDisconnected,
    HTTPError,
    Message,
    Receive,
    Request,
    Scope,
    Send,
    api_key_ok,
    send_body,
    send_error,
)
from .cors import is_preflight
from .embedding_handler import create_embeddings
from .serving_chat import create_chat_completion
from .serving_completion import create_completion
from .serving_messages import count_tokens, create_message
from .serving_render import render_chat_completion, render_completion
from .serving_responses import RESPONSE_ROUTES, create_response
from .state import Handler, ServingState, Unavailable

if TYPE_CHECKING:
    from .web_ui import WebUI

logger = logging.getLogger("legato.server")

ROUTES: dict[str, dict[str, Handler]] = {
    "/v1/completions": {"POST": create_completion},
    "/v1/chat/completions": {"POST": create_chat_completion},
    "/v1/completions/render": {"POST": render_completion},
    "/v1/chat/completions/render": {"POST": render_chat_completion},
    "/v1/responses": {"POST": create_response},
    "/v1/messages": {"POST": create_message},
    "/v1/messages/count_tokens": {"POST": count_tokens},
    "/v1/models": {"GET": handlers.list_models},
    "/v1/embeddings": {"POST": create_embeddings},
    "/v1/load_lora_adapter": {"POST": lora_routes.load_lora_adapter},
    "/v1/unload_lora_adapter": {"POST": lora_routes.unload_lora_adapter},
    "/health": {"GET": handlers.health},
    "/metrics": {"GET": handlers.metrics},
    "/version": {"GET": handlers.version},
    "/tokenize": {"POST": handlers.tokenize},
    "/detokenize": {"POST": handlers.detokenize},
    **{path: {"GET": handler} for path, handler in DOCS_ROUTES.items()},
}

PATTERN_ROUTES = RESPONSE_ROUTES
"""Routes with an id in the path: (path pattern, method -> handler), tried after ``ROUTES``."""

ANTHROPIC_PREFIX = "/v1/messages"
"""Paths under it answer errors in Anthropic's shape (``{"type": "error", "error": ...}``)."""

OPEN_PATHS = frozenset({"/health"})
"""Paths served without the API key (the API description needs it too, as documented)."""

LINGER_FACTOR = 4
"""An unread body up to this many times ``max_body_bytes`` is read and dropped before the
response ends; a longer one is cut off (the client may then see a reset)."""


MAX_REQUEST_ID_CHARS = 256


def request_id_header(request: Request) -> list[tuple[bytes, bytes]]:
    """``X-Request-Id`` echoed back (a printable ASCII value of at most 256 characters);
    a fresh one when the client sent none or an unusable one."""
    given = request.header("x-request-id")
    if (
        given is None
        or not 0 < len(given) <= MAX_REQUEST_ID_CHARS
        or not all(33 <= ord(c) < 127 for c in given)
    ):
        given = uuid.uuid4().hex
    return [(b"x-request-id", given.encode("ascii"))]


class OpenAIApp:
    """The ASGI application over one ``ServingState``, with the chat page unless ``web_ui`` is None."""

    def __init__(self, state: ServingState, web_ui: WebUI | None = None) -> None:
        self.state = state
        self.web_ui = web_ui

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] == "websocket":  # the WebSocket endpoint has a port of its own
            try:
                await send({"type": "websocket.close", "code": 1008})
            except Exception:  # noqa: BLE001 - a server's state after junk bytes
                logger.debug("refusing a WebSocket upgrade on the HTTP port failed", exc_info=True)
            return
        if scope["type"] != "http":
            raise RuntimeError(f"unsupported ASGI scope type {scope['type']!r}")
        await self._http(
            Request(scope, receive, send, body_timeout=self.state.settings.body_timeout)
        )

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, request: Request) -> None:
        started = False
        send = request.send
        linger_bytes = LINGER_FACTOR * self.state.settings.max_body_bytes
        cors = self.state.settings.cors
        origin = request.header("origin")
        # Every response carries the CORS headers its Origin earns, and the X-Request-Id.
        extra_headers = [*cors.response_headers(origin), *request_id_header(request)]

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [*message.get("headers", ()), *extra_headers]
                if not request.body_done:  # answered unread: the connection will not be reused
                    headers.append((b"connection", b"close"))
                message = {**message, "headers": headers}
            last = message["type"] == "http.response.body" and not message.get("more_body")
            if last and not request.body_done:
                await send({**message, "more_body": True})
                await request.linger(linger_bytes)
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        request.send = tracked_send
        try:
            if not self.state.site_guard.host_allowed(request.header("host")):
                raise HTTPError(
                    403,
                    "this server does not answer to that Host (see --allowed-hosts)",
                    code="host_not_allowed",
                )
            preflight = request.header("access-control-request-method")
            if origin is not None and is_preflight(request.method, origin, preflight):
                assert preflight is not None
                status, headers, text = cors.preflight(
                    origin, preflight, request.header("access-control-request-headers")
                )
                extra_headers[:] = [h for h in extra_headers if h[0] == b"x-request-id"]
                await send_body(request.send, status, text.encode(), "text/plain", headers)
                return
            handler = self._route(request)
            await handler(request, self.state)
            return
        except ClientDisconnected:
            return
        except HTTPError as exc:
            error = exc
        except ValidationError as exc:
            error = HTTPError(400, str(exc), param=exc.field, code="invalid_value")
        except Unavailable as exc:
            error = HTTPError(exc.status, exc.message, code=exc.code)
        except EngineDeadError as exc:
            error = HTTPError(503, f"the engine is dead: {exc}", code="engine_dead")
        except EngineBusyError as exc:  # the engine's own admission bound: retry later
            error = HTTPError(503, str(exc), code="server_busy")
        except EngineGenerateError as exc:
            error = HTTPError(500, str(exc), code="internal_error")
        except Exception as exc:
            logger.exception("unhandled error in %s %s", request.method, request.path)
            error = HTTPError(500, f"internal error: {type(exc).__name__}", code="internal_error")
        if started:  # too late for an error response: the connection just ends
            logger.warning(
                "%s %s failed after its response started: %s", request.method, request.path, error
            )
            return
        await send_error(request.send, error, anthropic=request.path.startswith(ANTHROPIC_PREFIX))

    def _route(self, request: Request) -> Handler:
        settings = self.state.settings
        methods = ROUTES.get(request.path)
        for pattern, by_method in PATTERN_ROUTES:
            if methods is None and pattern.match(request.path):
                methods = by_method
        public = request.path in OPEN_PATHS
        if methods is None and self.web_ui is not None:
            methods = self.web_ui.routes.get(request.path)
            public = methods is not None  # the page asks for the key itself
        if settings.api_key is not None and not public:
            key = settings.api_key
            if not api_key_ok(request.header("authorization"), request.header("x-api-key"), key):
                raise HTTPError(401, "invalid or missing API key", code="invalid_api_key")
        if methods is None:
            raise HTTPError(404, f"no route for {request.path}", code="not_found")
        handler = methods.get(request.method)
        if handler is None:
            allowed = ", ".join(sorted(methods))
            raise HTTPError(
                405,
                f"{request.method} is not allowed here (use {allowed})",
                code="method_not_allowed",
            )
        return handler
