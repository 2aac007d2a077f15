"""Two "nodes" on loopback: ``legato serve`` runs rank 0 on node 0, ``legato worker``
runs rank 1 on node 1; they meet at the rendezvous store, serve a completion, and
both exit 0 when the server is stopped. Plus the checks on the flags."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from legato.actors.tensor_parallel_executor import free_port
from legato.config import EngineConfig
from legato.workers.node import node_ranks


def test_flags_are_checked() -> None:
    assert list(node_ranks(4, 2, 1)) == [2, 3]
    with pytest.raises(ValueError, match="node_rank"):
        node_ranks(4, 2, 0)  # node 0 is the engine's
    with pytest.raises(ValueError, match="nnodes"):
        node_ranks(3, 2, 1)
    with pytest.raises(ValueError, match="master_port"):
        EngineConfig(tensor_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match="executor"):
        EngineConfig(tensor_parallel_size=2, executor="inproc")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)


async def test_serve_on_node_0_and_worker_on_node_1(toy_model_dir: Path) -> None:
    port = free_port("127.0.0.1")
    cluster = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(port)]  # fmt: skip
    cli = [sys.executable, "-m", "legato.cli"]
    worker = await trio.lowlevel.open_process(
        [*cli, "worker", *cluster, "--node-rank", "1"], stdin=subprocess.DEVNULL
    )
    serve = await trio.lowlevel.open_process(
        [
            *cli,
            "serve",
            str(toy_model_dir),
            "--port",
            "0",
            "--ws-port",
            "0",
            *cluster,
            "--node-rank",
            "0",
            "--max-model-len",
            "256",
            "--num-kv-blocks",
            "64",
            "--disable-log-stats",
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "LEGATO_API_KEY": ""},
    )
    assert serve.stdout is not None
    output = b""
    try:
        with trio.fail_after(90):
            while b"listening on" not in output:
                chunk = await serve.stdout.receive_some()
                assert chunk, f"serve exited early: {output.decode(errors='replace')}"
                output += chunk
        match = re.search(rb"listening on (http://\S+)", output)
        assert match is not None, output
        body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.0,
                "ignore_eos": True}  # fmt: skip
        async with httpx.AsyncClient(base_url=match.group(1).decode(), timeout=60) as client:
            answer = (await client.post("/v1/completions", json=body)).json()
        assert answer["usage"]["completion_tokens"] == 8, answer
        assert answer["choices"][0]["finish_reason"] == "length"
        serve.send_signal(signal.SIGINT)
        with trio.fail_after(60):
            async for chunk in serve.stdout:
                output += chunk
            assert await serve.wait() == 0, output.decode(errors="replace")
            assert await worker.wait() == 0  # rank 1 was told to stop, and did
    finally:
        for process in (serve, worker):
            if process.returncode is None:
                process.kill()
                await process.wait()
