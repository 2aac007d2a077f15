"""``EngineThread``: the trio engine in a thread of its own (``LLM`` and ``legato.aio`` run on it)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import trio

from legato.engine.thread import Crossing, EngineThread
from legato.protocol.errors import ModelLoadError

ARGS = dict(max_model_len=64, num_kv_blocks=16, disable_log_stats=True, executor="inproc")


class Recording(EngineThread):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.calls: list[str] = []

    def on_started(self, engine: object) -> None:
        self.calls.append("started")

    def on_start_failed(self, error: BaseException) -> None:
        self.calls.append(f"failed:{type(error).__name__}")

    def on_ended(self) -> None:
        self.calls.append("ended")


def test_a_start_up_error_reaches_wait_ready_and_the_thread_ends(tmp_path: Path) -> None:
    runner = Recording(str(tmp_path / "no-such-model"), dict(ARGS))
    runner.start()
    with pytest.raises(ModelLoadError):
        runner.wait_ready()
    runner.thread.join(30)
    assert runner.done.is_set() and not runner.thread.is_alive()
    assert runner.calls == ["failed:ModelLoadError", "ended"]


def test_spawned_work_is_cancelled_through_its_crossing_and_stop_ends_the_engine(
    toy_model_dir: Path,
) -> None:
    runner = Recording(str(toy_model_dir), dict(ARGS))
    runner.start()
    engine = runner.wait_ready()
    began, ended = threading.Event(), threading.Event()

    async def forever() -> None:
        began.set()
        try:
            await trio.sleep_forever()
        finally:
            ended.set()

    crossing = Crossing()
    runner.spawn(crossing, forever)
    assert began.wait(30)
    runner.call_soon(crossing.cancel)
    assert ended.wait(30)  # cancelled alone: the engine still runs
    assert engine.is_running
    runner.stop()
    assert not runner.thread.is_alive() and engine.is_stopped
    assert runner.calls == ["started", "ended"]


def test_a_stop_asked_while_starting_shuts_the_engine_down_once_up(toy_model_dir: Path) -> None:
    runner = Recording(str(toy_model_dir), dict(ARGS))
    runner.start()
    runner.request_stop()  # before the engine is up: remembered, carried out once it is
    runner.thread.join(60)
    assert not runner.thread.is_alive()
    assert runner.engine is None or runner.engine.is_stopped
