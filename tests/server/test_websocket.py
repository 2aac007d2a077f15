"""The WebSocket endpoint with trio-websocket's client: JSON and msgpack, concurrency, aborts, limits."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgpack
import pytest
import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    WebSocketConnection,
    open_websocket_url,
    wrap_client_stream,
)

from legato.engine import AsyncEngine, open_engine
from legato.server import Server

from .conftest import ENGINE_ARGS, metric, serving, wait_kv_used


@asynccontextmanager
async def connect(server: Server, **kwargs: Any) -> AsyncIterator[WebSocketConnection]:
    """A client connection, closed explicitly.

    After a server-side close, trio-websocket's client never closes its TCP
    stream (it waits for the server's FIN, then just stops reading), which
    leaves a ResourceWarning: close the stream ourselves.
    """
    async with open_websocket_url(server.ws_url + "/", **kwargs) as ws:
        try:
            yield ws
        finally:
            await ws.aclose()
            await ws._stream.aclose()


async def send(ws: WebSocketConnection, frame: dict[str, Any], binary: bool = False) -> None:
    await ws.send_message(msgpack.packb(frame) if binary else json.dumps(frame))


async def receive(ws: WebSocketConnection) -> tuple[dict[str, Any], bool]:
    """The next frame and whether it was binary (msgpack)."""
    with trio.fail_after(20):
        message = await ws.get_message()
    if isinstance(message, bytes):
        return msgpack.unpackb(message), True
    return json.loads(message), False


async def collect(ws: WebSocketConnection, until: set[str]) -> dict[str, list[dict[str, Any]]]:
    """Frames per request id until every id in ``until`` has its last frame (finished or error)."""
    frames: dict[str, list[dict[str, Any]]] = {}
    pending = set(until)
    while pending:
        frame, _ = await receive(ws)
        rid = frame.get("request_id", "")
        frames.setdefault(rid, []).append(frame)
        if frame["type"] == "error" or frame.get("finished"):
            pending.discard(rid)
    return frames


def generate(rid: str, prompt: str = "Hello", **params: Any) -> dict[str, Any]:
    return {"type": "generate", "request_id": rid, "prompt": prompt, "params": params}


async def test_json_and_msgpack_requests_stream_deltas(server: Server) -> None:
    texts = []
    async with connect(server) as ws:
        for binary in (False, True):
            await send(ws, generate("r", max_tokens=6, temperature=0, ignore_eos=True), binary)
            frames = []
            while not frames or not frames[-1]["finished"]:
                frame, was_binary = await receive(ws)
                assert was_binary == binary
                assert frame["type"] == "output" and frame["request_id"] == "r"
                frames.append(frame)
            last = frames[-1]
            assert last["finish_reason"] == "length"
            assert last["usage"]["completion_tokens"] == 6
            assert sum(len(f["token_ids"]) for f in frames) == 6
            assert not any(f["finished"] for f in frames[:-1])
            texts.append("".join(f["text"] for f in frames))
    assert texts[0] == texts[1]  # greedy: the same text in either encoding


async def test_prompt_forms_n_and_logprobs(server: Server) -> None:
    async with connect(server) as ws:
        await send(
            ws,
            {"type": "generate", "request_id": "ids", "prompt_token_ids": [5, 6, 7], "params": {"max_tokens": 3, "n": 2, "logprobs": 1}},
        )  # fmt: skip
        chat = {
            "type": "generate",
            "request_id": "chat",
            "messages": [{"role": "user", "content": "hi"}],
            "params": {"max_tokens": 2},
            "priority": 0,
        }
        await send(ws, chat, binary=True)
        frames = await collect(ws, {"ids", "chat"})
    assert {f["index"] for f in frames["ids"]} == {0, 1}
    assert sum(len(f["token_ids"]) for f in frames["ids"]) == 6
    assert all(len(pos) >= 1 for f in frames["ids"] for pos in f["logprobs"])
    assert frames["chat"][-1]["usage"]["prompt_tokens"] > 3


async def test_a_large_chat_renders_in_its_own_task_and_an_abort_meanwhile_holds(
    toy_model_dir: Any, held_tokenizer: Any
) -> None:
    """A chat too large to render inline renders in its request's task, in the engine's
    thread (held there, the connection serves other requests); an abort that comes
    meanwhile ends it with finish_reason "abort" once it is submitted."""
    chat = [{"role": "user", "content": "the " * 1100}]
    args = {**ENGINE_ARGS, "max_model_len": 2048}
    async with (
        open_engine(str(toy_model_dir), executor="inproc", **args) as engine,
        serving(engine) as server,
        connect(server) as ws,
    ):
        assert engine.frontend.offload_renderer is not None
        engine.frontend.offload_renderer.tokenizer = held_tokenizer
        params = {"max_tokens": 400, "ignore_eos": True}
        await send(
            ws, {"type": "generate", "request_id": "big", "messages": chat, "params": params}
        )
        with trio.fail_after(30):
            await held_tokenizer.entered.wait()
        await send(ws, generate("small", max_tokens=4, ignore_eos=True))
        frames = await collect(ws, {"small"})
        assert frames["small"][-1]["finish_reason"] == "length" and "big" not in frames
        await send(ws, {"type": "abort", "request_id": "big"})
        await send(ws, generate("after-abort", max_tokens=1))  # answered: the abort was read
        assert "big" not in await collect(ws, {"after-abort"})
        held_tokenizer.release.set()
        frames = await collect(ws, {"big"})
    assert frames["big"][-1]["finish_reason"] == "abort"
    assert sum(len(f["token_ids"]) for f in frames["big"]) < 400


async def test_concurrent_requests_on_one_connection(server: Server) -> None:
    ids = {f"c{i}" for i in range(8)}
    async with connect(server) as ws:
        for i, rid in enumerate(sorted(ids)):
            await send(
                ws, generate(rid, f"prompt {i}", max_tokens=5, ignore_eos=True), binary=i % 2 == 1
            )
        frames = await collect(ws, ids)
    assert set(frames) == ids
    for rid in ids:
        assert frames[rid][-1]["finish_reason"] == "length"
        assert sum(len(f["token_ids"]) for f in frames[rid]) == 5


async def test_abort_by_frame_and_by_closing(
    server: Server, client: httpx.AsyncClient, engine: AsyncEngine, gate_steps: Any
) -> None:
    gate = gate_steps(engine)

    async def freed_and_reported() -> None:
        # The requests had hundreds of tokens to go: one step at most, then nothing is held.
        with trio.fail_after(10):
            await server.state.wait_idle()
        await gate.assert_done_within_one_step()
        text = (await client.get("/metrics")).text
        assert metric(text, "legato:kv_cache_blocks_used") == 0
        assert metric(text, "legato:num_requests_running") == 0
        gate.open()

    async with connect(server) as ws:
        await send(ws, generate("long", max_tokens=450, ignore_eos=True))
        await receive(ws)
        await wait_kv_used(client)
        await send(ws, {"type": "abort", "request_id": "long"})
        await send(ws, {"type": "abort", "request_id": "unknown"})  # ignored
        frames = await collect(ws, {"long"})
        assert frames["long"][-1]["finish_reason"] == "abort"
        await freed_and_reported()

        for i in range(3):  # the connection keeps working, then closes with requests in flight
            await send(ws, generate(f"bg{i}", max_tokens=450, ignore_eos=True), binary=True)
        await receive(ws)
        await wait_kv_used(client)
    await freed_and_reported()


async def test_errors_name_the_field_in_the_frames_terms(server: Server) -> None:
    """SamplingParams' rules and the engine's checks (after admission) give an error frame
    whose ``param`` is the field as the frame spells it and whose message is
    ``"param: reason"``."""
    cases = [
        (generate("a", top_p=1.5), "params.top_p"),
        (generate("b", min_tokens=5, max_tokens=4), "params.min_tokens"),
        (generate("c", structured_outputs={"json": "{no"}), "params.structured_outputs.json"),
        (generate("d", structured_outputs={"wibble": 1}), "params.structured_outputs.wibble"),
        # found by the engine, after admission
        (generate("e", stop_token_ids=[99999]), "params.stop_token_ids"),
        (generate("f", logprobs=50), "params.logprobs"),
        (
            generate("g", structured_outputs={"grammar": "start: ("}),
            "params.structured_outputs.grammar",
        ),
        ({"type": "generate", "request_id": "h", "prompt_token_ids": [1] * 600}, "prompt"),
    ]
    async with connect(server) as ws:
        for frame, param in cases:
            await send(ws, frame)
            error, _ = await receive(ws)
            assert error["type"] == "error" and error["code"] == "invalid_request", error
            assert (error["request_id"], error["param"]) == (frame["request_id"], param), error
            assert error["message"].startswith(f"{param}: "), error
        await send(ws, generate("ok", max_tokens=2))
        assert (await collect(ws, {"ok"}))["ok"][-1]["finish_reason"] in ("length", "stop")


async def test_bad_frames_get_error_frames_and_the_connection_stays(engine: AsyncEngine) -> None:
    async with serving(engine, ws_max_frame_bytes=2000, ws_max_requests=2, max_n=2) as server:
        async with connect(server) as ws:
            cases: list[tuple[str | bytes, str, str | None]] = [
                ("{not json", "invalid_frame", None),
                (b"\xc1", "invalid_frame", None),
                ("[1, 2]", "invalid_frame", None),
                (json.dumps({"type": "dance"}), "unknown_type", "type"),
                (json.dumps({"type": "generate", "prompt": "x"}), "invalid_request", "request_id"),
                (json.dumps(generate("u", wibble=1)), "invalid_request", "params.wibble"),
                (json.dumps(generate("o", output_kind=0)), "invalid_request", "params.output_kind"),
                (
                    json.dumps(generate("t", temperature="hot")),
                    "invalid_request",
                    "params.temperature",
                ),
                (json.dumps(generate("n", n=3)), "invalid_request", "params.n"),
                (json.dumps({"type": "generate", "request_id": "p"}), "invalid_request", "prompt"),
                (
                    json.dumps({**generate("v"), "prompt_token_ids": [1]}),
                    "invalid_request",
                    "prompt",
                ),
                (json.dumps(generate("x" * 3000)), "frame_too_large", None),
                (
                    msgpack.packb(generate("m", max_tokens=[1])),
                    "invalid_request",
                    "params.max_tokens",
                ),
                (msgpack.packb(msgpack.ExtType(1, b"x")), "invalid_frame", None),
            ]
            for message, code, param in cases:
                await ws.send_message(message)
                frame, binary = await receive(ws)
                assert binary == isinstance(message, bytes), message
                assert frame["type"] == "error" and frame["code"] == code, (message, frame)
                assert frame.get("param") == param, (message, frame)

            # errors the engine finds (after admission) name the field too
            await send(ws, {"type": "generate", "request_id": "big", "prompt_token_ids": [99999]})
            frame, _ = await receive(ws)
            assert (frame["code"], frame["request_id"], frame["param"]) == (
                "invalid_request",
                "big",
                "prompt",
            )

            # duplicate live ids, too many requests per connection
            await send(ws, generate("a", max_tokens=450, ignore_eos=True))
            await send(ws, generate("a", max_tokens=5))
            await send(ws, generate("b", max_tokens=450, ignore_eos=True))
            await send(ws, generate("c", max_tokens=5))
            errors = []
            while len(errors) < 2:
                frame, _ = await receive(ws)
                if frame["type"] == "error":
                    errors.append((frame["code"], frame["request_id"]))
            assert errors == [("duplicate_request_id", "a"), ("too_many_requests", "c")]
            await send(ws, {"type": "abort", "request_id": "a"})
            await send(ws, {"type": "abort", "request_id": "b"})
            await collect(ws, {"a", "b"})

            # and a valid request still works
            await send(ws, generate("ok", max_tokens=2))
            frames = await collect(ws, {"ok"})
            assert frames["ok"][-1]["finish_reason"] in ("length", "stop")

        async with connect(server) as ws:  # far over the hard limit: closed with 1009
            await ws.send_message("x" * 20000)
            with pytest.raises(ConnectionClosed) as info:
                await receive(ws)
            assert info.value.reason.code == 1009


async def test_auth_by_header_or_first_frame(engine: AsyncEngine) -> None:
    async with serving(engine, api_key="k") as server:
        async with connect(server, extra_headers=[(b"Authorization", b"Bearer k")]) as ws:
            await send(ws, generate("h", max_tokens=2))
            assert (await collect(ws, {"h"}))["h"][-1]["finished"]

        # (on a stream of our own: trio-websocket leaves a rejected client's socket open)
        bad = [(b"Authorization", b"Bearer bad")]
        async with await trio.open_tcp_stream("127.0.0.1", server.ws_port) as stream:
            with pytest.RaisesGroup(
                ConnectionRejected, allow_unwrapped=True, flatten_subgroups=True
            ) as rejected:
                async with trio.open_nursery() as nursery:
                    await wrap_client_stream(nursery, stream, "127.0.0.1", "/", extra_headers=bad)
        assert rejected.value.exceptions[0].status_code == 401

        async with connect(server) as ws:
            await send(ws, {"type": "auth", "api_key": "k"}, binary=True)
            await send(ws, generate("f", max_tokens=2), binary=True)
            assert (await collect(ws, {"f"}))["f"][-1]["finished"]

        for first in ({"type": "auth", "api_key": "bad"}, generate("g")):
            async with connect(server) as ws:
                await send(ws, first)
                frame, _ = await receive(ws)
                assert frame["type"] == "error" and frame["code"] == "unauthorized"
                with pytest.raises(ConnectionClosed) as closed:
                    await receive(ws)
                assert closed.value.reason.code == 1008


async def test_shutdown_closes_connections_after_the_drain(engine: AsyncEngine) -> None:
    async with serving(engine, shutdown_grace=0.0) as server:
        async with connect(server) as ws:
            await send(ws, generate("s", max_tokens=450, ignore_eos=True))
            await receive(ws)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(server.shutdown)
                frames = await collect(ws, {"s"})
                assert frames["s"][-1]["finish_reason"] == "abort"
                with pytest.raises(ConnectionClosed) as closed:
                    await receive(ws)
                assert closed.value.reason.code == 1001


async def test_cache_salt_keeps_tenants_apart(server: Server, client: httpx.AsyncClient) -> None:
    ids = list(range(5, 205))

    async def hits() -> float:
        response = await client.get("/metrics")
        return metric(response.text, "legato:prefix_cache_hits_total", default=0.0)

    async with connect(server) as ws:

        async def hits_gained(rid: str, salt: str | None) -> float:
            before = await hits()
            frame: dict[str, Any] = {
                "type": "generate",
                "request_id": rid,
                "prompt_token_ids": ids,
                "params": {"max_tokens": 2},
            }
            if salt is not None:
                frame["cache_salt"] = salt
            await send(ws, frame, binary=salt == "tenant-b")
            frames = await collect(ws, {rid})
            assert frames[rid][-1]["finished"], frames
            return await hits() - before

        assert await hits_gained("a1", "tenant-a") == 0
        assert await hits_gained("b1", "tenant-b") == 0
        assert await hits_gained("n1", None) == 0
        assert await hits_gained("a2", "tenant-a") >= 192
        assert await hits_gained("b2", "tenant-b") >= 192
        await send(ws, {"type": "generate", "request_id": "x", "prompt": "hi", "cache_salt": ""})
        frames = await collect(ws, {"x"})
        assert frames["x"][-1]["type"] == "error" and frames["x"][-1]["param"] == "cache_salt"
