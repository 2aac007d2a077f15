"""The examples run against a real server (and the embedding one on its own), so they do not rot."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import trio

from legato.server import Server

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


async def run_example(*args: str) -> str:
    with trio.fail_after(120):
        result = await trio.run_process(
            [sys.executable, str(EXAMPLES / args[0]), *args[1:]],
            capture_stdout=True,
            stderr=subprocess.STDOUT,
            check=False,
        )
    output = result.stdout.decode(errors="replace")
    assert result.returncode == 0, output
    return output


async def test_websocket_and_openai_client_examples(server: Server) -> None:
    output = await run_example("websocket_client.py", "--url", server.ws_url + "/")
    assert re.search(r"\[json\] (length|stop): ", output), output
    assert re.search(r"\[chat\] (length|stop): ", output), output
    assert "[long] abort: " in output
    output = await run_example("openai_client.py", "--base-url", server.http_url + "/v1")
    assert "model: legato-toy" in output and "[finish_reason=" in output and "[usage:" in output


async def test_embedding_example(toy_model_dir: Path) -> None:
    output = await run_example("embed_in_trio_app.py", str(toy_model_dir))
    assert output.count("finished (length)") == 3
    assert "engine healthy: True" in output
