"""Hostile input on the WebSocket endpoint: random JSON and msgpack frames, wrong types for every
known field, binary garbage, invalid UTF-8 in text frames, huge frames, floods of requests.

Every frame gets its documented ``error`` frame (in the frame's encoding) or
its documented close, the server never crashes, a valid request on a fresh
connection succeeds afterwards, and nothing piles up: no request or
connection left behind, RSS bounded over repeated rounds.

One server per module in a background thread (``ServerThread`` from
``test_fuzz_http``); each hypothesis example talks to it in a ``trio.run`` of
its own, on a fresh connection.
"""

from __future__ import annotations

import gc
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import psutil
import pytest
import trio
import wsproto
import wsproto.events
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trio_websocket import ConnectionClosed, WebSocketConnection

from .test_fuzz_http import JSON_VALUES, NUMBERS, PLAUSIBLE, TEXT, ServerThread
from .test_websocket import connect

FRAME_LIMIT = 4096
MAX_REQUESTS = 4
FUZZ = settings(
    max_examples=int(os.environ.get("LEGATO_FUZZ_EXAMPLES", "100")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SYNC = {"type": "sync?"}
"""Sent after each fuzzed frame: its ``unknown_type`` error says the frame has been handled."""

DOCUMENTED_CODES = {
    "invalid_frame",
    "frame_too_large",
    "unknown_type",
    "invalid_request",
    "duplicate_request_id",
    "too_many_requests",
}


@pytest.fixture(scope="module")
def fuzz_server(toy_model_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(
        toy_model_dir, ws_max_frame_bytes=FRAME_LIMIT, ws_max_requests=MAX_REQUESTS
    ) as server:
        yield server


def decode(message: str | bytes) -> dict[str, Any]:
    value = json.loads(message) if isinstance(message, str) else msgpack.unpackb(message)
    assert isinstance(value, dict), value
    return value


def check_frame(frame: dict[str, Any]) -> None:
    """A server frame has the documented shape."""
    if frame["type"] == "error":
        assert frame["code"] in DOCUMENTED_CODES, frame
        assert isinstance(frame["message"], str) and frame["message"], frame
        assert set(frame) <= {"type", "code", "message", "request_id", "param"}, frame
        return
    assert frame["type"] == "output", frame
    assert isinstance(frame["request_id"], str) and isinstance(frame["index"], int), frame
    assert isinstance(frame["text"], str) and isinstance(frame["token_ids"], list), frame
    assert isinstance(frame["finished"], bool), frame


def live_request_id(message: str | bytes) -> str | None:
    """The request id a fuzzed frame may start a request under (its end is then awaited)."""
    try:
        frame = json.loads(message) if isinstance(message, str) else msgpack.unpackb(message)
    except Exception:
        return None
    if not isinstance(frame, dict) or frame.get("type") != "generate":
        return None
    rid = frame.get("request_id")
    return rid if isinstance(rid, str) and 0 < len(rid) <= 256 else None


async def exchange(ws: WebSocketConnection, message: str | bytes) -> list[dict[str, Any]]:
    """Send ``message`` then ``SYNC``; the frames that answer ``message``, checked.

    Waits for the answer to ``SYNC`` and, if ``message`` may have started a
    request, for that request's last frame.
    """
    binary = isinstance(message, bytes)
    pending = live_request_id(message)
    await ws.send_message(message)
    await ws.send_message(json.dumps(SYNC))
    frames: list[dict[str, Any]] = []
    synced = False
    with trio.fail_after(60):
        while not synced or pending is not None:
            raw = await ws.get_message()
            frame = decode(raw)
            if frame.get("code") == "unknown_type" and "sync?" in frame["message"]:
                synced = True
                continue
            check_frame(frame)
            if frame["type"] == "error" and not synced:  # about the frame: in its encoding
                assert isinstance(raw, bytes) == binary, (message, frame)
            frames.append(frame)
            if frame["type"] == "error" and not synced and "request_id" not in frame:
                pending = None  # the frame was refused as a whole (too large, say)
            if frame.get("request_id") == pending and (
                frame["type"] == "error" or frame["finished"]
            ):
                pending = None
    return frames


def run_exchange(server: ServerThread, message: str | bytes) -> list[dict[str, Any]]:
    """``exchange`` on a fresh connection, in a trio run of its own; the engine must live on."""

    async def main() -> list[dict[str, Any]]:
        assert server.server is not None
        async with connect(server.server) as ws:
            return await exchange(ws, message)

    frames = trio.run(main)
    server.assert_engine_alive()
    return frames


def assert_still_serving(server: ServerThread) -> None:
    """A valid request on a fresh connection streams to its end; nothing is left in flight."""
    frame = {"type": "generate", "request_id": "ok", "prompt": "Hi", "params": {"max_tokens": 2}}
    frames = run_exchange(server, json.dumps(frame))
    assert frames[-1]["finished"] and frames[-1]["finish_reason"] == "length", frames
    server.wait_idle()

    async def all_closed() -> None:  # the server notices each close a moment later
        with trio.fail_after(10):
            await server.server.endpoint.wait_all_closed()  # type: ignore[union-attr]

    server.run(all_closed)


# ------------------------------------------------------------------ strategies

PARAM_FIELDS = [
    "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
    "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "bad_words",
    "include_stop_str_in_output", "ignore_eos", "max_tokens", "min_tokens", "logprobs",
    "prompt_logprobs", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
    "logits_processors", "truncate_prompt_tokens", "output_kind", "allowed_token_ids",
    "logit_bias", "extra_args", "wibble",
]  # fmt: skip

REQUEST_IDS = st.sampled_from(["r", "x" * 256, "x" * 257, ""]) | TEXT | JSON_VALUES
PROMPT_FIELDS = st.sampled_from(["prompt", "prompt_token_ids", "messages"])

# msgpack has bytes, and ints up to 2**64 - 1 but no further.
MSGPACK_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12)
)
MSGPACK_VALUES = st.recursive(
    MSGPACK_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.text(max_size=8) | st.integers(-9, 9) | st.binary(max_size=4), inner, max_size=4
        )
    ),
    max_leaves=10,
)


