"""Supervised restart: ``open_supervised_engine``, a server that outlives its engine, ``legato serve
--restart-on-failure`` past its limit."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import trio

from legato.actors.supervisor import InjectedFault
from legato.cli import build_parser, cmd_serve
from legato.engine import AsyncEngine, open_engine
from legato.protocol.errors import EngineDeadError
from legato.protocol.params import SamplingParams
from legato.server import ServerSettings, open_server
from legato.supervise import RestartLimitExceeded, RestartPolicy, open_supervised_engine

from .conftest import ENGINE_ARGS, MODEL, SETTINGS, read_until_listening, wait_until
from .test_websocket import collect, connect, generate, receive, send

LONG = {"max_tokens": 450, "ignore_eos": True}


async def complete(engine: AsyncEngine, request_id: str) -> str | None:
    """One short request to its end; its finish reason."""
    async with engine.generate("Hello", SamplingParams(max_tokens=2), request_id) as stream:
        async for output in stream:
            if output.finished:
                return output.outputs[0].finish_reason
    return None


async def test_supervised_engine_restarts_within_the_limit_then_gives_up(
    toy_model_dir: Path,
) -> None:
    args: dict[str, Any] = dict(executor="inproc", **ENGINE_ARGS)
    with pytest.raises(RestartLimitExceeded) as info:
        async with open_supervised_engine(
            str(toy_model_dir), max_restarts=1, window=600, **args
        ) as handle:
            first = handle.engine
            assert await complete(first, "a") == "length"
            params = SamplingParams(max_tokens=450, ignore_eos=True)
            async with first.generate("Hi", params, "long") as stream:
                await stream.__anext__()
                first.inject_fault("scheduler")
                with pytest.raises(EngineDeadError):  # the stream ends with the engine
                    async for _ in stream:
                        pass
            assert first.errored and handle.restarting
            with trio.fail_after(30):
                second = await handle.wait_running()
            assert second is not first and handle.engine is second
            assert handle.restarts == 1 and not handle.restarting
            assert isinstance(handle.last_death, EngineDeadError)
            assert await complete(second, "a") == "length"  # the same id, a new engine

            second.inject_fault("detokenizer")  # the second death within the window
            with trio.fail_after(30):
                await trio.sleep_forever()  # the limit cancels the body
    error = info.value
    assert error.deaths == 2 and "died 2 times" in str(error)
    assert isinstance(error.__cause__, EngineDeadError)
    assert isinstance(error.__cause__.__cause__, InjectedFault)
    assert second.is_stopped


def test_restart_policy_and_flags_are_checked() -> None:
    for bad in (dict(max_restarts=-1), dict(max_restarts=True), dict(window=0)):
        with pytest.raises(ValueError):
            RestartPolicy(**bad)
    args = build_parser().parse_args(
        ["serve", "--restart-on-failure", "--max-restarts", "2", "--restart-window", "30"]
    )
    assert (args.restart_on_failure, args.max_restarts, args.restart_window) == (True, 2, 30.0)
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.restart_on_failure, defaults.max_restarts) == (False, 3)
    bad_args = build_parser().parse_args(["serve", "--restart-on-failure", "--max-restarts", "-1"])
    assert cmd_serve(bad_args) == 2  # refused before anything starts


async def test_server_keeps_its_ports_and_connections_across_a_restart(
    toy_model_dir: Path,
) -> None:
    gate = trio.Event()  # holds the restart until the test has seen the server restarting
    opened: list[AsyncEngine] = []

    @asynccontextmanager
    async def gated_open_engine(model: str | None, **kwargs: Any) -> AsyncIterator[AsyncEngine]:
        if opened:
            await gate.wait()
        async with open_engine(model, **kwargs) as engine:
            opened.append(engine)
            yield engine

    async with (
        open_supervised_engine(
            str(toy_model_dir),
            max_restarts=1,
            window=600,
            opener=gated_open_engine,
            executor="inproc",
            **ENGINE_ARGS,
        ) as handle,
        open_server(handle, ServerSettings(**SETTINGS), model_name=MODEL) as server,
        httpx.AsyncClient(base_url=server.http_url, timeout=30) as client,
        connect(server) as ws,
    ):
        assert (await client.get("/health")).status_code == 200
        await send(ws, generate("w", **LONG))
        await receive(ws)
        body = {"prompt": "Hi", "stream": True, **LONG}
        async with client.stream("POST", "/v1/completions", json=body) as sse:
            lines = sse.aiter_lines()
            await lines.__anext__()
            handle.engine.inject_fault("scheduler")
            with trio.fail_after(20):
                rest = [line async for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: ") :])["error"]["code"] == "engine_dead"
        frames = await collect(ws, {"w"})
        assert (frames["w"][-1]["type"], frames["w"][-1]["code"]) == ("error", "engine_dead")

        # restarting: 503 with a code of its own, on both front ends; the connection stays open
        health = await client.get("/health")
        assert health.status_code == 503, health.text
        assert health.json()["error"]["code"] == "engine_restarting"
        refused = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert (refused.status_code, refused.json()["error"]["code"]) == (
            503,
            "engine_restarting",
        )
        await send(ws, generate("early", max_tokens=2))
        frame, _ = await receive(ws)
        assert (frame["type"], frame["code"], frame["request_id"]) == (
            "error",
            "engine_restarting",
            "early",
        )

        gate.set()

        async def healthy() -> bool:
            return (await client.get("/health")).status_code == 200

        await wait_until(healthy, 30)
        assert len(opened) == 2 and server.state.engine is opened[1]
        done = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 2
        chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
        await send(ws, generate("after", max_tokens=2))  # the same connection
        frames = await collect(ws, {"after"})
        assert frames["after"][-1]["finish_reason"] == "length"
        with trio.fail_after(10):  # the last frame goes out before its task ends
            await server.state.wait_idle()


async def test_legato_serve_restarts_then_exits_non_zero_past_the_limit(
    toy_model_dir: Path,
) -> None:
    command = [
        sys.executable, "-m", "legato.cli", "serve", str(toy_model_dir), "--port", "0",
        "--ws-port", "0", "--executor", "process", "--max-model-len", "512",
        "--num-kv-blocks", "600", "--disable-log-stats",
        "--restart-on-failure", "--max-restarts", "1", "--restart-window", "600",
    ]  # fmt: skip
    process = await trio.lowlevel.open_process(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    assert process.stdout is not None
    try:
        output = await read_until_listening(process, 60)
        match = re.search(rb"listening on (http://\S+) ", output)
        assert match is not None, output
        http_url = match.group(1).decode()

        async def read_rest() -> None:
            nonlocal output
            async for chunk in process.stdout:  # type: ignore[union-attr]
                output += chunk

        def worker_pids() -> set[int]:
            return {child.pid for child in psutil.Process(process.pid).children()}

        async with (
            trio.open_nursery() as nursery,
            httpx.AsyncClient(base_url=http_url, timeout=30) as client,
        ):
            nursery.start_soon(read_rest)
            (first_worker,) = worker_pids()
            body = {"prompt": "Hi", "stream": True, **LONG}
            async with client.stream("POST", "/v1/completions", json=body) as sse:
                lines = sse.aiter_lines()
                await lines.__anext__()
                os.kill(first_worker, signal.SIGKILL)
                with trio.fail_after(20):
                    rest = [line async for line in lines if line]
            assert json.loads(rest[-2][len("data: ") :])["error"]["code"] == "engine_dead"

            async def restarted() -> bool:
                health = await client.get("/health")
                if health.status_code != 200:
                    assert health.json()["error"]["code"] == "engine_restarting", health.text
                return health.status_code == 200

            await wait_until(restarted, 60)
            done = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert done.status_code == 200, done.text
            (second_worker,) = worker_pids()
            assert second_worker != first_worker

            os.kill(second_worker, signal.SIGKILL)  # the second death: past the limit
            with trio.fail_after(30):
                code = await process.wait()
        text = output.decode(errors="replace")
        assert code == 1, text
        assert "restarting it (1 of at most 1" in text, text
        assert "legato serve: the engine died 2 times within 600 s" in text, text
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_adapters_are_reloaded_into_a_restarted_engine(
    toy_model_dir: Path, make_toy_adapter: Any
) -> None:
    """Adapters from ``lora_modules`` and from /v1/load_lora_adapter answer by name after
    the worker process is killed and the engine restarted, with the same greedy text as
    before; one unloaded before the death stays unloaded."""
    from legato.server.lora_routes import parse_lora_modules

    paths = {
        name: make_toy_adapter(r=4, targets=("q_proj", "v_proj"), seed=seed).path
        for name, seed in (("a", 1), ("b", 2), ("c", 3))
    }
    settings = ServerSettings(
        **SETTINGS,
        lora_modules=parse_lora_modules([f"a={paths['a']}"]),
        allow_runtime_lora_updating=True,
        lora_root=os.path.commonpath([str(p) for p in paths.values()]),
    )
    args = dict(ENGINE_ARGS, executor="process", enable_lora=True, max_loras=2, max_lora_rank=8)
    async with (
        open_supervised_engine(str(toy_model_dir), max_restarts=1, window=600, **args) as handle,
        open_server(handle, settings, model_name=MODEL) as server,
        httpx.AsyncClient(base_url=server.http_url, timeout=60) as client,
    ):

        async def texts() -> dict[str, str]:
            out = {}
            for model in (MODEL, "a", "b"):
                body = {"model": model, "prompt": [5, 300, 71, 1200, 9], "max_tokens": 8,
                        "temperature": 0, "ignore_eos": True}  # fmt: skip
                response = await client.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
                out[model] = response.json()["choices"][0]["text"]
            return out

        for name in ("b", "c"):
            load = {"lora_name": name, "lora_path": str(paths[name])}
            assert (await client.post("/v1/load_lora_adapter", json=load)).status_code == 200
        unload = {"lora_name": "c"}
        assert (await client.post("/v1/unload_lora_adapter", json=unload)).status_code == 200
        before = await texts()
        assert len(set(before.values())) == 3  # the adapters change the text

        first = handle.engine
        assert first.executor.pid is not None
        os.kill(first.executor.pid, signal.SIGKILL)

        async def restarted() -> bool:
            return handle.engine is not first and (await client.get("/health")).status_code == 200

        await wait_until(restarted, 60)
        models = (await client.get("/v1/models")).json()["data"]
        assert [m["id"] for m in models] == [MODEL, "a", "b"]
        assert await texts() == before
        gone = {"model": "c", "prompt": "x", "max_tokens": 2}
        assert (await client.post("/v1/completions", json=gone)).status_code == 404
