"""``StatLoggerBase``: vLLM's stat-logger API; ``StepStatLogger``: legato's shape over it.

A logger written for vLLM (``vllm.v1.metrics.loggers.StatLoggerBase``) runs unchanged
once its import names ``legato``: it is built by ``(vllm_config, engine_index)`` (a
``legato.vllm_config.VllmConfig`` view) and gets ``record(scheduler_stats,
iteration_stats, mm_cache_stats, engine_idx)``, where ``scheduler_stats`` is
legato's ``SchedulerStats`` (vLLM's names too: ``num_running_reqs``,
``num_waiting_reqs``, ``kv_cache_usage``, ``prefix_cache_stats``) and
``iteration_stats`` a ``StepStats`` (vLLM's ``IterationStats`` names:
``num_generation_tokens``, ``num_prompt_tokens``, ``time_to_first_tokens_iter``,
``inter_token_latencies_iter``, ``finished_requests``...).

Where legato differs: ``record`` comes once or twice per engine step (the engine
core's figures, then the output processor's; either part may be empty, as vLLM's
may be None), timestamps are ``time.monotonic()`` seconds, and ``mm_cache_stats``
is always None (no multimodal inputs).

Never imports trio or torch.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .records import StepStats

if TYPE_CHECKING:
    from ..protocol.messages import SchedulerStats
    from ..vllm_config import VllmConfig


class StatLoggerBase(ABC):
    """A sink for the engine's figures, in vLLM's shape; subclass it for a custom logger.

    ``record`` is called synchronously on the engine's event loop, once or twice
    per engine step: it must be quick and must not block. ``log`` is called every
    ``log_stats_interval`` seconds and by ``do_log_stats``, never when
    ``disable_log_stats`` is set. ``log_engine_initialized`` is called once,
    when the engine has started. The stats objects may grow fields; read them
    by name.

    A logger whose method raises is logged (with its traceback) and removed
    from its engine, which keeps serving: a faulty metrics sink must not take
    generation down, nor fill the log with one traceback per step.
    """

    def __init__(  # noqa: B027 - vLLM's constructor shape
        self, vllm_config: VllmConfig | None = None, engine_index: int = 0
    ) -> None:
        """vLLM's constructor shape; the base keeps nothing (a subclass may)."""

    @abstractmethod
    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: StepStats | None,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        """Take one step's figures (vLLM's signature)."""

    def log(self) -> None:  # noqa: B027 - optional, as in vLLM
        """Report the figures recorded since the last call (optional)."""

    def log_engine_initialized(self) -> None:  # noqa: B027 - optional, as in vLLM
        """The engine has started (optional)."""

    def record_sleep_state(self, is_awake: int, level: int) -> None:  # noqa: B027
        """vLLM's sleep-state hook (optional)."""


class StepStatLogger(StatLoggerBase):
    """legato's own shape: one ``StepStats`` per call to ``record_step``. The built-in
    loggers (Prometheus, the log line) are these; ``record`` adapts vLLM's call."""

    @abstractmethod
    def record_step(self, step: StepStats) -> None:
        """Take one step's figures."""

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: StepStats | None,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if iteration_stats is None:
            iteration_stats = StepStats(timestamp=time.monotonic(), scheduler=scheduler_stats)
        self.record_step(iteration_stats)


StatLoggerFactory = Callable[["VllmConfig", int], StatLoggerBase]
"""vLLM's shape: ``(vllm_config, engine_index) -> logger``; a StatLoggerBase subclass
with vLLM's constructor is one."""
