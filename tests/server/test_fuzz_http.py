"""Hostile input on the HTTP API: random bodies, wrong types for every known field, junk bytes,
wrong content types, huge bodies, junk queries, paths and methods, raw garbage on the socket.

Every answer must be a documented status with OpenAI's error body (never a 500
for client input), the server must keep serving, and nothing may pile up:
no request left in flight, RSS bounded over repeated rounds.

One server per module, in trio in a background thread (``ServerThread``), so
that hypothesis' ``@given`` drives plain synchronous tests with httpx.
"""

from __future__ import annotations

import gc
import json
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import trio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from trio_websocket import open_websocket_url

from legato.engine import open_engine
from legato.server import Server, ServerSettings, open_server

MODEL = "legato-toy"
FUZZ_ENGINE_ARGS: dict[str, Any] = dict(
    executor="inproc", max_model_len=128, num_kv_blocks=200, disable_log_stats=True
)
FUZZ_SETTINGS: dict[str, Any] = dict(
    port=0, ws_port=0, shutdown_grace=1.0, max_body_bytes=64 * 1024, max_n=2, log_requests=False
)
FUZZ = settings(
    max_examples=int(os.environ.get("LEGATO_FUZZ_EXAMPLES", "120")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class ServerThread:
    """A real server over the toy model, running in ``trio.run`` in a background thread.

    ``with ServerThread(...) as st:`` starts it and returns once it listens
    (start-up errors are raised there); leaving the block shuts it down
    gracefully and joins the thread. ``call(fn)`` runs ``fn()`` in the
    server's trio thread (to read its state safely) and returns the result.
    """

    def __init__(
        self, model_dir: Path, engine_args: dict[str, Any] | None = None, **settings: Any
    ) -> None:
        self._model_dir = model_dir
        self._engine_args = {**FUZZ_ENGINE_ARGS, **(engine_args or {})}
        self._settings = ServerSettings(**{**FUZZ_SETTINGS, **settings})
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="fuzz-server", daemon=True)
        self._error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self.server: Server | None = None

    def __enter__(self) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(120):
            raise TimeoutError("the server thread did not start within 120 s")
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: object) -> None:
        if self._token is not None and self._stop is not None:
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(60)
        assert not self._thread.is_alive(), "the server thread did not stop"
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # reported to the test thread
            self._error = exc
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._stop = trio.Event()
        async with (
            open_engine(str(self._model_dir), **self._engine_args) as engine,
            open_server(engine, self._settings, model_name=MODEL) as server,
        ):
            self.server = server
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await self._stop.wait()

    def call(self, fn: Any) -> Any:
        """``fn()`` in the server's trio thread; its result."""
        assert self._token is not None
        return trio.from_thread.run_sync(fn, trio_token=self._token)

    @property
    def http_url(self) -> str:
        assert self.server is not None
        return self.server.http_url

    @property
    def ws_url(self) -> str:
        assert self.server is not None
        return self.server.ws_url

    def run(self, async_fn: Any) -> Any:
        """``await async_fn()`` in the server's trio thread; its result."""
        assert self._token is not None
        return trio.from_thread.run(async_fn, trio_token=self._token)

    def assert_engine_alive(self) -> None:
        """Fail (on the example that did it) if client input has killed the engine."""
        error = self.call(
            lambda: self.server.state.engine.supervisor.dead_error  # type: ignore[union-attr]
        )
        assert error is None, f"client input killed the engine: {error!r} ({error.__cause__!r})"

    def num_live(self) -> int:
        """Requests in flight, read in the server's thread."""
        return int(self.call(lambda: self.server.state.num_live))  # type: ignore[union-attr]

    def wait_idle(self, seconds: float = 10.0) -> None:
        """Block until no request is in flight; fail after ``seconds``."""

        async def idle() -> None:
            with trio.fail_after(seconds):
                await self.server.state.wait_idle()  # type: ignore[union-attr]

        self.run(idle)


