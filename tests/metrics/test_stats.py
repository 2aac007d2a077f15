"""The stat loggers: Prometheus series (legato: and vLLM's names), the log line, the collector
that feeds custom loggers and drops one that raises."""

from __future__ import annotations

import logging
import math
import random
import re
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from legato.config import EngineConfig
from legato.metrics import prometheus as stats
from legato.metrics.collector import StatsCollector, make_stat_logger
from legato.metrics.log_line import LoggingStatLogger
from legato.metrics.logger_base import StatLoggerBase
from legato.metrics.prometheus import BatchHistogram, PrometheusStatLogger
from legato.metrics.records import FinishedRequest, StepStats
from legato.protocol.messages import SchedulerStats
from legato.testing.per_sample_histogram import PerSampleHistogram


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


def test_log_line_drops_to_debug_while_idle(caplog: pytest.LogCaptureFixture) -> None:
    """As vLLM: no throughput and nothing running or waiting -> debug, else info."""
    line_logger = LoggingStatLogger(interval=10.0)
    levels: list[int] = []
    with caplog.at_level(logging.DEBUG, logger="legato.stats"):
        line_logger.log()  # nothing has happened yet
        now = time.monotonic()
        line_logger.record(step(now))  # tokens computed, 3 running, 2 waiting
        line_logger.log()
        drained = StepStats(timestamp=now + 1, scheduler=SchedulerStats())
        line_logger.record(drained)  # queues empty, but tokens within the interval
        line_logger.log()
        line_logger.record(StepStats(timestamp=now + 20, scheduler=SchedulerStats()))
        assert line_logger.idle(now + 20)
        levels = [r.levelno for r in caplog.records]
    assert levels == [logging.DEBUG, logging.INFO, logging.INFO]


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
        loud.record(step(1.0))  # not idle: 3 running (an idle engine logs at debug)
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


# --- BatchHistogram: exposed exactly as prometheus_client's Histogram ---------------------


SUM_OR_CREATED = re.compile(r"^(\S+_(?:sum|created)\{[^}]*\}) (\S+)$", re.MULTILINE)


def assert_same_exposition(ours: bytes, reference: bytes) -> None:
    """Line for line the same text, but for the values of ``_created`` (a clock reading)
    and ``_sum`` (ours adds a batch's sum at once; equal to 1e-12)."""
    mine, theirs = ours.decode(), reference.decode()
    assert SUM_OR_CREATED.sub(r"\1 X", mine) == SUM_OR_CREATED.sub(r"\1 X", theirs)
    mine_values = {m[0]: float(m[1]) for m in SUM_OR_CREATED.findall(mine)}
    their_values = {m[0]: float(m[1]) for m in SUM_OR_CREATED.findall(theirs)}
    assert mine_values.keys() == their_values.keys()
    for key, value in mine_values.items():
        tolerance = 60.0 if key.split("{")[0].endswith("_created") else 0
        assert value == pytest.approx(their_values[key], rel=1e-12, abs=tolerance), key
    # and what a Prometheus server parses from it
    assert [
        (f.name, f.documentation, f.type, [(s.name, s.labels) for s in f.samples])
        for f in text_string_to_metric_families(mine)
    ] == [
        (f.name, f.documentation, f.type, [(s.name, s.labels) for s in f.samples])
        for f in text_string_to_metric_families(theirs)
    ]


def reference_logger(monkeypatch: pytest.MonkeyPatch) -> PrometheusStatLogger:
    """PrometheusStatLogger("m", vllm_names=True) with prometheus_client Histograms."""
    with monkeypatch.context() as patch:
        patch.setattr(stats, "BatchHistogram", PerSampleHistogram)
        return PrometheusStatLogger("m", vllm_names=True)


def edge_values(bounds: Sequence[float]) -> list[float]:
    """Every bound, the floats either side of it, zero and a negative."""
    out = [0.0, -1.0]
    for bound in bounds:
        out += [bound, math.nextafter(bound, -math.inf), math.nextafter(bound, math.inf)]
    return out


