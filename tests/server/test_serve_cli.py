"""``legato serve`` as a real subprocess: the listening line, a request, SIGINT, a clean exit."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import trio

from legato.cli import build_parser
from legato.server.state import ServerSettings

from .conftest import read_until_listening


def test_serve_flags_parse() -> None:
    args = build_parser().parse_args(
        ["serve", "some/dir", "--port", "0", "--ws-port", "9", "--api-key", "k", "--max-n", "3",
         "--shutdown-grace", "1.5", "--max-model-len", "256", "--executor", "inproc"]
    )  # fmt: skip
    expected = ("some/dir", 0, 9, "k", 3)
    assert (args.model, args.port, args.ws_port, args.api_key, args.max_n) == expected
    assert (args.shutdown_grace, args.max_model_len, args.executor) == (1.5, 256, "inproc")
    assert build_parser().parse_args(["serve"]).model is None
    bench = build_parser().parse_args(
        ["bench", "serve", "--request-rate", "inf", "--num-prompts", "4"]
    )
    assert bench.request_rate == float("inf") and bench.num_prompts == 4
    assert ServerSettings().host == "127.0.0.1"


def test_security_flags_parse() -> None:
    from legato.cli import openai_features_settings

    args = build_parser().parse_args(
        ["serve", "--allowed-hosts", '["llm.internal"]', "--trust-request-chat-template",
         "--body-timeout", "5", "--max-connections", "7", "--max-requests-in-flight", "9"]
    )  # fmt: skip
    features = openai_features_settings(args)
    assert features["allowed_hosts"] == ("llm.internal",)
    assert features["trust_request_chat_template"] is True
    assert features["cors"].allowed_origins == ()  # CORS off unless asked for
    assert (args.body_timeout, args.max_connections, args.max_requests_in_flight) == (5, 7, 9)
    defaults = openai_features_settings(build_parser().parse_args(["serve"]))
    assert defaults["trust_request_chat_template"] is False and defaults["allowed_hosts"] == ()


def test_served_model_name_reaches_the_engine() -> None:
    from legato.cli import engine_kwargs

    serve = build_parser().parse_args(["serve", "--served-model-name", "mine"])
    assert engine_kwargs(serve)["served_model_name"] == "mine"
    assert "served_model_name" not in engine_kwargs(build_parser().parse_args(["generate", "x"]))


async def test_legato_serve_subprocess_sigint_exits_cleanly(toy_model_dir: Path) -> None:
    command = [
        sys.executable, "-m", "legato.cli", "serve", str(toy_model_dir), "--port", "0", "--ws-port", "0",
        "--executor", "inproc", "--max-model-len", "512", "--num-kv-blocks", "600", "--shutdown-grace", "30",
        "--log-stats-interval", "0.2", "--vllm-metric-names",
    ]  # fmt: skip
    env = {**os.environ, "LEGATO_API_KEY": "k"}
    process = await trio.lowlevel.open_process(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )
    assert process.stdout is not None
    try:
        output = await read_until_listening(process, 60)
        match = re.search(rb"listening on (http://\S+) and (ws://\S+)", output)
        assert match is not None, output
        http_url = match.group(1).decode()

        stats_logged = trio.Event()

        async def read_rest() -> None:
            nonlocal output
            async for chunk in process.stdout:  # type: ignore[union-attr]
                output += chunk
                if b"Avg generation throughput:" in output:  # the engine's periodic stats line
                    stats_logged.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_rest)
            auth = {"Authorization": "Bearer k"}
            async with httpx.AsyncClient(base_url=http_url, timeout=30) as client:
                assert (await client.get("/health")).status_code == 200
                assert (await client.get("/v1/models")).status_code == 401
                models = await client.get("/v1/models", headers=auth)
                assert models.json()["data"][0]["id"] == str(toy_model_dir)

                # --vllm-metric-names: the figures under vLLM's names too, same label
                body = {"prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
                assert (await client.post("/v1/completions", json=body, headers=auth)).is_success
                metrics = (await client.get("/metrics", headers=auth)).text
                model = f'model_name="{toy_model_dir}"'
                for prefix in ("legato:", "vllm:"):
                    for line in (
                        f"{prefix}generation_tokens_total{{{model}}} 3.0",
                        f'{prefix}request_success_total{{finished_reason="length",{model}}} 1.0',
                        f"{prefix}num_requests_running{{{model}}} 0.0",
                        f"{prefix}e2e_request_latency_seconds_count{{{model}}} 1.0",
                    ):
                        assert line in metrics, (line, metrics)
                for name in ("num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                             "time_to_first_token_seconds_bucket", "request_queue_time_seconds_sum",
                             "inter_token_latency_seconds_count"):  # fmt: skip
                    assert f"\nvllm:{name}{{" in metrics, name

                # An idle engine logs its stats line at debug level, a busy one at info: it
                # shows while a long stream runs (left early, which aborts it).
                body = {"prompt": "Hi", "max_tokens": 500, "ignore_eos": True, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body, headers=auth) as sse:
                    await sse.aiter_lines().__anext__()
                    with trio.fail_after(10):
                        await stats_logged.wait()

                body = {"prompt": "Hi", "max_tokens": 40, "ignore_eos": True, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body, headers=auth) as sse:
                    lines = sse.aiter_lines()
                    await lines.__anext__()
                    process.send_signal(signal.SIGINT)  # the stream still finishes: grace is 30 s
                    rest = [line async for line in lines if line]
                assert rest[-1] == "data: [DONE]"
                assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
            with trio.fail_after(30):
                code = await process.wait()
        text = output.decode(errors="replace")
        assert code == 0, text
        assert "SIGINT: shutting down" in text
        request_line = r"request cmpl-\w+: prompt_tokens=\d+ completion_tokens=40 latency="
        assert re.search(request_line, text), text
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_legato_serve_without_a_model_answers_a_chat(smollm2_dir: Path) -> None:
    """The README's first command: no model argument serves SmolLM2-135M-Instruct (converted
    into `$LEGATO_HOME` by the fixture, so this start reuses it)."""
    command = [
        sys.executable, "-m", "legato.cli", "serve", "--port", "0", "--ws-port", "0",
        "--max-model-len", "2048", "--num-kv-blocks", "256",
    ]  # fmt: skip
    process = await trio.lowlevel.open_process(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    assert process.stdout is not None
    try:
        output = await read_until_listening(process, 120)
        match = re.search(rb"listening on (http://\S+) and", output)
        assert match is not None, output
        assert b"converting" not in output  # the fixture's conversion is reused
        async with httpx.AsyncClient(base_url=match.group(1).decode(), timeout=120) as client:
            models = (await client.get("/v1/models")).json()["data"]
            assert [m["id"] for m in models] == ["SmolLM2-135M-Instruct"]
            body = {
                "model": "SmolLM2-135M-Instruct",
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 32,
                "temperature": 0,
            }
            answer = (await client.post("/v1/chat/completions", json=body)).json()
        assert answer["model"] == "SmolLM2-135M-Instruct"
        assert "Paris" in answer["choices"][0]["message"]["content"], answer
        assert answer["choices"][0]["finish_reason"] == "stop"
        process.send_signal(signal.SIGINT)
        with trio.fail_after(30):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_legato_serve_refuses_a_truncated_gguf_in_one_line(
    toy_model_dir: Path, tmp_path: Path
) -> None:
    from legato.testing.gguf_files import write_gguf

    good = write_gguf(toy_model_dir, tmp_path / "toy.gguf", tensor_type="F16")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    command = [
        sys.executable,
        "-m",
        "legato.cli",
        "serve",
        str(bad),
        "--port",
        "0",
        "--ws-port",
        "0",
    ]
    with trio.fail_after(60):
        result = await trio.run_process(
            command, capture_stdout=True, capture_stderr=True, check=False
        )
    assert result.returncode == 1
    assert result.stdout == b""
    lines = result.stderr.decode().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"legato serve: model: {bad}: truncated")