@pytest.fixture(scope="module")
def fuzz_server(toy_model_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(toy_model_dir) as server:
        yield server


@pytest.fixture(scope="module")
def http(fuzz_server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fuzz_server.http_url, timeout=60) as client:
        yield client


# ------------------------------------------------------------------ what an answer may be

DOCUMENTED = {
    400: {"invalid_json", "invalid_value"},
    401: {"invalid_api_key"},
    404: {"not_found", "model_not_found", "previous_response_not_found"},
    405: {"method_not_allowed"},
    413: {"body_too_large"},
    408: {"request_timeout"},
    415: {"unsupported_media_type"},
}


def check_answer(response: httpx.Response, *, allowed: set[int]) -> None:
    """A documented status; errors have OpenAI's body with a documented code; 200s parse."""
    status = response.status_code
    assert status in allowed, (status, response.text[:500])
    if response.request.method == "HEAD":
        return
    if status != 200:
        body = response.json()
        assert set(body) == {"error"}, body
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["code"] in DOCUMENTED[status], error
        assert isinstance(error["message"], str) and error["message"], error
        assert error["param"] is None or isinstance(error["param"], str), error
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in response.text.split("\n") if line]
        assert events[-1] == "data: [DONE]", events[-3:]
        for event in events[:-1]:
            assert event.startswith("data: "), event
            chunk = json.loads(event[len("data: ") :])
            assert "error" not in chunk, chunk  # an error event is for engine death only
    elif response.headers["content-type"].startswith("application/json"):
        response.json()


def assert_still_serving(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
    assert http.get("/health").status_code == 200


# ------------------------------------------------------------------ strategies

TEXT = st.text(st.characters(exclude_categories=()) | st.characters(categories=["Cs"]), max_size=12)
NUMBERS = (
    st.integers(min_value=-(2**70), max_value=2**70)
    | st.integers(min_value=-3, max_value=140)
    | st.floats()
    | st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324])
)
SCALARS = st.none() | st.booleans() | NUMBERS | TEXT
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=10,
)
# Values that get past the type checks more often, so that the engine sees them.
PLAUSIBLE = (
    JSON_VALUES
    | st.lists(st.integers(min_value=-2, max_value=70000), min_size=1, max_size=6)
    | st.lists(TEXT, min_size=1, max_size=3)
    | st.dictionaries(st.integers(-2, 70000).map(str), NUMBERS, max_size=3)
    | st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})
    | st.fixed_dictionaries({"include_usage": JSON_VALUES})
    | st.lists(st.fixed_dictionaries({"role": JSON_VALUES, "content": JSON_VALUES}), max_size=2)
)

SAMPLING_FIELDS = [
    "temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty",
    "logit_bias", "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens",
    "stop_token_ids", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "truncate_prompt_tokens", "allowed_token_ids", "bad_words",
]  # fmt: skip
COMMON_FIELDS = [
    "model", "stream", "stream_options", "priority", "user", "tools", "functions",
    "tool_choice", "response_format", "max_tokens", "logprobs", "best_of",
]  # fmt: skip
ENDPOINTS: dict[str, tuple[dict[str, Any], list[str]]] = {
    # path: (a valid body, the fields it knows)
    "/v1/completions": (
        {"prompt": "Hi", "max_tokens": 2},
        ["prompt", "echo", "suffix", *COMMON_FIELDS, *SAMPLING_FIELDS],
    ),
    "/v1/chat/completions": (
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        [
            "messages",
            "max_completion_tokens",
            "top_logprobs",
            "add_generation_prompt",
            *COMMON_FIELDS,
            *SAMPLING_FIELDS,
        ],
    ),  # fmt: skip
    "/tokenize": (
        {"prompt": "hi"},
        ["prompt", "messages", "add_special_tokens", "add_generation_prompt", "model"],
    ),
    "/detokenize": ({"tokens": [5, 6]}, ["tokens", "model"]),
    "/v1/completions/render": (
        {"prompt": "Hi", "max_tokens": 2},
        ["prompt", "echo", "suffix", *COMMON_FIELDS, *SAMPLING_FIELDS],
    ),
    "/v1/chat/completions/render": (
        {"messages": [{"role": "user", "content": "hi"}]},
        [
            "messages",
            "max_completion_tokens",
            "add_generation_prompt",
            *COMMON_FIELDS,
            *SAMPLING_FIELDS,
        ],
    ),  # fmt: skip
}
POST_ALLOWED = {200, 400, 404, 413, 415}
JSON_TYPE = {"content-type": "application/json"}


