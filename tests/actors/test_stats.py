"""The stat loggers: Prometheus series (legato: and vLLM's names), the log line, the collector
that feeds custom loggers and drops one that raises."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from legato.actors.stats import (
    FinishedRequest,
    LoggingStatLogger,
    PrometheusStatLogger,
    StatLoggerBase,
    StatsCollector,
    StepStats,
    make_stat_logger,
)
from legato.config import EngineConfig
from legato.protocol.messages import SchedulerStats


def step(t: float = 1.0, reason: str | None = "length") -> StepStats:
    return StepStats(
        timestamp=t,
        scheduler=SchedulerStats(
            num_running=3,
            num_waiting=2,
            kv_cache_usage=0.25,
            num_blocks_total=8,
            num_blocks_used=2,
            prefix_cache_queries=10,
            prefix_cache_hits=4,
            num_preempted=1,
        ),
        num_prompt_tokens=7,
        num_generation_tokens=5,
        time_to_first_token=[0.01],
        inter_token_latency=[0.002, 0.003],
        queue_time=[0.001],
        finished=[FinishedRequest(reason, 0.5, 7, 5)] if reason else [],
    )


def samples(exposition: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(exposition.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


M = (("model_name", "m"),)
VLLM_NAMES = [
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prompt_tokens_total",
    "generation_tokens_total",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "num_preemptions_total",
    "time_to_first_token_seconds_count",
    "inter_token_latency_seconds_count",
    "e2e_request_latency_seconds_count",
    "request_queue_time_seconds_count",
    "request_prompt_tokens_sum",
    "request_generation_tokens_sum",
]


def test_prometheus_logger_publishes_vllm_names_only_when_asked() -> None:
    plain = PrometheusStatLogger("m")
    both = PrometheusStatLogger("m", vllm_names=True)
    for logger_ in (plain, both):
        logger_.record(step(1.0))
        logger_.record(step(2.0, reason="stop"))
    got = samples(both.exposition())
    expected = {
        "num_requests_running": 3,
        "num_requests_waiting": 2,
        "kv_cache_usage_perc": 0.25,
        "prompt_tokens_total": 14,
        "generation_tokens_total": 10,
        "prefix_cache_queries_total": 20,
        "prefix_cache_hits_total": 8,
        "num_preemptions_total": 2,
        "time_to_first_token_seconds_count": 2,
        "inter_token_latency_seconds_count": 4,
        "e2e_request_latency_seconds_count": 2,
        "request_queue_time_seconds_count": 2,
        "request_prompt_tokens_sum": 14,
        "request_generation_tokens_sum": 10,
    }
    assert sorted(expected) == sorted(VLLM_NAMES)
    for name, value in expected.items():
        assert got[("legato:" + name, M)] == value, name
        assert got[("vllm:" + name, M)] == value, name
    for reason in ("length", "stop"):
        labels = (("finished_reason", reason), ("model_name", "m"))
        assert got[("legato:request_success_total", labels)] == 1
        assert got[("vllm:request_success_total", labels)] == 1
    assert got[("legato:kv_cache_blocks_used", M)] == 2
    assert not any(name.startswith("vllm:kv_cache_blocks") for name, _ in got)  # no vLLM name
    assert not any(name.startswith("vllm:") for name, _ in samples(plain.exposition()))
    assert samples(plain.exposition())[("legato:generation_tokens_total", M)] == 10


def test_per_step_updates_do_not_look_up_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The labelled children are cached: ``labels()`` runs once per series (and finish
    reason), not once per series per step."""
    logger_ = PrometheusStatLogger("m", vllm_names=True)
    logger_.record(step(0.0))  # the first "length" finish makes its child
    calls = []
    original = MetricWrapperBase.labels

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(MetricWrapperBase, "labels", counting)
    for i in range(50):
        logger_.record(step(float(i)))
    assert calls == []
    logger_.record(step(51.0, reason="abort"))  # a new reason: one child per prefix
    assert len(calls) == 2


