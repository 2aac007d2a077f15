"""Chaos: every fault kills the engine loudly and completely (legato.testing.chaos).

The harness runs a few rounds per fault on the toy model in a worker process;
the rest checks that the harness itself sees what it must (a hung stream, a
leaked task or process is reported by name) and the fault descriptions.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from legato.actors.supervisor import InjectedFault, Supervisor
from legato.engine import AsyncEngine, open_engine
from legato.protocol.errors import EngineDeadError
from legato.protocol.outputs import CompletionOutput, RequestOutput
from legato.protocol.params import SamplingParams
from legato.testing.chaos import (
    ACTORS,
    ALL_FAULTS,
    AfterDelay,
    AfterTokens,
    AtStartup,
    ChaosConfig,
    ChaosInvariantError,
    Fault,
    FaultKind,
    OnStep,
    RoundResult,
    StreamPlan,
    StreamRecord,
    StreamSpec,
    apply_fault,
    check_round,
    find_cause,
    format_table,
    plan_streams,
    run_chaos,
    run_round,
)


def small_config(model: Path, **changes: Any) -> ChaosConfig:
    """A light workload: 8 streams of 1..12 tokens, so that a round takes a few seconds."""
    args: dict[str, Any] = dict(model=str(model), num_streams=8, max_tokens=(1, 12))
    args.update(changes)
    return ChaosConfig(**args)


# Each actor once (six rounds of KILL_ACTOR in all), the worker faults twice.
ROUNDS = {name: 1 if name.startswith("kill:") or name == "fail_load" else 2 for name in ALL_FAULTS}


@pytest.mark.parametrize("fault", ALL_FAULTS)
async def test_every_fault_fails_every_stream_and_leaves_nothing(
    toy_model_dir: Path, fault: str
) -> None:
    lines: list[str] = []
    seed = ALL_FAULTS.index(fault)
    results = await run_chaos(
        ROUNDS[fault],
        seed=seed,
        faults=[fault],
        config=small_config(toy_model_dir),
        log=lines.append,
    )
    # run_chaos raised already if any invariant broke; check it really exercised the fault.
    for result in results:
        assert check_round(result) == []
        if fault == "fail_load":
            assert result.startup_error is not None and not result.streams
            continue
        assert result.dead_error is not None
        assert find_cause(result.dead_error, result.fault, result.injected) is not None
        assert result.count("hung") == 0 and result.leaked_processes == []
    assert fault in lines[-1].splitlines()[2]  # the table's row


# ------------------------------------------------------------------ the harness sees hangs and leaks


def _hung_record() -> StreamRecord:
    spec = StreamSpec("req-7", "a prompt", SamplingParams(max_tokens=9), StreamPlan.RUN)
    record = StreamRecord(spec, outputs=3, tokens=3, outcome="hung")
    record.last_output = RequestOutput(
        "req-7", "a prompt", [1, 2], None, [CompletionOutput(0, "partial text", [5, 6, 7])], False
    )
    return record


def test_a_hung_stream_is_named_with_its_progress() -> None:
    fault = Fault(FaultKind.SIGKILL, when=AfterTokens(0, 2))
    result = RoundResult(4, 99, fault, [_hung_record()], fault_time=1.0, death_time=1.1)
    result.leaked_processes = ["pid 4242 (sleeping): python -m legato.workers.worker"]
    (hang, leak) = check_round(result)
    assert "round 4 (seed 99, fault sigkill" in hang
    assert "stream 'req-7'" in hang and "3 outputs, 3 tokens" in hang
    assert "'partial text'" in hang and "hung: still running 2 s after the fault" in hang
    assert leak.endswith("leaked process pid 4242 (sleeping): python -m legato.workers.worker")
    table = format_table([result])
    assert table.splitlines()[2].split()[:7] == ["sigkill", "1", "1", "0", "0", "0", "1"]


async def test_harness_reports_a_real_hang_a_leaked_task_and_a_leaked_process(
    toy_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Test doubles of three engine bugs: death forgets one stream, a task and a
    process outlive open_engine. The harness must name each and never hang itself."""
    stray: list[trio.Process] = []
    on_death = AsyncEngine._on_death
    start = AsyncEngine._start

    def forgetful_on_death(self: AsyncEngine, error: EngineDeadError) -> None:
        live = self.frontend.core.live
        victim = live.pop("chaos-r0-s0", None)
        try:
            on_death(self, error)
        finally:
            if victim is not None:
                live["chaos-r0-s0"] = victim

    async def leaky_start(self: AsyncEngine) -> None:
        await start(self)
        trio.lowlevel.spawn_system_task(trio.sleep_forever, name="leaked-engine-task")
        sleeper = [sys.executable, "-c", "import time; time.sleep(60)", "leaked-process-marker"]
        stray.append(await trio.lowlevel.open_process(sleeper))

    monkeypatch.setattr(AsyncEngine, "_on_death", forgetful_on_death)
    monkeypatch.setattr(AsyncEngine, "_start", leaky_start)
    config = small_config(toy_model_dir, executor="inproc", stream_deadline=0.5)
    specs = plan_streams(random.Random(0), "chaos-r0", 4, config.max_tokens)
    fault = Fault(FaultKind.KILL_ACTOR, actor="stats", when=AfterTokens(0, 1))
    try:
        with trio.fail_after(30):
            result = await run_round(fault, specs, config=config)
    finally:
        for process in stray:
            process.kill()
            await process.wait()
    broken = "\n".join(check_round(result))
    assert "stream 'chaos-r0-s0' (plan run, max_tokens 12, n 1, DELTA)" in broken
    assert "hung: still running 0.5 s after the fault" in broken
    assert "task left running after open_engine exited: leaked-engine-task" in broken
    assert f"leaked process pid {stray[0].pid}" in broken and "leaked-process-marker" in broken
    assert [r.outcome for r in result.streams].count("hung") == 1


