"""The HTTP port's connections (legato.server.http_server): HTTP/1.x only, and a
connection is let go as soon as its client has hung up and has its answer.

The servers here get a header (keep-alive) timeout of an hour, so a connection
that is closed was closed by the server's reading of the client, not by a timer;
``fail_after`` only turns a hang into a failure.
"""

from __future__ import annotations

import httpx
import trio

from legato.engine import AsyncEngine

from .conftest import serving

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