def _msgpack_safe(value: Any) -> Any:
    """``value`` with what msgpack cannot pack (ints past 64 bits, lone surrogates) replaced."""
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return value
    if isinstance(value, int):
        return value if -(2**63) <= value < 2**64 else str(value)
    if isinstance(value, str):
        return value.encode(errors="replace").decode()
    if isinstance(value, list):
        return [_msgpack_safe(v) for v in value]
    if isinstance(value, dict):
        return {_msgpack_safe(k): _msgpack_safe(v) for k, v in value.items()}
    return value


@st.composite
def generate_frames(draw: st.DrawFn) -> dict[str, Any]:
    """A ``generate`` frame with some of its fields (and params) hostile."""
    frame: dict[str, Any] = {"type": "generate", "request_id": "r", "prompt": "Hi"}
    frame["params"] = {"max_tokens": draw(st.integers(1, 8))}
    if draw(st.booleans()):
        frame["request_id"] = draw(REQUEST_IDS)
    if draw(st.booleans()):
        del frame["prompt"]
        frame[draw(PROMPT_FIELDS)] = draw(PLAUSIBLE)
    if draw(st.booleans()):
        frame[draw(PROMPT_FIELDS)] = draw(PLAUSIBLE)  # maybe a second prompt field
    for field in draw(st.lists(st.sampled_from(PARAM_FIELDS), max_size=3, unique=True)):
        frame["params"][field] = draw(PLAUSIBLE | NUMBERS)
    if draw(st.booleans()):
        frame["params"] = draw(st.just(frame["params"]) | JSON_VALUES)
    if draw(st.booleans()):
        frame["priority"] = draw(NUMBERS | JSON_VALUES)
    if draw(st.booleans()):
        frame["type"] = draw(st.sampled_from(["abort", "auth", "Generate", ""]) | JSON_VALUES)
    return frame


