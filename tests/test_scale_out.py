"""Two ``legato serve`` replicas behind vllm-router, started by scripts/scale-out.py, on
loopback: spread, prefix-cache-aware routing, a killed replica taken out and brought back,
and an engine restarted in place under ``--restart-on-failure``.

Not in the default run (it starts four processes and vllm-router's binary):

    python -m pytest -m router tests/test_scale_out.py     # about 1 min on 2 cores
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import psutil
import pytest
import trio

pytestmark = pytest.mark.router

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "scale-out.py"
SERVE_ARGS = [
    "--served-model-name",
    "legato-toy",
    "--max-model-len",
    "512",
    "--num-kv-blocks",
    "600",
    "--disable-log-stats",
]
MODEL = "legato-toy"
# Two long prompts' shared beginnings (several KV blocks each).
PREFIX = {
    "A": "You are a careful assistant for a shipping company. Answer briefly. " * 5,
    "B": "Translate every sentence the user writes into French, then explain. " * 5,
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def vllm_router() -> str:
    path = Path(sys.executable).parent / "vllm-router"
    if not path.exists():
        pytest.skip("vllm-router is not installed (pip install 'legato[router]')")
    return str(path)


class Replicas:
    """The script's processes as the test sees them: replica URLs, their pids, the router."""

    def __init__(self, process: trio.Process, router: str, replicas: list[str]) -> None:
        self.process = process
        self.router = router
        self.urls = replicas
        self.pids: dict[int, int] = {}
        self.buffer = b""

    async def read_line_matching(self, pattern: bytes) -> re.Match[bytes]:
        assert self.process.stdout is not None
        while True:
            match = re.search(pattern, self.buffer)
            if match is not None:
                self.buffer = self.buffer[match.end() :]
                return match
            chunk = await self.process.stdout.receive_some(65536)
            assert chunk, f"scale-out.py ended: {self.buffer[-2000:]!r}"
            self.buffer += chunk


@pytest.fixture
async def replicas(toy_model_dir: Path) -> AsyncIterator[Replicas]:
    router_bin = vllm_router()
    base, router_port = free_port(), free_port()
    while base + 1 == router_port or not _free(base + 1):
        base = free_port()
    command = [
        sys.executable, str(SCRIPT), str(toy_model_dir), "--replicas", "2",
        "--base-port", str(base), "--router-port", str(router_port), "--policy", "round_robin",
        "--", *SERVE_ARGS,
    ]  # fmt: skip
    env = {**os.environ, "PATH": f"{Path(router_bin).parent}:{os.environ['PATH']}"}
    process = await trio.lowlevel.open_process(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )
    urls = [f"http://127.0.0.1:{base + i}" for i in range(2)]
    group = Replicas(process, f"http://127.0.0.1:{router_port}", urls)
    try:
        with trio.fail_after(180):
            for i in range(2):
                match = await group.read_line_matching(rb"replica %d: \S+ pid (\d+)" % i)
                group.pids[i] = int(match.group(1))
            await group.read_line_matching(rb"\nready\n")
        yield group
    finally:
        process.send_signal(signal.SIGTERM)
        with trio.move_on_after(60):
            await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


async def served(client: httpx.AsyncClient, urls: list[str]) -> list[tuple[float, float]]:
    """Per replica: (requests finished, prefix-cache hit tokens), from its /metrics;
    (-1, -1) for one that is down."""
    out = []
    for url in urls:
        try:
            text = (await client.get(url + "/metrics")).text
        except httpx.TransportError:
            out.append((-1.0, -1.0))
            continue
        done = re.findall(r"^legato:request_success_total\{[^}]*\} (\S+)", text, re.M)
        hits = re.findall(r"^legato:prefix_cache_hits_total\{[^}]*\} (\S+)", text, re.M)
        out.append((sum(map(float, done)), sum(map(float, hits))))
    return out


async def complete(client: httpx.AsyncClient, base: str, prompt: str) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    response = await client.post(base + "/v1/completions", json=body)
    assert response.status_code == 200, response.text


