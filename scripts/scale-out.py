#!/usr/bin/env python3
"""Start N ``legato serve`` replicas and vllm-router in front of them (docs/scale-out.md).

    pip install 'legato[router]'
    python scripts/scale-out.py MODEL --replicas 2 --router-port 8000 --policy cache_aware \\
        -- --max-model-len 4096          # anything after -- goes to every `legato serve`

Replica i listens on ``--base-port + i`` (loopback unless ``--host``), with
``--restart-on-failure`` (a dead engine is replaced in the same process; its
``/health`` answers 503 meanwhile, so the router takes it out until it is back)
and ``--vllm-metric-names`` (the series routers and gateways read). A replica
process that exits is started again (``--respawn``, on by default). The router
checks every replica's ``/health`` each ``--health-check-interval`` seconds.

Prints one line per process (``replica 0: http://127.0.0.1:8100 pid 1234``,
``router: http://127.0.0.1:8000 pid 1240``) once all answer, then ``ready``.
Ctrl-C or SIGTERM stops everything.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any


def wait_healthy(url: str, process: subprocess.Popen[Any], timeout: float) -> None:
    """Poll ``url`` until it answers 200; raise if ``process`` exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{process.args[0]} exited with {process.returncode} before {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not answer 200 within {timeout} s")


def main() -> None:
    argv = sys.argv[1:]
    serve_extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, serve_extra = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", nargs="?", default=None, help="as for `legato serve`")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--base-port", type=int, default=8100)
    parser.add_argument("--router-port", type=int, default=8000)
    parser.add_argument(
        "--policy",
        default="cache_aware",
        help="vllm-router's --policy: cache_aware (prefix-aware), round_robin, power_of_two ...",
    )
    parser.add_argument("--health-check-interval", type=int, default=1, help="seconds")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds")
    parser.add_argument("--respawn", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--router-arg", action="append", default=[], help="one more vllm-router argument"
    )
    args = parser.parse_args(argv)

    router_bin = shutil.which("vllm-router")
    if router_bin is None:
        raise SystemExit("vllm-router is not installed: pip install 'legato[router]'")
    model = [args.model] if args.model else []

    def start_replica(i: int) -> subprocess.Popen[Any]:
        command = [
            sys.executable, "-m", "legato.cli", "serve", *model,
            "--host", args.host, "--port", str(args.base_port + i), "--ws-port", "0",
            "--restart-on-failure", "--vllm-metric-names", *serve_extra,
        ]  # fmt: skip
        return subprocess.Popen(command)

    urls = [f"http://{args.host}:{args.base_port + i}" for i in range(args.replicas)]
    replicas = [start_replica(i) for i in range(args.replicas)]
    router: subprocess.Popen[Any] | None = None
    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        for url, process in zip(urls, replicas, strict=True):
            wait_healthy(url + "/health", process, args.startup_timeout)
            print(f"replica {urls.index(url)}: {url} pid {process.pid}", flush=True)
        interval = str(args.health_check_interval)
        router = subprocess.Popen(
            [
                router_bin,
                "--host",
                args.host,
                "--port",
                str(args.router_port),
                "--worker-urls",
                *urls,
                "--policy",
                args.policy,
                "--health-check-interval-secs",
                interval,
                "--health-failure-threshold",
                "1",
                "--health-success-threshold",
                "1",
                "--health-check-endpoint",
                "/health",
                *args.router_arg,
            ]  # fmt: skip
        )
        router_url = f"http://{args.host}:{args.router_port}"
        wait_healthy(router_url + "/health", router, args.startup_timeout)
        print(f"router: {router_url} pid {router.pid}", flush=True)
        print("ready", flush=True)
        while not stopping:
            if router.poll() is not None:
                raise SystemExit(f"vllm-router exited with {router.returncode}")
            for i, process in enumerate(replicas):
                if process.poll() is not None and args.respawn:
                    print(f"replica {i} exited with {process.returncode}: respawning", flush=True)
                    replicas[i] = start_replica(i)
                    print(f"replica {i}: {urls[i]} pid {replicas[i].pid}", flush=True)
            time.sleep(0.5)
    finally:
        for process in [router, *replicas]:
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGINT)
        for process in [router, *replicas]:
            if process is not None:
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


if __name__ == "__main__":
    main()
