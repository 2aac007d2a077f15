"""``StatLoggerBase``: the stat-logger API (vLLM's, in our terms), and the factory shape.

Never imports trio or torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

from .records import StepStats

if TYPE_CHECKING:
    from ..config import EngineConfig


class StatLoggerBase(ABC):
    """A sink for the engine's figures; subclass it for a custom logger.

    ``record`` is called synchronously on the engine's event loop, once or twice
    per engine step (the engine core's figures, then the output processor's): it
    must be quick and must not block. ``log`` is called every
    ``log_stats_interval`` seconds and by ``do_log_stats``, never when
    ``disable_log_stats`` is set. ``log_engine_initialized`` is called once,
    when the engine has started. ``StepStats`` and ``SchedulerStats`` may grow
    fields; read them by name.

    A logger whose method raises is logged (with its traceback) and removed
    from its engine, which keeps serving: a faulty metrics sink must not take
    generation down, nor fill the log with one traceback per step.
    """

    @abstractmethod
    def record(self, step: StepStats) -> None:
        """Take one step's figures."""

    def log(self) -> None:  # noqa: B027 - optional, as in vLLM
        """Report the figures recorded since the last call (optional)."""

    def log_engine_initialized(self) -> None:  # noqa: B027 - optional, as in vLLM
        """The engine has started (optional)."""


StatLoggerFactory = Callable[["EngineConfig", int], StatLoggerBase]
"""vLLM's shape: ``(config, engine_index) -> logger``; a StatLoggerBase subclass is one."""