def encoded(frames: st.SearchStrategy[Any]) -> st.SearchStrategy[str | bytes]:
    """Each value as a JSON text frame or a msgpack binary frame."""
    as_json = frames.map(lambda value: json.dumps(value))
    as_msgpack = frames.map(lambda value: msgpack.packb(_msgpack_safe(value), use_bin_type=True))
    return as_json | as_msgpack


# ------------------------------------------------------------------ the fuzzers


@FUZZ
@given(message=encoded(generate_frames()))
def test_generate_frames_with_hostile_fields(
    fuzz_server: ServerThread, message: str | bytes
) -> None:
    run_exchange(fuzz_server, message)


@FUZZ
@given(
    message=encoded(JSON_VALUES) | MSGPACK_VALUES.map(lambda v: msgpack.packb(v, use_bin_type=True))
)
def test_random_values_as_frames(fuzz_server: ServerThread, message: str | bytes) -> None:
    frames = run_exchange(fuzz_server, message)
    for frame in frames:
        if frame["type"] == "error" and live_request_id(message) is None:
            assert frame["code"] in ("invalid_frame", "unknown_type", "frame_too_large"), frame


@FUZZ
@given(
    message=st.binary(max_size=200)
    | st.sampled_from(
        [b"", b"\xc1", b"\x91" * 2000, b"\xdf\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff",
         b"\xc6\xff\xff\xff\xff", msgpack.packb(msgpack.ExtType(1, b"x")), b"\xd9\x03\xff\xfe\xfd"]
    )
    | st.sampled_from(['{"type": "generate"', "[" * 3000, "\ud800", '{"type": "\\ud800"}', "\x00"])
)  # fmt: skip
def test_garbage_frames(fuzz_server: ServerThread, message: str | bytes) -> None:
    if isinstance(message, str):
        message = message.encode(errors="surrogatepass").decode(errors="replace")
    frames = run_exchange(fuzz_server, message)
    assert frames and frames[0]["type"] == "error", frames
    assert frames[0]["code"] in ("invalid_frame", "unknown_type"), frames


def test_every_param_and_field_with_every_wrong_type(fuzz_server: ServerThread) -> None:
    wrong: list[Any] = [
        None, True, -1, 2**63, 1.5, math.inf, "s", [], [1], ["a"], {}, {"1": "x"}, [None],
    ]  # fmt: skip
    base = {"type": "generate", "request_id": "r", "prompt": "Hi", "params": {"max_tokens": 1}}
    engine = fuzz_server.call(lambda: fuzz_server.server.state.engine)  # type: ignore[union-attr]

    async def main() -> None:
        assert fuzz_server.server is not None
        async with connect(fuzz_server.server) as ws:
            for value in wrong:
                for field in PARAM_FIELDS:
                    await exchange(
                        ws, json.dumps({**base, "params": {"max_tokens": 1, field: value}})
                    )
                    assert not engine.errored, (field, value, engine.dead_error.__cause__)
                for key in ("request_id", "prompt", "prompt_token_ids", "messages", "params",
                            "priority", "type"):  # fmt: skip
                    await exchange(ws, msgpack.packb(_msgpack_safe({**base, key: value})))

    trio.run(main)
    assert_still_serving(fuzz_server)


def test_escaped_lone_surrogates_are_invalid_frames(fuzz_server: ServerThread) -> None:
    """JSON may spell a lone surrogate (\\ud800): Python decodes it to a str that is not text."""
    for frame in (
        {"type": "generate", "request_id": "r", "prompt": "\ud800"},
        {"type": "generate", "request_id": "\udfff", "prompt": "x"},
        {
            "type": "generate",
            "request_id": "r",
            "messages": [{"role": "user", "content": "\ud800"}],
        },
        {"\ud800": 1, "type": "abort"},
    ):
        (error,) = run_exchange(fuzz_server, json.dumps(frame))
        assert (error["type"], error["code"]) == ("error", "invalid_frame"), error
    assert_still_serving(fuzz_server)


