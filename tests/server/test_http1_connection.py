"""One HTTP/1.1 connection (legato.server.http1_connection) and the accept loop around it
(legato.server.http_server): keep-alive and pipelining, HEAD, ``Expect: 100-continue``,
an app that fails, and the shutdown of idle and busy connections.

The first three run the real server over the toy engine. The last two drive
``serve_http`` with a small ASGI app of their own: a test double that fails, or
holds its answer, on purpose.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.testing

from legato.engine import AsyncEngine
from legato.server.asgi import Message, Receive, Scope, Send, send_json
from legato.server.http1_connection import ConnectionLimits
from legato.server.http_server import HTTPServerConfig, serve_http

from .conftest import serving

NO_TIMER = 3600.0  # header_timeout: a connection that closes was closed by the server's logic


class Answers:
    """Reads HTTP/1.1 answers (each with a Content-Length) off one client stream."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = b""

    async def _fill(self) -> bool:
        chunk = await self.stream.receive_some()
        self.buffer += chunk
        return bool(chunk)

    async def next(self, *, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
        """The next answer: status, headers (lower-cased names), body (fail after 30 s)."""
        with trio.fail_after(30):
            while b"\r\n\r\n" not in self.buffer:
                assert await self._fill(), f"closed before an answer: {self.buffer[:300]!r}"
            head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
            status_line, *lines = head.decode("latin-1").split("\r\n")
            headers = {
                name.strip().lower(): value.strip()
                for name, value in (line.split(":", 1) for line in lines)
            }
            length = 0 if head_only else int(headers["content-length"])
            while len(self.buffer) < length:
                assert await self._fill(), "closed in the middle of a body"
            body, self.buffer = self.buffer[:length], self.buffer[length:]
            return int(status_line.split(" ")[1]), headers, body

    async def closed(self) -> bool:
        """Whether the server closes the stream with nothing more to read (fail after 30 s)."""
        with trio.fail_after(30):
            return not self.buffer and not await self._fill()


async def test_pipelined_requests_are_answered_in_order_on_one_connection(
    engine: AsyncEngine,
) -> None:
    body = b'{"prompt": "hello"}'
    requests = (
        b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"
        b"POST /tokenize HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
        + b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n"
    )
    async with serving(engine, header_timeout=NO_TIMER) as server:
        async with await trio.open_tcp_stream("127.0.0.1", server.http_port) as stream:
            await stream.send_all(requests)  # one packet, three requests
            answers = Answers(stream)
            status, _, health = await answers.next()
            assert (status, json.loads(health)) == (200, {"status": "ok"})
            status, _, tokens = await answers.next()
            assert status == 200 and json.loads(tokens)["count"] > 0, tokens
            status, headers, models = await answers.next()
            assert status == 200 and json.loads(models)["object"] == "list", models
            assert "connection" not in headers  # still kept alive: one more request
            await stream.send_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            assert (await answers.next())[0] == 200
            await stream.send_eof()
            assert await answers.closed()


async def test_head_gets_the_head_alone_and_the_connection_goes_on(engine: AsyncEngine) -> None:
    async with serving(engine, header_timeout=NO_TIMER) as server:
        async with await trio.open_tcp_stream("127.0.0.1", server.http_port) as stream:
            await stream.send_all(b"HEAD /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            answers = Answers(stream)
            status, headers, _ = await answers.next(head_only=True)
            assert status in (200, 405) and int(headers["content-length"]) > 0, headers
            await stream.send_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            status, _, health = await answers.next()  # no stray body bytes came before it
            assert (status, json.loads(health)) == (200, {"status": "ok"})


async def test_expect_100_continue_gets_its_continue_when_the_body_is_wanted(
    engine: AsyncEngine,
) -> None:
    body = b'{"prompt": "hello"}'
    head = (
        b"POST /tokenize HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Expect: 100-continue\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    async with serving(engine, header_timeout=NO_TIMER) as server:
        async with await trio.open_tcp_stream("127.0.0.1", server.http_port) as stream:
            await stream.send_all(head)  # the body follows only after "100 Continue"
            answers = Answers(stream)
            with trio.fail_after(30):
                while b"\r\n\r\n" not in answers.buffer:
                    assert await answers._fill()
            assert answers.buffer.startswith(b"HTTP/1.1 100 "), answers.buffer
            answers.buffer = answers.buffer.split(b"\r\n\r\n", 1)[1]
            await stream.send_all(body)
            status, _, tokens = await answers.next()
            assert status == 200 and json.loads(tokens)["count"] > 0, tokens


# ------------------------------------------------------------------ with a test-double app


class DoubleApp:
    """``/ok`` answers; ``/boom`` raises before answering; ``/half`` raises in the middle
    of an answer; ``/held`` answers once ``release`` is set (``entered`` says it waits)."""

    def __init__(self) -> None:
        self.entered = trio.Event()
        self.release = trio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        if path == "/boom":
            raise RuntimeError("an injected fault before the answer")
        if path == "/half":
            start: Message = {"type": "http.response.start", "status": 200, "headers": []}
            await send(start)
            await send({"type": "http.response.body", "body": b"part", "more_body": True})
            raise RuntimeError("an injected fault in the middle of the answer")
        if path == "/held":
            self.entered.set()
            await self.release.wait()
        await send_json(send, 200, {"path": path})


@asynccontextmanager
async def double_server(app: DoubleApp, **config: Any) -> AsyncIterator[tuple[int, trio.Event]]:
    """``serve_http(app)`` on a free port: yields (port, the shutdown trigger); on exit
    triggers the shutdown and waits for ``serve_http`` to return."""
    stop = trio.Event()
    settings = HTTPServerConfig(port=0, limits=ConnectionLimits(header_timeout=NO_TIMER), **config)
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(
            lambda task_status: serve_http(
                app, settings, shutdown_trigger=stop.wait, task_status=task_status
            )
        )
        yield int(binds[0].rsplit(":", 1)[1]), stop
        stop.set()


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode()


async def test_an_app_that_fails_breaks_only_its_own_connection() -> None:
    async with double_server(DoubleApp()) as (port, _):
        kept = await trio.open_tcp_stream("127.0.0.1", port)
        kept_answers = Answers(kept)
        await kept.send_all(get("/ok"))
        assert (await kept_answers.next())[0] == 200

        async with await trio.open_tcp_stream("127.0.0.1", port) as boom:
            await boom.send_all(get("/boom"))
            answers = Answers(boom)
            status, headers, body = await answers.next()
            assert status == 500 and headers["connection"] == "close", headers
            assert json.loads(body)["error"]["code"] == "internal_error"
            assert b"injected" not in body  # the detail stays in the server's log
            assert await answers.closed()

        async with await trio.open_tcp_stream("127.0.0.1", port) as half:
            await half.send_all(get("/half"))
            received = b""
            with trio.fail_after(30):
                while chunk := await half.receive_some():
                    received += chunk
            assert received.startswith(b"HTTP/1.1 200 ") and b"part" in received
            assert not received.endswith(b"0\r\n\r\n")  # cut, never a complete chunked body

        await kept.send_all(get("/ok"))  # the first connection, and the server, go on
        status, _, body = await kept_answers.next()
        assert (status, json.loads(body)) == (200, {"path": "/ok"})
        await kept.aclose()


async def test_shutdown_closes_idle_connections_at_once_and_lets_busy_ones_finish() -> None:
    app = DoubleApp()
    async with double_server(app, graceful_timeout=60.0) as (port, stop):
        idle = await trio.open_tcp_stream("127.0.0.1", port)
        idle_answers = Answers(idle)
        await idle.send_all(get("/ok"))
        assert (await idle_answers.next())[0] == 200  # now idle, kept alive
        busy = await trio.open_tcp_stream("127.0.0.1", port)
        await busy.send_all(get("/held"))
        await app.entered.wait()

        stop.set()
        assert await idle_answers.closed()  # at once, while the busy one still waits
        assert not app.release.is_set()
        app.release.set()
        busy_answers = Answers(busy)
        status, headers, body = await busy_answers.next()
        assert (status, json.loads(body)) == (200, {"path": "/held"})
        assert headers["connection"] == "close"
        assert await busy_answers.closed()
        for stream in (idle, busy):
            await stream.aclose()
