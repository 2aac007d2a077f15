"""``legato bench serve`` against an in-process server (figures are printed, never asserted)."""

from __future__ import annotations

import math

from legato.server import Server
from legato.server.bench import percentile, run_bench


async def test_bench_serve_reports_every_request(server: Server) -> None:
    for rate in (math.inf, 200.0):
        report = await run_bench(
            server.http_url, num_prompts=4, request_rate=rate, input_len=8, output_len=4
        )
        assert len(report.ok) == 4, report.table()
        assert all(r.prompt_len == 8 and r.output_tokens == 4 for r in report.ok)
        assert all(0 < r.ttft <= r.latency and len(r.itl) >= 1 for r in report.ok)
    table = report.table()
    for label in ("Request throughput (req/s):", "Output token throughput (tok/s):",
                  "Total token throughput (tok/s):", "Mean TTFT (ms):", "Median TPOT (ms):",
                  "P99 ITL (ms):", "Mean E2EL (ms):"):  # fmt: skip
        assert label in table
    print(table)


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([], 99) == 0.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([3.0, 1.0, 2.0], 100) == 3.0
