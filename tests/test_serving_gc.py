"""Every engine tunes the garbage collector once it is up, once per process: the start-up
heap frozen (gc.freeze, as vLLM's engine core does) and the young generation's threshold
raised, so the per-step garbage of 256 streams neither makes the collector rescan torch,
transformers and the tokenizer nor run young collections every step. Each case runs in a
fresh interpreter: the test process has long been tuned by earlier engines."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from legato.serving_gc import YOUNG_THRESHOLD


def run_fresh(script: str) -> None:
    """Run ``script`` in a new interpreter, whose collector no engine has tuned yet
    (``YOUNG`` is the engine's threshold there); it must finish without an error."""
    code = f"import gc\nYOUNG = {YOUNG_THRESHOLD}\n"
    code += "assert gc.get_freeze_count() == 0 and gc.get_threshold()[0] < YOUNG\n"
    code += textwrap.dedent(script) + "print('ok')\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


ASYNC_ENGINE = """
import gc, trio
from legato.engine import open_engine

async def main():
    async with open_engine(MODEL, executor="inproc", disable_log_stats=True):
        assert gc.get_freeze_count() > 0, "the first engine froze nothing"
        assert gc.get_threshold()[0] == YOUNG, gc.get_threshold()
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    async with open_engine(MODEL, executor="inproc", disable_log_stats=True):
        assert gc.get_freeze_count() == 0, "a second engine in the process froze again"
        assert gc.get_threshold() == (700, 10, 10), "a second engine overrode the application"

trio.run(main)
"""

SYNC_ENGINE = """
import gc
from legato.llm import LLMEngine

LLMEngine.from_engine_args(MODEL, disable_log_stats=True)
assert gc.get_freeze_count() > 0, "LLMEngine froze nothing"
assert gc.get_threshold()[0] == YOUNG, gc.get_threshold()
"""

HIGHER_ALREADY = """
import gc, trio
from legato.engine import open_engine

gc.set_threshold(YOUNG * 3, 15, 20)

async def main():
    async with open_engine(MODEL, executor="inproc", disable_log_stats=True):
        assert gc.get_threshold() == (YOUNG * 3, 15, 20), gc.get_threshold()

trio.run(main)
"""

DISABLED = """
import gc, trio
from legato.engine import open_engine

gc.set_threshold(0)

async def main():
    async with open_engine(MODEL, executor="inproc", disable_log_stats=True):
        assert gc.get_threshold()[0] == 0, "the engine re-enabled automatic collection"

trio.run(main)
"""


@pytest.mark.parametrize(
    "script",
    [ASYNC_ENGINE, SYNC_ENGINE, HIGHER_ALREADY, DISABLED],
    ids=["AsyncEngine", "LLMEngine", "higher-threshold-kept", "disabled-kept"],
)
def test_an_engine_tunes_the_collector_once_per_process(toy_model_dir: Path, script: str) -> None:
    run_fresh(f"MODEL = {str(toy_model_dir)!r}\n" + script)


WORKER = """
import gc, io
from legato.config import EngineConfig
from legato.protocol import messages as m
from legato.protocol.wire import encode, frame_header
from legato.workers.worker import serve

init = encode(m.WorkerInit(config=EngineConfig(runner="null", num_kv_blocks=64).to_dict()))
frames = io.BytesIO(frame_header(len(init), 1) + init)  # then end of input: a clean exit
assert serve(frames, io.BytesIO()) == 0
assert gc.get_freeze_count() > 0, "the worker froze nothing"
assert gc.get_threshold()[0] == YOUNG, gc.get_threshold()
"""


def test_the_model_worker_tunes_its_own_process() -> None:
    """The worker (``python -m legato.workers.worker`` runs ``serve``) is an engine process too."""
    run_fresh(WORKER)
