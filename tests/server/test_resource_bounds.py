"""Bounded resources (issue 26, F10): requests in flight, connections, the body phase and
unauthenticated WebSockets each have a bound; past it the server answers (503 with
Retry-After, 408, an error frame, a close) and keeps serving."""

from __future__ import annotations

import json
from typing import Any

import httpx
import trio
import trio.testing
from trio_websocket import ConnectionClosed, open_websocket_url

from legato.engine import AsyncEngine

from .conftest import MODEL, serving, wait_until

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 1}


async def test_requests_past_the_in_flight_cap_get_503_and_an_error_frame(
    engine: AsyncEngine, gate_steps: Any
) -> None:
    gate = gate_steps(engine)
    gate.close()  # the first request stays in flight
    async with (
        serving(engine, max_requests_in_flight=1) as server,
        httpx.AsyncClient(base_url=server.http_url, timeout=30) as client,
        trio.open_nursery() as nursery,
    ):
        answers: list[httpx.Response] = []

        async def first() -> None:
            answers.append(await client.post("/v1/completions", json=BODY))

        nursery.start_soon(first)
        await wait_until(lambda: _async(server.state.num_live == 1))
        busy = await client.post("/v1/completions", json=BODY)
        assert busy.status_code == 503, busy.text
        assert busy.json()["error"]["code"] == "server_busy" and busy.headers["retry-after"]
        async with open_websocket_url(server.ws_url + "/") as ws:
            frame = {"type": "generate", "request_id": "w", "prompt": "hi", "params": {}}
            await ws.send_message(json.dumps(frame))
            reply = json.loads(await ws.get_message())
            assert reply["type"] == "error" and reply["code"] == "server_busy", reply
        assert (await client.get("/health")).status_code == 200
        gate.open()
        await wait_until(lambda: _async(bool(answers)))
        assert answers[0].status_code == 200
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200


async def test_requests_past_the_sequence_cap_get_503_counted_by_n(
    engine: AsyncEngine, gate_steps: Any
) -> None:
    """The engine's queue is bounded in sequences: a request's n children each count."""
    gate = gate_steps(engine)
    gate.close()  # the first request stays in flight
    async with (
        serving(engine, max_sequences_in_flight=3, max_n=4) as server,
        httpx.AsyncClient(base_url=server.http_url, timeout=30) as client,
        trio.open_nursery() as nursery,
    ):
        too_many = await client.post("/v1/completions", json={**BODY, "n": 4})
        assert too_many.status_code == 503, too_many.text
        assert too_many.json()["error"]["code"] == "server_busy"
        assert too_many.headers["retry-after"]
        answers: list[httpx.Response] = []

        async def first() -> None:
            answers.append(await client.post("/v1/completions", json={**BODY, "n": 2}))

        nursery.start_soon(first)
        await wait_until(lambda: _async(server.state.num_live == 1))
        busy = await client.post("/v1/completions", json={**BODY, "n": 2})  # 2 + 2 > 3
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "server_busy"
        async with open_websocket_url(server.ws_url + "/") as ws:
            frame = {"type": "generate", "request_id": "w", "prompt": "hi", "params": {"n": 2}}
            await ws.send_message(json.dumps(frame))
            reply = json.loads(await ws.get_message())
            assert reply["type"] == "error" and reply["code"] == "server_busy", reply
        gate.open()
        await wait_until(lambda: _async(bool(answers)))
        assert answers[0].status_code == 200
        assert (await client.post("/v1/completions", json={**BODY, "n": 3})).status_code == 200


async def _async(value: bool) -> bool:
    return value


async def test_a_body_that_never_arrives_gets_408(engine: AsyncEngine) -> None:
    async with serving(engine, body_timeout=0.5) as server:
        stream = await trio.open_tcp_stream("127.0.0.1", server.http_port)
        async with stream:
            await stream.send_all(
                b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                b"Content-Type: application/json\r\nContent-Length: 4096\r\n\r\n{"
            )
            answer = b""
            with trio.fail_after(30):
                while b"\r\n\r\n" not in answer:
                    answer += await stream.receive_some()
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]


async def test_connections_past_the_cap_are_refused_on_both_ports(engine: AsyncEngine) -> None:
    async with serving(engine, max_connections=2) as server:
        held = [await trio.open_tcp_stream("127.0.0.1", server.http_port) for _ in range(2)]
        await trio.testing.wait_all_tasks_blocked()
        extra = await trio.open_tcp_stream("127.0.0.1", server.http_port)
        answer = b""
        with trio.fail_after(30):
            while chunk := await extra.receive_some():
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 503 ") and b"server_busy" in answer, answer[:200]
        for stream in [*held, extra]:
            await stream.aclose()
        async with (
            open_websocket_url(server.ws_url + "/"),
            open_websocket_url(server.ws_url + "/"),
        ):
            try:
                async with open_websocket_url(server.ws_url + "/"):
                    raise AssertionError("a third WebSocket was accepted")
            except Exception as exc:  # trio_websocket.HandshakeError
                assert getattr(exc, "status_code", None) == 503, exc
        async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as client:
            assert (await client.get("/health")).status_code == 200


async def test_an_unauthenticated_websocket_is_closed_after_the_auth_timeout(
    engine: AsyncEngine,
) -> None:
    async with serving(engine, api_key="k", header_timeout=0.5) as server:
        async with open_websocket_url(server.ws_url + "/") as ws:
            with trio.fail_after(30):
                reply = json.loads(await ws.get_message())
                assert reply["code"] == "unauthorized" and "within" in reply["message"]
                try:
                    await ws.get_message()
                    raise AssertionError("the connection stayed open")
                except ConnectionClosed as closed:
                    assert closed.reason.code == 1008
