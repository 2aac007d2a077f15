"""Hostile bodies and frames against a real ``legato serve toy`` subprocess (issue 26).

Both ports on loopback, with its worker in a child process (the path a bad input could
kill): hostile HTTP requests (wrong content types, foreign Host and Origin, hostile
sampling fields, a request template) and WebSocket frames (hostile params, foreign
Origin, msgpack with non-string keys), bounded in count (``LEGATO_FUZZ_EXAMPLES``) and
in time. It ends with the engine alive: ``/health`` 200 and a request served.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import msgpack
import pytest
import trio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from trio_websocket import HandshakeError, open_websocket_url

from .test_fuzz_engine_params import HOSTILE, hostile_params

EXAMPLES = int(os.environ.get("LEGATO_FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
DOCUMENTED_HTTP = {200, 400, 403, 404, 408, 413, 415, 503}


class ServeToy:
    """``legato serve toy`` on free loopback ports, in a subprocess."""

    def __init__(self) -> None:
        command = [
            sys.executable, "-m", "legato.cli", "serve", "toy", "--port", "0", "--ws-port", "0",
            "--max-model-len", "256", "--num-kv-blocks", "400", "--disable-log-requests",
            "--disable-log-stats",
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ.copy()
        )
        assert self.process.stdout is not None
        output = b""
        while b"listening on" not in output:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"legato serve toy did not start: {output.decode()}")
            output += line
        match = re.search(rb"listening on (http://\S+) and (ws://\S+)", output)
        assert match is not None, output
        self.http_url, self.ws_url = match.group(1).decode(), match.group(2).decode()

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def serve_toy() -> Iterator[ServeToy]:
    server = ServeToy()
    try:
        yield server
    finally:
        server.close()
    assert server.process.returncode is not None


def assert_alive(server: ServeToy) -> None:
    assert server.process.poll() is None, "legato serve exited"
    health = httpx.get(f"{server.http_url}/health", timeout=30)
    assert health.status_code == 200, health.text


@FUZZ
@given(
    kwargs=hostile_params,
    route=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize"]),
    content_type=st.sampled_from(["application/json", "text/plain", ""]),
    host=st.sampled_from([None, "rebind.evil.example", "localhost"]),
    origin=st.sampled_from([None, "http://evil.example", "null"]),
    template=st.sampled_from([None, "{% for a in range(99999) %}{% endfor %}"]),
)
def test_hostile_http_requests(
    serve_toy: ServeToy,
    kwargs: dict[str, Any],
    route: str,
    content_type: str,
    host: str | None,
    origin: str | None,
    template: str | None,
) -> None:
    body: dict[str, Any] = {**kwargs, "model": "legato-toy"}
    if route == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
        if template is not None:
            body["chat_template"] = template
    else:
        body["prompt"] = "hi"
    headers = {"content-type": content_type}
    if host is not None:
        headers["host"] = host
    if origin is not None:
        headers["origin"] = origin
    answer = httpx.post(
        serve_toy.http_url + route,
        content=json.dumps(body, allow_nan=True).encode(),
        headers=headers,
        timeout=120,
    )
    assert answer.status_code in DOCUMENTED_HTTP, (answer.status_code, answer.text[:300])
    if answer.status_code != 200:
        assert answer.json()["error"]["message"]
    assert_alive(serve_toy)


@FUZZ
@given(
    params=hostile_params,
    binary=st.booleans(),
    origin=st.sampled_from([None, "http://evil.example", "null"]),
    junk=st.sampled_from([None, b"\xc1", b"\x00" * 8, "{" * 3000]),
)
# Found by the fuzz: the grammar and allowed_token_ids leave no common token, the request
# fails while generating, and that ConstraintFailedError must reach the client as an
# error frame naming params.structured_outputs.regex (it once closed the socket with 1011).
@example(
    params={"max_tokens": 2, "structured_outputs": {"regex": "[ab]+"}, "allowed_token_ids": [0]},
    binary=False,
    origin=None,
    junk=None,
)
def test_hostile_websocket_frames(
    serve_toy: ServeToy,
    params: dict[str, Any],
    binary: bool,
    origin: str | None,
    junk: bytes | str | None,
) -> None:
    frame = {"type": "generate", "request_id": "x", "prompt": "hi", "params": params}

    async def exchange() -> None:
        headers = [] if origin is None else [("Origin", origin)]
        try:
            async with open_websocket_url(serve_toy.ws_url + "/", extra_headers=headers) as ws:
                assert origin is None, "a foreign Origin was accepted"
                if junk is not None:
                    await ws.send_message(junk)
                    await ws.get_message()
                if binary:
                    try:
                        data: str | bytes = msgpack.packb({**frame, "params": {**params, 7: 1}})
                    except (OverflowError, TypeError):
                        return
                else:
                    data = json.dumps(frame, allow_nan=True)
                await ws.send_message(data)
                while True:
                    message = await ws.get_message()
                    reply = (
                        json.loads(message)
                        if isinstance(message, str)
                        else msgpack.unpackb(message)
                    )
                    if reply["type"] == "error" or reply.get("finished"):
                        return
        except HandshakeError as exc:
            assert origin is not None and getattr(exc, "status_code", None) == 403, exc

    async def bounded() -> None:
        with trio.fail_after(120):
            await exchange()

    trio.run(bounded)
    assert_alive(serve_toy)


def test_after_the_fuzz_the_engine_serves(serve_toy: ServeToy) -> None:
    assert HOSTILE  # the same hostile values as the in-process fuzz
    assert_alive(serve_toy)
    body = {"model": "legato-toy", "prompt": "hello", "max_tokens": 3}
    answer = httpx.post(f"{serve_toy.http_url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1
