"""Speculative decoding's figures: vLLM's spec_decode series and the log line."""

from __future__ import annotations

from legato.metrics.log_line import LoggingStatLogger
from legato.metrics.prometheus import PrometheusStatLogger
from legato.metrics.records import StepStats
from legato.protocol.messages import SchedulerStats, SpecDecodingStats


def step(t: float, drafts: int, tokens: int, accepted: int, per_pos: list[int]) -> StepStats:
    spec = SpecDecodingStats(drafts, tokens, accepted, per_pos)
    return StepStats(timestamp=t, scheduler=SchedulerStats(spec_decoding=spec))


def test_prometheus_has_vllms_spec_decode_series() -> None:
    logger = PrometheusStatLogger("m", vllm_names=True)
    logger.record_step(step(1.0, 2, 6, 4, [2, 1, 1]))
    logger.record_step(step(2.0, 1, 3, 1, [1, 0, 0]))
    logger.record_step(StepStats(timestamp=3.0, scheduler=SchedulerStats()))  # nothing verified
    text = logger.exposition().decode()
    for prefix in ("vllm:", "legato:"):
        assert f'{prefix}spec_decode_num_drafts_total{{model_name="m"}} 3.0' in text
        assert f'{prefix}spec_decode_num_draft_tokens_total{{model_name="m"}} 9.0' in text
        assert f'{prefix}spec_decode_num_accepted_tokens_total{{model_name="m"}} 5.0' in text
        for pos, n in enumerate([3, 1, 1]):
            assert (
                f"{prefix}spec_decode_num_accepted_tokens_per_pos_total"
                f'{{model_name="m",position="{pos}"}} {n}.0'
            ) in text


def test_log_line_reports_acceptance_over_the_interval() -> None:
    logger = LoggingStatLogger(interval=10.0)
    assert logger.spec_line(now=0.0) is None
    logger.record_step(step(1.0, 2, 6, 3, [2, 1, 0]))
    logger.record_step(step(2.0, 2, 6, 3, [2, 1, 0]))
    line = logger.spec_line(now=3.0)
    assert line == (
        "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted: 6 tokens, "
        "Drafted: 12 tokens, Draft acceptance rate: 50.0%"
    )
    assert logger.spec_line(now=30.0) is None  # past the interval
