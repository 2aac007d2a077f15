"""``StatsCollector``: the stat loggers of one engine (Prometheus, the log line, custom
ones), fed synchronously by the actors that produce the figures.

Never imports trio or torch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from .log_line import LoggingStatLogger
from .logger_base import StatLoggerBase, StatLoggerFactory
from .prometheus import PrometheusStatLogger, cache_config_labels
from .records import StepStats

if TYPE_CHECKING:
    from ..config import EngineConfig

logger = logging.getLogger("legato.stats")


class StatsCollector:
    """The stat loggers of one engine: the Prometheus logger, the log-line logger
    (unless ``log_stats`` is False) and any custom ones, in that order.

    ``record`` / ``log`` / ``log_engine_initialized`` call every logger; one that
    raises is logged and removed (see ``StatLoggerBase``). ``log`` does nothing
    when ``log_stats`` is False (``disable_log_stats``). Not thread-safe: call it
    from the engine's own thread.
    """

    def __init__(
        self,
        model_name: str = "legato",
        *,
        log_stats: bool = True,
        log_interval: float = 10.0,
        vllm_names: bool = False,
        loggers: Iterable[StatLoggerBase] = (),
        cache_config: dict[str, str] | None = None,
        max_loras: int | None = None,
    ) -> None:
        self.log_stats = log_stats
        self.prometheus = PrometheusStatLogger(
            model_name, vllm_names=vllm_names, cache_config=cache_config, max_loras=max_loras
        )
        self.log_line_logger = LoggingStatLogger(log_interval) if log_stats else None
        self._loggers: list[StatLoggerBase] = [self.prometheus]
        if self.log_line_logger is not None:
            self._loggers.append(self.log_line_logger)
        for one in loggers:
            self.add(one)

    @classmethod
    def for_config(
        cls, config: EngineConfig, model_name: str, stat_loggers: Sequence[StatLoggerArg] = ()
    ) -> StatsCollector:
        """The collector an engine with ``config`` starts with; ``stat_loggers`` are
        loggers or vLLM-style factories ``(config, engine_index) -> logger``."""
        return cls(
            model_name,
            log_stats=not config.disable_log_stats,
            log_interval=config.log_stats_interval,
            vllm_names=config.vllm_metric_names,
            loggers=[make_stat_logger(arg, config) for arg in stat_loggers],
            cache_config=cache_config_labels(config),
            max_loras=config.max_loras if config.enable_lora else None,
        )

    @property
    def loggers(self) -> tuple[StatLoggerBase, ...]:
        """The loggers, built-ins first."""
        return tuple(self._loggers)

    def add(self, stat_logger: StatLoggerBase) -> None:
        """Feed ``stat_logger`` from the next step on (TypeError if it is not a logger)."""
        if not isinstance(stat_logger, StatLoggerBase):
            raise TypeError(f"expected a StatLoggerBase, got {type(stat_logger).__name__}")
        if stat_logger not in self._loggers:
            self._loggers.append(stat_logger)

    def remove(self, stat_logger: StatLoggerBase) -> None:
        """Stop feeding ``stat_logger`` (ValueError if it is not one of these loggers)."""
        try:
            self._loggers.remove(stat_logger)
        except ValueError:
            raise ValueError(f"{stat_logger!r} is not a logger of this engine") from None

    def _call(self, method: str, *args: Any) -> None:
        for one in tuple(self._loggers):
            try:
                getattr(one, method)(*args)
            except Exception:
                logger.exception("stat logger %r raised in %s(); it is removed", one, method)
                if one in self._loggers:
                    self._loggers.remove(one)

    def record(self, step: StepStats) -> None:
        self._call("record", step)

    def log(self) -> None:
        """Every logger's ``log()``; nothing when stats logging is disabled."""
        if self.log_stats:
            self._call("log")

    def log_engine_initialized(self) -> None:
        self._call("log_engine_initialized")

    def log_line(self, now: float | None = None) -> str:
        """The log-line logger's line (its figures are kept only while stats logging is on)."""
        if self.log_line_logger is None:
            return "stats logging is disabled"
        return self.log_line_logger.line(now)

    def exposition(self) -> bytes:
        """The metrics in Prometheus text format."""
        return self.prometheus.exposition()


StatLoggerArg = StatLoggerBase | StatLoggerFactory
"""What ``stat_loggers=`` takes: a logger, or a factory ``(config, engine_index) -> logger``."""


def make_stat_logger(arg: StatLoggerArg, config: EngineConfig) -> StatLoggerBase:
    """``arg`` itself if it is a logger, else ``arg(config, 0)`` (engine index 0: one engine)."""
    if isinstance(arg, StatLoggerBase):
        return arg
    if not callable(arg):
        raise TypeError(
            f"stat_loggers: expected a StatLoggerBase or a factory, got {type(arg).__name__}"
        )
    made = arg(config, 0)
    if not isinstance(made, StatLoggerBase):
        raise TypeError(f"stat_loggers: {arg!r} made a {type(made).__name__}, not a StatLoggerBase")
    return made
