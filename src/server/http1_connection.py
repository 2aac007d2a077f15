"""HTTP1Connection: one HTTP/1.1 connection, parsed by h11, driving an ASGI app.

A connection serves its requests one after another (pipelined requests wait in
h11's buffer for their turn). For each one the app gets an ASGI ``http`` scope
and these ``receive`` / ``send`` callables:

- ``receive`` reads the request body from the socket as the app asks for it
  (nothing is read ahead, so a client cannot make the server buffer an unread
  body); a client waiting on ``Expect: 100-continue`` gets its ``100`` then.
  Once the body is in, ``receive`` waits for the client to hang up and then
  says ``http.disconnect`` (so does a write that fails): a streaming handler
  that watches it is cancelled.
- ``send`` takes ``http.response.start`` / ``http.response.body``; h11 frames
  the body (``Content-Length`` when the app gives one, otherwise chunked for
  HTTP/1.1 and close-delimited for HTTP/1.0). The head is held back and
  written with the first body bytes, one write for a whole small answer.
  After the client has gone, ``send`` silently does nothing.

What the connection never does: switch protocols (an ``Upgrade: h2c`` or a
WebSocket upgrade is served as the plain HTTP/1.1 request it also is, and
h11 takes the upgrade as declined; ``PRI * HTTP/2.0`` is a request for ``*``);
keep a client that has hung up once its answers are written; wait more than
``header_timeout`` seconds for a request's head (from the connection's start or
the previous answer's end: slow-header clients go); wait more than
``send_timeout`` seconds for a client to take the next piece of an answer (a
client that stops reading is closed, and the app gets ``http.disconnect``, as
for a hang-up). Bytes that are not HTTP
get a short error answer and the connection closes. ``run`` never raises for
anything a client sends or for what the app raises: the caller's other
connections are never touched.

Imports trio and h11; never torch, never the app's routes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

import h11
import trio

from .asgi import HTTPError, Message, Receive, Scope, Send, dumps

logger = logging.getLogger("legato.server")

READ_SIZE = 64 * 1024
"""Bytes asked of the socket per read."""
WRITE_PIECE = 128 * 1024
"""Bytes of an answer each of which must be taken within ``send_timeout``."""

ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class ConnectionLimits:
    """What one connection may cost: head size, the wait for a head, the wait for the
    client to read its answer."""

    header_timeout: float = 10.0
    """Seconds a client has to send a request's head (and a keep-alive connection may idle)."""
    max_header_bytes: int = 64 * 1024
    """A request head (or pipelined bytes read ahead) past this gets ``431`` and a close."""
    send_timeout: float = 60.0
    """Seconds the kernel may take to accept each ``WRITE_PIECE`` of an answer, i.e. for
    the client to read on once the socket's send buffer is full (nginx's
    ``send_timeout``, 60 s by default too: a deadline on progress, not on the whole
    answer, so a slow reader of a long stream is kept). Past it the connection is
    closed and the app gets ``http.disconnect``: a client that stops reading cannot
    hold its request (and the engine's KV blocks) for longer."""


@dataclass
class Shutdown:
    """Shared by the connections of one server: ``begin`` closes the ones waiting for a
    request (idle keep-alive connections) and makes the others close after their answer."""

    closing: bool = False
    idle: set[trio.CancelScope] = field(default_factory=set)

    def begin(self) -> None:
        self.closing = True
        for scope in self.idle:
            scope.cancel()


def error_answer(status: int, message: str, code: str, extra: bytes = b"") -> bytes:
    """A whole ``Connection: close`` answer with OpenAI's error body, written without h11
    (the connection ends after it, whatever state h11 is in)."""
    body = dumps(HTTPError(status, message, code=code).body())
    head = (
        f"HTTP/1.1 {status} {_phrase(status)}\r\n".encode()
        + extra
        + b"content-type: application/json\r\nconnection: close\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
    )
    return head + body


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}
_INTERNAL_ERROR = error_answer(500, "internal server error", "internal_error")
_DISCONNECT: Message = {"type": "http.disconnect"}


class _Date:
    """The ``Date`` header value, formatted at most once a second."""

    second = -1
    value = b""

    @classmethod
    def now(cls) -> bytes:
        second = int(time.time())
        if second != cls.second:
            cls.second, cls.value = second, formatdate(second, usegmt=True).encode()
        return cls.value