def random_step(rng: random.Random, t: float) -> StepStats:
    latency_edges = edge_values(stats._LATENCY_BUCKETS)

    def latencies(n: int) -> list[float]:
        return [
            rng.choice(latency_edges) if rng.random() < 0.3 else rng.lognormvariate(-4, 2)
            for _ in range(n)
        ]

    n = rng.choice([0, 1, 3, 7, 8, 9, 64, 256, 1024])
    tokens = [int(b) for b in stats._TOKEN_BUCKETS] + [0, 3, 7_000_000]
    return StepStats(
        timestamp=t,
        num_generation_tokens=n,
        time_to_first_token=latencies(rng.choice([0, 1, 9])),
        inter_token_latency=latencies(n),
        queue_time=latencies(rng.choice([0, 2, 20])),
        finished=[
            FinishedRequest("stop", *latencies(1), rng.choice(tokens), rng.choice(tokens))
            for _ in range(rng.choice([0, 1, 12]))
        ],
    )


@pytest.mark.parametrize("created", [True, False])
def test_exposition_is_prometheus_clients_for_every_histogram(
    monkeypatch: pytest.MonkeyPatch, created: bool
) -> None:
    """Every histogram of both prefixes, fed steps of 0 to 1024 samples (bounds, the
    floats either side of them, one-bucket and spread batches) reads exactly as
    prometheus_client's Histogram fed the same samples one by one: names, HELP/TYPE,
    labels, ``le`` bounds, cumulative counts, ``_count``, ``_sum`` and ``_created``."""
    monkeypatch.setattr(prometheus_metrics, "_use_created", created)
    ours, reference = PrometheusStatLogger("m", vllm_names=True), reference_logger(monkeypatch)
    rng = random.Random(13)
    for i in range(60):
        one = random_step(rng, float(i))
        ours.record(one)
        reference.record(one)
    one_bucket = StepStats(timestamp=61.0, inter_token_latency=[0.007] * 300 + [0.01, 0.005])
    for logger_ in (ours, reference):
        logger_.record(one_bucket)
    text = ours.exposition()
    assert_same_exposition(text, reference.exposition())
    assert (b"inter_token_latency_seconds_created" in text) == created
    got = samples(text)
    le_01 = (("le", "0.01"), ("model_name", "m"))
    assert got[("vllm:inter_token_latency_seconds_bucket", le_01)] > 300


@pytest.mark.parametrize("size", [1, 2, 7, 8, 9, 256, 1024])
@pytest.mark.parametrize("spread", ["one bucket", "on the bounds", "all buckets"])
def test_a_batch_counts_as_its_samples_one_by_one(size: int, spread: str) -> None:
    bounds = (0.001, 0.01, 0.1, 1.0)
    rng = random.Random(size)
    pick = {
        "one bucket": lambda: rng.uniform(0.0011, 0.01),
        "on the bounds": lambda: rng.choice(bounds),
        "all buckets": lambda: rng.choice(edge_values(bounds) + [5.0]),
    }[spread]
    ours_registry, reference_registry = CollectorRegistry(), CollectorRegistry()
    ours = BatchHistogram("h_seconds", "H.", "m", bounds, ours_registry)
    reference = PerSampleHistogram("h_seconds", "H.", "m", bounds, reference_registry)
    for _ in range(3):
        batch = [pick() for _ in range(size)]
        ours.observe_many(batch)
        reference.observe_many(batch)
    ours.observe_many([])
    assert_same_exposition(generate_latest(ours_registry), generate_latest(reference_registry))


def test_nan_and_infinite_samples_count_as_in_prometheus_client() -> None:
    """NaN goes in ``_sum`` only; +-inf land in the +Inf and first buckets."""
    bounds = (0.5, 1.0)
    for batch in ([math.nan, 0.7], [math.inf, -math.inf, 0.2] * 4, [math.nan, 2.0] * 5):
        ours_registry, reference_registry = CollectorRegistry(), CollectorRegistry()
        BatchHistogram("h", "H.", "m", bounds, ours_registry).observe_many(batch)
        PerSampleHistogram("h", "H.", "m", bounds, reference_registry).observe_many(batch)
        ours, reference = (
            {k: v for k, v in samples(generate_latest(r)).items() if not k[0].endswith("created")}
            for r in (ours_registry, reference_registry)
        )
        assert ours.keys() == reference.keys()
        for key, value in ours.items():
            assert value == reference[key] or (math.isnan(value) and math.isnan(reference[key]))


