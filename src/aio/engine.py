"""``AioEngine`` (the asyncio ``EngineClient``) and ``open_engine``, its ``async with``.
Never imports torch.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import uuid
import weakref
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
    Sequence,
)
from types import TracebackType
from typing import Any, Generic, cast

import trio

from ..engine import AsyncEngine
from ..engine.thread import SHUT_DOWN, Crossing
from ..outputs.delta_merge import merge_cumulative, merge_delta_outputs
from ..protocol.client import EngineClient, PauseModeName, SupportedTask
from ..protocol.errors import EngineDeadError
from ..protocol.outputs import PoolingRequestOutput, RequestOutput
from ..protocol.params import LoRARequest, PoolingParams, RequestOutputKind, SamplingParams
from .mailbox import _Mailbox, _serve_stream
from .thread import _EXIT_JOIN_SECONDS, OutputT, T, _EngineThread, _set_exception, _set_result


class AioStream(Generic[OutputT]):
    """One request's outputs for asyncio: an async iterator that is also an async
    context manager (the counterpart of ``legato.engine.RequestStream``).

    The request is submitted on ``__aenter__`` (which raises what submission
    raises: ValidationError, EngineDeadError) or on the first ``__anext__``.
    News merges until taken, per the output kind (DELTA joins deltas, else the
    newest wins). Cancelling the task waiting in ``__anext__``, ``aclose()``,
    leaving the ``async with``, or dropping the stream unfinished (``break``)
    aborts the request; the engine frees its KV blocks within one step. A dead
    engine raises its ``EngineDeadError`` from ``__anext__``.
    """

    def __init__(
        self,
        client: AioEngine,
        open_stream: Callable[[AsyncEngine], AsyncIterator[OutputT]],
        request_id: str,
        merge_deltas: bool,
    ) -> None:
        self._client = client
        self._open_stream = open_stream
        self.request_id = request_id
        self._merge_deltas = merge_deltas
        self._crossing = Crossing()
        self._box: _Mailbox[OutputT] = _Mailbox(client._loop.create_future())
        self._started = False
        self._done = False  # the consumer side is finished with it

    async def __aenter__(self) -> AioStream[OutputT]:
        self._start()
        try:
            await self._box.submitted
        except asyncio.CancelledError:
            self._abandon()
            raise
        except BaseException:
            self._done = True
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __aiter__(self) -> AioStream[OutputT]:
        return self

    async def __anext__(self) -> OutputT:
        if self._done:
            raise StopAsyncIteration
        self._start()
        box = self._box
        while not box.pending and box.error is None and not box.ended:
            box.waiter = self._client._loop.create_future()
            try:
                await box.waiter
            except asyncio.CancelledError:
                self._abandon()
                raise
            finally:
                box.waiter = None
        if box.error is not None:
            self._done = True
            raise box.error
        if not box.pending:  # ended without a finished output (an aborted encode)
            self._done = True
            raise StopAsyncIteration
        pending, box.pending = box.pending, []
        output = pending[0] if len(pending) == 1 else self._merge(pending)
        if output.finished:
            self._done = True
        return output

    def _merge(self, pending: list[OutputT]) -> OutputT:
        if self._merge_deltas:
            return cast(OutputT, merge_delta_outputs(cast(list[RequestOutput], pending)))
        if isinstance(pending[-1], RequestOutput):  # CUMULATIVE n>1: keep every completion
            return cast(
                OutputT, functools.reduce(merge_cumulative, cast(list[RequestOutput], pending))
            )
        return pending[-1]

    async def aclose(self) -> None:
        """Abort the request if it is still running. Idempotent."""
        self._abandon()
        await asyncio.sleep(0)

    def _start(self) -> None:
        if self._started:
            return
        self._started = True
        client = self._client
        try:
            client._check_alive()
            client._runner.spawn(
                self._crossing,
                _serve_stream,
                client._runner,
                client._engine,
                self._open_stream,
                self._box,
            )
        except BaseException as exc:
            self._box.on_end(exc)

    def _abandon(self) -> None:
        if self._started and not self._done:
            self._done = True
            with contextlib.suppress(EngineDeadError):
                self._client._runner.call_soon(self._crossing.cancel)

    def __del__(self) -> None:
        # `break` out of `async for` without `async with`: abort from wherever GC runs.
        if self._started and not self._done:
            self._done = True
            with contextlib.suppress(Exception):
                self._client._runner.call_soon(self._crossing.cancel)


class AioEngine(EngineClient):
    """The legato engine for asyncio code: every method of the trio ``AsyncEngine``,
    with the same contract (``legato.protocol.client``), awaited from an event loop.

    Build it with ``legato.aio.open_engine``. Every method must be called from the
    event loop that opened it. Control calls run in the engine thread; a caller
    cancelled while waiting stops waiting, and the call completes there (as in
    trio). Once the engine is dead, new requests and control calls raise its
    ``dead_error`` at once, without crossing threads.
    """

    def __init__(self, runner: _EngineThread, engine: AsyncEngine) -> None:
        self._runner = runner
        self._loop = runner.loop
        self._engine = engine

    @property
    def engine(self) -> AsyncEngine:
        """The trio engine behind this client (call it only through ``call_in_engine``)."""
        return self._engine

    async def call_in_engine(self, fn: Callable[[AsyncEngine], Awaitable[T]]) -> T:
        """``await fn(trio_engine)`` as a task of the engine's trio thread; its result.

        For what has no asyncio method here (tests, custom probes). Cancelling
        the caller cancels that task.
        """
        future: asyncio.Future[T] = self._loop.create_future()
        crossing = Crossing()
        runner = self._runner

        async def call() -> None:
            try:
                result = await fn(self._engine)
            except trio.Cancelled:  # the caller gave up (its future is done), or shutdown
                runner.post(_set_exception, future, EngineDeadError(SHUT_DOWN))
                raise
            except Exception as exc:
                runner.post(_set_exception, future, exc)
            else:
                runner.post(_set_result, future, result)

        runner.spawn(crossing, call)
        try:
            return await future
        except asyncio.CancelledError:
            with contextlib.suppress(EngineDeadError):
                runner.call_soon(crossing.cancel)
            raise

    async def _control(self, fn: Callable[[AsyncEngine], Awaitable[T]]) -> T:
        self._check_alive()
        return await self.call_in_engine(fn)

    def _check_alive(self) -> None:
        if self._engine.errored:
            raise self._engine.dead_error
        if self._engine.is_stopped or self._runner.done.is_set():
            raise EngineDeadError(SHUT_DOWN)

    # ------------------------------------------------------------- state

    @property
    def is_running(self) -> bool:
        return self._engine.is_running and not self._runner.done.is_set()

    @property
    def is_stopped(self) -> bool:
        return self._engine.is_stopped or self._runner.done.is_set()

    @property
    def errored(self) -> bool:
        return self._engine.errored

    @property
    def dead_error(self) -> EngineDeadError:
        return self._engine.dead_error

    @property
    def model_name(self) -> str:
        return self._engine.model_name

    # ------------------------------------------------------------- requests

    def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
        prompt_adapter_request: None = None,
        priority: int = 0,
        *,
        prompt_text: str | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        data_parallel_rank: int | None = None,
        reasoning_ended: bool | None = None,
        reasoning_parser_kwargs: dict[str, Any] | None = None,
    ) -> AioStream[RequestOutput]:
        """Stream the request's outputs (see ``AioStream``). Not a coroutine.

        As the trio ``AsyncEngine.generate``, except that bad arguments raise
        their ValidationError on submission (``__aenter__`` or the first
        ``__anext__``) rather than here: they are checked in the engine thread.
        """
        rid = str(request_id) if request_id is not None else uuid.uuid4().hex
        params = sampling_params if sampling_params is not None else SamplingParams()
        delta = isinstance(params, SamplingParams) and params.output_kind == RequestOutputKind.DELTA

        def open_stream(engine: AsyncEngine) -> AsyncIterator[RequestOutput]:
            return engine.generate(
                prompt,
                params,
                rid,
                prompt_text=prompt_text,
                lora_request=lora_request,
                tokenization_kwargs=tokenization_kwargs,
                trace_headers=trace_headers,
                prompt_adapter_request=prompt_adapter_request,
                priority=priority,
                data_parallel_rank=data_parallel_rank,
                reasoning_ended=reasoning_ended,
                reasoning_parser_kwargs=reasoning_parser_kwargs,
            )

        return AioStream(self, open_stream, rid, delta)

    def encode(
        self,
        prompt: Any,
        pooling_params: PoolingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        tokenization_kwargs: dict[str, Any] | None = None,
        reasoning_ended: bool | None = None,
    ) -> AioStream[PoolingRequestOutput]:
        """Embed ``prompt``: a stream yielding one PoolingRequestOutput (see ``AsyncEngine.encode``)."""

        def open_stream(engine: AsyncEngine) -> AsyncIterator[PoolingRequestOutput]:
            return engine.encode(
                prompt,
                pooling_params,
                request_id,
                lora_request=lora_request,
                trace_headers=trace_headers,
                priority=priority,
                tokenization_kwargs=tokenization_kwargs,
                reasoning_ended=reasoning_ended,
            )

        return AioStream(self, open_stream, request_id, False)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (their streams end with finish_reason "abort"); never raises
        EngineDeadError."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if self.is_stopped:
            await asyncio.sleep(0)
            return
        with contextlib.suppress(EngineDeadError):
            await self.call_in_engine(lambda e: e.abort(ids))

    async def check_health(self) -> None:
        """Raise the engine's EngineDeadError if it is dead or shut down; return otherwise."""
        await asyncio.sleep(0)
        self._check_alive()

    async def is_tracing_enabled(self) -> bool:
        return False

    async def do_log_stats(self) -> None:
        await self.call_in_engine(lambda e: e.do_log_stats())

    async def start_profile(self) -> None:
        await self._control(lambda e: e.start_profile())

    async def stop_profile(self) -> None:
        await self._control(lambda e: e.stop_profile())

    async def reset_mm_cache(self) -> None:
        await self.call_in_engine(lambda e: e.reset_mm_cache())

    async def reset_encoder_cache(self) -> None:
        await self.call_in_engine(lambda e: e.reset_encoder_cache())

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        return await self._control(
            lambda e: e.reset_prefix_cache(reset_running_requests, reset_connector)
        )

    # ---------------------------------------------------------- lifecycle

    async def pause_generation(
        self,
        *,
        mode: PauseModeName = "abort",
        wait_for_inflight_requests: bool = False,
        clear_cache: bool = True,
    ) -> None:
        """See ``AsyncEngine.pause_generation``."""
        await self._control(
            lambda e: e.pause_generation(
                mode=mode,
                wait_for_inflight_requests=wait_for_inflight_requests,
                clear_cache=clear_cache,
            )
        )

    async def resume_generation(self) -> None:
        await self._control(lambda e: e.resume_generation())

    async def is_paused(self) -> bool:
        return await self.call_in_engine(lambda e: e.is_paused())

    async def sleep(self, level: int = 1, mode: PauseModeName = "abort") -> None:
        """See ``AsyncEngine.sleep``."""
        await self._control(lambda e: e.sleep(level, mode))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._control(lambda e: e.wake_up(tags))

    async def is_sleeping(self) -> bool:
        return await self.call_in_engine(lambda e: e.is_sleeping())

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """See ``AsyncEngine.add_lora``."""
        return await self._control(lambda e: e.add_lora(lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        return await self._control(lambda e: e.remove_lora(lora_id))

    async def list_loras(self) -> set[int]:
        return await self.call_in_engine(lambda e: e.list_loras())

    async def pin_lora(self, lora_id: int) -> bool:
        return await self._control(lambda e: e.pin_lora(lora_id))

    async def get_tokenizer(self, lora_request: LoRARequest | None = None) -> Any:
        """As ``AsyncEngine.get_tokenizer``: adapters share the base model's tokenizer."""
        return await self.call_in_engine(lambda e: e.get_tokenizer(lora_request))

    async def get_supported_tasks(self) -> tuple[SupportedTask, ...]:
        return await self.call_in_engine(lambda e: e.get_supported_tasks())

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,  # noqa: ASYNC109 - vLLM's signature
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        return await self._control(lambda e: e.collective_rpc(method, timeout, args, kwargs))

    async def wait_until_idle(self) -> None:
        """Return once the scheduler holds no request (every KV block free)."""
        await self._control(lambda e: e.wait_until_idle())

    def shutdown(self, timeout: float | None = None) -> None:
        """Ask the engine to stop (open streams end with EngineDeadError). Never blocks;
        idempotent. ``open_engine``'s exit waits for the thread and reaps the worker."""
        self._runner.request_stop()


_open_runners: weakref.WeakSet[_EngineThread] = weakref.WeakSet()


@atexit.register
def _stop_open_engines() -> None:
    """Interpreter exit with engines still open (a loop closed without leaving
    ``open_engine``): shut them down and reap their workers."""
    for runner in list(_open_runners):
        runner.request_stop()
        runner.thread.join(_EXIT_JOIN_SECONDS)


@contextlib.asynccontextmanager
async def open_engine(model: str | None = None, **engine_args: Any) -> AsyncIterator[AioEngine]:
    """Start an engine for ``model`` in a thread of its own and yield its asyncio client.

    ``engine_args`` are those of ``legato.open_engine`` (EngineConfig's fields,
    ``stat_loggers``, ``faults``). Start-up failures raise here. On exit
    (also by cancellation) the engine shuts down: open streams end with
    EngineDeadError, the worker is reaped, and the thread ends before this
    returns (the wait is shielded from a second cancellation's effect on the
    engine: it finishes shutting down regardless).
    """
    runner = _EngineThread(asyncio.get_running_loop(), model, engine_args)
    _open_runners.add(runner)
    runner.thread.start()
    try:
        engine = await asyncio.shield(runner.started)
        yield AioEngine(runner, engine)
    finally:
        runner.request_stop()
        await asyncio.shield(runner.finished)
        _open_runners.discard(runner)
