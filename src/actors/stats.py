"""The stats actor: calls the collector's ``log()`` every ``log_stats_interval``.

The figures themselves are recorded synchronously by the actors that produce them;
the loggers and the collector live in ``legato.metrics``. Never imports torch.
"""

from __future__ import annotations

import trio

from ..metrics.collector import StatsCollector


async def run_stats(collector: StatsCollector, *, log_interval: float) -> None:
    """The stats actor: ``collector.log()`` every ``log_interval`` seconds.

    Figures are recorded synchronously by the actors that produce them
    (``StatsCollector.record``), so a metric is up to date as soon as the
    output it counts has been delivered. Runs until cancelled.
    """
    while True:
        await trio.sleep(log_interval)
        collector.log()