@st.composite
def mutated_bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """An endpoint and its valid body with 1-3 known fields set to hostile values."""
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    base, fields = ENDPOINTS[path]
    body = dict(base)
    for field in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True)):
        body[field] = draw(PLAUSIBLE)
    return path, body


def post_json(http: httpx.Client, path: str, value: Any) -> httpx.Response:
    """POST ``value`` as JSON the way Python writes it (NaN and lone surrogates included)."""
    content = json.dumps(value).encode()
    return http.post(path, content=content, headers={"content-type": "application/json"})


# ------------------------------------------------------------------ the fuzzers


@FUZZ
@given(case=mutated_bodies())
def test_known_fields_with_hostile_values(
    fuzz_server: ServerThread, http: httpx.Client, case: tuple[str, dict[str, Any]]
) -> None:
    path, body = case
    check_answer(post_json(http, path, body), allowed=POST_ALLOWED)
    fuzz_server.assert_engine_alive()


@FUZZ
@given(path=st.sampled_from(sorted(ENDPOINTS)), value=JSON_VALUES)
def test_random_json_values_as_bodies(
    fuzz_server: ServerThread, http: httpx.Client, path: str, value: Any
) -> None:
    check_answer(post_json(http, path, value), allowed=POST_ALLOWED)
    fuzz_server.assert_engine_alive()


@FUZZ
@given(
    path=st.sampled_from(sorted(ENDPOINTS)),
    body=st.binary(max_size=300)
    | st.sampled_from([b"", b"{", b"[" * 5000, b'{"prompt": "\xff\xfe"}', b"\x00" * 64])
    | st.text(max_size=50).map(lambda t: f'{{"prompt": "{t}'.encode(errors="surrogatepass")),
    content_type=st.sampled_from(
        ["application/json", "text/plain", "application/x-www-form-urlencoded",
         "multipart/form-data; boundary=x", "application/msgpack", "", "json; charset=ebcdic"]
    ),
)  # fmt: skip
def test_random_bytes_and_content_types(
    http: httpx.Client, path: str, body: bytes, content_type: str
) -> None:
    check_answer(
        http.post(path, content=body, headers={"content-type": content_type}),
        allowed=POST_ALLOWED,
    )


@FUZZ
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
    path=st.sampled_from(["/v1/models", "/health", "/metrics", "/version", *ENDPOINTS])
    | st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=20).map(
        lambda t: "/" + "".join(c for c in t if c not in "?#%").lstrip("/")  # no "//host"
    ),
    query=st.dictionaries(TEXT, TEXT, max_size=3),
    body=st.binary(max_size=100),
)
def test_methods_paths_queries_and_bodies(
    http: httpx.Client, method: str, path: str, query: dict[str, str], body: bytes
) -> None:
    def clean(text: str) -> str:
        return text.encode(errors="replace").decode()

    response = http.request(
        method, path, params={clean(k): clean(v) for k, v in query.items()}, content=body
    )
    if method == "GET":
        allowed = {200, 404, 405}
    elif method == "POST" and path in ENDPOINTS:
        allowed = POST_ALLOWED
    else:
        allowed = {404, 405}
    check_answer(response, allowed=allowed)


def test_every_known_field_with_every_wrong_type(
    fuzz_server: ServerThread, http: httpx.Client
) -> None:
    wrong: list[Any] = [
        None, True, False, -1, 0, 2**64, 1.5, math.nan, math.inf, "", "s", "\ud800",
        [], [1], ["a"], [[1]], {}, {"a": 1}, {"1": "x"}, [None], "x" * 3000,
    ]  # fmt: skip
    for path, (base, fields) in ENDPOINTS.items():
        for field in fields:
            for value in wrong:
                response = post_json(http, path, {**base, field: value})
                check_answer(response, allowed=POST_ALLOWED)
                fuzz_server.assert_engine_alive()
    assert_still_serving(http)
    fuzz_server.wait_idle()


