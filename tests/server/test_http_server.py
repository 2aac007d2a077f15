"""The HTTP port's connections (legato.server.http_server): HTTP/1.x only, a
connection is let go as soon as its client has hung up and has its answer, and
one whose client stops reading is closed after ``send_timeout``.

The servers here get a header (keep-alive) timeout of an hour, so a connection
that is closed was closed by the server's reading of the client, not by a timer;
``fail_after`` only turns a hang into a failure.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import trio

from legato.engine import AsyncEngine

from .conftest import serving, wait_kv_used

NO_TIMER = 3600.0  # header_timeout, which is also the keep-alive timeout

# hypercorn switches these to HTTP/2 (after a "101" for the h2c upgrades), and its HTTP/2
# code never closed the connection when the client hung up before the answer was sent.
H2C_UPGRADES = [
    b"GET /health HTTP/1.1\r\nHost: localhost\r\nUpgrade: h2c\r\n\r\n",
    b"GET /health HTTP/1.0\r\nHost: localhost\r\nUpgrade: h2c\r\n\r\n",
    b"GET /health HTTP/1.0\r\nHost: localhost\r\nUpgrade: h2c\r\nUpgrade: h2c\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade, HTTP2-Settings\r\n"
    b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n",
]
HTTP2_PRIOR_KNOWLEDGE = (
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # SETTINGS, empty
    # HEADERS, END_STREAM | END_HEADERS, stream 1: GET http://x/health (HPACK)
    + b"\x00\x00\x0e\x01\x05\x00\x00\x00\x01"
    + b"\x82\x86\x04\x07/health\x01\x01x"
)


async def send_and_read_to_close(port: int, data: bytes) -> bytes:
    """Send ``data``, half-close, read until the server closes (fail after 30 s)."""
    answer = b""
    with trio.fail_after(30):
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            await stream.send_all(data)
            await stream.send_eof()
            while chunk := await stream.receive_some():
                answer += chunk
    return answer


async def assert_health(server_url: str) -> None:
    async with httpx.AsyncClient(base_url=server_url, timeout=30) as client:
        assert (await client.get("/health")).json() == {"status": "ok"}


async def test_h2c_upgrades_are_answered_in_http1_and_closed(engine: AsyncEngine) -> None:
    """An ``Upgrade: h2c`` request gets its plain HTTP/1.1 answer (no ``101``, no HTTP/2
    frames) and the connection closes when the client has hung up."""
    async with serving(engine, header_timeout=NO_TIMER) as server:
        for packet in H2C_UPGRADES:
            answer = await send_and_read_to_close(server.http_port, packet)
            assert answer.startswith(b"HTTP/1.1 200 "), (packet, answer[:300])
            assert answer.endswith(b'{"status":"ok"}'), (packet, answer[:300])
            await assert_health(server.http_url)


async def test_http2_prior_knowledge_gets_http1_answers_and_closed(engine: AsyncEngine) -> None:
    """The HTTP/2 preface with a request is read as HTTP/1.x: an error answer for
    ``PRI *`` and for the frames that follow, then the connection closes."""
    async with serving(engine, header_timeout=NO_TIMER) as server:
        answer = await send_and_read_to_close(server.http_port, HTTP2_PRIOR_KNOWLEDGE)
        assert answer.startswith(b"HTTP/1.1 404 "), answer[:300]
        assert b"}HTTP/1.1 400 " in answer, answer[:600]  # after the 404's body
        await assert_health(server.http_url)


async def test_a_client_that_hangs_up_after_its_answer_is_let_go(engine: AsyncEngine) -> None:
    """A keep-alive connection whose client half-closes once answered is closed then, not
    when the keep-alive timer runs out (with or without an upgrade offer, declined)."""
    async with serving(engine, header_timeout=NO_TIMER) as server:
        for upgrade in (b"", b"Upgrade: websocket\r\n", b"Upgrade: foo\r\n"):
            request = b"GET /health HTTP/1.1\r\nHost: localhost\r\n" + upgrade + b"\r\n"
            with trio.fail_after(30):
                async with await trio.open_tcp_stream("127.0.0.1", server.http_port) as stream:
                    await stream.send_all(request)
                    answer = b""
                    while not answer.endswith(b'{"status":"ok"}'):
                        answer += await stream.receive_some()
                    await stream.send_eof()
                    assert await stream.receive_some() == b"", upgrade
            assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
            assert b"connection: close" not in answer.lower()  # kept alive until the hang-up


STALLED_STEPS = 60
"""Engine steps the stalled request may run (of its 450), so that it cannot end by itself:
16 choices with 20 logprobs make ~13 KB of SSE a step, ~800 KB in all, more than the
loopback socket buffers take for a reader that reads nothing."""


async def test_a_client_that_stops_reading_is_closed_and_its_request_aborted(
    engine: AsyncEngine, gate_steps: Any
) -> None:
    """A client that starts a long stream and then reads nothing (a small receive window,
    soon full) holds neither its connection nor the engine: once a write has waited
    ``send_timeout`` the server closes the connection, the request is aborted and its KV
    blocks are freed; other clients are served meanwhile. The engine may run only
    ``STALLED_STEPS`` steps, so the request cannot end by itself: only the abort lets
    the server go idle. (Without a deadline ``wait_idle`` never returns: fail_after.)"""
    gate = gate_steps(engine)
    gate.close()
    gate.allow(STALLED_STEPS)
    body = json.dumps(
        {
            "prompt": "Hello",
            "max_tokens": 450,
            "ignore_eos": True,
            "stream": True,
            "n": 16,
            "logprobs": 20,
        }
    ).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    ) + body
    async with serving(engine, send_timeout=1.0, header_timeout=NO_TIMER) as server:
        with trio.fail_after(60):
            sock = trio.socket.socket()
            # Set before connecting: the window the client offers stays small.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await sock.connect(("127.0.0.1", server.http_port))
            async with trio.SocketStream(sock) as stalled:
                await stalled.send_all(request)
                async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as other:
                    await wait_kv_used(other)  # the request runs (another client is served)
                    assert (await other.get("/health")).json() == {"status": "ok"}
                await server.state.wait_idle()  # the server let go of the request
                await gate.assert_done_within_one_step()  # its abort reached the engine
                # The connection was closed: what the kernel had taken arrives, then the end.
                answer = b""
                try:
                    while chunk := await stalled.receive_some():
                        answer += chunk
                except trio.BrokenResourceError:  # a reset also ends it
                    pass
                assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
                assert not answer.endswith(b"data: [DONE]\r\n\r\n0\r\n\r\n")
        await assert_health(server.http_url)
