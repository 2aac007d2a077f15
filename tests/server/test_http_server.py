"""The HTTP port's connections (legato.server.http_server): a connection is let go
as soon as its client has hung up and has its answer.

The servers here get a header (keep-alive) timeout of an hour, so a connection
that is closed was closed by the server's reading of the client, not by a timer;
``fail_after`` only turns a hang into a failure.
"""

from __future__ import annotations

import trio

from legato.engine import AsyncEngine

from .conftest import serving

NO_TIMER = 3600.0  # header_timeout, which is also the keep-alive timeout


async def test_a_client_that_hangs_up_after_its_answer_is_let_go(engine: AsyncEngine) -> None:
    """A keep-alive connection whose client half-closes once answered is closed then, not
    when the keep-alive timer runs out (with or without an upgrade offer, declined)."""
    async with serving(engine, header_timeout=NO_TIMER) as server:
        for upgrade in (b"", b"Upgrade: websocket\r\n", b"Upgrade: foo\r\n"):
            request = b"GET /health HTTP/1.1\r\nHost: x\r\n" + upgrade + b"\r\n"
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
