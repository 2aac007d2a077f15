"""Hostile sampling parameters and request bodies through the real engine and its worker
process: whatever a caller sends, through Python, HTTP or the WebSocket, fails alone with a
ValidationError (a 400, an ``invalid_request`` frame) or runs; the engine stays alive.

Values are chosen to hit the fatal paths found in review: integers past 64 bits, -1
sentinels, free-form ``extra_args`` (non-string keys, deep nesting), huge stop strings and
token lists fanned out over ``n`` children, non-finite numbers.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from legato.protocol.errors import ValidationError
from legato.protocol.params import SamplingParams

from .test_fuzz_http import MODEL, ServerThread
from .test_websocket import connect

FUZZ = settings(
    max_examples=int(os.environ.get("LEGATO_FUZZ_EXAMPLES", "40")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

BIG_INTS = st.sampled_from([-1, -(2**63) - 1, 2**63, 2**64, 2**70, 10**30])
ODD_NUMBERS = st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 1e308])
HOSTILE_EXTRA = st.recursive(
    st.none() | st.booleans() | BIG_INTS | st.integers() | st.text(max_size=4) | ODD_NUMBERS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=12,
)
HOSTILE: dict[str, st.SearchStrategy[Any]] = {
    "n": st.integers(1, 16) | BIG_INTS,
    "logprobs": st.sampled_from([-1, 0, 5, 20, 21]) | BIG_INTS,
    "prompt_logprobs": st.sampled_from([-1, 0, 5, 20, 21]) | BIG_INTS,
    "seed": st.integers(0, 2**63 - 1) | BIG_INTS,
    "top_k": st.integers(-1, 5000) | BIG_INTS,
    "temperature": st.floats(0, 3) | ODD_NUMBERS,
    "min_tokens": st.integers(0, 3) | BIG_INTS,
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3)
    | st.sampled_from([["Z" * 200_000], ["a"] * 5000]),
    "stop_token_ids": st.lists(st.integers(0, 3000) | BIG_INTS, max_size=4),
    "allowed_token_ids": st.lists(st.integers(0, 2100) | BIG_INTS, min_size=1, max_size=4)
    | st.just(list(range(2048)) * 20),
    "logit_bias": st.dictionaries(st.integers(0, 2100) | BIG_INTS, st.floats(-100, 100), max_size=3)
    | st.just({str(i): 1.0 for i in range(2048)}),
    "bad_words": st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "extra_args": st.dictionaries(st.text(max_size=4), HOSTILE_EXTRA, max_size=3)
    | st.just({"deep": [[[[[[[[[[1]]]]]]]]]]})
    | st.just({"k": 2**64}),
    "structured_outputs": st.sampled_from(
        [{"regex": "[ab]+"}, {"choice": ["x", "y"]}, {"json": {"type": "object"}}, {"bogus": 1}]
    ),
}
hostile_params = st.fixed_dictionaries({"max_tokens": st.integers(1, 3)}, optional=HOSTILE)


@pytest.fixture(scope="module")
def engine_server(toy_model_dir: Path) -> Iterator[ServerThread]:
    """The toy model with its worker in a child process (the path that can die)."""
    with ServerThread(
        toy_model_dir,
        engine_args=dict(executor="process", max_model_len=256, num_kv_blocks=400),
        max_body_bytes=1024 * 1024,
        max_n=16,
    ) as server:
        yield server


@FUZZ
@given(kwargs=hostile_params)
def test_hostile_sampling_params_fail_alone_in_python(
    engine_server: ServerThread, kwargs: dict[str, Any]
) -> None:
    async def generate() -> None:
        engine = engine_server.server.state.engine  # type: ignore[union-attr]
        try:
            params = SamplingParams(**kwargs)
        except ValidationError:
            return
        try:
            with trio.fail_after(120):
                async for _ in engine.generate([5, 6, 7], params, request_id=f"py{id(kwargs)}"):
                    pass
        except ValidationError as exc:
            assert exc.field and exc.reason

    engine_server.run(generate)
    engine_server.assert_engine_alive()


def _body(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {"model": MODEL, "prompt": [[5, 6]] * 4, **kwargs}


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body, allow_nan=True).encode()


@FUZZ
@given(kwargs=hostile_params)
def test_hostile_completion_bodies_fail_alone_over_http(
    engine_server: ServerThread, kwargs: dict[str, Any]
) -> None:
    answer = httpx.post(
        f"{engine_server.http_url}/v1/completions",
        content=_json(_body(kwargs)),
        headers={"content-type": "application/json"},
        timeout=120,
    )
    assert answer.status_code in (200, 400), answer.text
    if answer.status_code == 400:
        assert answer.json()["error"]["message"]
    engine_server.assert_engine_alive()


@FUZZ
@given(kwargs=hostile_params, binary=st.booleans())
def test_hostile_generate_frames_fail_alone_over_the_websocket(
    engine_server: ServerThread, kwargs: dict[str, Any], binary: bool
) -> None:
    frame = {"type": "generate", "request_id": "x", "prompt": "hi", "params": kwargs}

    async def exchange() -> None:
        with trio.fail_after(120):
            await _exchange()

    async def _exchange() -> None:
        async with connect(engine_server.server) as ws:  # type: ignore[arg-type]
            if binary:
                try:
                    data: str | bytes = msgpack.packb(frame, strict_types=False)
                except (OverflowError, TypeError):
                    return  # msgpack cannot carry the value at all
                if isinstance(kwargs.get("extra_args"), dict):  # non-string keys, as msgpack can
                    frame["params"]["extra_args"] = {7: "x", **kwargs["extra_args"]}
                    data = msgpack.packb(frame)
            else:
                data = json.dumps(frame, allow_nan=True)
            await ws.send_message(data)
            while True:
                message = await ws.get_message()
                reply = (
                    json.loads(message) if isinstance(message, str) else msgpack.unpackb(message)
                )
                if reply["type"] == "error":
                    assert reply["code"] in ("invalid_request", "invalid_frame"), reply
                    return
                if reply.get("finished"):
                    return

    trio.run(exchange)
    engine_server.assert_engine_alive()


def test_the_review_reproductions_leave_the_engine_alive(engine_server: ServerThread) -> None:
    """F3: one ~1 MB stop string fanned out over 64 prompts x 16 children; F4: an int past
    64 bits in extra_args; F5: prompt_logprobs -1."""
    url = f"{engine_server.http_url}/v1/completions"
    body = {"model": MODEL, "prompt": [[5, 6]] * 64, "n": 16, "max_tokens": 1}
    answer = httpx.post(url, json={**body, "stop": ["Z" * 900_000]}, timeout=300)
    assert answer.status_code in (200, 400), answer.text
    engine_server.assert_engine_alive()
    answer = httpx.post(url, json={**body, "n": 1, "logprobs": -1}, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "logprobs"

    async def frames() -> list[dict[str, Any]]:
        replies = []
        async with connect(engine_server.server) as ws:  # type: ignore[arg-type]
            hostile = [
                {"max_tokens": 2, "extra_args": {"k": 2**64}},
                {"max_tokens": 1, "prompt_logprobs": -1},
            ]
            for i, params in enumerate(hostile):
                frame = {"type": "generate", "request_id": f"r{i}", "prompt": "hi"}
                await ws.send_message(json.dumps({**frame, "params": params}))
                replies.append(json.loads(await ws.get_message()))
        return replies

    first, second = trio.run(frames)
    assert first["type"] == "error" and first["param"] == "params.extra_args", first
    assert second["type"] == "error" and second["param"] == "params.prompt_logprobs", second
    assert httpx.get(f"{engine_server.http_url}/health").status_code == 200
    engine_server.assert_engine_alive()
