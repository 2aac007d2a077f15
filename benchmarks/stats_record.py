"""Microseconds per ``StatsCollector.record`` call for one decode step, with the histograms
as prometheus_client ``Histogram`` s (one locked ``observe`` per sample: the old way) and as
``BatchHistogram`` s (a whole step per call), in the same run.

The step is the front end's at ``--samples`` streams in steady decode: that many
inter-token latencies and generated tokens, ``--finished`` requests ending. Prints a
table; never asserted in tests. Example::

    python benchmarks/stats_record.py --samples 256
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch

from legato.metrics import prometheus as stats
from legato.metrics.collector import StatsCollector
from legato.metrics.records import FinishedRequest, StepStats
from legato.testing.per_sample_histogram import PerSampleHistogram


def collector(kind: str, vllm_names: bool) -> StatsCollector:
    original = stats.BatchHistogram
    if kind == "prometheus_client Histogram":
        stats.BatchHistogram = PerSampleHistogram  # type: ignore[misc,assignment]
    try:
        return StatsCollector("m", vllm_names=vllm_names)
    finally:
        stats.BatchHistogram = original  # type: ignore[misc]


def step(args: argparse.Namespace, rng: random.Random) -> StepStats:
    return StepStats(
        timestamp=time.monotonic(),
        num_generation_tokens=args.samples,
        inter_token_latency=[rng.uniform(*args.itl_range) for _ in range(args.samples)],
        finished=[
            FinishedRequest("length", rng.uniform(1.0, 3.0), 128, 256) for _ in range(args.finished)
        ],
    )


def time_record(kind: str, vllm_names: bool, steps: list[StepStats], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        target: Any = collector(kind, vllm_names)
        start = time.perf_counter()
        for one in steps:
            target.record(one)
        best = min(best, (time.perf_counter() - start) / len(steps))
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=256, help="streams in the step")
    parser.add_argument("--finished", type=int, default=0, help="requests ending in the step")
    parser.add_argument(
        "--itl-range",
        type=float,
        nargs=2,
        default=(0.006, 0.009),
        metavar=("LO", "HI"),
        help="inter-token latencies drawn uniformly from [LO, HI] seconds (default: one "
        "bucket; 0.001 0.1 spreads them over nine)",
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=5, help="best of this many runs")
    args = parser.parse_args()
    rng = random.Random(0)
    steps = [step(args, rng) for _ in range(args.steps)]
    print(
        f"cpu: {torch.backends.cpu.get_cpu_capability()}; StatsCollector.record of a step with "
        f"{args.samples} inter-token latencies in {args.itl_range} s, {args.finished} finished; "
        f"best of {args.repeat} x {args.steps} steps"
    )
    print(f"{'series':<16} {'histograms':<28} {'us/record':>10} {'ratio':>7}")
    for vllm_names in (False, True):
        series = "legato: + vllm:" if vllm_names else "legato:"
        before = None
        for kind in ("prometheus_client Histogram", "BatchHistogram"):
            us = time_record(kind, vllm_names, steps, args.repeat)
            before = before or us
            print(f"{series:<16} {kind:<28} {us:>10.1f} {before / us:>6.1f}x")


if __name__ == "__main__":
    main()
