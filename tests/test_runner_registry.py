"""The runner registry: ``EngineConfig.runner`` picks the runner; the null runner needs no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from legato.config import EngineConfig
from legato.null_runner import NullModelRunner
from legato.workers.runner_registry import RUNNERS, build_runner


def test_the_null_runner_is_built_by_name() -> None:
    runner = build_runner(EngineConfig(model=None, runner="null"))
    assert isinstance(runner, NullModelRunner)
    assert set(RUNNERS) == {"model", "null"}


def test_an_unregistered_runner_is_refused_naming_the_field(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = EngineConfig(model=None, runner="null")
    monkeypatch.delitem(RUNNERS, "null")
    with pytest.raises(ValueError, match="runner: unknown runner 'null'"):
        build_runner(config)


def test_a_null_runner_worker_never_imports_torch_or_the_testing_package() -> None:
    code = (
        "import sys\n"
        "from legato.config import EngineConfig\n"
        "from legato.workers.runner_registry import build_runner\n"
        "import legato.workers.worker\n"
        "build_runner(EngineConfig(model=None, runner='null'))\n"
        "print(sorted(n for n in sys.modules if n == 'torch' or n.startswith('legato.testing')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