def test_huge_bodies_get_413_and_the_server_keeps_serving(http: httpx.Client) -> None:
    """Sent whole before the answer is read (as httpx does): a body up to 4x the limit is
    read and dropped, so the client gets its 413; a far larger one may be cut off instead."""
    limit = FUZZ_SETTINGS["max_body_bytes"]

    def chunks(body: bytes) -> Iterator[bytes]:  # no Content-Length: the limit counts bytes
        for start in range(0, len(body), 8192):
            yield body[start : start + 8192]

    for path in ENDPOINTS:
        for size in (limit + 1, 2 * limit, 3 * limit, 64 * limit):
            body = b'{"prompt": "' + b"x" * size + b'"}'
            for content in (body, chunks(body)):
                try:
                    response = http.post(path, content=content, headers=JSON_TYPE)
                except (httpx.RemoteProtocolError, httpx.WriteError):
                    assert size > 4 * limit
                    continue
                check_answer(response, allowed={413})
                assert response.headers["connection"] == "close"  # answered unread
        # just under the limit: a valid body with a prompt far too long for the model
        body = json.dumps({**ENDPOINTS[path][0], "prompt": "ab " * (limit // 4)}).encode()
        assert len(body) <= limit
        check_answer(http.post(path, content=body, headers=JSON_TYPE), allowed={200, 400})
    assert_still_serving(http)


WS_KEY = b"dGhlIHNhbXBsZSBub25jZQ=="
RAW_HEADERS = [
    # whole upgrade requests, so that the fragile paths are reached often
    b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
    b"Sec-WebSocket-Key: " + WS_KEY,
    b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
    b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA",
    b"Host: localhost",
    b"Host: localhost\r\nHost: y",
    b"Connection: Upgrade",
    b"Connection: keep-alive",
    b"Connection: close",
    b"Connection: Upgrade, HTTP2-Settings",
    b"Upgrade: websocket",
    b"Upgrade: h2c",
    b"Upgrade: \xff\xfe",
    b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA",
    b"Sec-WebSocket-Key: " + WS_KEY,
    b"Sec-WebSocket-Version: 13",
    b"Sec-WebSocket-Version: 99",
    b"Transfer-Encoding: chunked",
    b"Transfer-Encoding: gzip, chunked",
    b"Transfer-Encoding: bogus",
    b"Content-Length: 5",
    b"Content-Length: 0",
    b"Content-Length: -1",
    b"Content-Length: 99999999999999999999",
    b"Content-Length: 3\r\nContent-Length: 4",
    b"Expect: 100-continue",
    b"Content-Type: application/json",
    b"Authorization: Bearer x",
    b"X-Long: " + b"a" * 9000,
    b" folded-continuation",
    b"no colon here",
    b"\x00: \x00",
]
RAW_TAILS = [
    b"",
    b"hello",
    b'{"prompt": "x", "max_tokens": 1}',
    b"5\r\nhello\r\n0\r\n\r\n",
    b"ffffffffffffffffff\r\n",
    b"\x81\x05hello",  # an unmasked WebSocket frame
    b"\x88\x80\x00\x00\x00\x00junk",  # a close frame, then junk
    b"\x81\xff" + b"\xff" * 8 + b"\x00" * 4,  # a frame claiming 2**64 bytes
    b"\x00\x00\x12\x04\x00\x00\x00\x00\x00",  # an HTTP/2 SETTINGS frame
    b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n",  # a pipelined second request
]


@st.composite
def raw_requests(draw: st.DrawFn) -> list[bytes]:
    """Bytes that look enough like HTTP (or a WebSocket / HTTP/2 upgrade) to get past the
    first checks, with junk where a parser is most fragile; cut into 1-4 packets."""
    if draw(st.integers(0, 9)) == 0:
        data = draw(st.binary(min_size=1, max_size=400))
    elif draw(st.integers(0, 9)) == 0:
        data = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + draw(st.binary(max_size=64))
    else:
        method = draw(st.sampled_from([b"GET", b"POST", b"HEAD", b"OPTIONS", b"G\xffT", b""]))
        path = draw(
            st.sampled_from([b"/", b"/v1/models", b"/v1/completions", b"/health", b"*", b"//x"])
        )
        version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/9", b""]))
        headers = draw(st.lists(st.sampled_from(RAW_HEADERS), max_size=7))
        if draw(st.integers(0, 4)):  # HTTP/1.1 needs a Host: without it, h11 stops at a 400
            headers.insert(0, b"Host: localhost")
        tail = draw(st.sampled_from(RAW_TAILS)) + draw(st.binary(max_size=32))
        data = method + b" " + path + b" " + version + b"\r\n"
        data += b"".join(h + b"\r\n" for h in headers) + b"\r\n" + tail
    cuts = sorted(draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=3, unique=True)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)]) if data[a:b]]