async def landed_on(client: httpx.AsyncClient, group: Replicas, base: str, prompt: str) -> int:
    """Send one request through ``base``; the replica that served it."""
    before = await served(client, group.urls)
    await complete(client, base, prompt)
    after = await served(client, group.urls)
    moved = [i for i in range(len(group.urls)) if after[i][0] > before[i][0]]
    assert len(moved) == 1, (before, after)
    return moved[0]


async def router_health(client: httpx.AsyncClient, group: Replicas) -> dict[str, bool]:
    workers = (await client.get(group.router + "/workers")).json()["workers"]
    return {w["url"]: w["is_healthy"] for w in workers}


async def until_router_sees(
    client: httpx.AsyncClient, group: Replicas, url: str, healthy: bool
) -> None:
    """Until the router's health checks (every second) mark ``url`` so. The router is
    another process: its view is read, not awaited."""
    with trio.fail_after(60):
        while (await router_health(client, group))[url] != healthy:  # noqa: ASYNC110
            await trio.sleep(0.2)


async def test_two_replicas_behind_vllm_router(replicas: Replicas) -> None:
    group = replicas
    async with httpx.AsyncClient(timeout=60) as client:
        # Spread: round robin sends every other request to each replica.
        landed = [await landed_on(client, group, group.router, f"spread {i}") for i in range(6)]
        assert sorted(landed) == [0, 0, 0, 1, 1, 1]

        # Cache-aware routing (a second router on the same replicas): requests that share
        # a long prefix land together, and their replica's prefix cache serves the prefix.
        port = free_port()
        router = await trio.lowlevel.open_process(
            [vllm_router(), "--host", "127.0.0.1", "--port", str(port), "--policy",
             "cache_aware", "--worker-urls", *group.urls, "--log-level", "warning",
             "--prometheus-port", str(free_port())],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            aware = f"http://127.0.0.1:{port}"
            with trio.fail_after(60):
                while True:
                    assert router.poll() is None, "the cache-aware router exited"
                    try:
                        if (await client.get(aware + "/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await trio.sleep(0.2)
            hits_before = await served(client, group.urls)
            where: dict[str, set[int]] = {"A": set(), "B": set()}
            for name in ("A", "B"):  # in a row: round robin would alternate them
                for i in range(4):
                    prompt = PREFIX[name] + f"Question {i}: what next?"
                    where[name].add(await landed_on(client, group, aware, prompt))
            assert len(where["A"]) == 1 and len(where["B"]) == 1, where
            hits_after = await served(client, group.urls)
            for name in ("A", "B"):
                (replica,) = where[name]
                # three of four requests found the shared prefix cached (16-token blocks)
                assert hits_after[replica][1] - hits_before[replica][1] >= 3 * 16
        finally:
            router.kill()
            await router.wait()

        # A killed replica is taken out; later requests succeed on the other; the
        # script starts it again and the router brings it back.
        os.kill(group.pids[0], signal.SIGKILL)
        await until_router_sees(client, group, group.urls[0], healthy=False)
        landed = [await landed_on(client, group, group.router, f"one left {i}") for i in range(4)]
        assert landed == [1, 1, 1, 1]
        with trio.fail_after(180):
            match = await group.read_line_matching(rb"replica 0: \S+ pid (\d+)")
        assert int(match.group(1)) != group.pids[0]
        await until_router_sees(client, group, group.urls[0], healthy=True)
        landed = [await landed_on(client, group, group.router, f"back {i}") for i in range(4)]
        assert sorted(landed) == [0, 0, 1, 1]

        # --restart-on-failure: replica 1's engine worker dies; the server replaces the
        # engine in place (same process, same port) and serves again through the router.
        server = psutil.Process(group.pids[1])
        (worker,) = server.children()
        worker.kill()
        with trio.fail_after(120):
            while True:
                children = server.children()
                health = await client.get(group.urls[1] + "/health")
                if health.status_code == 200 and children and children[0].pid != worker.pid:
                    break
                await trio.sleep(0.2)
        await until_router_sees(client, group, group.urls[1], healthy=True)
        landed = [await landed_on(client, group, group.router, f"again {i}") for i in range(4)]
        assert sorted(landed) == [0, 0, 1, 1]
        assert server.is_running()