async def test_run_chaos_raises_with_the_diagnosis(
    toy_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(AsyncEngine, "_on_death", lambda self, error: None)  # nothing ends
    lines: list[str] = []
    config = small_config(toy_model_dir, executor="inproc", num_streams=3, stream_deadline=0.3)
    with pytest.raises(ChaosInvariantError, match=r"stream 'chaos-r0-s0' .* hung"):
        await run_chaos(1, faults=["kill:scheduler"], config=config, log=lines.append)
    assert "BROKEN" in lines[0]
    assert lines[1].splitlines()[2].startswith("kill:scheduler")  # the table so far
    assert "hung" in lines[2]


# ------------------------------------------------------------------ the supervisor's first cause


async def test_an_injected_fault_stays_the_cause_while_its_actor_unwinds() -> None:
    """The executor reaps its worker after the injected fault; a failure that this
    causes elsewhere (a closed pipe) must not replace the injected cause."""
    supervisor = Supervisor()
    unwinding = trio.Event()
    consequence = trio.Event()

    async def slow_to_unwind() -> None:
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                unwinding.set()
                await consequence.wait()

    async def fails_as_a_consequence() -> None:
        await unwinding.wait()
        consequence.set()
        raise BrokenPipeError("the worker's pipe is closed")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(supervisor.run_actor, "executor", slow_to_unwind)
        nursery.start_soon(supervisor.run_actor, "scheduler", fails_as_a_consequence)
        await trio.testing.wait_all_tasks_blocked()
        injected = InjectedFault("boom")
        supervisor.inject("executor", injected)
    assert supervisor.dead_error is not None
    assert supervisor.dead_error.__cause__ is injected


async def test_an_actor_whose_task_first_runs_after_the_stop_is_cancelled() -> None:
    """``start_soon`` runs an actor's task later; a stop (or a death) in between must
    still reach it (an engine opened and closed at once hung on such an actor)."""
    for end in ("stop", "death"):
        supervisor = Supervisor()
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(supervisor.run_actor, "stats", trio.sleep_forever)
                if end == "stop":  # as AsyncEngine.shutdown, before the task has run
                    supervisor.stopping = True
                    supervisor.cancel_all()
                else:
                    supervisor.die(RuntimeError("the worker died"))
        assert (supervisor.dead_error is not None) == (end == "death")


async def test_an_engine_opened_and_closed_at_once_closes(toy_model_dir: Path) -> None:
    for _ in range(4):
        with trio.fail_after(60):
            async with open_engine(
                str(toy_model_dir), executor="inproc", max_model_len=256, disable_log_stats=True
            ):
                pass


# ------------------------------------------------------------------ fault descriptions


def test_fault_descriptions_are_checked() -> None:
    assert Fault(FaultKind.KILL_ACTOR, "stats", AfterDelay(0.1)).name == "kill:stats"
    assert Fault(FaultKind.RAISE_ON_STEP, when=OnStep(3)).engine_faults() == {
        "worker": {"raise_on_step": 3}
    }
    assert Fault(FaultKind.FAIL_LOAD, when=AtStartup()).engine_faults() == {
        "worker": {"fail_load": True}
    }
    assert Fault(FaultKind.SIGSTOP, when=AfterTokens(0, 1)).engine_faults() is None
    with pytest.raises(ValueError, match="actor: must be one of scheduler"):
        Fault(FaultKind.KILL_ACTOR, "tokenizer")
    with pytest.raises(ValueError, match="actor: only a kill fault"):
        Fault(FaultKind.SIGKILL, "executor")
    with pytest.raises(ValueError, match="when: a raise_on_step fault strikes at OnStep"):
        Fault(FaultKind.RAISE_ON_STEP, when=AfterDelay(1))
    with pytest.raises(ValueError, match="when: a sigkill fault strikes at AfterTokens or"):
        Fault(FaultKind.SIGKILL, when=OnStep(1))
    assert len(ALL_FAULTS) == len(ACTORS) + 4


def test_start_time_faults_are_not_applied_live() -> None:
    fault = Fault(FaultKind.RAISE_ON_STEP, when=OnStep(2))
    with pytest.raises(ValueError, match="pass fault.engine_faults"):
        apply_fault(None, fault)  # type: ignore[arg-type]


def test_command_line_prints_the_table(
    toy_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from legato.testing.chaos import main

    args = ["--model", str(toy_model_dir), "--rounds", "1", "--faults", "fail_load"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "round   0 fail_load" in out
    assert out.splitlines()[-1].split()[:3] == ["fail_load", "1", "0"]
    with pytest.raises(ValueError, match="sigkill needs the worker in a process"):
        main([*args[:4], "--faults", "sigkill", "--executor", "inproc"])