def _send_raw(url: str, packets: list[bytes]) -> bytes:
    """Send the packets (a pause between them), half-close, read until the server closes."""
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    answer = b""
    with socket.create_connection((host, int(port)), timeout=15) as sock:
        try:
            for packet in packets:
                sock.sendall(packet)
                time.sleep(0.002)  # separate TCP segments, as a slow client sends them
            sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(65536):
                answer += chunk
        except TimeoutError:
            raise  # the server neither answered nor closed: a hang
        except OSError:
            pass  # the server may cut a hostile connection short (reset, not connected)
    return answer


def assert_both_ports_serve(fuzz_server: ServerThread, http: httpx.Client) -> None:
    """The HTTP port answers, a WebSocket request completes, the engine is alive."""
    assert http.get("/health").status_code == 200

    async def ws_round_trip() -> None:
        async with open_websocket_url(fuzz_server.ws_url + "/") as ws:
            frame = {"type": "generate", "request_id": "alive", "prompt": "hi"}
            await ws.send_message(json.dumps({**frame, "params": {"max_tokens": 1}}))
            with trio.fail_after(30):
                while not json.loads(await ws.get_message()).get("finished"):
                    pass

    trio.run(ws_round_trip)
    fuzz_server.assert_engine_alive()


# No 101: the HTTP port switches to no other protocol (WebSocket has a port of its own).
# 415: a JSON route given a body without Content-Type: application/json (no web page may
# drive the API with a "simple" text/plain request); 408: a body that never arrives.
RAW_ANSWER_STATUSES = {200, 400, 401, 403, 404, 405, 408, 413, 415, 417, 426, 431, 500, 501, 505}