class HTTP1Connection:
    """One accepted connection. ``await run()`` serves it to its end, then closes it."""

    def __init__(
        self,
        app: ASGIApp,
        stream: trio.SocketStream,
        limits: ConnectionLimits,
        shutdown: Shutdown,
    ) -> None:
        self._app = app
        self._stream = stream
        self._limits = limits
        self._shutdown = shutdown
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
        self._addresses = _addresses(stream)
        self._eof = False  # the client has sent EOF (half-close) or reset
        self._broken = False  # a write failed: nothing more can reach the client
        self._reading = trio.Lock()  # one socket reader at a time (receive_some is not shared)
        # per request
        self._head_request = False
        self._started = False
        self._done = False
        self._end_pending = False  # the body's last bytes went out: its end is next
        self._held = b""  # the response head, written with the first body bytes

    async def run(self) -> None:
        """Serve requests until the client hangs up, an answer ends the connection, the
        head timer runs out or the server shuts down; then close. Never raises an
        ``Exception`` (cancellation passes)."""
        try:
            while not self._shutdown.closing:
                request = await self._next_request()
                if request is None:
                    break
                await self._serve(request)
                self._skip_buffered_body()
                if self._broken or self._h11.our_state is not h11.DONE:
                    break  # Connection: close, HTTP/1.0, an unread body, a failed answer
                if self._h11.their_state is not h11.DONE:
                    break
                self._h11.start_next_cycle()
        except Exception:
            logger.warning("HTTP connection closed after an error", exc_info=True)
            self._broken = True
        finally:
            await self._close()

    async def _next_request(self) -> h11.Request | None:
        """The next request's head, or None: the client closed, sent junk (answered with
        an error), or took longer than ``header_timeout``; or the server is shutting down."""
        with trio.move_on_after(self._limits.header_timeout) as idle:
            self._shutdown.idle.add(idle)
            try:
                while True:
                    try:
                        event = self._h11.next_event()
                    except h11.RemoteProtocolError as exc:
                        await self._write_error(exc)
                        return None
                    if event is h11.NEED_DATA:
                        await self._read()
                    elif isinstance(event, h11.Request):
                        return event
                    else:  # ConnectionClosed
                        return None
            finally:
                self._shutdown.idle.discard(idle)
        return None

    async def _serve(self, request: h11.Request) -> None:
        """Run the app for ``request``; answer ``500`` if it fails before answering, cut
        the connection if it fails (or returns) in the middle of an answer."""
        self._head_request = request.method == b"HEAD"
        self._started = self._done = self._end_pending = False
        self._held = b""
        try:
            await self._app(self._scope(request), self._receive, self._send)
        except Exception:
            logger.exception("the app failed on %s", request.target[:200].decode("latin-1"))
            if not self._started:
                await self._write(_INTERNAL_ERROR)
            self._broken = True
            return
        if not self._started:
            logger.error("the app returned without an answer")
            await self._write(_INTERNAL_ERROR)
            self._broken = True
        elif not self._done:
            logger.error("the app returned in the middle of an answer")
            self._broken = True

    def _skip_buffered_body(self) -> None:
        """Take the rest of a request the app did not read, as far as it is buffered (h11
        reports a request's end only when asked: a bodiless request ends here)."""
        while self._h11.their_state is h11.SEND_BODY:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError:
                return
            if event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
                return

    def _scope(self, request: h11.Request) -> Scope:
        raw_path, _, query = request.target.partition(b"?")
        client, server = self._addresses
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version.decode("latin-1"),
            "method": request.method.decode("latin-1"),
            "scheme": "http",
            "path": unquote(raw_path.decode("latin-1")),
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": list(request.headers),
            "client": client,
            "server": server,
        }

    async def _receive(self) -> Message:
        """ASGI ``receive``: the next piece of the body, then ``http.disconnect`` once the
        client has gone (or at once when the answer is complete). Checkpoints."""
        async with self._reading:
            if self._broken or self._done:
                return _DISCONNECT
            if self._end_pending:
                self._end_pending = False
                return {"type": "http.request", "body": b"", "more_body": False}
            if self._h11.their_state is h11.SEND_BODY:
                return await self._body_piece()
            # The body is in: wait for the client to go. Bytes it sends meanwhile (a
            # pipelined request) wait in h11's buffer, up to the head limit.
            while not self._eof and not self._broken:
                if len(self._h11.trailing_data[0]) > self._limits.max_header_bytes:
                    await trio.sleep_forever()
                await self._read()
            return _DISCONNECT

    async def _body_piece(self) -> Message:
        chunks: list[bytes] = []
        while True:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError:  # a broken body (bad chunk, early EOF ...)
                self._broken = True
                return _DISCONNECT
            if isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                # The end comes as a message of its own (as hypercorn sent it): a body
                # over the app's limit is then refused before the app saw it all.
                self._end_pending = bool(chunks)
                return {"type": "http.request", "body": b"".join(chunks), "more_body": bool(chunks)}
            elif event is h11.NEED_DATA:
                if chunks:
                    return {"type": "http.request", "body": b"".join(chunks), "more_body": True}
                if self._h11.they_are_waiting_for_100_continue:
                    go_on = h11.InformationalResponse(
                        status_code=100, headers=[], reason=b"Continue"
                    )
                    await self._write(self._h11.send(go_on) or b"")
                await self._read()
                if self._broken:
                    return _DISCONNECT
            else:  # ConnectionClosed in the middle of a body
                self._broken = True
                return _DISCONNECT

    async def _send(self, message: Message) -> None:
        """ASGI ``send``. Raises ``RuntimeError`` for messages out of order and
        ``h11.LocalProtocolError`` for a body that breaks its own framing. Checkpoints
        when it writes."""
        kind = message["type"]
        if kind == "http.response.start":
            if self._started:
                raise RuntimeError("http.response.start sent twice")
            status = int(message["status"])
            headers = [*message.get("headers", ()), (b"date", _Date.now())]
            if self._shutdown.closing:
                headers.append((b"connection", b"close"))
            response = h11.Response(
                status_code=status, headers=headers, reason=_REASONS.get(status, b"")
            )
            self._held = self._h11.send(response) or b""
            self._started = True
        elif kind == "http.response.body":
            if not self._started or self._done:
                raise RuntimeError("http.response.body outside a response")
            data = self._held
            self._held = b""
            body = message.get("body", b"")
            if body and not self._head_request:  # h11 frames a HEAD answer with no body
                data += self._h11.send(h11.Data(data=body)) or b""
            if not message.get("more_body", False):
                data += self._h11.send(h11.EndOfMessage()) or b""
                self._done = True
            if data:
                await self._write(data)
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r} on an HTTP connection")

    async def _read(self) -> None:
        """One read from the socket into h11; EOF or a reset is h11's end of input."""
        if self._eof:
            await trio.sleep_forever()  # never here: h11 reports the end instead
        try:
            data = await self._stream.receive_some(READ_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        if not data:
            self._eof = True
        self._h11.receive_data(data)

    async def _write(self, data: bytes) -> None:
        """Write ``data``, each ``WRITE_PIECE`` of it within ``send_timeout``. A client that
        does not take them in time is cut off: the stream is closed, which also wakes a
        ``receive`` waiting for the hang-up, so the app gets ``http.disconnect``."""
        if self._broken:
            return
        view = memoryview(data)
        for start in range(0, len(view), WRITE_PIECE):
            with trio.move_on_after(self._limits.send_timeout) as deadline:
                try:
                    await self._stream.send_all(view[start : start + WRITE_PIECE])
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    self._broken = True
                    return
            if deadline.cancelled_caught:
                logger.info(
                    "closing a connection from %s: its client took no answer bytes for %g s",
                    self._addresses[0],
                    self._limits.send_timeout,
                )
                self._broken = True
                await trio.aclose_forcefully(self._stream)
                return

    async def _write_error(self, exc: h11.RemoteProtocolError) -> None:
        status = exc.error_status_hint
        if self._h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            await self._write(error_answer(status, _phrase(status), "invalid_http"))

    async def _close(self) -> None:
        """Half-close so the answers already written arrive, then close. Shielded, bounded."""
        with trio.CancelScope(shield=True), trio.move_on_after(1.0):
            if not self._broken:
                try:
                    await self._stream.send_eof()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            await self._stream.aclose()
        await trio.aclose_forcefully(self._stream)  # a no-op once closed


def _addresses(stream: trio.SocketStream) -> tuple[Any, Any]:
    """(client, server) as ASGI wants them: ``(host, port)``, or None for other families."""

    def pair(address: Any) -> tuple[str, int] | None:
        if isinstance(address, tuple) and len(address) >= 2:
            return (str(address[0]), int(address[1]))
        return None

    try:
        return pair(stream.socket.getpeername()), pair(stream.socket.getsockname())
    except OSError:
        return None, None
