"""legato.ray on a local Ray instance: two replicas serving the OpenAI routes, requests
spread over both, a replica killed mid-stream fails its stream loudly, later requests
succeed and Ray brings the replica back.

Not in the default run (it starts Ray):

    pip install -e '.[test,ray]'
    python -m pytest -m ray tests/test_ray.py      # about 2 min on 2 cores
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

ENGINE_ARGS: dict[str, Any] = dict(
    executor="inproc", max_model_len=512, num_kv_blocks=600, disable_log_stats=True
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def ray_serve(toy_model_dir: Path) -> Iterator[str]:
    from legato.ray import build_app

    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app(
            str(toy_model_dir),
            num_replicas=2,
            ray_actor_options={"num_cpus": 1},
            served_model_name="legato-toy",
            **ENGINE_ARGS,
        )
        serve.run(app, name="legato", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def complete(client: httpx.Client, prompt: str, max_tokens: int = 4) -> str:
    """One completion; the pid of the replica that answered."""
    body = {"model": "legato-toy", "prompt": prompt, "max_tokens": max_tokens}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] is not None
    return response.headers["x-legato-replica"]


def until(condition: Any, seconds: float, what: str) -> Any:
    """Ray's replicas are other processes: their state is read until it holds."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"not within {seconds} s: {what}")


def test_two_replicas_spread_and_a_killed_one_comes_back(ray_serve: str) -> None:
    with httpx.Client(base_url=ray_serve, timeout=60) as client:
        assert client.get("/health").status_code == 200
        pids = {complete(client, f"spread {i}") for i in range(24)}
        assert len(pids) == 2, pids  # Ray's router used both replicas

        # A stream whose replica is killed mid-way fails loudly (no [DONE]).
        body = {"model": "legato-toy", "prompt": "long", "max_tokens": 400, "stream": True}
        body["ignore_eos"] = True
        events: list[Any] = []
        with pytest.raises(httpx.HTTPError):
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                victim = int(response.headers["x-legato-replica"])
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 2:
                            os.kill(victim, signal.SIGKILL)
                assert "[DONE]" not in events
                raise AssertionError("the stream ended quietly")  # pragma: no cover
        assert events and json.loads(events[0])["choices"]

        # Later requests succeed (once Ray stops routing to the dead replica), and Ray
        # starts a replacement: a third replica process answers.
        def succeeds() -> bool:
            try:
                complete(client, "after")
            except (AssertionError, httpx.HTTPError):
                return False
            return True

        until(succeeds, 120, "a request succeeds after the kill")
        assert all(complete(client, f"later {i}") != str(victim) for i in range(4))
        seen = until(
            lambda: {complete(client, "new") for _ in range(8)} - pids,
            180,
            "a replacement replica answers",
        )
        assert str(victim) not in seen