@settings(FUZZ, max_examples=max(10, FUZZ.max_examples // 3))
@given(packets=raw_requests(), port=st.sampled_from(["http", "ws"]))
@example(  # hypercorn answers "100 Continue" before the final 404
    packets=[b"GET / HTTP/2.0\r\nHost: localhost\r\nExpect: 100-continue\r\n\r\n"], port="http"
)
@example(  # hypercorn switched to HTTP/2 (101), then never closed when the client hung up
    packets=[b"GET /health HTTP/1.1\r\nHost: localhost\r\nUpgrade: h2c\r\n\r\n"], port="http"
)
@example(packets=[b"GET /health HTTP/1.0\r\nHost: localhost\r\nUpgrade: h2c\r\n\r\n"], port="http")
@example(
    packets=[b"GET /health HTTP/1.0\r\nHost: localhost\r\nUpgrade: h2c\r\nUpgrade: h2c\r\n\r\n"],
    port="http",
)
def test_raw_bytes_on_both_ports(
    fuzz_server: ServerThread, http: httpx.Client, packets: list[bytes], port: str
) -> None:
    """Raw bytes, HTTP-shaped or not, on either port: that connection may get an error
    answer or be closed, and nothing else changes (one crafted packet once killed the
    whole server). An HTTP answer, if any, has a status the server documents, and the
    server closes the connection within its timeouts."""
    url = fuzz_server.http_url if port == "http" else fuzz_server.ws_url
    answer = _send_raw(url, packets)
    while answer.startswith(b"HTTP/1.1 100 ") and b"\r\n\r\n" in answer:
        # an interim "100 Continue" (a request with Expect: 100-continue): the final answer follows
        answer = answer.split(b"\r\n\r\n", 1)[1]
    if answer.startswith(b"HTTP/1.1 ") and port == "http":
        status = int(answer.split(b" ", 2)[1])
        assert status in RAW_ANSWER_STATUSES, answer[:300]
        if status == 500:  # only the server's own answer to an app that broke mid-response
            assert b"legato" not in answer, answer[:300]
    assert_both_ports_serve(fuzz_server, http)


def test_the_one_packet_that_killed_the_server(
    fuzz_server: ServerThread, http: httpx.Client
) -> None:
    """issue 11: a GET /v1/models carrying WebSocket upgrade headers and trailing bytes in
    the same packet made h11 raise LocalProtocolError out of hypercorn, and the process exit."""
    packet = (
        b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Sec-WebSocket-Key: " + WS_KEY + b"\r\nSec-WebSocket-Version: 13\r\n\r\ntrailing"
    )
    for url in (fuzz_server.http_url, fuzz_server.ws_url):
        _send_raw(url, [packet])
        assert_both_ports_serve(fuzz_server, http)


def _rss() -> int:
    gc.collect()
    return int(psutil.Process().memory_info().rss)


def test_memory_and_in_flight_state_stay_bounded(
    fuzz_server: ServerThread, http: httpx.Client
) -> None:
    """The same hostile round, twice after a warm-up: RSS grows by less than a generous bound."""
    limit = FUZZ_SETTINGS["max_body_bytes"]

    def hostile_round() -> None:
        for i in range(40):
            path = sorted(ENDPOINTS)[i % len(ENDPOINTS)]
            post_json(http, path, {**ENDPOINTS[path][0], "stop": [i] * 50, "n": "x"})
            http.post(path, content=b'{"prompt": "' + b"y" * (2 * limit) + b'"}')
            http.post(path, content=bytes(range(256)) * 4)
            http.post(path, content=b"[" * 3000)
            post_json(http, path, {**ENDPOINTS[path][0], "max_tokens": 3, "stream": i % 2 == 0})

    hostile_round()
    fuzz_server.wait_idle()
    before = _rss()
    for _ in range(3):
        hostile_round()
    fuzz_server.wait_idle()
    grown = _rss() - before
    assert grown < 64 * 1024 * 1024, f"RSS grew by {grown / 2**20:.1f} MiB over 3 rounds"
    assert fuzz_server.num_live() == 0
    assert_still_serving(http)


# ------------------------------------------------------------------ the agent APIs

AGENT_ENDPOINTS: dict[str, tuple[dict[str, Any], list[str]]] = {
    # path: (a valid body, the fields it knows)
    "/v1/responses": (
        {"input": "Hi", "max_output_tokens": 2},
        [
            "model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
            "tools", "tool_choice", "parallel_tool_calls", "text", "reasoning", "stream",
            "store", "background", "previous_response_id", "metadata", "user", "top_k",
            "seed", "priority",
        ],
    ),
    "/v1/messages": (
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        [
            "model", "messages", "max_tokens", "system", "stop_sequences", "temperature",
            "top_p", "top_k", "stream", "tools", "tool_choice", "metadata", "output_config",
        ],
    ),
    "/v1/messages/count_tokens": (
        {"messages": [{"role": "user", "content": "hi"}]},
        ["model", "messages", "system", "tools", "tool_choice"],
    ),
}  # fmt: skip
AGENT_VALUES = (
    PLAUSIBLE
    | st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["function_call", "function_call_output", "tool_use",
                                      "tool_result", "text", "message", "image"]),
             "call_id": JSON_VALUES, "output": JSON_VALUES, "text": JSON_VALUES,
             "id": JSON_VALUES, "name": JSON_VALUES, "input": JSON_VALUES}
        ),
        max_size=3,
    )
    | st.fixed_dictionaries({"format": st.fixed_dictionaries({"type": JSON_VALUES, "schema": JSON_VALUES})})
)  # fmt: skip


