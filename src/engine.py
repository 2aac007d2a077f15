"""The EngineClient facade over the actors: ``open_engine``, ``AsyncEngine``, ``RequestStream``.

``open_engine`` is an async context manager: it loads the model (in a worker
process by default), starts the actors in a nursery of its own under a
``Supervisor``, yields an ``AsyncEngine``, and on exit shuts everything down and
reaps the worker. The engine's death never cancels the caller's tasks; the
caller learns of it from the calls it makes (``EngineDeadError``).

A request's life, as the caller sees it::

    async with engine.generate(prompt, params, "r1") as stream:   # the safe form
        async for output in stream:
            ...

Leaving the ``async with``, cancelling the surrounding scope, ``aclose()`` or
breaking out of ``async for`` aborts the request: its KV blocks are freed
within one engine step and nothing more is computed for it.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
import os
import sys
import types
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import TracebackType
from typing import Any, TypeVar

import trio

from .actors.engine_core import CoreStopped, EngineCore
from .actors.executor import Executor, OnFailure, WorkerCallError, WorkerDiedError
from .actors.frontend import Frontend, thread_renderer
from .actors.heartbeat import run_heartbeat
from .actors.inproc_executor import InprocExecutor
from .actors.output_slot import OutputSlot
from .actors.process_executor import ProcessExecutor
from .actors.stats import run_stats
from .actors.supervisor import Supervisor
from .config import EngineConfig
from .engine_adapters import EngineAdapters
from .engine_parts import build_engine_parts
from .exception_groups import unwrap_single_error
from .frontend.renderer import PromptType, check_tokenization_kwargs
from .metrics.collector import StatLoggerArg, StatsCollector
from .metrics.logger_base import StatLoggerBase
from .protocol import messages as m
from .protocol.client import EngineClient, PauseModeName, SupportedTask
from .protocol.errors import EngineDeadError, ValidationError
from .protocol.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from .protocol.params import LoRARequest, PoolingParams, RequestOutputKind, SamplingParams
from .scheduling.pause_gate import PauseMode
from .serving_gc import tune_gc_for_serving
from .tokenizer_loading import load_tokenizer
from .vllm_config import DecodingConfig, EngineArgs, ModelConfig, VllmConfig

logger = logging.getLogger("legato.engine")

T = TypeVar("T")

_PAUSE_MODES = {"abort": PauseMode.ABORT, "wait": PauseMode.WAIT, "keep": PauseMode.KEEP}


def resolve_model(config: EngineConfig) -> EngineConfig:
    """``config`` with ``model`` resolved to a path and ``served_model_name`` filled in
    (see legato.model_source). Blocks; raises ModelLoadError for a bad model argument."""
    import dataclasses

    from .model_source import resolve_model_source

    source = resolve_model_source(config.model)
    return dataclasses.replace(
        config, model=source.path, served_model_name=config.served_model_name or source.name
    )


def make_executor(
    config: EngineConfig, *, on_failure: OnFailure, inject_fault: dict[str, Any] | None = None
) -> Executor:
    """The executor ``config`` asks for: tensor-parallel, in-process or a child process."""
    if config.tensor_parallel_size > 1:
        # Imported here: it reaches the rank worker's module, which `python -m
        # legato.workers.worker` must not find imported already by `import legato`.
        from .actors.tensor_parallel_executor import TensorParallelExecutor

        return TensorParallelExecutor(config, on_failure=on_failure, inject_fault=inject_fault)
    if config.executor == "inproc":
        return InprocExecutor(config, on_failure=on_failure, inject_fault=inject_fault)
    return ProcessExecutor(config, on_failure=on_failure, inject_fault=inject_fault)


class RequestStream:
    """One request's outputs: an async iterator that is also an async context manager.

    The request is submitted on ``__aenter__`` or the first ``__anext__``.
    ``__anext__`` is a checkpoint; if the caller is cancelled while waiting,
    the request is aborted and ``Cancelled`` propagates (cancellation is never
    an error). ``aclose()`` and leaving the ``async with`` abort an unfinished
    request; so does dropping the stream unfinished (``break``), as a fallback.
    A dead engine raises ``EngineDeadError`` (cause chained) from ``__anext__``.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        priority: int,
    ) -> None:
        self._engine = engine
        self._prompt = prompt
        self._params = params
        self.request_id = request_id
        self.engine_id = ""  # the engine's own id for this request, set on submission
        self._priority = priority
        self._slot = OutputSlot(params.output_kind)
        self._render_options: dict[str, Any] = {}  # tokenization_kwargs, prompt_text
        self._lora: LoRARequest | None = None  # the adapter it runs through
        self._pooling: PoolingParams | None = None  # set for an encode() request
        self._submitted = False
        self._done = False
        self._token = trio.lowlevel.current_trio_token()

    async def __aenter__(self) -> RequestStream:
        await self._submit()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        if not self._submitted:
            await self._submit()
        try:
            output = await self._slot.get()
        except trio.Cancelled:
            self._abandon()
            raise
        except BaseException:
            self._finish()
            raise
        if output.finished:
            self._finish()
        if self._lora is not None:  # vLLM's outputs name the adapter they came through
            output.lora_request = self._lora
            for completion in output.outputs:
                completion.lora_request = self._lora
        return output

    async def aclose(self) -> None:
        """Abort the request if it is still running. Idempotent; a checkpoint."""
        self._abandon()
        await trio.lowlevel.checkpoint()

    async def _submit(self) -> None:
        if self._submitted:
            return
        self._submitted = True
        try:
            await self._engine._submit(self)
        except BaseException:
            self._done = True
            raise

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._engine._release(self.request_id, self.engine_id)

    def _abandon(self) -> None:
        if self._submitted and not self._done:
            self._done = True
            self._engine._abort_quietly(self.request_id, self.engine_id)

    def __del__(self) -> None:
        # Fallback for `break` out of `async for` without `async with`: CPython frees
        # the stream at once. run_sync_soon is safe from any thread and from GC. The
        # abort names this request's engine id, so a later request reusing the
        # caller's id is never hit by it.
        if self._submitted and not self._done:
            self._done = True
            try:
                self._token.run_sync_soon(
                    self._engine._abort_quietly, self.request_id, self.engine_id
                )
            except trio.RunFinishedError:
                pass


