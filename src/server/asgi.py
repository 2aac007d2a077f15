"""Plain-ASGI helpers for the HTTP front end: requests, bounded bodies, JSON, SSE, errors.

No framework: a handler gets a ``Request`` (scope, receive, send) and answers
through ``send_json`` / ``send_error`` / ``SSEResponse``. Errors a handler
raises as ``HTTPError`` become OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``.

Three ASGI traps are handled here: the body is read with a byte limit while
it arrives (never buffered unbounded); ``watch_disconnect`` turns a client's
``http.disconnect`` into a cancelled scope (``send`` after a disconnect
silently does nothing, so a streaming handler must watch ``receive``); and
``Request.linger`` reads and drops a body that was answered without being
read (a 413, a 404 ...), since the server closes the connection as soon as the
response ends, and closing a socket with unread input resets it: a client
still sending its body would get a reset instead of the answer.

Imports trio; never torch.
"""

from __future__ import annotations

import hmac
import json
import math
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import trio

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class HTTPError(Exception):
    """An error answer: status, message, and OpenAI's ``type`` / ``param`` / ``code``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        """OpenAI's error body."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's error body (``/v1/messages``): ``{"type": "error", "error": {"type",
        "message"}}``; the field a 400 is about leads the message."""
        message = self.message
        if self.param is not None and not message.startswith(self.param):
            message = f"{self.param}: {message}"
        kind = _ANTHROPIC_ERROR_TYPES.get(self.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}


_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class ClientDisconnected(Exception):
    """The client went away while the request body was being read."""


LINGER_SECONDS = 2.0
"""How long ``Request.linger`` waits for the rest of an unread body."""


@dataclass
class Request:
    """One HTTP request as the handlers see it."""

    scope: Scope
    receive: Receive
    send: Send
    body_done: bool = False
    """Whether the whole body has arrived (or the client left): nothing more to read."""
    body_timeout: float = 60.0
    """Seconds the whole body may take to arrive (then 408): no slow-loris after the headers."""

    def __post_init__(self) -> None:
        # Without Content-Length or Transfer-Encoding a request has no body (RFC 9112 6.3).
        if self.header("transfer-encoding") is None and not self.declared_length():
            self.body_done = True

    @property
    def method(self) -> str:
        return str(self.scope["method"])

    @property
    def path(self) -> str:
        return str(self.scope["path"])

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (case-insensitive), decoded as latin-1."""
        key = name.lower().encode("latin-1")
        for k, v in self.scope.get("headers", ()):
            if bytes(k).lower() == key:
                return bytes(v).decode("latin-1")
        return None

    async def body(self, limit: int) -> bytes:
        """Read the whole body, at most ``limit`` bytes.

        Raises ``HTTPError(413)`` as soon as the declared Content-Length or
        the bytes received so far exceed ``limit`` (the rest is never read),
        and ``ClientDisconnected`` if the client leaves first. Checkpoints.
        """
        declared = self.declared_length()
        if declared is not None and declared > limit:
            raise _too_large(limit)
        with trio.move_on_after(self.body_timeout):
            return await self._read_body(limit)
        raise HTTPError(
            408, f"the body was not sent within {self.body_timeout:g} s", code="request_timeout"
        )

    async def _read_body(self, limit: int) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.body_done = True
                raise ClientDisconnected()
            if message["type"] != "http.request":
                continue
            chunk = bytes(message.get("body", b""))
            size += len(chunk)
            if not message.get("more_body", False):
                self.body_done = True
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
            if self.body_done:
                return b"".join(chunks)

    def declared_length(self) -> int | None:
        """The Content-Length header as a number, if there is a valid one."""
        declared = self.header("content-length")
        if declared is not None and declared.strip().isdigit():
            return int(declared)
        return None

    async def linger(self, max_bytes: int) -> None:
        """Read and drop what is left of the body: at most ``max_bytes``, for at most
        ``LINGER_SECONDS``. Returns at once if the body was read (or is declared
        longer than ``max_bytes``: not worth waiting for). Checkpoints.
        """
        await trio.lowlevel.checkpoint()
        declared = self.declared_length()
        if self.body_done or (declared is not None and declared > max_bytes):
            return
        dropped = 0
        with trio.move_on_after(LINGER_SECONDS):
            while not self.body_done and dropped <= max_bytes:
                message = await self.receive()
                if message["type"] == "http.disconnect":
                    self.body_done = True
                elif message["type"] == "http.request":
                    dropped += len(message.get("body", b""))
                    self.body_done = not message.get("more_body", False)

    async def json(self, limit: int) -> dict[str, Any]:
        """The body as a JSON object. ``HTTPError(400)`` if it is not one, 413 if too large,
        415 unless sent as ``Content-Type: application/json`` (a web page can send a
        ``text/plain`` body cross-site without a CORS preflight: CSRF)."""
        media_type = (self.header("content-type") or "").split(";", 1)[0].strip().lower()
        if media_type != "application/json":
            raise HTTPError(
                415,
                "the body must be sent with Content-Type: application/json",
                code="unsupported_media_type",
            )
        raw = await self.body(limit)
        try:
            value = json.loads(raw)
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise HTTPError(
                400, f"the body is not valid JSON: {exc}", code="invalid_json"
            ) from None
        except RecursionError:
            raise HTTPError(400, "the body is nested too deeply", code="invalid_json") from None
        if has_lone_surrogate(value):
            raise HTTPError(
                400, f"the body is not valid JSON: {LONE_SURROGATE}", code="invalid_json"
            )
        if not isinstance(value, dict):
            raise HTTPError(400, "the body must be a JSON object", code="invalid_json")
        return value