def test_log_line_is_vllms_over_the_last_interval() -> None:
    line_logger = LoggingStatLogger(interval=10.0)
    line_logger.record(step(1.0))
    line_logger.record(step(5.0))
    assert line_logger.line(now=6.0) == (
        "Avg prompt throughput: 1.4 tokens/s, Avg generation throughput: 1.0 tokens/s, "
        "Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 40.0%"
    )
    # 12 s later the first step is out of the window
    assert line_logger.line(now=13.0).startswith(
        "Avg prompt throughput: 0.7 tokens/s, Avg generation throughput: 0.5 tokens/s"
    )


class Recorder(StatLoggerBase):
    def __init__(self, fail_in: str | None = None) -> None:
        self.steps: list[StepStats] = []
        self.logs = 0
        self.initialized = 0
        self.fail_in = fail_in

    def record(self, step: StepStats) -> None:
        if self.fail_in == "record":
            raise RuntimeError("sink down")
        self.steps.append(step)

    def log(self) -> None:
        if self.fail_in == "log":
            raise RuntimeError("sink down")
        self.logs += 1

    def log_engine_initialized(self) -> None:
        self.initialized += 1


def test_collector_feeds_custom_loggers_and_drops_one_that_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    good, bad_record, bad_log = Recorder(), Recorder("record"), Recorder("log")
    collector = StatsCollector("m", loggers=[good, bad_record])
    collector.add(bad_log)
    collector.add(bad_log)  # once only
    assert collector.loggers[2:] == (good, bad_record, bad_log)
    collector.log_engine_initialized()
    with caplog.at_level(logging.ERROR, logger="legato.stats"):
        collector.record(step(1.0))
        collector.record(step(2.0))
        collector.log()
        collector.log()
    assert len(good.steps) == 2 and good.logs == 2 and good.initialized == 1
    assert collector.loggers[2:] == (good,)  # the two faulty ones are gone
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and all(r.exc_info for r in errors)  # once each, with traceback
    assert b"legato:generation_tokens_total" in collector.exposition()
    assert samples(collector.exposition())[("legato:generation_tokens_total", M)] == 10
    collector.remove(good)
    collector.record(step(3.0))
    assert len(good.steps) == 2
    with pytest.raises(ValueError, match="not a logger of this engine"):
        collector.remove(good)
    with pytest.raises(TypeError):
        collector.add(object())  # type: ignore[arg-type]


def test_log_is_silent_when_stats_logging_is_disabled(caplog: pytest.LogCaptureFixture) -> None:
    custom = Recorder()
    quiet = StatsCollector("m", log_stats=False, loggers=[custom])
    loud = StatsCollector("m", log_stats=True)
    with caplog.at_level(logging.INFO, logger="legato.stats"):
        quiet.record(step(1.0))
        quiet.log()
        assert not caplog.records and custom.logs == 0
        assert len(custom.steps) == 1  # still recorded (Prometheus too)
        loud.log()
    assert "Avg generation throughput" in caplog.text


def test_stat_loggers_take_vllm_style_factories() -> None:
    config = EngineConfig(model="m")
    seen: list[tuple[EngineConfig, int]] = []

    def factory(cfg: EngineConfig, index: int) -> StatLoggerBase:
        seen.append((cfg, index))
        return Recorder()

    made = make_stat_logger(factory, config)
    assert isinstance(made, Recorder) and seen == [(config, 0)]
    instance = Recorder()
    assert make_stat_logger(instance, config) is instance
    with pytest.raises(TypeError, match="stat_loggers"):
        make_stat_logger(lambda cfg, i: object(), config)  # type: ignore[arg-type,return-value]
    collector = StatsCollector.for_config(
        EngineConfig(model="m", vllm_metric_names=True, disable_log_stats=True), "served", [factory]
    )
    assert collector.log_line_logger is None and isinstance(collector.loggers[-1], Recorder)
    collector.record(step())
    assert (
        samples(collector.exposition())[("vllm:num_requests_running", (("model_name", "served"),))]
        == 3
    )