def check_agent_answer(path: str, response: httpx.Response) -> None:
    """A documented status; errors in the API's own shape; streams end as the API says."""
    status = response.status_code
    assert status in POST_ALLOWED, (status, response.text[:500])
    anthropic = path.startswith("/v1/messages")
    if status != 200:
        body = response.json()
        if anthropic:
            assert set(body) == {"type", "error"} and body["type"] == "error", body
            assert set(body["error"]) == {"type", "message"}, body
            assert body["error"]["message"], body
        else:
            assert set(body) == {"error"} and body["error"]["code"] in DOCUMENTED[status], body
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        names = [line[7:] for line in response.text.split("\n") if line.startswith("event: ")]
        assert "error" not in names, response.text[-500:]  # an error event is for engine death
        assert names[-1] == ("message_stop" if anthropic else "response.completed"), names[-3:]
    else:
        response.json()


@st.composite
def agent_bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """An agent endpoint and its valid body with 1-3 known fields set to hostile values."""
    path = draw(st.sampled_from(sorted(AGENT_ENDPOINTS)))
    base, fields = AGENT_ENDPOINTS[path]
    body = dict(base)
    for field in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True)):
        body[field] = draw(AGENT_VALUES)
    return path, body


@FUZZ
@given(case=agent_bodies())
def test_agent_api_fields_with_hostile_values(
    fuzz_server: ServerThread, http: httpx.Client, case: tuple[str, dict[str, Any]]
) -> None:
    path, body = case
    check_agent_answer(path, post_json(http, path, body))
    fuzz_server.assert_engine_alive()


def test_every_agent_api_field_with_every_wrong_type(
    fuzz_server: ServerThread, http: httpx.Client
) -> None:
    wrong: list[Any] = [
        None, True, -1, 0, 2**64, 1.5, math.nan, math.inf, "", "s", "\ud800",
        [], [1], ["a"], [{}], {}, {"a": 1}, {"type": "tool"}, [None], "x" * 3000,
    ]  # fmt: skip
    for path, (base, fields) in AGENT_ENDPOINTS.items():
        for field in fields:
            for value in wrong:
                check_agent_answer(path, post_json(http, path, {**base, field: value}))
                fuzz_server.assert_engine_alive()
    assert_still_serving(http)
    fuzz_server.wait_idle()


# ------------------------------------------------------------------ stored responses

RESPONSE_IDS = (
    TEXT
    | st.from_regex(r"resp_[0-9a-f]{0,40}", fullmatch=True)
    | st.text(alphabet="abc_-/.%?#", max_size=200)
)


@FUZZ
@given(
    response_id=RESPONSE_IDS,
    method=st.sampled_from(["GET", "DELETE", "POST", "PUT"]),
    cancel=st.booleans(),
)
def test_stored_response_routes_with_hostile_ids(
    fuzz_server: ServerThread, http: httpx.Client, response_id: str, method: str, cancel: bool
) -> None:
    quoted = "".join(c if c.isascii() and c.isalnum() else f"%{ord(c):02X}" for c in response_id)
    response = http.request(method, f"/v1/responses/{quoted}" + ("/cancel" if cancel else ""))
    check_answer(response, allowed={200, 400, 404, 405})
    fuzz_server.assert_engine_alive()


def test_continuations_and_background_with_every_wrong_type(
    fuzz_server: ServerThread, http: httpx.Client
) -> None:
    """Every field of a continuation of a stored response (and of a background one) with
    every wrong type: documented answers, and the engine and the store stay whole."""
    stored = post_json(http, "/v1/responses", {"input": "Hi", "max_output_tokens": 2}).json()
    wrong: list[Any] = [None, True, -1, 2**64, math.nan, "", "\ud800", [], [{}], {"a": 1}]
    base, fields = AGENT_ENDPOINTS["/v1/responses"]
    for extra in ({"previous_response_id": stored["id"]}, {"background": True}):
        for field in fields:
            for value in wrong:
                body = {**base, **extra, field: value}
                check_agent_answer("/v1/responses", post_json(http, "/v1/responses", body))
                fuzz_server.assert_engine_alive()
    fuzz_server.wait_idle(60)  # max_output_tokens=None runs a background one to the limit
    kept = http.get(f"/v1/responses/{stored['id']}")
    assert kept.status_code == 200 and kept.json()["output"] == stored["output"]
    assert_still_serving(http)
