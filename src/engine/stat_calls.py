"""``EngineStatCalls``: the engine's stat loggers as vLLM's AsyncLLM names them
(``stat_loggers``, ``add_logger``, ``do_log_stats`` ...) and the Prometheus text.
A mixin of ``AsyncEngine``; never imports torch.
"""

from __future__ import annotations

from typing import Any

import trio

from ..metrics.collector import StatsCollector
from ..metrics.logger_base import StatLoggerBase


class EngineStatCalls:
    """Mixin: the stat-logger side of ``EngineClient``."""

    stats: StatsCollector

    @property
    def stat_loggers(self) -> dict[str, StatLoggerBase]:
        """vLLM's AsyncLLM attribute: the loggers by name ("prometheus", "logging", then
        each custom one by its class name). Change them with ``add_logger`` /
        ``remove_logger``."""
        named: dict[str, StatLoggerBase] = {}
        for one in self.stats.loggers:
            if one is self.stats.prometheus:
                name = "prometheus"
            elif one is self.stats.log_line_logger:
                name = "logging"
            else:
                name = type(one).__name__
                while name in named:
                    name += "_"
            named[name] = one
        return named

    def metrics_text(self) -> bytes:
        return self.stats.exposition()

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