def test_huge_frames_get_an_error_or_a_1009_close(fuzz_server: ServerThread) -> None:
    async def main() -> None:
        assert fuzz_server.server is not None
        async with connect(fuzz_server.server) as ws:
            for size in (FRAME_LIMIT + 1, 2 * FRAME_LIMIT, 4 * FRAME_LIMIT - 100):
                for message in ("x" * size, b"\x00" * size):
                    (error,) = await exchange(ws, message)
                    assert error["code"] == "frame_too_large", error
        # A message far beyond what the socket buffers hold is still being sent when the
        # server closes: its unread bytes make the server's TCP answer with a reset, which
        # may reach the client before the 1009 close frame does (1006 on this side).
        for message, codes in (
            ("x" * (4 * FRAME_LIMIT + 1), {1009}),
            (b"\x00" * (64 * FRAME_LIMIT), {1009, 1006}),
        ):
            async with connect(fuzz_server.server) as ws:
                with pytest.raises(ConnectionClosed) as closed, trio.fail_after(30):
                    await ws.send_message(message)  # (the close may come while it sends)
                    await ws.get_message()
                assert closed.value.reason.code in codes

    trio.run(main)
    assert_still_serving(fuzz_server)


def _masked_frame(opcode: int, payload: bytes) -> bytes:
    """One client frame as raw bytes (FIN set, masked), bypassing the client's UTF-8 checks."""
    mask = b"\x01\x02\x03\x04"
    header = bytes([0x80 | opcode])
    if len(payload) < 126:
        header += bytes([0x80 | len(payload)])
    else:
        header += bytes([0x80 | 126]) + len(payload).to_bytes(2, "big")
    return header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def test_invalid_utf8_and_protocol_garbage_close_the_connection(
    fuzz_server: ServerThread,
) -> None:
    """Not a valid WebSocket message at all: the connection ends at once. trio-websocket
    fails it by closing TCP, without a close frame (RFC 6455 allows either; were one sent, it
    would say 1007 for invalid UTF-8 in a text frame, 1002 for a protocol error). The server
    itself carries on."""
    cases = [
        (_masked_frame(0x1, b'{"type": "\xff\xfe"}'), {1007}),
        (_masked_frame(0x1, b"\xed\xa0\x80"), {1007}),  # an encoded surrogate
        (_masked_frame(0x1, b"\xc3"), {1007}),  # truncated
        (_masked_frame(0x3, b"x"), {1002}),  # reserved opcode
        (b"\x81\x05hello", {1002}),  # unmasked client frame
        (_masked_frame(0x0, b"x"), {1002}),  # continuation without a start
    ]

    async def one(raw: bytes) -> int | None:
        host, port = fuzz_server.ws_url.removeprefix("ws://").rsplit(":", 1)
        client = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
        async with await trio.open_tcp_stream(host, int(port)) as stream:
            await stream.send_all(client.send(wsproto.events.Request(host=host, target="/")))
            accepted = False
            with trio.fail_after(30):
                while not accepted:
                    client.receive_data(await stream.receive_some())
                    accepted = any(
                        isinstance(e, wsproto.events.AcceptConnection) for e in client.events()
                    )
                await stream.send_all(raw)
                while data := await stream.receive_some():
                    client.receive_data(data)
                    for event in client.events():
                        if isinstance(event, wsproto.events.CloseConnection):
                            return event.code
        return None

    for raw, codes in cases:
        code = trio.run(one, raw)
        assert code is None or code in codes, (raw, code)
    assert_still_serving(fuzz_server)


