"""Time from a fresh clone to the first answer, for the README's two commands.

1. ``git clone`` the repository, run ``scripts/run.sh`` (set-up, then ``legato
   serve`` on the default model, converted into an empty ``$LEGATO_HOME``), and
   send the README's chat request until it is answered: seconds to that answer.
2. Another fresh clone: ``scripts/test.sh`` (set-up, lint, type check, the whole
   test suite): seconds to its end, and its result line.

Each clone makes its own ``.venv``; pip's download cache is the machine's (say
so when quoting the figures: a first-ever install downloads ~1 GB more).
Prints a table; never asserted in tests.

    python benchmarks/fresh_clone.py --repo . --branch main [--skip-tests]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

CHAT = {
    "model": "SmolLM2-135M-Instruct",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 32,
    "temperature": 0,
}


def clone(repo: str, branch: str, into: Path) -> Path:
    subprocess.run(
        ["git", "clone", "-q", "--branch", branch, "--single-branch", repo, str(into)], check=True
    )
    return into


def ask(url: str) -> str | None:
    """The chat answer, or None while the server is not up yet."""
    request = urllib.request.Request(
        url, json.dumps(CHAT).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return str(json.load(response)["choices"][0]["message"]["content"])
    except (urllib.error.URLError, ConnectionError):
        return None


def time_run_sh(checkout: Path, port: int, env: dict[str, str]) -> tuple[float, str, str]:
    """(seconds from launch to the first answer, the answer, the server's output)."""
    start = time.perf_counter()
    log = checkout / "run.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            ["scripts/run.sh", "serve", "--port", str(port), "--ws-port", str(port + 1)],
            cwd=checkout,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            while (answer := ask(url)) is None:
                if server.poll() is not None:
                    raise RuntimeError(f"scripts/run.sh exited: {log.read_text()}")
                time.sleep(0.5)
            elapsed = time.perf_counter() - start
        finally:
            os.killpg(server.pid, signal.SIGINT)
            server.wait(60)
    return elapsed, answer, log.read_text(errors="replace")


def time_test_sh(checkout: Path, env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    result = subprocess.run(
        ["scripts/test.sh", "-q"], cwd=checkout, env=env, capture_output=True, text=True
    )
    elapsed = time.perf_counter() - start
    summary = re.findall(r"^=* ?(\d+ (?:passed|failed).*?) ?=*$", result.stdout, re.MULTILINE)
    return elapsed, f"exit {result.returncode}: {summary[-1] if summary else result.stdout[-300:]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", default=".")
    parser.add_argument("--branch", default="main")
    parser.add_argument("--port", type=int, default=18600)
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args()
    repo = str(Path(args.repo).resolve())
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="legato-clone-") as tmp:
        root = Path(tmp)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LEGATO_", "VIRTUAL_ENV"))}
        env["LEGATO_HOME"] = str(root / "home")  # empty: the first start converts the model
        started = time.perf_counter()
        checkout = clone(repo, args.branch, root / "run")
        cloned = time.perf_counter() - started
        seconds, answer, output = time_run_sh(checkout, args.port, env)
        converted = re.search(r"converted \S+ in ([\d.]+) s", output)
        print(f"git clone: {cloned:.1f} s")
        print(f"scripts/run.sh -> first chat answer: {seconds:.1f} s "
              f"(of which the model conversion {converted.group(1) if converted else '?'} s)")  # fmt: skip
        print(f"  answer: {answer!r}")
        if not args.skip_tests:
            started = time.perf_counter()
            checkout = clone(repo, args.branch, root / "test")
            seconds, result = time_test_sh(checkout, env)
            print(f"git clone + scripts/test.sh: {time.perf_counter() - started:.1f} s ({result})")


if __name__ == "__main__":
    main()
