"""Every engine freezes the start-up heap (gc.freeze) once it is up, once per process,
as vLLM's engine core does: the per-step garbage of 256 streams then never makes the
collector rescan torch, transformers and the tokenizer. Each case runs in a fresh
interpreter: the test process has long been frozen by earlier engines."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ASYNC_ENGINE = """
import gc, trio
from legato.engine import open_engine

async def main():
    async with open_engine(MODEL, executor="inproc", disable_log_stats=True):
        assert gc.get_freeze_count() > 0, "the first engine froze nothing"
    gc.unfreeze()
    async with open_engine(MODEL, executor="inproc", disable_log_stats=True):
        assert gc.get_freeze_count() == 0, "a second engine in the process froze again"

trio.run(main)
"""

SYNC_ENGINE = """
import gc
from legato.llm import LLMEngine

LLMEngine.from_engine_args(MODEL, disable_log_stats=True)
assert gc.get_freeze_count() > 0, "LLMEngine froze nothing"
"""


@pytest.mark.parametrize("script", [ASYNC_ENGINE, SYNC_ENGINE], ids=["AsyncEngine", "LLMEngine"])
def test_an_engine_freezes_the_startup_heap_once_per_process(
    toy_model_dir: Path, script: str
) -> None:
    code = "import gc\nassert gc.get_freeze_count() == 0\n"
    code += f"MODEL = {str(toy_model_dir)!r}\n" + textwrap.dedent(script) + "print('ok')\n"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