def test_a_flood_of_requests_past_the_limit(fuzz_server: ServerThread) -> None:
    """Over the per-connection limit: one ``too_many_requests`` per extra frame, in order;
    closing the connection ends the live ones. (The engine is paused meanwhile, so that no
    live request can finish and free a place before the flood has been refused.)"""
    extra = 20
    engine = fuzz_server.call(lambda: fuzz_server.server.state.engine)  # type: ignore[union-attr]
    fuzz_server.run(lambda: engine.pause_generation(mode="keep"))

    async def main() -> None:
        assert fuzz_server.server is not None
        async with connect(fuzz_server.server) as ws:
            for i in range(MAX_REQUESTS + extra):
                frame = {"type": "generate", "request_id": f"f{i}", "prompt": "Hi",
                         "params": {"max_tokens": 100, "ignore_eos": True}}  # fmt: skip
                await ws.send_message(msgpack.packb(frame) if i % 2 else json.dumps(frame))
            refused = []
            with trio.fail_after(60):
                while len(refused) < extra:
                    frame = decode(await ws.get_message())
                    check_frame(frame)
                    if frame["type"] == "error":
                        assert frame["code"] == "too_many_requests", frame
                        refused.append(frame["request_id"])
            assert refused == [f"f{i}" for i in range(MAX_REQUESTS, MAX_REQUESTS + extra)]
        # closed with MAX_REQUESTS requests live

    try:
        trio.run(main)
        fuzz_server.wait_idle()
    finally:
        fuzz_server.run(engine.resume_generation)
    assert_still_serving(fuzz_server)


def _rss() -> int:
    gc.collect()
    return int(psutil.Process().memory_info().rss)


def test_memory_and_connections_stay_bounded(fuzz_server: ServerThread) -> None:
    """The same hostile round, three times after a warm-up: RSS grows by less than a
    generous bound; no connection or request is left behind."""
    messages: list[str | bytes] = [
        "x" * (2 * FRAME_LIMIT),
        b"\x93" + b"\xc0" * 3,
        json.dumps({"type": "generate", "request_id": "m", "prompt": "Hi", "params": {"n": "x"}}),
        msgpack.packb({"type": "generate", "request_id": "m", "prompt": "Hi", "params": {"max_tokens": 3}}),
        json.dumps({"type": "generate", "request_id": "m", "prompt_token_ids": [1] * 900}),
        "[" * 2000,
    ]  # fmt: skip

    async def hostile_round() -> None:
        assert fuzz_server.server is not None
        for _ in range(10):
            async with connect(fuzz_server.server) as ws:
                for message in messages:
                    await exchange(ws, message)

    trio.run(hostile_round)
    fuzz_server.wait_idle()
    before = _rss()
    for _ in range(3):
        trio.run(hostile_round)
    fuzz_server.wait_idle()
    grown = _rss() - before
    assert grown < 64 * 1024 * 1024, f"RSS grew by {grown / 2**20:.1f} MiB over 3 rounds"
    assert_still_serving(fuzz_server)


def test_nan_and_infinite_numbers_in_params(fuzz_server: ServerThread) -> None:
    """JSON (as Python writes it) and msgpack both carry NaN and infinities."""
    for field in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "max_tokens", "seed", "top_k"):  # fmt: skip
        for value in (math.nan, math.inf, -math.inf, 1e308, -0.0):
            frame = {"type": "generate", "request_id": "r", "prompt": "Hi",
                     "params": {"max_tokens": 2, field: value}}  # fmt: skip
            for message in (json.dumps(frame), msgpack.packb(frame)):
                frames = run_exchange(fuzz_server, message)
                assert frames[-1]["type"] == "error" or frames[-1]["finished"], frames
    assert_still_serving(fuzz_server)


def test_every_settable_param_has_a_type_check() -> None:
    """SamplingParams checks ranges but not every type (a dict for a bool once reached the
    detokenizer and killed the engine): the params model types every settable field."""
    from legato.server.openai_protocol import GenerateParams
    from legato.server.websocket_frames import _FIXED_PARAMS, _PARAM_FIELDS

    assert set(GenerateParams.model_fields) == _PARAM_FIELDS - _FIXED_PARAMS