class AsyncEngine(EngineClient):
    """The engine as a trio-native ``EngineClient``: a facade over the front end
    (``Frontend``: rendering, output processing, request slots) and the engine
    core's actors. Build it with ``open_engine``."""

    frontend: Frontend  # set by _start

    def __init__(
        self,
        config: EngineConfig,
        nursery: trio.Nursery,
        *,
        faults: dict[str, Any] | None = None,
        stat_loggers: Sequence[StatLoggerArg] = (),
    ):
        self.config = config
        self._nursery = nursery
        self._faults = faults or {}
        self.supervisor = Supervisor()
        self.executor = make_executor(
            config, on_failure=self.supervisor.die, inject_fault=self._faults.get("worker")
        )
        self.stats = StatsCollector.for_config(config, self.model_name, stat_loggers)
        self.adapters = EngineAdapters(config.enable_lora, self._worker_call, WorkerCallError)
        self._embedding_size: int | None = None
        self._stopped = False
        self._worker_started = False  # the executor actor has begun (a worker may exist)
        self._worker_gone = trio.Event()  # ...and has ended: its worker is reaped
        self.supervisor.on_death(self._on_death)

    # ------------------------------------------------------------ start-up

    log_requests = False  # vLLM's flag: legato never logs each request

    @property
    def log_stats(self) -> bool:
        """vLLM's flag: whether the stat loggers are fed (not ``disable_log_stats``)."""
        return self.stats.log_stats

    @property
    def vllm_config(self) -> VllmConfig:
        """vLLM's read-only view of this engine's configuration (legato.vllm_config),
        with the values learnt from the model (max_model_len, KV blocks, dtype) once
        it has started."""
        ready: m.WorkerReady | None = getattr(self, "ready", None)
        return VllmConfig.of(self.config, dtype=ready.dtype if ready is not None else None)

    @property
    def model_config(self) -> ModelConfig:
        """``vllm_config.model_config``."""
        return self.vllm_config.model_config

    @property
    def decoding_config(self) -> DecodingConfig:
        """``vllm_config.decoding_config`` (structured outputs)."""
        return self.vllm_config.decoding_config

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, *, stat_loggers: Sequence[StatLoggerArg] = ()
    ) -> AbstractAsyncContextManager[AsyncEngine]:
        """vLLM's constructor in trio's form: ``async with AsyncEngine.from_engine_args(args)
        as engine:`` starts the engine and stops it on exit (``open_engine(args)``)."""
        return open_engine(engine_args, stat_loggers=stat_loggers)

    async def get_vllm_config(self) -> VllmConfig:
        await trio.lowlevel.checkpoint()
        return self.vllm_config

    async def get_model_config(self) -> ModelConfig:
        await trio.lowlevel.checkpoint()
        return self.model_config

    async def get_decoding_config(self) -> DecodingConfig:
        await trio.lowlevel.checkpoint()
        return self.vllm_config.decoding_config

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or self.config.model or ""

    async def _start(self) -> None:
        config = self.config
        tokenizer_path = config.tokenizer or config.model
        assert tokenizer_path is not None
        tokenizer = await trio.to_thread.run_sync(load_tokenizer, tokenizer_path)
        ready: m.WorkerReady = await self._nursery.start(
            functools.partial(self.supervisor.run_actor, uses_task_status=True),
            "executor",
            self._run_executor,
        )
        self.ready = ready
        parts = build_engine_parts(config, ready, tokenizer)
        self.config = config = parts.config
        self.renderer = parts.renderer
        self.tokenizer = tokenizer
        grammars = parts.grammars
        offload_renderer = await trio.to_thread.run_sync(thread_renderer, self.renderer)
        self.scheduler = parts.scheduler
        outputs_send, outputs_recv = trio.open_memory_channel[m.EngineCoreOutputs](math.inf)
        self.core = EngineCore(
            self.scheduler,
            self.executor,
            outputs_send,
            self.stats.record,
            async_scheduling=config.async_scheduling,
            grammars=grammars,
        )
        self.frontend = Frontend(
            self.renderer,
            parts.processor,
            self.core.submit,
            self.stats.record,
            offload_renderer=offload_renderer,
        )
        start = self._nursery.start_soon
        run = self.supervisor.run_actor
        start(run, "scheduler", self.core.run)
        start(run, "detokenizer", self.frontend.deliver, outputs_recv)
        stats_actor = functools.partial(run_stats, log_interval=config.log_stats_interval)
        start(run, "stats", stats_actor, self.stats)
        probes = [("scheduler loop", self._ping_core), ("model worker", self.executor.ping)]
        heartbeat = functools.partial(
            run_heartbeat, interval=config.heartbeat_interval, silence=config.heartbeat_timeout
        )
        start(run, "heartbeat", heartbeat, probes)
        tune_gc_for_serving()
        self.stats.log_engine_initialized()
        await trio.lowlevel.checkpoint()

    async def _run_executor(
        self, *, task_status: trio.TaskStatus[m.WorkerReady] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The executor actor; ``_worker_gone`` is set once it has ended (worker reaped)."""
        self._worker_started = True
        try:
            await self.executor.run(task_status=task_status)
        finally:
            self._worker_gone.set()

    async def _ping_core(self) -> None:
        await self.core.ping()

    # ------------------------------------------------------------- requests

    def _check_alive(self) -> None:
        if self.supervisor.dead_error is not None:
            raise self.supervisor.dead_error
        if self._stopped:
            raise EngineDeadError("the engine has been shut down")

    def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: Any = None,
        trace_headers: Mapping[str, str] | None = None,
        prompt_adapter_request: None = None,
        priority: int = 0,
        *,
        prompt_text: str | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        data_parallel_rank: int | None = None,
        reasoning_ended: bool | None = None,
        reasoning_parser_kwargs: dict[str, Any] | None = None,
    ) -> RequestStream:
        """Stream the request's outputs (see ``RequestStream``).

        Not a coroutine: returns the stream at once; the request is submitted
        when the stream is entered or first iterated. A dead engine raises
        ``EngineDeadError`` then; a duplicate live ``request_id`` raises
        ValueError; while paused or asleep, the request is held until resume.
        ``prompt_text`` is the prompt text outputs report (for token-id
        prompts); ``tokenization_kwargs`` may set ``add_special_tokens``,
        ``truncation`` and ``max_length`` for text prompts; anything else, or
        ``sampling_params`` that are not SamplingParams, raise ValidationError
        at once.

        Every argument up to ``priority`` may also be passed by position, in
        the order of vLLM's AsyncLLM / multiprocess client
        (``prompt_adapter_request``: None only); the rest, as in vLLM's
        EngineClient protocol, by keyword.

        As vLLM's: a ``priority`` other than 0 is refused unless the engine
        schedules by priority; a prompt carrying ``multi_modal_data`` (or
        ``mm_processor_kwargs``) is refused, legato serving text-only models.
        ``reasoning_ended`` and ``reasoning_parser_kwargs`` are accepted and
        checked: the engine has no reasoning parser (``legato serve
        --reasoning-parser`` splits reasoning in the server), so a structured
        output constrains from the first token, as vLLM's does without one.
        """
        _check_vllm_extras(prompt, priority, self.config.scheduling_policy)
        if prompt_adapter_request is not None:
            raise ValidationError("prompt_adapter_request", "prompt adapters are not supported")
        if reasoning_ended is not None and not isinstance(reasoning_ended, bool):
            raise ValidationError(
                "reasoning_ended", f"must be a bool, got {type(reasoning_ended).__name__}"
            )
        if reasoning_parser_kwargs is not None and not isinstance(reasoning_parser_kwargs, dict):
            raise ValidationError(
                "reasoning_parser_kwargs",
                f"must be a dict, got {type(reasoning_parser_kwargs).__name__}",
            )
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValidationError(
                "lora_request", f"must be a LoRARequest, got {type(lora_request).__name__}"
            )
        if data_parallel_rank not in (None, 0):
            raise ValidationError(
                "data_parallel_rank", f"this engine has one core, got {data_parallel_rank}"
            )
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValidationError(
                "sampling_params", f"must be SamplingParams, got {type(params).__name__}"
            )
        kwargs = check_tokenization_kwargs(tokenization_kwargs) or None
        if prompt_text is not None and not isinstance(prompt_text, str):
            raise ValidationError(
                "prompt_text", f"must be a string, got {type(prompt_text).__name__}"
            )
        if request_id is None:
            request_id = uuid.uuid4().hex
        stream = RequestStream(self, prompt, params, str(request_id), priority)
        stream._render_options = {"tokenization_kwargs": kwargs, "prompt_text": prompt_text}
        stream._lora = lora_request
        return stream

    async def _submit(self, stream: RequestStream) -> None:
        """Render and register the stream's request in the caller's task; a checkpoint.

        Either submits or raises, never both (see ``Frontend.add_request``: a
        prompt that fails to render is reported by the stream's first read).
        While the engine is paused or asleep the request is accepted and held
        until it resumes. A ``lora_request`` adapter not loaded yet is loaded
        first (a bad one raises its ValidationError here, before anything is
        registered).
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_alive()
        if stream._lora is not None:
            await self.adapters.ensure(stream._lora)
            self._check_alive()
        stream.engine_id = await self.frontend.add_request(
            stream.request_id,
            stream._prompt,
            stream._params,
            stream._slot,
            priority=stream._priority,
            lora_request=stream._lora,
            pooling_params=stream._pooling,
            **stream._render_options,
        )

    async def render_chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Chat messages as a ready prompt ``{"prompt", "prompt_token_ids"}`` for
        ``generate``, rendered with the chat template (``chat_template``, else the
        tokenizer's); ``tools`` and ``template_kwargs`` reach the template.

        A checkpoint. A large chat renders in a worker thread, so it never
        stalls other streams; cancelling the caller then drops the render (see
        ``Frontend.render_chat_prompt``). Bad messages or a failing template
        raise ValidationError naming the field. Works on a dead engine too: it
        is the tokenizer's work only.
        """
        return await self.frontend.render_chat_prompt(
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            tools=tools,
            template_kwargs=template_kwargs,
        )

    def _release(self, request_id: str, engine_id: str) -> None:
        """Forget a request whose stream has ended (only this one: not a later namesake)."""
        self.frontend.release(request_id, engine_id)

    def _abort_quietly(self, request_id: str, engine_id: str) -> None:
        """The consumer left: abort in the scheduler, forget the request. Never blocks."""
        self.frontend.abort_quietly(request_id, engine_id)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests: each stream ends with a last output whose finish_reason is "abort".

        Tokens generated so far are included. Unknown or finished ids are
        ignored; on a dead engine there is nothing to abort and it returns. A
        checkpoint.
        """
        self.frontend.abort([request_id] if isinstance(request_id, str) else request_id)
        await trio.lowlevel.checkpoint()

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        lora_request: Any = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        tokenization_kwargs: dict[str, Any] | None = None,
        reasoning_ended: bool | None = None,
    ) -> AsyncIterator[PoolingRequestOutput]:
        """Embed ``prompt``: yields one PoolingRequestOutput (the pooled, by default
        L2-normalised final hidden state; see legato.models.pooling).

        The request is scheduled beside generation requests (one queue, the
        same budgets) and ends in the step that computes its prompt's end.
        ``pooling_params.task`` must be "embed"; ``dimensions`` is refused
        (no model here is trained to be shortened) unless it is the hidden
        size. Bad input raises ValidationError naming the field; an aborted
        request yields nothing. Cancellation aborts it, as for ``generate``.
        """
        params = await self._check_pooling(pooling_params)
        torch = await _import_torch()
        sampling = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
        stream = self.generate(
            prompt,
            sampling,
            request_id,
            lora_request=lora_request,
            tokenization_kwargs=tokenization_kwargs,
            priority=priority,
            reasoning_ended=reasoning_ended,
        )
        stream._pooling = params
        try:
            async with stream:
                async for output in stream:
                    if not output.finished:
                        continue
                    vector = self.frontend.take_pooled(stream.engine_id)
                    if vector is not None:
                        yield PoolingRequestOutput(
                            stream.request_id,
                            PoolingOutput(torch.tensor(vector, dtype=torch.float32)),
                            list(output.prompt_token_ids or []),
                            num_cached_tokens=output.num_cached_tokens or 0,
                            finished=True,
                        )
        finally:  # a vector that came while nobody read it any more
            self.frontend.take_pooled(stream.engine_id)

    async def _check_pooling(self, params: object) -> PoolingParams:
        if not isinstance(params, PoolingParams):
            raise ValidationError(
                "pooling_params", f"must be PoolingParams, got {type(params).__name__}"
            )
        params.check_servable(
            await self.embedding_size() if params.dimensions is not None else None
        )
        return params

    async def embedding_size(self) -> int:
        """The length of the model's embedding vectors (its hidden size). A checkpoint."""
        if self._embedding_size is None:
            self._embedding_size = int(await self._worker_call("embedding_size"))
        else:
            await trio.lowlevel.checkpoint()
        return self._embedding_size

    # -------------------------------------------------------------- health

    def _on_death(self, error: EngineDeadError) -> None:
        frontend: Frontend | None = getattr(self, "frontend", None)  # None: died starting
        if frontend is not None:
            frontend.fail_all(error)

    @property
    def is_running(self) -> bool:
        return not self._stopped and self.supervisor.dead_error is None

    @property
    def is_stopped(self) -> bool:
        return self._stopped or self.supervisor.dead_error is not None

    @property
    def errored(self) -> bool:
        return self.supervisor.dead_error is not None

    @property
    def dead_error(self) -> EngineDeadError:
        if self.supervisor.dead_error is not None:
            return self.supervisor.dead_error
        return EngineDeadError("the engine is not dead (dead_error read while running)")

    async def check_health(self) -> None:
        """Raise the engine's EngineDeadError if it is dead; return otherwise. A checkpoint."""
        await trio.lowlevel.checkpoint()
        self._check_alive()

    async def do_log_stats(self, scheduler_outputs: Any = None, model_output: Any = None) -> None:
        """Every stat logger's ``log()``; silent when ``disable_log_stats``. A checkpoint.

        ``scheduler_outputs`` and ``model_output`` are vLLM's older parameters,
        accepted and unused (the figures come from the engine's own steps)."""
        self.stats.log()
        await trio.lowlevel.checkpoint()

    def add_logger(self, stat_logger: StatLoggerBase) -> None:
        """Feed ``stat_logger`` the engine's figures from the next step on."""
        self.stats.add(stat_logger)

    def remove_logger(self, stat_logger: StatLoggerBase) -> None:
        """Stop feeding ``stat_logger`` (a built-in one too); ValueError if unknown."""
        self.stats.remove(stat_logger)

    async def is_tracing_enabled(self) -> bool:
        return False

    # ---------------------------------------------------------- lifecycle

    async def pause_generation(
        self,
        *,
        mode: PauseModeName = "abort",
        wait_for_inflight_requests: bool = False,
        clear_cache: bool = True,
    ) -> None:
        """Stop generating. New requests are accepted and held until resume. Idempotent.

        "abort": in-flight requests end with reason "abort"; "wait": returns
        once they have finished; "keep": they freeze and continue on resume.
        ``wait_for_inflight_requests=True`` is vLLM's older spelling of "wait".
        ``clear_cache`` resets the prefix cache once nothing is in flight.
        A caller cancelled while waiting stops waiting; the pause goes on.
        """
        if wait_for_inflight_requests:
            mode = "wait"
        if mode not in _PAUSE_MODES:
            raise ValueError(f"mode: must be one of {', '.join(_PAUSE_MODES)}, got {mode!r}")
        self._check_alive()
        await self._control(self.core.pause(_PAUSE_MODES[mode], clear_cache))

    async def resume_generation(self) -> None:
        self._check_alive()
        await self._control(self.core.resume())

    async def is_paused(self) -> bool:
        await trio.lowlevel.checkpoint()
        return self.scheduler.is_paused

    async def sleep(self, level: int = 1, mode: PauseModeName = "abort") -> None:
        """Free the KV cache (level 2: also the weights); new requests are held until ``wake_up``.

        In-flight requests are aborted ("abort") or first allowed to finish
        ("wait"); "keep" is refused, since a frozen request needs its KV cache.
        A caller cancelled while waiting stops waiting; the engine still goes
        to sleep.
        """
        if level not in (1, 2):
            raise ValueError(f"level: must be 1 or 2, got {level!r}")
        if mode not in ("abort", "wait"):
            raise ValueError(f"mode: sleep supports 'abort' and 'wait', got {mode!r}")
        self._check_alive()
        await self._control(self.core.sleep(level, _PAUSE_MODES[mode]))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` freed (``tags``: None = everything, else a subset of
        "weights" and "kv_cache"); held requests start once the KV cache is back."""
        if tags is not None:
            unknown = sorted(set(tags) - {"weights", "kv_cache"})
            if unknown:
                raise ValueError(f"tags: unknown tag(s) {unknown}; expected weights, kv_cache")
            tags = list(tags)
        self._check_alive()
        await self._control(self.core.wake_up(tags))

    async def is_sleeping(self) -> bool:
        await trio.lowlevel.checkpoint()
        return self.core.sleeping

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        self._check_alive()
        return await self._control(self.core.reset_prefix_cache(reset_running_requests))

    async def _control(self, call: Awaitable[T]) -> T:
        """Await one of the engine core's control calls; its answer. A checkpoint.

        The loop does the whole of it even if this caller is cancelled while
        waiting (it just stops waiting). If the engine dies or stops first,
        raises its EngineDeadError.
        """
        try:
            return await call
        except CoreStopped:
            self._check_alive()
            raise

    async def reset_mm_cache(self) -> None:
        await trio.lowlevel.checkpoint()  # no multimodal inputs yet: nothing to reset

    async def reset_encoder_cache(self) -> None:
        await trio.lowlevel.checkpoint()  # no encoder cache yet: nothing to reset

    async def _worker_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` on the worker; a checkpoint. A cancelled caller stops waiting (the
        call still runs on the worker); if the worker dies, raises the engine's
        EngineDeadError."""
        self._check_alive()
        try:
            return await self.executor.call(method, *args, **kwargs)
        except WorkerDiedError:
            self._check_alive()
            raise

    async def start_profile(self) -> None:
        trace_dir = self.config.profile_dir or os.path.join(os.getcwd(), "legato-profile")
        await self._worker_call("start_profile", trace_dir)

    async def stop_profile(self) -> None:
        path = await self._worker_call("stop_profile")
        logger.info("profiler trace written to %s", path)

    async def add_lora(self, lora_request: Any) -> bool:
        """Load a PEFT adapter on the worker (blocks the caller while it reads); True.

        Requests name it by ``lora_request`` (Python) or by its ``lora_name``
        as the model (HTTP). An adapter the engine cannot serve (bad path, a
        rank above max_lora_rank, an unknown module...) raises ValidationError
        naming the field; the engine lives. See legato.engine_adapters.
        """
        self._check_alive()
        return await self.adapters.add(lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter; False if it was not loaded."""
        self._check_alive()
        return await self.adapters.remove(lora_id)

    async def list_loras(self) -> set[int]:
        """The int ids of the loaded adapters. A checkpoint."""
        await trio.lowlevel.checkpoint()
        return self.adapters.ids()

    async def pin_lora(self, lora_id: int) -> bool:
        """Exempt a loaded adapter from LRU eviction; False if it is not loaded."""
        self._check_alive()
        return await self.adapters.pin(lora_id)

    async def get_tokenizer(self, lora_request: LoRARequest | None = None) -> Any:
        """The tokenizer requests are rendered with. A checkpoint.

        ``lora_request`` (vLLM's parameter) is accepted: an adapter runs with
        the base model's tokenizer here (adapters that add tokens are not
        served), so the answer is the same tokenizer. Anything but a
        LoRARequest or None raises ValidationError.
        """
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValidationError(
                "lora_request", f"must be a LoRARequest, got {type(lora_request).__name__}"
            )
        await trio.lowlevel.checkpoint()
        return self.tokenizer

    async def get_supported_tasks(self) -> tuple[SupportedTask, ...]:
        """Generation and embeddings (pooled final hidden states) from the one model."""
        await trio.lowlevel.checkpoint()
        return ("generate", "embed")

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,  # noqa: ASYNC109 - vLLM's signature
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Call ``method`` on the model worker and return its result in a list.

        Under tensor parallelism every rank runs it; rank 0's result is returned.
        As vLLM's: a method that raises fails the call with RuntimeError (the
        worker's message; the engine keeps serving), and no answer within
        ``timeout`` seconds raises TimeoutError (the call still completes on
        the worker). A dead engine raises its EngineDeadError.
        """
        try:
            with trio.fail_after(math.inf if timeout is None else timeout):
                return [await self._worker_call(method, *args, **(kwargs or {}))]
        except WorkerCallError as exc:
            raise RuntimeError(f"collective_rpc {method!r} failed: {exc}") from exc
        except trio.TooSlowError:
            raise TimeoutError(f"collective_rpc {method!r}: no answer within {timeout} s") from None

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine: open streams end with EngineDeadError, the worker is reaped.

        Synchronous and idempotent; the actors finish within the nursery's exit.
        The worker gets ``timeout`` seconds to exit by itself before it is
        killed (vLLM's parameter), at most the executor's own grace of 5 s; None:
        that grace. With the in-process executor there is no process to kill,
        so ``timeout`` bounds nothing there. Only the first call's ``timeout``
        counts.
        """
        if self._stopped:
            return
        self._stopped = True
        if timeout is not None and self._worker_started and not self._worker_gone.is_set():
            try:
                self._nursery.start_soon(self._kill_worker_after, max(0.0, timeout))
            except RuntimeError:  # the nursery has closed: the worker is long gone
                pass
        self.supervisor.stopping = True
        frontend: Frontend | None = getattr(self, "frontend", None)  # None: never started
        if frontend is not None:
            frontend.fail_all(EngineDeadError("the engine has been shut down"))
        self.executor.begin_shutdown()
        self.supervisor.cancel_all()

    async def _kill_worker_after(self, timeout: float) -> None:  # noqa: ASYNC109 - a deadline
        """Kill the worker if it has not been reaped ``timeout`` seconds from now."""
        with trio.move_on_after(timeout):
            await self._worker_gone.wait()
            return
        try:
            self.executor.kill()
        except (WorkerCallError, ProcessLookupError):  # in-process; or it has just gone
            pass

    async def wait_until_idle(self) -> None:
        """Return once the scheduler holds no request (every KV block free). A checkpoint."""
        self._check_alive()
        await self.core.wait_idle()

    # ------------------------------------------------------------ testing

    def inject_fault(self, actor: str, error: BaseException | None = None) -> None:
        """Chaos hook: make ``actor`` fail at its next checkpoint (see legato.testing.chaos)."""
        self.supervisor.inject(actor, error)

    @property
    def num_kv_blocks_used(self) -> int:
        """KV blocks held by requests now. Reads the pool only: the per-step figures
        that /metrics counts are left alone."""
        return self.scheduler.kv.num_used_blocks


async def _import_torch() -> types.ModuleType:
    """torch, imported in a worker thread the first time: the engine's process needs it
    only to hand out ``PoolingOutput.data`` as a tensor, and the import takes seconds
    that must not hold the event loop."""
    module = sys.modules.get("torch")
    if module is None:
        module = await trio.to_thread.run_sync(importlib.import_module, "torch")
    return module


def _check_vllm_extras(prompt: object, priority: object, policy: str) -> None:
    """Refuse, as vLLM does, what a text-only, fcfs engine cannot honour (ValidationError)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValidationError("priority", f"must be an integer, got {type(priority).__name__}")
    if priority != 0 and policy != "priority":
        raise ValidationError(
            "priority",
            f"got {priority}, but priority scheduling is not enabled "
            "(scheduling_policy='priority')",
        )
    if isinstance(prompt, Mapping):
        for key in ("multi_modal_data", "mm_processor_kwargs"):
            if prompt.get(key):
                raise ValidationError(
                    f"prompt.{key}",
                    "multimodal inputs are not supported: legato serves text-only models",
                )


@asynccontextmanager
async def open_engine(
    model: str | EngineArgs | None = None,
    *,
    faults: dict[str, Any] | None = None,
    stat_loggers: Sequence[StatLoggerArg] = (),
    **engine_args: Any,
) -> AsyncIterator[AsyncEngine]:
    """Start an engine for ``model`` (None: the default model; see legato.model_source) and yield it.

    ``engine_args`` are EngineConfig's fields (vLLM's names). ``model`` may
    instead be vLLM's ``EngineArgs`` (legato.vllm_config), which then holds every
    setting: ``engine_args`` must be empty. Start-up
    failures (a bad model directory, weights that fail to load) raise here.
    On exit every request is ended, the actors stop and the worker is reaped.
    ``faults`` is for chaos testing only (``legato.testing.chaos``).
    ``stat_loggers``: custom stat loggers (``legato.actors.stats.StatLoggerBase``)
    or vLLM-style factories ``(config, engine_index) -> logger``, fed besides the
    built-in Prometheus and log-line loggers.
    """
    if isinstance(model, EngineArgs):
        if engine_args:
            raise TypeError(
                f"open_engine: with EngineArgs, pass every setting in it, not as "
                f"{', '.join(sorted(engine_args))}"
            )
        config = model.to_engine_config()
    else:
        config = EngineConfig.from_kwargs(model=model, **engine_args)
    config = await trio.to_thread.run_sync(resolve_model, config)
    # The actors never raise into this nursery: a group here wraps one error from
    # start-up or from the caller's own block.
    with unwrap_single_error():
        async with trio.open_nursery() as nursery:
            engine = AsyncEngine(config, nursery, faults=faults, stat_loggers=stat_loggers)
            try:
                await engine._start()
                yield engine
            finally:
                engine.shutdown()
