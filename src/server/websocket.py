"""The WebSocket streaming endpoint (trio-websocket): many concurrent requests per connection.

Protocol (see ``docs/websocket.md``): text frames carry JSON, binary frames
the same objects in msgpack. Client frames are ``generate``, ``embed``,
``abort`` and ``auth``; server frames are ``output`` (one per completion per
engine step, DELTA text), ``embedding`` (an ``embed`` request's vectors, in
one frame) and ``error``. Each request is answered in the encoding of the
frame that started it; an error about a frame comes in that frame's encoding.

Every connection owns a nursery with one task per request; when the client
closes the connection (or it breaks), the nursery is cancelled and every
request of the connection is aborted in the engine. Bad frames, oversized
frames, unknown parameters, duplicate live ids and too many concurrent
requests get an ``error`` frame; the connection stays open. Only an
authentication failure closes it (code 1008), and a frame beyond the hard
size limit (4x ``ws_max_frame_bytes``) closes it with 1009 (trio-websocket
cannot answer it without buffering it).

The frames themselves (decoding, parsing, the server's frames) are
``websocket_frames``'. Imports trio; never torch.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import time
from collections.abc import Mapping
from typing import Any, cast

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest

from ..protocol.client import PromptType
from ..protocol.errors import EngineDeadError
from .asgi import HTTPError, bearer_token_ok
from .embedding_handler import embed_inputs
from .embeddings import encode_vector, parse_embedding_request
from .lora_routes import select_model
from .openai_schemas import show
from .state import ServingState, Unavailable
from .websocket_frames import (
    HARD_LIMIT_FACTOR,
    Encoding,
    FrameError,
    GenerateRequest,
    decode_frame,
    embed_request_id,
    encode_frame,
    in_embed_terms,
    in_frame_terms,
    output_frames,
    parse_generate,
    request_error,
)

logger = logging.getLogger("legato.server")


class WebSocketEndpoint:
    """The handler given to ``trio_websocket.serve_websocket``; tracks open connections."""

    def __init__(self, state: ServingState) -> None:
        self.state = state
        self.connections: set[WebSocketConnection] = set()
        self._numbers = itertools.count()
        self._none_open = trio.Event()  # set whenever ``connections`` is empty
        self._none_open.set()

    @property
    def hard_limit(self) -> int:
        """``max_message_size`` for trio-websocket."""
        return HARD_LIMIT_FACTOR * self.state.settings.ws_max_frame_bytes

    async def handle(self, request: WebSocketRequest) -> None:
        """Serve one connection until the client closes it; then abort its requests."""
        api_key = self.state.settings.api_key
        authed = api_key is None
        if self.state.draining:
            await request.reject(503, body=b"the server is shutting down")
            return
        headers = {k.lower(): v.decode("latin-1") for k, v in request.headers}
        guard = self.state.site_guard
        # wsproto takes Host out of the headers; trio-websocket has no public accessor.
        host: str | None = getattr(getattr(request, "_event", None), "host", None)
        if not guard.host_allowed(host if host is not None else headers.get(b"host")):
            await request.reject(403, body=b"this server does not answer to that Host")
            return
        if not guard.ws_origin_allowed(headers.get(b"origin")):
            await request.reject(403, body=b"WebSocket connections from that Origin are refused")
            return
        header = next((v for k, v in request.headers if k.lower() == b"authorization"), None)
        if api_key is not None and header is not None:
            if not bearer_token_ok(header.decode("latin-1"), api_key):
                await request.reject(401, body=b"invalid API key")
                return
            authed = True
        if len(self.connections) >= self.state.settings.max_connections:
            await request.reject(503, body=b"too many connections")
            return
        ws = await request.accept()
        if not self.connections:
            self._none_open = trio.Event()
        self.connections.add(ws)
        try:
            await Connection(self.state, ws, next(self._numbers), authed).run()
        except Exception:  # a bug: close this connection, never the server
            logger.exception("WebSocket connection failed")
            with trio.move_on_after(1.0):
                await ws.aclose(1011, "internal error")
        finally:
            self.connections.discard(ws)
            if not self.connections:
                self._none_open.set()

    async def wait_all_closed(self) -> None:
        """Return once no connection is open (each one's requests ended). A checkpoint."""
        await trio.lowlevel.checkpoint()
        while self.connections:
            await self._none_open.wait()

    async def close_all(self, close_timeout: float = 2.0) -> None:
        """Close every connection with 1001 (going away), each within ``close_timeout`` seconds."""

        async def close(ws: WebSocketConnection) -> None:
            with trio.move_on_after(close_timeout):
                await ws.aclose(1001, "the server is shutting down")

        async with trio.open_nursery() as nursery:
            for ws in list(self.connections):
                nursery.start_soon(close, ws)


class Connection:
    """One client connection: reads frames, runs one task per request in its nursery."""

    def __init__(
        self, state: ServingState, ws: WebSocketConnection, number: int, authed: bool
    ) -> None:
        self.state = state
        self.ws = ws
        self.number = number
        self.authed = authed
        self._live: dict[str, str] = {}  # client request id -> engine request id
        self._embeds: dict[str, trio.CancelScope] = {}  # live embed requests: abort cancels
        self._rendering: dict[str, bool] = {}  # chats being rendered -> abort asked meanwhile

    async def run(self) -> None:
        """Read frames until the connection closes; then cancel (abort) every request."""
        async with trio.open_nursery() as nursery:
            try:
                if not self.authed and not await self._authenticate(nursery):
                    return
                while True:
                    message = await self.ws.get_message()
                    if not await self._on_message(message, nursery):
                        break
            except ConnectionClosed:
                pass
            nursery.cancel_scope.cancel()

    async def _authenticate(self, nursery: trio.Nursery) -> bool:
        """Handle the first frame of a connection that must authenticate; it must come
        within ``header_timeout`` (then close 1008). False to stop reading."""
        timeout = self.state.settings.header_timeout
        with trio.move_on_after(timeout):
            message = await self.ws.get_message()
            return await self._on_message(message, nursery)
        frame = FrameError("unauthorized", f"authenticate within {timeout:g} s").frame()
        await self.send(frame, "json")
        await self.ws.aclose(1008, "unauthorized")
        return False

    async def send(self, frame: Mapping[str, Any], encoding: Encoding) -> None:
        """Send one frame; a closed connection is ignored (the reader notices it)."""
        try:
            await self.ws.send_message(encode_frame(frame, encoding))
        except ConnectionClosed:
            pass

    async def _on_message(self, message: str | bytes, nursery: trio.Nursery) -> bool:
        """Handle one frame; False to stop reading (authentication failed)."""
        encoding: Encoding = "json" if isinstance(message, str) else "msgpack"
        try:
            frame, encoding = decode_frame(message, self.state.settings.ws_max_frame_bytes)
            kind = frame.get("type")
            if kind == "auth":
                return await self._auth(frame, encoding)
            if not self.authed:
                await self.send(FrameError("unauthorized", "authenticate first").frame(), encoding)
                await self.ws.aclose(1008, "unauthorized")
                return False
            if kind == "generate":
                self._start(parse_generate(frame, self.state, encoding), nursery)
            elif kind == "embed":
                rid = embed_request_id(frame)
                self._admit(rid)
                self._embeds[rid] = trio.CancelScope()
                nursery.start_soon(self._serve_embed, rid, frame, encoding)
            elif kind == "abort":
                await self._abort(frame)
            else:
                raise FrameError(
                    "unknown_type", f"type: unknown frame type {show(kind)}", param="type"
                )
        except FrameError as exc:
            await self.send(exc.frame(), encoding)
        return True

    async def _auth(self, frame: Mapping[str, Any], encoding: Encoding) -> bool:
        api_key = self.state.settings.api_key
        given = frame.get("api_key")
        if api_key is None or (
            isinstance(given, str) and hmac.compare_digest(given.encode(), api_key.encode())
        ):
            self.authed = True
            return True
        await self.send(
            FrameError("unauthorized", "invalid API key", param="api_key").frame(), encoding
        )
        await self.ws.aclose(1008, "unauthorized")
        return False

    def _start(self, request: GenerateRequest, nursery: trio.Nursery) -> None:
        self._admit(request.request_id)
        nursery.start_soon(self._serve, request)

    def _admit(self, rid: str) -> None:
        """Make ``rid`` live (FrameError if it cannot start: a duplicate, too many, the
        server unavailable); the caller starts its task, which removes it."""
        if rid in self._live:
            raise FrameError(
                "duplicate_request_id", f"request {show(rid)} is already running", request_id=rid
            )
        if len(self._live) >= self.state.settings.ws_max_requests:
            raise FrameError(
                "too_many_requests",
                f"at most {self.state.settings.ws_max_requests} concurrent requests per connection",
                request_id=rid,
            )
        try:
            self.state.check_available()
            self.state.check_capacity()
        except Unavailable as exc:
            raise FrameError(exc.code, exc.message, request_id=rid) from None
        self._live[rid] = f"ws{self.number}-{rid}"

    async def _abort(self, frame: Mapping[str, Any]) -> None:
        """Abort a live request (its last frame has finish_reason "abort"); unknown ids are ignored."""
        rid = frame.get("request_id")
        engine_id = self._live.get(rid) if isinstance(rid, str) else None
        embed = self._embeds.get(rid) if isinstance(rid, str) else None
        if embed is not None:  # its task aborts its engine requests and answers
            embed.cancel()
        elif isinstance(rid, str) and rid in self._rendering:  # its task aborts once submitted
            self._rendering[rid] = True
        elif engine_id is not None:
            try:
                await self.state.engine.abort(engine_id)
            except EngineDeadError:
                pass  # the request's own task reports the death
            return
        await trio.lowlevel.checkpoint()

    async def _render_chat(
        self, rid: str, messages: list[dict[str, Any]], fields: dict[str, Any]
    ) -> tuple[dict[str, Any], bool]:
        """The chat rendered as a prompt with ``fields`` added, and whether an ``abort``
        came meanwhile. Raises what ``AsyncEngine.render_chat_prompt`` raises."""
        self._rendering[rid] = False
        try:
            rendered = await self.state.engine.render_chat_prompt(messages)
        finally:
            abort_asked = self._rendering.pop(rid)
        return {**rendered, **fields}, abort_asked

    async def _serve(self, request: GenerateRequest) -> None:
        rid, encoding = request.request_id, request.encoding
        engine_id = self._live[rid]
        started = time.monotonic()
        prompt_tokens = completion_tokens = 0
        outcome = "connection closed"  # unless it finishes or fails first
        error: FrameError | None = None
        try:
            with self.state.track(engine_id, [engine_id], n=request.params.n) as live:
                prompt, abort_asked = request.prompt, False
                if request.messages is not None:
                    assert isinstance(prompt, dict)
                    prompt, abort_asked = await self._render_chat(rid, request.messages, prompt)
                stream = self.state.engine.generate(
                    cast("PromptType", prompt),  # a text or a TokensPrompt dict
                    request.params,
                    engine_id,
                    priority=request.priority,
                    lora_request=request.lora_request,
                )
                async with stream:
                    if abort_asked:
                        await self.state.engine.abort(engine_id)
                    async for output in stream:
                        prompt_tokens = len(output.prompt_token_ids or ())
                        completion_tokens += sum(len(c.token_ids) for c in output.outputs)
                        usage = None
                        if output.finished:
                            usage = {
                                "prompt_tokens": prompt_tokens,
                                "completion_tokens": completion_tokens,
                            }
                            reasons = {c.finish_reason for c in output.outputs if c.finish_reason}
                            outcome = ",".join(sorted(reasons)) or "finished"
                        for frame in output_frames(rid, output, usage):
                            await self.send(frame, encoding)
            if live.scope.cancelled_caught:
                outcome = "cancelled by shutdown"
                error = FrameError(
                    "shutting_down", "the server shut down before the request finished"
                )
        except Exception as exc:
            error = request_error(exc, engine_id, in_frame_terms)
        finally:
            del self._live[rid]
            if error is not None:
                outcome = f"error: {error.code}"
            self.state.log_request(
                engine_id,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                started=started,
                outcome=outcome,
            )
        if error is not None:
            error.request_id = rid
            await self.send(error.frame(), encoding)

    async def _serve_embed(self, rid: str, frame: Mapping[str, Any], encoding: Encoding) -> None:
        """Run one ``embed`` frame (the body of ``POST /v1/embeddings``); send its
        ``embedding`` frame, or an ``error`` frame naming the field at fault.

        An ``abort`` cancels ``self._embeds[rid]``: the engine requests are
        aborted and the answer has ``finish_reason: "abort"`` and no vectors.
        """
        engine_id, scope = self._live[rid], self._embeds[rid]
        started = time.monotonic()
        prompt_tokens = 0
        outcome = "connection closed"  # unless it finishes or fails first
        answer: dict[str, Any] | None = None
        error: FrameError | None = None
        try:
            with scope:
                self.state.check_generates()
                size = await self.state.engine.embedding_size()
                parsed = parse_embedding_request(frame, hidden_size=size)
                lora = select_model(self.state, parsed.model)
                engine_ids = [f"{engine_id}-{i}" for i in range(len(parsed.inputs))]
                kwargs = {"add_special_tokens": parsed.add_special_tokens}
                with self.state.track(engine_id, engine_ids) as live:
                    vectors, prompt_tokens = await embed_inputs(
                        self.state, parsed.inputs, parsed.params, engine_ids, lora, kwargs,
                        parsed.priority,
                    )  # fmt: skip
                if live.scope.cancelled_caught:
                    raise Unavailable("shutting_down", "the server shut down before it was done")
                answer = {
                    "type": "embedding",
                    "request_id": rid,
                    "model": self.state.model_name if lora is None else lora.lora_name,
                    "data": [
                        {"index": i, "embedding": encode_vector(v, parsed.encoding_format)}
                        for i, v in enumerate(vectors)
                    ],
                    "finished": True,
                    "finish_reason": "stop",
                    "usage": {"prompt_tokens": prompt_tokens},
                }
                outcome = "stop"
            if scope.cancelled_caught:
                outcome = "abort"
                answer = {"type": "embedding", "request_id": rid, "data": [], "finished": True,
                          "finish_reason": "abort", "usage": {"prompt_tokens": 0}}  # fmt: skip
        except HTTPError as exc:  # select_model: no such model
            error = FrameError("model_not_found", exc.message, param="model")
        except Exception as exc:
            error = request_error(exc, engine_id, in_embed_terms)
        finally:
            del self._live[rid], self._embeds[rid]
            self.state.log_request(
                engine_id,
                prompt_tokens=prompt_tokens,
                completion_tokens=0,
                started=started,
                outcome=outcome if error is None else f"error: {error.code}",
            )
        if error is not None:
            error.request_id = rid
            answer = error.frame()
        if answer is not None:
            await self.send(answer, encoding)
