"""``AsyncEngine`` and ``open_engine``: the engine's start-up, requests and health.

``open_engine`` resolves the model, starts the actors in a nursery of its own
under a ``Supervisor`` (``AsyncEngine._start``: the executor first, then the
parts ``build_engine_parts`` wires, then the core, delivery, stats and
heartbeat actors), yields the engine, and on exit shuts everything down and
reaps the worker. The control calls (pause, sleep, LoRA, profile,
``collective_rpc``) are ``EngineControls``, vLLM's weight updates over it
``EngineWeightUpdates``; the tokenizer's calls (tokenize,
render a chat, model info) ``EngineTokenizerCalls``; the stat loggers'
``EngineStatCalls``; the config views are ``VllmConfigViews``; a request's
stream is ``RequestStream``.

Never imports models, the worker side or torch at import time (``encode``
imports torch in a thread, the first time).
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
import sys
import types
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import trio

from ..actors.engine_core import EngineCore
from ..actors.executor import WorkerCallError
from ..actors.frontend import Frontend, thread_renderer
from ..actors.heartbeat import run_heartbeat
from ..actors.stats import run_stats
from ..actors.supervisor import Supervisor
from ..config import EngineConfig
from ..config_views import VllmConfigViews
from ..engine_adapters import EngineAdapters
from ..engine_parts import build_engine_parts
from ..exception_groups import unwrap_single_error
from ..frontend.input_processor import InputProcessor
from ..frontend.renderer import PromptType
from ..metrics.collector import StatLoggerArg, StatsCollector
from ..protocol import messages as m
from ..protocol.client import EngineClient, StreamingInput
from ..protocol.errors import EngineBusyError, EngineDeadError, ValidationError
from ..protocol.inputs import EngineCoreRequest
from ..protocol.outputs import PoolingOutput, PoolingRequestOutput
from ..protocol.params import LoRARequest, RequestOutputKind, SamplingParams
from ..serving_gc import tune_gc_for_serving
from ..tokenizer_loading import load_tokenizer
from ..vllm_config import EngineArgs, VllmConfig
from .request_checks import check_pooling_params, check_request
from .request_stream import RequestStream
from .stat_calls import EngineStatCalls
from .tokenizer_calls import EngineTokenizerCalls
from .weight_updates import EngineWeightUpdates
from .wiring import make_executor, resolve_model

logger = logging.getLogger("legato.engine")


class AsyncEngine(
    EngineWeightUpdates, EngineTokenizerCalls, EngineStatCalls, VllmConfigViews, EngineClient
):
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
        self.ready: m.WorkerReady | None = None  # the worker's report, once started
        self._embedding_size: int | None = None
        self._stopped = False
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
        ready = self.ready
        return VllmConfig.of(self.config, dtype=ready.dtype if ready is not None else None)

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, *, stat_loggers: Sequence[StatLoggerArg] = ()
    ) -> AbstractAsyncContextManager[AsyncEngine]:
        """vLLM's constructor in trio's form: ``async with AsyncEngine.from_engine_args(args)
        as engine:`` starts the engine and stops it on exit (``open_engine(args)``)."""
        return open_engine(engine_args, stat_loggers=stat_loggers)

    @property
    def input_preprocessor(self) -> InputProcessor:
        """vLLM's older name: the input processor (``input_processor``, once started)."""
        return self.input_processor

    async def get_input_preprocessor(self) -> InputProcessor:
        """vLLM's getter; its v1 successor ``input_processor`` (``process_inputs``), with
        the older ``preprocess`` and ``get_tokenizer`` too."""
        await trio.lowlevel.checkpoint()
        return self.input_processor

    @property
    def processor(self) -> InputProcessor:
        """The early v1 AsyncLLM's name for its input processor (``process_inputs``)."""
        return self.input_processor

    @staticmethod
    def is_unsupported_config(vllm_config: VllmConfig) -> bool:
        """vLLM's multiprocess client's check: pipeline parallelism is not supported
        (nor data parallelism here, which EngineArgs refuses by name)."""
        parallel = vllm_config.parallel_config
        return parallel.pipeline_parallel_size > 1 or parallel.data_parallel_size > 1

    async def _start(self) -> None:
        config = self.config
        tokenizer_path = config.tokenizer or config.model
        assert tokenizer_path is not None
        tokenizer = await trio.to_thread.run_sync(load_tokenizer, tokenizer_path)
        ready: m.WorkerReady = await self._nursery.start(
            functools.partial(self.supervisor.run_actor, uses_task_status=True),
            "executor",
            self.executor.run,
        )
        self.ready = ready
        parts = build_engine_parts(config, ready, tokenizer)
        self.config = config = parts.config
        self.renderer = parts.renderer
        self.input_processor = InputProcessor(self.renderer)
        self.tokenizer = tokenizer
        offload_renderer = await trio.to_thread.run_sync(thread_renderer, self.renderer)
        self.scheduler = parts.scheduler
        outputs_send, outputs_recv = trio.open_memory_channel[m.EngineCoreOutputs](math.inf)
        self.core = EngineCore(
            self.scheduler,
            self.executor,
            outputs_send,
            self.stats.record,
            async_scheduling=config.async_scheduling,
            grammars=parts.grammars,
            max_live_requests=config.max_live_requests,
        )
        self.frontend = Frontend(
            self.renderer,
            parts.processor,
            self.core.submit,
            self.stats.record,
            offload_renderer=offload_renderer,
            admit=self.check_admission,
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

    async def _ping_core(self) -> None:
        await self.core.ping()

    # ------------------------------------------------------------- requests

    def generate(
        self,
        prompt: PromptType | EngineCoreRequest | AsyncIterable[StreamingInput],
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
        at once (see legato.engine.request_checks).

        Every argument up to ``priority`` may also be passed by position, in
        the order of vLLM's AsyncLLM / multiprocess client
        (``prompt_adapter_request``: None only); the rest, as in vLLM's
        EngineClient protocol, by keyword.

        As vLLM's: a ``priority`` other than 0 is refused unless the engine
        schedules by priority; a prompt carrying ``multi_modal_data`` (or
        ``mm_processor_kwargs``) is refused, legato serving text-only models. An
        ``EngineCoreRequest`` (from ``input_processor.process_inputs``) runs with its
        own sampling parameters, id, adapter and priority; its tokens are checked again.
        An async generator of ``StreamingInput`` chunks runs a streaming-input session
        (``legato.engine.streaming_input``), fed chunk by chunk as they arrive.
        ``reasoning_ended`` and ``reasoning_parser_kwargs`` are accepted and
        checked: the engine has no reasoning parser (``legato serve
        --reasoning-parser`` splits reasoning in the server), so a structured
        output constrains from the first token, as vLLM's does without one.
        """
        if isinstance(prompt, AsyncIterable):  # vLLM's streaming-input session
            from .streaming_input import StreamingSession

            session_params = sampling_params if sampling_params is not None else SamplingParams()
            if not isinstance(session_params, SamplingParams):
                raise ValidationError("sampling_params", "must be SamplingParams")
            options = dict(
                lora_request=lora_request,
                priority=priority,
                tokenization_kwargs=tokenization_kwargs,
                data_parallel_rank=data_parallel_rank,
            )
            rid = uuid.uuid4().hex if request_id is None else str(request_id)
            return StreamingSession(self, prompt, session_params, rid, options)
        if isinstance(prompt, EngineCoreRequest):  # vLLM's: the request's own settings
            sampling_params = prompt.sampling_params or sampling_params
            request_id = prompt.external_req_id or prompt.request_id
            lora_request, priority = prompt.lora_request or lora_request, prompt.priority
        request = check_request(
            prompt,
            sampling_params,
            scheduling_policy=self.config.scheduling_policy,
            lora_request=lora_request,
            prompt_adapter_request=prompt_adapter_request,
            priority=priority,
            prompt_text=prompt_text,
            tokenization_kwargs=tokenization_kwargs,
            data_parallel_rank=data_parallel_rank,
            reasoning_ended=reasoning_ended,
            reasoning_parser_kwargs=reasoning_parser_kwargs,
        )
        request_id = uuid.uuid4().hex if request_id is None else str(request_id)
        return RequestStream(self, request, request_id)

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType | EngineCoreRequest,
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        prompt_text: str | None = None,
    ) -> RequestStream:
        """vLLM's AsyncLLM ``add_request``: submit the request now and return its stream
        (``generate``'s, entered: iterate it, or ``aclose`` it to abort). Raises what
        submission raises (a duplicate id, a dead engine). ``arrival_time`` is accepted
        and unused: the engine stamps arrival itself (``time.monotonic()``)."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        stream = self.generate(
            prompt,
            params,
            request_id,
            lora_request,
            trace_headers,
            None,
            priority,
            prompt_text=prompt_text,
            tokenization_kwargs=tokenization_kwargs,
            data_parallel_rank=data_parallel_rank,
        )
        return await stream.__aenter__()

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
        request = stream.request
        if request.lora_request is not None:
            await self.adapters.ensure(request.lora_request)
            self._check_alive()
        stream.engine_id = await self.frontend.add_request(
            stream.request_id,
            request.prompt,
            request.params,
            stream.slot,
            priority=request.priority,
            lora_request=request.lora_request,
            pooling_params=request.pooling_params,
            tokenization_kwargs=request.tokenization_kwargs,
            prompt_text=request.prompt_text,
        )

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        """Raise EngineBusyError if one more request would pass ``max_live_requests``
        (requests rendering, queued, running or held; ``n``, its sequences, does not
        count: the bound is on requests, the unit the engine core's inbox holds).

        Not a checkpoint; never blocks. Every submission makes the same check
        before anything is held for it, so a flood of submissions is refused
        request by request and never grows the core's inbox past its bound.
        """
        frontend: Frontend | None = getattr(self, "frontend", None)
        if frontend is None:  # not started: nothing is held
            return
        if frontend.num_live >= self.config.max_live_requests or not self.core.has_room():
            raise EngineBusyError(
                f"the engine holds {frontend.num_live} requests, its max_live_requests="
                f"{self.config.max_live_requests}: retry once some have finished"
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
        pooling_params: Any,
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
        params = check_pooling_params(pooling_params)
        params.check_servable(
            await self.embedding_size() if params.dimensions is not None else None
        )
        torch = await _import_torch()
        request = check_request(
            prompt,
            SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY),
            scheduling_policy=self.config.scheduling_policy,
            lora_request=lora_request,
            priority=priority,
            tokenization_kwargs=tokenization_kwargs,
            reasoning_ended=reasoning_ended,
            pooling_params=params,
        )
        stream = RequestStream(self, request, str(request_id))
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
    ``stat_loggers``: custom stat loggers (``legato.metrics.logger_base.StatLoggerBase``)
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
