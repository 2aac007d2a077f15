"""What the HTTP and WebSocket front ends share: settings, admission, in-flight requests, drain.

``ServingState`` decides whether a new request may start (not while the
server drains, not while the engine is dead or restarting), keeps a cancel
scope and the engine request ids of every request in flight, and runs the
graceful drain: wait up to a grace period, abort what is left through the
engine (so clients see finish_reason "abort"), then cancel what still has not
ended.

It serves one ``EngineClient`` (an ``AsyncEngine``, or a ``RenderOnlyClient`` that only
renders) or a ``SupervisedEngine``
(``legato.supervise``): then ``engine`` is always the current engine, and a
dead one that is being replaced makes requests ``Unavailable`` with
``code="engine_restarting"`` rather than ``"engine_dead"``. The front ends
talk to ``engine`` through the ``EngineClient`` protocol only (it is typed so).

Imports trio; never torch, never h11 or trio-websocket.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import trio

from ..protocol.client import EngineClient
from ..protocol.errors import ValidationError
from ..protocol.params import LoRARequest
from ..supervise import SupervisedEngine
from .asgi import Request
from .cors import CORSPolicy
from .reasoning import ReasoningParser, reasoning_parser
from .response_store import ResponseStore
from .site_guard import LOOPBACK_NAMES, SiteGuard
from .tool_parsers import ToolParser, tool_parser

logger = logging.getLogger("legato.server")

ABORT_WAIT = 2.0
"""Seconds the drain waits for aborted requests to end before cancelling them outright."""


@dataclass(frozen=True)
class ServerSettings:
    """How ``legato serve`` listens and what it admits. Ports 0 pick free ports."""

    host: str = "127.0.0.1"
    port: int = 8000
    ws_port: int = 8001
    api_key: str | None = None
    served_model_name: str | None = None
    max_body_bytes: int = 1 << 20
    max_n: int = 16
    ws_max_frame_bytes: int = 1 << 20
    ws_max_requests: int = 64
    shutdown_grace: float = 10.0
    header_timeout: float = 10.0  # seconds to send a request's headers / WebSocket handshake
    body_timeout: float = 60.0
    """Seconds a client may take to send a request's body (then 408)."""
    send_timeout: float = 60.0
    """Seconds an HTTP client may take to read each 128 KiB of an answer; past it the
    connection closes and its request is aborted, as on a hang-up."""
    max_connections: int = 1024
    """Connections served at once, per port; one more gets 503 (HTTP) or is refused."""
    max_requests_in_flight: int = 512
    """Requests (HTTP and WebSocket) in flight at once; one more gets 503 ``server_busy``
    with ``Retry-After`` (WebSocket: an error frame)."""
    max_sequences_in_flight: int = 2048
    """Engine sequences in flight at once, each of a request's ``n`` counted: this bounds
    the engine's waiting queue in the unit it grows by. A request that would pass it gets
    503 ``server_busy`` with ``Retry-After`` (WebSocket: an error frame)."""
    log_requests: bool = True
    web_ui: bool = True
    """Serve the chat page at ``/`` (``--no-web-ui`` turns it off)."""
    web_ui_ws_url: str | None = None
    """The WebSocket URL the chat page connects to; None: the page's host, ``ws_port``."""
    lora_modules: tuple[LoRARequest, ...] = ()
    """Adapters loaded at start-up, served as model names (``--lora-modules``)."""
    allow_runtime_lora_updating: bool = False
    """Serve ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (needs ``lora_root``)."""
    lora_root: str | None = None
    """The directory run-time adapters must lie under (``--lora-root``); symlinks resolved."""
    chat_template: str | None = None
    """A chat template (its text; ``--chat-template`` reads it from a file) used instead of
    the tokenizer's own."""
    trust_request_chat_template: bool = False
    """Accept a request's own ``chat_template`` (rendered in a limited child process);
    refused with a 400 otherwise (vLLM's ``--trust-request-chat-template``)."""
    enable_auto_tool_choice: bool = False
    """Allow ``tool_choice="auto"`` (needs ``tool_call_parser``), as vLLM's flag."""
    tool_call_parser: str | None = None
    """How ``tool_choice="auto"`` reads calls from the output: ``hermes`` or ``llama3_json``."""
    reasoning_parser: str | None = None
    """Split ``<think>`` reasoning into ``reasoning_content``: ``qwen3`` or ``deepseek_r1``."""
    cors: CORSPolicy = CORSPolicy()
    """CORS for the HTTP API (``--allowed-origins`` ...; off by default, unlike vLLM)."""
    allowed_hosts: tuple[str, ...] = ()
    """``Host`` values served besides the loopback names and ``host`` (``*``: any)."""
    responses_store_max_entries: int = 1000
    """Responses API responses kept for ``GET`` / ``previous_response_id``; one more evicts
    the oldest (vLLM's store is unbounded: see ``response_store``)."""
    responses_store_max_age: float = 3600.0
    """Seconds a stored response is kept."""
    responses_store_max_chars: int = 256 << 20
    """Characters of text (bodies and conversations) the stored responses may hold in all;
    past it the oldest are evicted."""

    def security_warnings(self) -> list[str]:
        """What this configuration leaves open, for the log at start-up."""
        if self.api_key is not None:
            return []
        warnings = []
        if self.host.strip("[]") not in LOOPBACK_NAMES:
            warnings.append(
                f"listening on {self.host} without --api-key: anyone who reaches this "
                "address can use the model (set --api-key or LEGATO_API_KEY)"
            )
        if self.cors.any_origin:
            warnings.append(
                "CORS allows any origin without --api-key: every web page the user opens "
                "can call this API and read its answers"
            )
        if self.allow_runtime_lora_updating:
            warnings.append(
                f"--allow-runtime-lora-updating without --api-key: any local client can load "
                f"adapters from {self.lora_root}"
            )
        return warnings

    @property
    def site_guard(self) -> SiteGuard:
        """The Host and WebSocket Origin allowlists (DNS rebinding, cross-site WebSockets)."""
        return SiteGuard(self.host, self.port, self.allowed_hosts, self.cors.allowed_origins)

    def __post_init__(self) -> None:
        for name in (
            "max_body_bytes",
            "max_n",
            "ws_max_frame_bytes",
            "ws_max_requests",
            "max_connections",
            "max_requests_in_flight",
            "max_sequences_in_flight",
            "responses_store_max_entries",
            "responses_store_max_chars",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        for name in ("port", "ws_port"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 65536:
                raise ValueError(
                    f"{name}: must be a port number (0 = any free port), got {value!r}"
                )
        if self.shutdown_grace < 0:
            raise ValueError(f"shutdown_grace: must be >= 0, got {self.shutdown_grace!r}")
        if self.web_ui_ws_url is not None and not self.web_ui_ws_url.startswith(
            ("ws://", "wss://")
        ):
            raise ValueError(
                f"web_ui_ws_url: must start with ws:// or wss://, got {self.web_ui_ws_url!r}"
            )
        if not self.responses_store_max_age > 0:
            raise ValueError(
                f"responses_store_max_age: must be > 0, got {self.responses_store_max_age!r}"
            )
        if not self.body_timeout > 0:
            raise ValueError(f"body_timeout: must be > 0, got {self.body_timeout!r}")
        if not self.header_timeout > 0:
            raise ValueError(f"header_timeout: must be > 0, got {self.header_timeout!r}")
        if not self.send_timeout > 0:
            raise ValueError(f"send_timeout: must be > 0, got {self.send_timeout!r}")
        if self.api_key == "":
            raise ValueError("api_key: must not be empty")
        if self.tool_call_parser is not None:
            tool_parser(self.tool_call_parser)  # ValueError listing the known ones
        if self.allow_runtime_lora_updating and self.lora_root is None:
            raise ValueError(
                "allow_runtime_lora_updating: needs lora_root (--lora-root), the directory "
                "run-time adapters are loaded from"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice: needs tool_call_parser")
        if self.reasoning_parser is not None:
            reasoning_parser(self.reasoning_parser)

    @property
    def auto_tool_parser(self) -> Callable[[], ToolParser] | None:
        """The parser for ``tool_choice="auto"``; None unless auto tool choice is enabled."""
        if not self.enable_auto_tool_choice or self.tool_call_parser is None:
            return None
        return tool_parser(self.tool_call_parser)

    @property
    def reasoning(self) -> Callable[[], ReasoningParser] | None:
        return None if self.reasoning_parser is None else reasoning_parser(self.reasoning_parser)


class Unavailable(Exception):
    """The server cannot take a new request: it is draining (``code="shutting_down"``),
    the engine is dead (``code="engine_dead"``) or being restarted
    (``code="engine_restarting"``); or it has no model to generate with (a render-only
    client, ``code="render_only"``, status 501)."""

    def __init__(self, code: str, message: str, *, status: int = 503) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status


@dataclass
class LiveRequest:
    """One client request in flight and the engine request ids it started."""

    request_id: str
    scope: trio.CancelScope
    engine_ids: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)


class ServingState:
    """Shared by every front end of one server over one engine."""

    def __init__(
        self,
        engine: EngineClient | SupervisedEngine,
        settings: ServerSettings,
        *,
        model_name: str,
    ) -> None:
        self._source = engine
        self.settings = settings
        self.model_name = model_name
        self.created = int(time.time())
        self.draining = False
        self._live: dict[str, LiveRequest] = {}
        self._num_sequences = 0  # engine sequences of the live requests (n each)
        self._emptied = trio.Event()
        self._emptied.set()
        # Host / WebSocket Origin allowlists; the app sets the HTTP port once it is bound.
        self.site_guard: SiteGuard = settings.site_guard
        self.generates = True
        """False over a client that only renders (``RenderOnlyClient``): ``track`` refuses
        every generation; rendering, tokenizing and the rest are served."""
        self.responses = ResponseStore(
            settings.responses_store_max_entries,
            settings.responses_store_max_age,
            settings.responses_store_max_chars,
        )

    @property
    def engine(self) -> EngineClient:
        """The engine to use now (under supervision: the current one, maybe dead and restarting)."""
        if isinstance(self._source, SupervisedEngine):
            return self._source.engine
        return self._source

    @property
    def restarting(self) -> bool:
        """Whether the engine is dead and a supervisor is starting a new one."""
        return isinstance(self._source, SupervisedEngine) and self._source.restarting

    @property
    def aliases(self) -> frozenset[str]:
        """Model names a request may ask for: the served name and the engine's own."""
        return frozenset({self.model_name, self.engine.model_info().name})

    @property
    def num_live(self) -> int:
        return len(self._live)

    def check_capacity(self, sequences: int = 0) -> None:
        """Raise ``Unavailable("server_busy")`` if ``max_requests_in_flight`` are in flight,
        or if ``sequences`` more engine sequences would pass ``max_sequences_in_flight``."""
        if len(self._live) >= self.settings.max_requests_in_flight:
            raise Unavailable(
                "server_busy",
                f"the server has {self.settings.max_requests_in_flight} requests in flight; "
                "retry shortly",
            )
        cap = self.settings.max_sequences_in_flight
        if self._num_sequences + sequences > cap:
            raise Unavailable(
                "server_busy",
                f"the engine has {self._num_sequences} of at most {cap} sequences in flight; "
                f"this request needs {sequences}: retry shortly",
            )

    def check_available(self) -> None:
        """Raise ``Unavailable`` if no new request may start now. Never blocks."""
        if self.draining:
            raise Unavailable("shutting_down", "the server is shutting down")
        engine = self.engine
        if engine.errored or engine.is_stopped:
            if self.restarting:
                raise Unavailable(
                    "engine_restarting", "the engine died and is being restarted: retry shortly"
                )
            why = engine.dead_error if engine.errored else "it has been shut down"
            raise Unavailable("engine_dead", f"the engine is dead: {why}")

    def check_generates(self) -> None:
        """Raise ``Unavailable("render_only")`` (501) over a client that only renders."""
        if not self.generates:
            raise Unavailable(
                "render_only",
                "this server only renders (a RenderOnlyClient, no model): use /tokenize, "
                "/detokenize, /v1/chat/completions/render or /v1/completions/render",
                status=501,
            )

    @contextmanager
    def track(self, request_id: str, engine_ids: list[str], *, n: int = 1) -> Iterator[LiveRequest]:
        """Admit one request for the ``with`` body, inside a cancel scope the drain may cancel.

        It counts ``len(engine_ids) * n`` engine sequences against
        ``max_sequences_in_flight`` (``n``: each prompt's completions).

        Raises ``Unavailable`` (before the body runs) while draining, once
        the engine is dead, or over a client that only renders, and ``ValidationError`` (a ValueError) naming
        ``request_id`` for a request id already live.
        If the drain cancels the scope, the body sees ``trio.Cancelled`` and
        the ``with`` ends quietly after it: the caller ends its response.
        """
        self.check_available()
        self.check_generates()
        sequences = max(1, len(engine_ids)) * max(1, n)
        self.check_capacity(sequences)
        if request_id in self._live:
            raise ValidationError("request_id", f"{request_id!r} is already running")
        with trio.CancelScope() as scope:
            live = LiveRequest(request_id, scope, list(engine_ids))
            if not self._live:
                self._emptied = trio.Event()
            self._live[request_id] = live
            self._num_sequences += sequences
            try:
                yield live
            finally:
                self._num_sequences -= sequences
                del self._live[request_id]
                if not self._live:
                    self._emptied.set()

    async def wait_idle(self) -> None:
        """Return once no request is in flight. A checkpoint."""
        await trio.lowlevel.checkpoint()
        while self._live:
            await self._emptied.wait()

    async def drain(self, grace: float) -> None:
        """Stop admitting, give in-flight requests ``grace`` seconds, then end them.

        Leftovers are first aborted through the engine (their streams end
        with finish_reason "abort"), then, after ``ABORT_WAIT`` seconds,
        cancelled. Returns when nothing is in flight. Idempotent.
        """
        self.draining = True
        if self._live:
            logger.info("draining %d request(s) for up to %.1f s", len(self._live), grace)
        with trio.move_on_after(grace):
            await self.wait_idle()
        if not self._live:
            return
        logger.info("aborting %d request(s) still running after the grace period", len(self._live))
        engine_ids = [rid for live in self._live.values() for rid in live.engine_ids]
        if engine_ids and not self.engine.errored and not self.engine.is_stopped:
            await self.engine.abort(engine_ids)
        with trio.move_on_after(ABORT_WAIT):
            await self.wait_idle()
        for live in list(self._live.values()):
            live.scope.cancel()
        await self.wait_idle()

    def log_request(
        self,
        request_id: str,
        *,
        prompt_tokens: int,
        completion_tokens: int,
        started: float,
        outcome: str,
    ) -> None:
        """Log one finished request: id, token counts, latency, outcome (finish reason or error)."""
        if not self.settings.log_requests:
            return
        logger.info(
            "request %s: prompt_tokens=%d completion_tokens=%d latency=%.3fs outcome=%s",
            request_id,
            prompt_tokens,
            completion_tokens,
            time.monotonic() - started,
            outcome,
        )


Handler = Callable[[Request, ServingState], Awaitable[None]]
"""A route: answers one HTTP request (see ``server.http``, ``server.web_ui``)."""
