"""``LLMEngine``: vLLM's step-wise engine (``add_request``, ``step``, ``abort_request``).

A short synchronous driver over the parts ``AsyncEngine`` has, wired by
``build_engine_parts``: the front end's core, the engine core's step
(``CoreSteps``) and an in-process ``Worker``, all in the calling thread.

Imports torch only through the worker it starts (and once, lazily, for a
pooled vector); never imports trio's actors beyond the output slot and the
runner-output check.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from ..actors.executor import WorkerCallError, check_runner_output
from ..actors.output_slot import OutputSlot
from ..config import EngineConfig
from ..engine_parts import build_engine_parts
from ..frontend.frontend_core import FrontendCore, RenderedRequest
from ..frontend.renderer import PromptType
from ..metrics.collector import StatLoggerArg, StatLoggerManager, StatsCollector
from ..metrics.logger_base import StatLoggerBase
from ..metrics.reader import Metric, get_metrics_snapshot
from ..protocol import messages as m
from ..protocol.errors import ValidationError
from ..protocol.inputs import EngineCoreRequest
from ..protocol.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from ..protocol.params import (
    LoRARequest,
    PoolingParams,
    RequestOutputKind,
    SamplingParams,
    check_lora_request,
)
from ..scheduling.core_steps import AddRequests, CoreSteps, FinishRequests, FrontendMessage
from ..scheduling.pause_gate import PauseMode
from ..serving_gc import tune_gc_for_serving
from ..tokenizer_loading import load_tokenizer
from ..vllm_config import EngineArgs, ModelConfig, VllmConfig
from .model_executor import InprocModelExecutor

_R = TypeVar("_R")


class LLMEngine:
    """vLLM's step-wise engine: ``add_request``, ``step``, ``abort_request``.

    A short synchronous driver over the same parts as ``AsyncEngine``, wired by
    ``build_engine_parts``: the front end's core (``FrontendCore``: render,
    register, process outputs, pass on), the engine core's step (``CoreSteps``:
    plan -> execute -> apply) and an in-process ``Worker`` (the same
    ``Worker.handle`` the worker process serves frames with: its utility-call
    rules and checks), all in the calling thread. Never overlaps steps. Not
    thread-safe.
    """

    def __init__(
        self,
        vllm_config: VllmConfig | EngineConfig,
        executor_class: Any = None,
        log_stats: bool | None = None,
        aggregate_engine_logging: bool = False,
        usage_context: Any = None,
        stat_loggers: Sequence[StatLoggerArg] | None = None,
        mm_registry: Any = None,
        use_cached_outputs: bool = False,
        multiprocess_mode: bool = False,
    ) -> None:
        """vLLM's constructor. ``vllm_config``: a ``VllmConfig`` (legato's view) or
        legato's ``EngineConfig``. ``executor_class`` must be None and
        ``multiprocess_mode`` False: this engine runs its one worker in the calling
        thread. ``log_stats``: None keeps the config's ``disable_log_stats``.
        ``stat_loggers``: custom stat loggers or vLLM-style factories, fed besides the
        built-in Prometheus and log-line loggers (see ``legato.metrics.logger_base``).
        ``usage_context``, ``aggregate_engine_logging``, ``mm_registry`` and
        ``use_cached_outputs`` are accepted and unused (one engine, no multimodal)."""
        from ..engine.wiring import resolve_model
        from ..frontend.input_processor import InputProcessor
        from ..workers.worker import Worker

        if executor_class is not None:
            raise ValidationError(
                "executor_class", "LLMEngine runs its worker in this thread; use LLM or AsyncEngine"
            )
        if multiprocess_mode:
            raise ValidationError(
                "multiprocess_mode", "LLMEngine runs its worker in this thread; use LLM"
            )
        config = vllm_config.engine_config if isinstance(vllm_config, VllmConfig) else vllm_config
        if log_stats is not None and log_stats == config.disable_log_stats:
            config = dataclasses.replace(config, disable_log_stats=not log_stats)
        config = resolve_model(config)
        if config.tensor_parallel_size > 1:  # refused, never silently run on one device
            raise ValidationError(
                "tensor_parallel_size",
                f"LLMEngine runs one in-process worker; got {config.tensor_parallel_size} "
                "(use LLM or AsyncEngine for tensor parallelism)",
            )
        self.worker = Worker.start(m.WorkerInit(config=config.to_dict()))
        # vLLM's name for the in-process executor (driver_worker, collective_rpc)
        self.model_executor = InprocModelExecutor(self.worker, self._call)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model or "")
        parts = build_engine_parts(config, self.worker.ready(), self.tokenizer)
        self.config = parts.config
        self.renderer = parts.renderer
        self.input_processor = InputProcessor(self.renderer)
        self.grammars = parts.grammars
        self.scheduler = parts.scheduler
        # vLLM's data-parallel members, at their values for one engine (no DP group).
        self.dp_group: Any = None
        self.external_launcher_dp = False
        self.should_execute_dummy_batch = False
        self._sleeping = False
        self._failures: list[Exception] = []  # failed requests step() has yet to raise
        self._last_logged = time.monotonic()
        model_name = self.config.served_model_name or self.config.model or "legato-toy"
        self.stats = StatsCollector.for_config(self.config, model_name, stat_loggers or ())
        self.core = CoreSteps(self.scheduler, self.stats.record, self.grammars)
        self.processor = parts.processor
        self.frontend: FrontendCore[OutputSlot] = FrontendCore(
            self.renderer, self.processor, self._to_core, self.stats.record
        )
        self._stats = m.SchedulerStats()
        tune_gc_for_serving()
        self.stats.log_engine_initialized()

    @classmethod
    def from_engine_args(
        cls,
        engine_args: EngineArgs | str | None = None,
        usage_context: Any = None,
        stat_loggers: Sequence[StatLoggerArg] | None = None,
        enable_multiprocessing: bool = False,
        **legato_args: Any,
    ) -> LLMEngine:
        """vLLM's constructor: from an ``EngineArgs``. legato's own form is kept too:
        a model (path, None or "toy") plus EngineConfig's keyword arguments.
        ``usage_context`` is accepted and unused; ``enable_multiprocessing`` must be
        False (this engine runs its worker in the calling thread)."""
        if enable_multiprocessing:
            raise ValidationError(
                "enable_multiprocessing", "LLMEngine runs its worker in this thread; use LLM"
            )
        if isinstance(engine_args, EngineArgs):
            if legato_args:
                raise TypeError(f"unexpected arguments with EngineArgs: {sorted(legato_args)}")
            config = engine_args.to_engine_config()
        else:
            config = EngineConfig.from_kwargs(model=engine_args, **legato_args)
        return cls(config, stat_loggers=stat_loggers)

    @classmethod
    def from_vllm_config(
        cls, vllm_config: VllmConfig, stat_loggers: Sequence[StatLoggerArg] | None = None
    ) -> LLMEngine:
        """vLLM's constructor from a ``VllmConfig`` (legato's view of an EngineConfig)."""
        return cls(vllm_config, stat_loggers=stat_loggers)

    @property
    def vllm_config(self) -> VllmConfig:
        """vLLM's configuration object, a read-only view of ``config``."""
        return VllmConfig.of(self.config, dtype=self.worker.ready().dtype)

    @property
    def model_config(self) -> ModelConfig:
        return self.vllm_config.model_config

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_supported_tasks(self) -> tuple[str, ...]:
        """Generation and embeddings (pooled final hidden states) from the one model."""
        return ("generate", "embed")

    def add_request(
        self,
        request_id: str,
        prompt: PromptType | EngineCoreRequest,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        prompt_text: str | None = None,
    ) -> str:
        """Render and queue a request; returns its id (vLLM's positional order). Raises
        TypeError for a non-str id, ValueError for bad input or a live duplicate id (and
        queues nothing).

        ``prompt`` may be an EngineCoreRequest from ``input_processor.process_inputs``:
        its parameters, adapter, priority, arrival time and id are used, as vLLM's
        (its tokens are checked again). ``tokenization_kwargs``, ``prompt_text`` and
        ``lora_request``: as for ``AsyncEngine.generate`` (an adapter not loaded yet is
        loaded here); ``trace_headers`` are accepted, unused (no tracing).
        ``params`` a PoolingParams: an embedding request (``AsyncEngine.encode``);
        ``step()`` gives its one PoolingRequestOutput when its prompt is computed.
        """
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        if isinstance(prompt, EngineCoreRequest):
            request_id = prompt.external_req_id or prompt.request_id
            params = prompt.params
            arrival_time, priority = prompt.arrival_time, prompt.priority
            lora_request = prompt.lora_request
        pooling = None
        if isinstance(params, PoolingParams):  # one step's worth, nothing sampled
            pooling = self._check_pooling(params)
            params = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
        params = params or SamplingParams()
        frontend = self.frontend
        live = frontend.begin(request_id, OutputSlot(params.output_kind))
        try:
            rendered, requests = frontend.render(
                self.renderer,
                live.engine_id,
                prompt,
                params,
                arrival_time=arrival_time,
                priority=priority,
                lora_request=lora_request,
                pooling_params=pooling,
                tokenization_kwargs=tokenization_kwargs,
                prompt_text=prompt_text,
            )
            if lora_request is not None and lora_request.lora_int_id not in self.list_loras():
                self.add_lora(lora_request)
            grammars = frontend.grammars(params, requests)  # ValidationError naming the field
            frontend.register(
                request_id, live, params, RenderedRequest(rendered, requests, grammars)
            )
        except BaseException:
            frontend.release(request_id, live.engine_id)
            raise
        return request_id

    def _to_core(self, message: FrontendMessage) -> None:
        """The front end's messages, carried out at once on the engine core's step."""
        if isinstance(message, AddRequests):
            self.core.add_requests(message.requests, message.grammars)
        elif isinstance(message, FinishRequests):
            self.core.finish(message.request_ids, message.reason)
        else:  # pragma: no cover - the front end sends no other
            raise TypeError(f"unexpected message {message!r}")

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` on the worker's runner, through ``Worker.call_utility`` (public
        methods only); the runner's ValidationError as itself, else WorkerCallError."""
        answer = self.worker.call_utility(m.UtilityCall(0, method, list(args), kwargs))
        if answer.error is not None:
            error = WorkerCallError.of(answer)
            if error.validation is not None:
                raise error.validation
            raise error
        return answer.result

    def _check_pooling(self, params: PoolingParams) -> PoolingParams:
        """``params`` if this engine can serve them; ValidationError naming the field."""
        params.check_servable(self._call("embedding_size"))
        return params

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter in this process; ValidationError naming the field if it cannot."""
        return bool(self._call("add_lora", check_lora_request(lora_request)))

    def remove_lora(self, lora_id: int) -> bool:
        return bool(self._call("remove_lora", lora_id))

    def list_loras(self) -> set[int]:
        return set(self._call("list_loras"))

    def pin_lora(self, lora_id: int) -> bool:
        return bool(self._call("pin_lora", lora_id))

    def abort_request(self, request_ids: str | Sequence[str], internal: bool = False) -> None:
        """Abort requests (the caller's ids; ``internal``: the engine's ids) and forget
        them: as vLLM's, no output follows (stat loggers still see them finish as
        "abort"). Unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if internal:
            by_engine_id = {live.engine_id: rid for rid, live in self.frontend.live.items()}
            ids = [by_engine_id[i] for i in ids if i in by_engine_id]
        self.frontend.abort(ids)
        for rid in ids:
            live = self.frontend.live.get(rid)
            if live is not None:
                self.frontend.release(rid, live.engine_id)

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Run one engine step; return the outputs it produced (finished ones included):
        a RequestOutput per generation request with news (with n>1 and DELTA or
        CUMULATIVE, one per completion that advanced, as vLLM's children; FINAL_ONLY:
        one with all n), a PoolingRequestOutput per embedding request that finished.

        A request that failed (a grammar or detokenizer error) is removed and its
        error raised once: by this call if it has no other outputs to return, else by
        the next one, before it steps."""
        if self._failures:  # reported once each, before any further step
            raise self._failures.pop(0)
        planned = self.core.plan()
        if planned is not None:
            answer = check_runner_output(planned.plan, self.worker.handle(planned.plan))
            core_out = self.core.apply(planned, answer)
            if core_out.scheduler_stats is not None:
                self._stats = core_out.scheduler_stats
            self.frontend.process(core_out)
        results: list[RequestOutput | PoolingRequestOutput] = []
        for rid, live in list(self.frontend.live.items()):
            try:
                out = live.slot.get_nowait()
            except Exception as exc:  # this request failed: forget it, report it once
                self.frontend.release(rid, live.engine_id)
                self._failures.append(exc)
                continue
            if out is None:
                continue
            vector = self.frontend.take_pooled(live.engine_id)
            if vector is not None and out.finished:
                import torch  # the worker runs in this process: torch is loaded already

                pooled = PoolingOutput(torch.tensor(vector, dtype=torch.float32))
                results.append(PoolingRequestOutput(rid, pooled, list(out.prompt_token_ids or [])))
            elif len(out.outputs) > 1 and live.slot.output_kind != RequestOutputKind.FINAL_ONLY:
                results += _per_completion(out)
            else:
                results.append(out)
            if out.finished:
                self.frontend.release(rid, live.engine_id)
        if self._failures and not results:
            raise self._failures.pop(0)
        return results

    def has_unfinished_requests(self) -> bool:
        """Live requests, or failures ``step()`` has yet to raise."""
        return (
            bool(self.frontend.live)
            or bool(self._failures)
            or self.scheduler.has_unfinished_requests()
        )

    @property
    def logger_manager(self) -> StatLoggerManager:
        """vLLM's name: the stat loggers' manager, over ``stats`` (the collector)."""
        return StatLoggerManager(self.stats)

    def has_unfinished_requests_dp(self, has_unfinished: bool) -> bool:
        """vLLM's data-parallel form; with one engine (no DP group) its own answer."""
        return has_unfinished

    def get_num_unfinished_requests(self) -> int:
        """Requests not finished yet, each of a request's n completions counted, as
        vLLM counts its child requests."""
        return self.scheduler.get_num_unfinished_requests()

    def get_metrics(self) -> list[Metric]:
        """The engine's Prometheus series as vLLM's ``list[Metric]`` (Gauge, Counter,
        Histogram; see ``legato.metrics.reader``): ``legato:`` names, and ``vllm:``
        names too with ``vllm_metric_names``."""
        return get_metrics_snapshot(self.stats.prometheus.registry)

    def do_log_stats(self) -> None:
        """Every stat logger's ``log()``; silent when ``disable_log_stats``."""
        self.stats.log()

    def add_logger(self, stat_logger: StatLoggerBase) -> None:
        """Feed ``stat_logger`` the engine's figures from the next step on."""
        self.stats.add(stat_logger)

    def remove_logger(self, stat_logger: StatLoggerBase) -> None:
        """Stop feeding ``stat_logger`` (a built-in one too); ValueError if unknown."""
        self.stats.remove(stat_logger)

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Forget cached prefixes (see ``Scheduler.reset_prefix_cache``); whether it did.
        ``reset_connector``: vLLM's KV connector; legato has none, so nothing more."""
        return self.scheduler.reset_prefix_cache(reset_running_requests)

    def reset_mm_cache(self) -> None:
        """No multimodal inputs yet: nothing to reset."""

    def reset_encoder_cache(self) -> None:
        """No encoder cache yet: nothing to reset."""

    def start_profile(self) -> None:
        """Start torch's profiler on the worker; traces go to ``profile_dir``."""
        self._call(
            "start_profile", self.config.profile_dir or os.path.join(os.getcwd(), "legato-profile")
        )

    def stop_profile(self) -> None:
        """Stop the profiler and write its trace."""
        self._call("stop_profile")

    @property
    def log_stats(self) -> bool:
        """Whether the periodic stats line is on (``not disable_log_stats``)."""
        return not self.config.disable_log_stats

    def do_log_stats_with_interval(self) -> None:
        """``do_log_stats`` at most once per ``log_stats_interval`` seconds."""
        now = time.monotonic()
        if now - self._last_logged >= self.config.log_stats_interval:
            self._last_logged = now
            self.do_log_stats()

    @staticmethod
    def validate_outputs(outputs: Sequence[Any], output_type: type) -> Sequence[Any]:
        """vLLM's check that every output is an ``output_type``; returns ``outputs``."""
        for output in outputs:
            if not isinstance(output, output_type):
                raise TypeError(f"expected {output_type.__name__}, got {type(output).__name__}")
        return outputs

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Free the KV cache (level 2: also the weights) until ``wake_up``; ``step()``
        runs nothing meanwhile. ``mode`` (vLLM's): "abort" forgets every live request
        (no output follows, as ``abort_request``); "keep" freezes them: they continue
        after ``wake_up``, recomputing their KV cache from their tokens so far. "wait"
        (finish them first) is for the async engine: here, step until
        ``has_unfinished_requests()`` is False, then sleep."""
        if level not in (1, 2):
            raise ValueError(f"level: must be 1 or 2, got {level!r}")
        if mode not in ("abort", "keep"):
            raise ValidationError("mode", f"must be 'abort' or 'keep', got {mode!r}")
        if mode == "abort":
            self.abort_request(list(self.frontend.live))
        self.scheduler.pause(PauseMode.KEEP)  # nothing is scheduled while asleep
        self.scheduler.reset_prefix_cache(True)  # running requests: recomputed after waking
        self._call("sleep", level)
        self._sleeping = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._call("wake_up", tags)
        if tags is None or "kv_cache" in tags:
            self._sleeping = False
            self.scheduler.resume()

    def is_sleeping(self) -> bool:
        return self._sleeping

    def collective_rpc(
        self,
        method: str | Callable[..., _R],
        timeout: float | None = None,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Call ``method`` on the one worker; its result in a list, as vLLM's.

        A name calls that public method of the model runner (its checks apply). A
        callable is called as vLLM calls one, ``method(worker, *args, **kwargs)``, with
        legato's in-process ``Worker`` (``worker.get_model()``, ``worker.model_runner``).
        ``timeout`` is accepted and unused, as by vLLM's in-process executor: the call
        runs in this thread."""
        if callable(method):
            return [method(self.worker, *args, **(kwargs or {}))]
        return [self._call(method, *args, **(kwargs or {}))]

    def apply_model(self, func: Callable[[Any], _R]) -> list[_R]:
        """vLLM's: ``func(model)`` on the worker's model (a ``torch.nn.Module``)."""
        return self.collective_rpc(lambda worker: func(worker.get_model()))


def _per_completion(output: RequestOutput) -> list[RequestOutput]:
    """One output per completion, as vLLM's LLMEngine gives n>1 children's outputs: the
    parent's id on each, ``finished`` on the last only (the parent ends with it)."""
    last = len(output.outputs) - 1
    return [
        dataclasses.replace(output, outputs=[one], finished=output.finished and i == last)
        for i, one in enumerate(output.outputs)
    ]
