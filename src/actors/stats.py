"""Metrics: Prometheus series in a registry of the engine's own, and the periodic log line.

Names follow Prometheus conventions under one prefix, ``legato:``, with units
in the names. ``StatsCollector`` is synchronous: the scheduler and detokenizer
actors record into it as they go; ``run_stats`` is the actor that logs a line
every ``log_stats_interval``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..protocol.messages import SchedulerStats

logger = logging.getLogger("legato.stats")

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


@dataclass
class FinishedRequest:
    """One request's life, reported once when it ends."""

    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class StepStats:
    """What one engine step contributes to the metrics."""

    timestamp: float
    scheduler: SchedulerStats | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)
    queue_time: list[float] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)


class StatsCollector:
    """Prometheus metrics for one engine, and the figures of the log line."""

    def __init__(self, model_name: str = "legato") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        self._model = model_name
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels + list(extra), registry=r)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=_LATENCY_BUCKETS, registry=r)

        self.running = gauge("legato:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("legato:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge(
            "legato:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)."
        )
        self.kv_blocks_used = gauge("legato:kv_cache_blocks_used", "KV-cache blocks in use.")
        self.kv_blocks_total = gauge("legato:kv_cache_blocks_total", "KV-cache blocks in all.")
        self.prefix_queries = counter(
            "legato:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter(
            "legato:prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.preemptions = counter(
            "legato:num_preemptions", "Requests preempted for lack of KV blocks."
        )
        self.prompt_tokens = counter("legato:prompt_tokens", "Prompt tokens computed.")
        self.generation_tokens = counter("legato:generation_tokens", "Tokens generated.")
        self.request_success = counter(
            "legato:request_success", "Requests finished, by reason.", ("finished_reason",)
        )
        self.ttft = histogram("legato:time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("legato:inter_token_latency_seconds", "Time between two tokens.")
        self.e2e = histogram("legato:e2e_request_latency_seconds", "Arrival to finish.")
        self.queue = histogram("legato:request_queue_time_seconds", "Arrival to first scheduled.")

        for gauge_ in (
            self.running,
            self.waiting,
            self.kv_usage,
            self.kv_blocks_used,
            self.kv_blocks_total,
        ):
            gauge_.labels(model_name).set(0)  # every series exists from the start
        self._last_scheduler = SchedulerStats()
        self._window: deque[tuple[float, int, int]] = deque()  # (time, prompt, generation)
        self._prefix_window: deque[tuple[float, int, int]] = deque()

    def record(self, step: StepStats) -> None:
        model = self._model
        if step.scheduler is not None:
            s = step.scheduler
            self._last_scheduler = s
            self.running.labels(model).set(s.num_running)
            self.waiting.labels(model).set(s.num_waiting)
            self.kv_usage.labels(model).set(s.kv_cache_usage)
            self.kv_blocks_used.labels(model).set(s.num_blocks_used)
            self.kv_blocks_total.labels(model).set(s.num_blocks_total)
            self.prefix_queries.labels(model).inc(s.prefix_cache_queries)
            self.prefix_hits.labels(model).inc(s.prefix_cache_hits)
            self.preemptions.labels(model).inc(s.num_preempted)
            self._prefix_window.append(
                (step.timestamp, s.prefix_cache_queries, s.prefix_cache_hits)
            )
        self.prompt_tokens.labels(model).inc(step.num_prompt_tokens)
        self.generation_tokens.labels(model).inc(step.num_generation_tokens)
        self._window.append((step.timestamp, step.num_prompt_tokens, step.num_generation_tokens))
        # One labels() lookup per series and step, not per token (it is a locked dict lookup).
        for series, values in (
            (self.ttft, step.time_to_first_token),
            (self.itl, step.inter_token_latency),
            (self.queue, step.queue_time),
        ):
            if values:
                child = series.labels(model)
                for value in values:
                    child.observe(value)
        for done in step.finished:
            self.request_success.labels(model, done.finish_reason).inc()
            self.e2e.labels(model).observe(done.e2e_latency)

    def log_line(self, now: float | None = None, window: float = 10.0) -> str:
        """Throughput over the last ``window`` seconds, queue sizes, KV usage, prefix hit rate."""
        now = time.monotonic() if now is None else now
        for dq in (self._window, self._prefix_window):
            while dq and dq[0][0] < now - window:
                dq.popleft()
        prompt = sum(p for _, p, _ in self._window)
        generated = sum(g for _, _, g in self._window)
        queries = sum(q for _, q, _ in self._prefix_window)
        hits = sum(h for _, _, h in self._prefix_window)
        s = self._last_scheduler
        hit_rate = 100.0 * hits / queries if queries else 0.0
        return (
            f"prompt throughput: {prompt / window:.1f} tokens/s, "
            f"generation throughput: {generated / window:.1f} tokens/s, "
            f"running: {s.num_running} reqs, waiting: {s.num_waiting} reqs, "
            f"KV cache usage: {100.0 * s.kv_cache_usage:.1f}%, "
            f"prefix cache hit rate: {hit_rate:.1f}%"
        )

    def exposition(self) -> bytes:
        """The metrics in Prometheus text format."""
        return generate_latest(self.registry)


async def run_stats(collector: StatsCollector, *, log_interval: float, log_enabled: bool) -> None:
    """The stats actor: log the collector's line every ``log_interval`` seconds.

    Figures are recorded synchronously by the actors that produce them
    (``StatsCollector.record``), so a metric is up to date as soon as the
    output it counts has been delivered. Runs until cancelled.
    """
    while True:
        await trio.sleep(log_interval)
        if log_enabled:
            logger.info(collector.log_line(window=log_interval))
