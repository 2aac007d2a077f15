"""``LLMEngine``: vLLM's step-wise engine (``add_request``, ``step``, ``abort_request``).

A short synchronous driver over the parts ``AsyncEngine`` has, wired by
``build_engine_parts``: the front end's core, the engine core's step
(``CoreSteps``) and an in-process ``Worker``, all in the calling thread.

Imports torch only through the worker it starts (and once, lazily, for a
pooled vector); never imports trio's actors beyond the output slot and the
runner-output check.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from ..actors.executor import WorkerCallError, check_runner_output
from ..actors.output_slot import OutputSlot
from ..config import EngineConfig
from ..engine_parts import build_engine_parts
from ..frontend.frontend_core import FrontendCore, RenderedRequest
from ..frontend.renderer import PromptType
from ..metrics.collector import StatLoggerArg, StatsCollector
from ..metrics.logger_base import StatLoggerBase
from ..protocol import messages as m
from ..protocol.errors import ValidationError
from ..protocol.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from ..protocol.params import (
    LoRARequest,
    PoolingParams,
    RequestOutputKind,
    SamplingParams,
    check_lora_request,
)
from ..scheduling.core_steps import AddRequests, CoreSteps, FinishRequests, FrontendMessage
from ..serving_gc import tune_gc_for_serving
from ..tokenizer_loading import load_tokenizer
from ..vllm_config import EngineArgs, ModelConfig, VllmConfig


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

    def __init__(self, config: EngineConfig, stat_loggers: Sequence[StatLoggerArg] = ()) -> None:
        """``stat_loggers``: custom stat loggers or vLLM-style factories, fed besides
        the built-in Prometheus and log-line loggers (see ``legato.actors.stats``)."""
        from ..engine.wiring import resolve_model
        from ..workers.worker import Worker

        config = resolve_model(config)
        if config.tensor_parallel_size > 1:  # refused, never silently run on one device
            raise ValidationError(
                "tensor_parallel_size",
                f"LLMEngine runs one in-process worker; got {config.tensor_parallel_size} "
                "(use LLM or AsyncEngine for tensor parallelism)",
            )
        self.worker = Worker.start(m.WorkerInit(config=config.to_dict()))
        self.tokenizer = load_tokenizer(config.tokenizer or config.model or "")
        parts = build_engine_parts(config, self.worker.ready(), self.tokenizer)
        self.config = parts.config
        self.renderer = parts.renderer
        self.grammars = parts.grammars
        self.scheduler = parts.scheduler
        self._sleeping = False
        self._failures: list[Exception] = []  # failed requests step() has yet to raise
        self._last_logged = time.monotonic()
        model_name = self.config.served_model_name or self.config.model or "legato-toy"
        self.stats = StatsCollector.for_config(self.config, model_name, stat_loggers)
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
        return cls(config, stat_loggers or ())

    @classmethod
    def from_vllm_config(
        cls, vllm_config: VllmConfig, stat_loggers: Sequence[StatLoggerArg] | None = None
    ) -> LLMEngine:
        """vLLM's constructor from a ``VllmConfig`` (legato's view of an EngineConfig)."""
        return cls(vllm_config.engine_config, stat_loggers or ())

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
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        tokenization_kwargs: dict[str, Any] | None = None,
        prompt_text: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Render and queue a request; returns its id. Raises ValueError for bad input
        or a live duplicate id (and queues nothing).

        ``tokenization_kwargs``, ``prompt_text`` and ``lora_request``: as for
        ``AsyncEngine.generate`` (an adapter not loaded yet is loaded here).
        ``params`` a PoolingParams: an embedding request (``AsyncEngine.encode``);
        ``step()`` gives its one PoolingRequestOutput when its prompt is computed.
        """
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
        """Abort requests (the caller's ids; ``internal``: the engine's ids); each one's
        last output (finish_reason "abort") comes from the next ``step()``. Unknown ids
        are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if internal:
            by_engine_id = {live.engine_id: rid for rid, live in self.frontend.live.items()}
            ids = [by_engine_id[i] for i in ids if i in by_engine_id]
        self.frontend.abort(ids)

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Run one engine step; return the outputs it produced (finished ones included):
        a RequestOutput per generation request with news, a PoolingRequestOutput per
        embedding request that finished (an aborted one gives its RequestOutput).

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

    def get_num_unfinished_requests(self) -> int:
        return len(self.frontend.live)

    def get_metrics(self) -> dict[str, float]:
        s = self._stats
        return {
            "num_requests_running": s.num_running,
            "num_requests_waiting": s.num_waiting,
            "kv_cache_usage": s.kv_cache_usage,
            "kv_cache_blocks_used": s.num_blocks_used,
        }

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
        """Abort every live request (their last outputs come from the next ``step()``)
        and free the KV cache (level 2: also the weights) until ``wake_up``. ``mode``:
        vLLM's; only "abort" (a frozen request needs the KV cache sleep frees)."""
        if level not in (1, 2):
            raise ValueError(f"level: must be 1 or 2, got {level!r}")
        if mode != "abort":
            raise ValidationError("mode", f"only 'abort' is supported, got {mode!r}")
        self.abort_request(list(self.frontend.live))
        self.scheduler.reset_prefix_cache(True)
        self._call("sleep", level)
        self._sleeping = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._call("wake_up", tags)
        if tags is None or "kv_cache" in tags:
            self._sleeping = False

    def is_sleeping(self) -> bool:
        return self._sleeping

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Call ``method`` on the model runner (the one worker); its result in a list."""
        return [self._call(method, *args, **(kwargs or {}))]