LONE_SURROGATE = "a string has a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text"


def has_lone_surrogate(value: Any) -> bool:
    """Whether a decoded JSON value has a string (or key) with a lone surrogate.

    Python's ``json`` accepts ``"\\ud800"`` and gives a ``str`` that cannot be
    encoded as UTF-8: the tokenizer, and every later ``encode``, would fail on
    it. Iterative, so any depth ``json.loads`` returns is fine.
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _too_large(limit: int) -> HTTPError:
    return HTTPError(413, f"the request body exceeds {limit} bytes", code="body_too_large")


def dumps(value: Any) -> bytes:
    """Compact JSON; NaN and infinities (e.g. a -inf logprob) become large finite numbers."""
    return json.dumps(_finite(value), separators=(",", ":"), ensure_ascii=False).encode()


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        if value != value:
            return None
        return -9999.0 if value < 0 else 9999.0
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


async def send_body(
    send: Send,
    status: int,
    body: bytes,
    content_type: str,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """A complete response with ``body``."""
    headers = [
        (b"content-type", content_type.encode("latin-1")),
        (b"content-length", str(len(body)).encode()),
        *(extra_headers or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_json(send: Send, status: int, value: Any) -> None:
    """A JSON response."""
    await send_body(send, status, dumps(value), "application/json")


async def send_error(send: Send, error: HTTPError, *, anthropic: bool = False) -> None:
    """OpenAI's error body (Anthropic's with ``anthropic``) with the error's status (401 adds
    ``WWW-Authenticate``, 503 ``Retry-After``)."""
    extra = {
        401: [(b"www-authenticate", b"Bearer")],
        503: [(b"retry-after", b"1")],
    }.get(error.status)
    body = error.anthropic_body() if anthropic else error.body()
    await send_body(send, error.status, dumps(body), "application/json", extra)


def bearer_token_ok(authorization: str | None, api_key: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <api_key>`` (constant-time compare)."""
    if authorization is None:
        return False
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), api_key.encode())


def api_key_ok(authorization: str | None, x_api_key: str | None, api_key: str) -> bool:
    """Whether a request carries the key: ``Authorization: Bearer KEY`` (OpenAI's clients)
    or ``x-api-key: KEY`` (Anthropic's). Constant-time compares."""
    if bearer_token_ok(authorization, api_key):
        return True
    if x_api_key is None:
        return False
    return hmac.compare_digest(x_api_key.strip().encode(), api_key.encode())


class SSEResponse:
    """A ``text/event-stream`` response: ``data: <json>\\n\\n`` events, then ``data: [DONE]``.

    ``start`` sends the headers; ``event`` one JSON event (named ``event: NAME`` when a
    name is given, as the Responses and Messages APIs do); ``done`` the terminating
    ``[DONE]`` and the end of the body, ``end`` the end of the body without it. Not safe
    for concurrent senders: use one task per response.
    """

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.closed = False

    async def start(self) -> None:
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        await self._send({"type": "http.response.start", "status": 200, "headers": headers})
        self.started = True

    async def event(self, value: Any, name: str | None = None) -> None:
        head = b"" if name is None else b"event: " + name.encode() + b"\n"
        await self._send(
            {
                "type": "http.response.body",
                "body": head + b"data: " + dumps(value) + b"\n\n",
                "more_body": True,
            }
        )

    async def done(self) -> None:
        await self.end(b"data: [DONE]\n\n")

    async def end(self, last: bytes = b"") -> None:
        if self.closed:
            return
        self.closed = True
        await self._send({"type": "http.response.body", "body": last, "more_body": False})


async def watch_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` when the client disconnects; otherwise wait forever.

    Run it in a nursery beside the work that ``scope`` covers (after the body
    has been read) and cancel the nursery when the work is done.
    """
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return