def histogram_samples(exposition: str) -> Iterator[tuple[list[float], float, float]]:
    """(cumulative bucket counts, _count, _sum) of each histogram family."""
    for family in text_string_to_metric_families(exposition):
        if family.type != "histogram":
            continue  # _created, which the text format puts in a gauge of its own
        values = {s.name: s.value for s in family.samples if not s.name.endswith("_bucket")}
        buckets = [s.value for s in family.samples if s.name.endswith("_bucket")]
        yield buckets, values[family.name + "_count"], values[family.name + "_sum"]


def test_a_scrape_from_another_thread_sees_whole_batches() -> None:
    """Recording on one thread, scraping on another: every scrape shows cumulative,
    monotone buckets, ``_count`` equal to the +Inf bucket, and whole batches only
    (bucket counts, count and sum all a whole number of batches)."""
    registry = CollectorRegistry()
    histogram = BatchHistogram("t_seconds", "T.", "m", stats._LATENCY_BUCKETS, registry)
    batch = [k / 1024 for k in range(1, 129)]  # exact sums; spread over 13 buckets
    per_batch = [sum(v <= b for v in batch) for b in (*stats._LATENCY_BUCKETS, math.inf)]
    scrapes: list[float] = []
    broken: list[str] = []
    done = threading.Event()

    def scrape() -> None:
        try:
            while not done.is_set():
                [(buckets, count, total)] = histogram_samples(generate_latest(registry).decode())
                batches = count / len(batch)
                if buckets != sorted(buckets) or count != buckets[-1]:
                    broken.append(f"not cumulative: {buckets} count {count}")
                elif buckets != [n * batches for n in per_batch] or total != sum(batch) * batches:
                    broken.append(f"part of a batch: {buckets} count {count} sum {total}")
                scrapes.append(count)
        except Exception as error:
            broken.append(repr(error))
            raise

    thread = threading.Thread(target=scrape)
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # hand the GIL over as often as it can
    try:
        thread.start()
        while len(scrapes) < 300 and not broken and thread.is_alive():
            histogram.observe_many(batch)
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(switch_interval)
    assert broken == []
    assert len(set(scrapes)) > 10  # the scrapes did land between batches


def test_vllm_cache_config_and_lora_requests_info() -> None:
    """The two info series the Kubernetes inference gateway reads, under vLLM's names
    and labels: the KV-cache configuration (block count from the first step when not
    configured), and per step which adapters run and wait (the value: the time)."""
    config = EngineConfig(
        model="m", vllm_metric_names=True, enable_lora=True, max_loras=3, disable_log_stats=True
    )
    collector = StatsCollector.for_config(config, "m")
    lora_step = step(5.0)
    assert lora_step.scheduler is not None
    lora_step.scheduler.running_lora_adapters = {"a": 2, "b": 1}
    lora_step.scheduler.waiting_lora_adapters = {"c": 1}
    before = time.time()
    collector.record(lora_step)
    got = samples(collector.exposition())
    info = [labels for name, labels in got if name == "vllm:cache_config_info"]
    assert len(info) == 1
    labels = dict(info[0])
    assert labels["block_size"] == str(config.block_size)
    assert labels["enable_prefix_caching"] == "True"
    assert labels["num_gpu_blocks"] == "9"  # 8 usable and the null block
    assert got[("vllm:cache_config_info", info[0])] == 1
    lora = (("max_lora", "3"), ("running_lora_adapters", "a,b"), ("waiting_lora_adapters", "c"))
    assert got[("vllm:lora_requests_info", lora)] >= before
    # Without LoRA there is no lora series; without vLLM names, neither series.
    plain = StatsCollector.for_config(EngineConfig(model="m", vllm_metric_names=True), "m")
    plain.record(step(1.0))
    assert not any(name == "vllm:lora_requests_info" for name, _ in samples(plain.exposition()))
    legato_only = StatsCollector.for_config(EngineConfig(model="m"), "m")
    assert not any("_info" in name for name, _ in samples(legato_only.exposition()))
