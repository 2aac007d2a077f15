"""``legato bench serve``: drive a running OpenAI-compatible server and print a vLLM-style table.

Requests are streamed completions with random token-id prompts of exactly
``input_len`` tokens (ids drawn from what the server's ``/tokenize`` gives for
a sample text, so they are real tokens; ids below 1000 if it has none) and
``max_tokens = min_tokens = output_len`` with ``ignore_eos``. Arrivals are a
Poisson process at ``request_rate`` requests/s (``inf``: all at once).

Measured per request: TTFT (request sent -> first token), ITL (between
streamed chunks), TPOT ((latency - TTFT) / (output tokens - 1)) and the
end-to-end latency. Works against legato or vLLM; imports trio and httpx
(an optional dependency: ``pip install 'legato[bench]'``).
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import trio

try:
    import httpx
except ImportError as exc:  # an optional dependency of the engine
    raise ImportError(
        "legato bench serve needs httpx: install it with pip install 'legato[bench]'"
    ) from exc

SAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog. Once upon a time, in a quiet village by the sea, "
    "people told stories of ships, storms, bread, music and the long winter nights; numbers like "
    "1, 2, 3, 42 and 1000 appeared in their songs, and so did questions: why? how? when?"
)


@dataclass
class RequestResult:
    """One benchmark request, as the client saw it."""

    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


@dataclass
class BenchReport:
    """The aggregate of a run."""

    duration: float
    results: list[RequestResult]

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    def table(self) -> str:
        """The vLLM-style result table."""
        ok = self.ok
        input_tokens = sum(r.prompt_len for r in ok)
        output_tokens = sum(r.output_tokens for r in ok)
        duration = max(self.duration, 1e-9)
        tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
        itls = [x for r in ok for x in r.itl]
        lines = [
            "{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="),
            f"{'Successful requests:':<40}{len(ok):<10}",
            f"{'Failed requests:':<40}{len(self.results) - len(ok):<10}",
            f"{'Benchmark duration (s):':<40}{self.duration:<10.2f}",
            f"{'Total input tokens:':<40}{input_tokens:<10}",
            f"{'Total generated tokens:':<40}{output_tokens:<10}",
            f"{'Request throughput (req/s):':<40}{len(ok) / duration:<10.2f}",
            f"{'Output token throughput (tok/s):':<40}{output_tokens / duration:<10.2f}",
            f"{'Total token throughput (tok/s):':<40}{(input_tokens + output_tokens) / duration:<10.2f}",
        ]
        for title, key, values in (
            ("Time to First Token", "TTFT", [r.ttft for r in ok]),
            ("Time per Output Token (excl. 1st token)", "TPOT", tpots),
            ("Inter-token Latency", "ITL", itls),
            ("End-to-end Latency", "E2EL", [r.latency for r in ok]),
        ):
            lines.append("{s:{c}^50}".format(s=title, c="-"))
            lines.append(
                f"{f'Mean {key} (ms):':<40}{_ms(statistics.fmean(values) if values else 0):<10.2f}"
            )
            lines.append(
                f"{f'Median {key} (ms):':<40}{_ms(statistics.median(values) if values else 0):<10.2f}"
            )
            lines.append(f"{f'P99 {key} (ms):':<40}{_ms(percentile(values, 99)):<10.2f}")
        lines.append("=" * 50)
        errors = sorted({r.error for r in self.results if not r.ok})
        lines.extend(f"error: {e}" for e in errors[:5])
        return "\n".join(lines)


def _ms(seconds: float) -> float:
    return 1000.0 * seconds


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation (numpy's default); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


async def _server_info(client: httpx.AsyncClient, model: str | None) -> tuple[str, list[int]]:
    """The model to ask for, and token ids to draw prompts from."""
    if model is None:
        response = await client.get("/v1/models")
        response.raise_for_status()
        model = str(response.json()["data"][0]["id"])
    pool: list[int] = []
    try:
        response = await client.post("/tokenize", json={"model": model, "prompt": SAMPLE_TEXT})
        if response.status_code == 200:
            pool = sorted(set(response.json()["tokens"]))
    except httpx.HTTPError:
        pass
    return model, pool or list(range(1000))


async def _one(
    client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int
) -> RequestResult:
    result = RequestResult(prompt_len=len(prompt))
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "min_tokens": output_len,
        "ignore_eos": True,
        "temperature": 1.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"].get("message"))
                    return result
                if event.get("usage"):
                    result.output_tokens = int(event["usage"]["completion_tokens"])
                if not event.get("choices") or not event["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.ok = True
    return result


async def run_bench(
    url: str,
    *,
    model: str | None = None,
    num_prompts: int = 100,
    request_rate: float = math.inf,
    input_len: int = 32,
    output_len: int = 32,
    seed: int = 0,
    api_key: str | None = None,
    request_timeout: float = 600.0,
) -> BenchReport:
    """Send ``num_prompts`` streamed completions to the server at ``url``; report the figures."""
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=num_prompts, max_keepalive_connections=num_prompts)
    async with httpx.AsyncClient(
        base_url=url.rstrip("/"), headers=headers, timeout=request_timeout, limits=limits
    ) as client:
        model, pool = await _server_info(client, model)
        prompts = [[rng.choice(pool) for _ in range(input_len)] for _ in range(num_prompts)]
        results: list[RequestResult] = [RequestResult() for _ in prompts]

        async def send(i: int) -> None:
            results[i] = await _one(client, model, prompts[i], output_len)

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(num_prompts):
                nursery.start_soon(send, i)
                if math.isfinite(request_rate) and request_rate > 0 and i + 1 < num_prompts:
                    await trio.sleep(rng.expovariate(request_rate))
        duration = time.perf_counter() - start
    return BenchReport(duration, results)
