"""Chaos testing: inject faults into a running engine and check it fails loudly and completely.

The promise under test (design.md, "Failure semantics"): when any part of the
engine fails, every open stream ends with ``EngineDeadError`` (its cause chain
holding the real failure) within a bounded time, new calls fail at once,
``check_health`` raises, the worker process is reaped and no task of the
engine outlives ``open_engine``. Nothing hangs, nothing leaks.

Two layers, both usable against your own model directory:

- **Faults.** A :class:`Fault` describes one failure: its kind, the actor it
  hits and when it strikes. :func:`apply_fault` applies a live fault to a
  running engine (an actor raising at its next checkpoint, SIGKILL or SIGSTOP
  to the worker); start-time faults (the model runner raising on step N,
  weight loading failing) travel as ``open_engine(faults=fault.engine_faults())``.
  :func:`find_cause` says whether a dead engine's error chain holds the fault.
- **The harness.** :func:`run_round` starts an engine, drives concurrent
  streams (mixed lengths, output kinds, n>1, callers cancelling, closing or
  aborting some of them), injects one fault at a seeded random moment and
  records what happened; :func:`check_round` turns the record into a list of
  broken invariants, each naming the stream or process at fault;
  :func:`run_chaos` runs many rounds, prints a table per fault and raises
  :class:`ChaosInvariantError` on the first broken invariant.

Command line (a soak): ``python -m legato.testing.chaos --rounds 50``.

Imports trio, psutil (an optional dependency: ``pip install 'legato[chaos]'``) and
the engine; never torch (the worker process does).
"""

from __future__ import annotations

import argparse
import enum
import logging
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import trio

try:
    import psutil
except ImportError as exc:  # an optional dependency of the engine
    raise ImportError(
        "the chaos harness needs psutil: install it with pip install 'legato[chaos]'"
    ) from exc

from ..actors.executor import WorkerDiedError
from ..actors.heartbeat import HeartbeatTimeout
from ..actors.supervisor import InjectedFault
from ..actors.tensor_parallel_executor import TensorParallelExecutor
from ..engine import AsyncEngine, open_engine
from ..protocol.errors import EngineDeadError, EngineStartupError
from ..protocol.outputs import RequestOutput
from ..protocol.params import RequestOutputKind, SamplingParams

# The actors an engine runs under its supervisor, each a target for KILL_ACTOR.
ACTORS: Final = ("scheduler", "executor", "detokenizer", "stats", "heartbeat")

# ------------------------------------------------------------------ faults


class FaultKind(enum.Enum):
    """How a fault strikes."""

    KILL_ACTOR = "kill"  # the actor raises InjectedFault at its next checkpoint
    SIGKILL = "sigkill"  # the worker process is killed
    SIGSTOP = "sigstop"  # the worker process freezes: a hang only the heartbeat sees
    RAISE_ON_STEP = "raise_on_step"  # the worker's model runner raises on step N
    FAIL_LOAD = "fail_load"  # the worker fails to load the weights


@dataclass(frozen=True)
class AfterTokens:
    """Once stream number ``stream`` has received ``tokens`` tokens, or has ended."""

    stream: int
    tokens: int


@dataclass(frozen=True)
class AfterDelay:
    """``seconds`` after the streams were started."""

    seconds: float


@dataclass(frozen=True)
class OnStep:
    """When the worker runs its ``step``-th model step (counted from 1)."""

    step: int


@dataclass(frozen=True)
class AtStartup:
    """While the engine starts (before ``open_engine`` yields)."""


Moment = AfterTokens | AfterDelay | OnStep | AtStartup


@dataclass(frozen=True)
class Fault:
    """One failure: what kind, which actor (KILL_ACTOR only) and when.

    Live faults (KILL_ACTOR, SIGKILL, SIGSTOP) strike at an ``AfterTokens`` or
    ``AfterDelay`` moment; RAISE_ON_STEP needs ``OnStep`` and FAIL_LOAD
    ``AtStartup``. An invalid combination raises ValueError.
    """

    kind: FaultKind
    actor: str | None = None
    when: Moment = AfterDelay(0.0)
    rank: int = 0  # the worker process it strikes: a tensor-parallel rank (0: the only one)

    def __post_init__(self) -> None:
        if self.kind is FaultKind.KILL_ACTOR:
            if self.actor not in ACTORS:
                raise ValueError(f"actor: must be one of {', '.join(ACTORS)}, got {self.actor!r}")
            if self.rank:
                raise ValueError("rank: a kill fault strikes an actor, not a rank")
        elif self.actor is not None:
            raise ValueError(f"actor: only a {FaultKind.KILL_ACTOR.value} fault names an actor")
        if self.rank < 0:
            raise ValueError(f"rank: must be >= 0, got {self.rank}")
        needed: dict[FaultKind, tuple[type, ...]] = {
            FaultKind.RAISE_ON_STEP: (OnStep,),
            FaultKind.FAIL_LOAD: (AtStartup,),
        }
        allowed = needed.get(self.kind, (AfterTokens, AfterDelay))
        if not isinstance(self.when, allowed):
            names = " or ".join(t.__name__ for t in allowed)
            raise ValueError(f"when: a {self.name} fault strikes at {names}, got {self.when!r}")

    @property
    def name(self) -> str:
        """The fault's row in the table: ``kill:<actor>`` or the kind's value."""
        if self.kind is FaultKind.KILL_ACTOR:
            return f"kill:{self.actor}"
        return str(self.kind.value) + (f"@rank{self.rank}" if self.rank else "")

    @property
    def is_live(self) -> bool:
        """Whether :func:`apply_fault` applies it (else it is set up at start)."""
        return self.kind in (FaultKind.KILL_ACTOR, FaultKind.SIGKILL, FaultKind.SIGSTOP)

    def engine_faults(self) -> dict[str, Any] | None:
        """The ``faults=`` argument of ``open_engine`` for a start-time fault, else None."""
        spec: dict[str, Any] = {"rank": self.rank} if self.rank else {}
        if isinstance(self.when, OnStep):
            return {"worker": {"raise_on_step": self.when.step, **spec}}
        if self.kind is FaultKind.FAIL_LOAD:
            return {"worker": {"fail_load": True, **spec}}
        return None

    @property
    def expected_cause(self) -> str:
        """In words: what the dead engine's cause chain must hold."""
        return {
            FaultKind.KILL_ACTOR: "the InjectedFault instance that was injected",
            FaultKind.SIGKILL: "a WorkerDiedError",
            FaultKind.SIGSTOP: "a HeartbeatTimeout",
            FaultKind.RAISE_ON_STEP: f"a WorkerDiedError naming {_RAISE_TEXT!r}",
            FaultKind.FAIL_LOAD: f"an EngineStartupError naming {_LOAD_TEXT!r}",
        }[self.kind]


ALL_FAULTS: Final = (
    *(f"kill:{actor}" for actor in ACTORS),
    FaultKind.SIGKILL.value,
    FaultKind.SIGSTOP.value,
    FaultKind.RAISE_ON_STEP.value,
    FaultKind.FAIL_LOAD.value,
)
# The faults that need the worker in a child process.
PROCESS_FAULTS: Final = (FaultKind.SIGKILL.value, FaultKind.SIGSTOP.value)
_RAISE_TEXT: Final = "injected fault: model runner raised on step"  # legato.workers.worker._FaultPlan
_LOAD_TEXT: Final = "weight loading failed"


def apply_fault(engine: AsyncEngine, fault: Fault) -> BaseException | None:
    """Apply a live fault to ``engine`` now. Synchronous; never blocks.

    Returns the exception injected into the actor for KILL_ACTOR (the cause
    ``dead_error`` must chain to), else None. SIGKILL and SIGSTOP need the
    process executor (the in-process one raises WorkerCallError). A start-time
    fault raises ValueError: pass ``fault.engine_faults()`` to ``open_engine``.
    """
    if fault.kind is FaultKind.KILL_ACTOR:
        assert fault.actor is not None
        error = InjectedFault(f"chaos: injected fault in the {fault.actor} actor")
        engine.inject_fault(fault.actor, error)
        return error
    if fault.kind in (FaultKind.SIGKILL, FaultKind.SIGSTOP):
        sig = signal.SIGKILL if fault.kind is FaultKind.SIGKILL else signal.SIGSTOP
        executor = engine.executor
        if fault.rank == 0:
            executor.kill(sig)
        elif isinstance(executor, TensorParallelExecutor):
            executor.kill_rank(fault.rank, sig)
        else:
            raise ValueError(f"rank: {fault.rank} needs a tensor-parallel engine")
        return None
    raise ValueError(f"fault: {fault.name} is set up at start; pass fault.engine_faults()")


def cause_chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, then its ``__cause__`` (or ``__context__``), and so on; cycle-safe."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def find_cause(
    error: BaseException, fault: Fault, injected: BaseException | None = None
) -> BaseException | None:
    """The exception in ``error``'s cause chain that ``fault`` explains, or None.

    For KILL_ACTOR that is ``injected`` itself when given (what ``apply_fault``
    returned), else any InjectedFault.
    """
    for exc in cause_chain(error):
        if fault.kind is FaultKind.KILL_ACTOR and (
            exc is injected if injected is not None else isinstance(exc, InjectedFault)
        ):
            return exc
        if fault.kind is FaultKind.SIGKILL and isinstance(exc, WorkerDiedError):
            return exc
        if fault.kind is FaultKind.SIGSTOP and isinstance(exc, HeartbeatTimeout):
            return exc
        if fault.kind is FaultKind.RAISE_ON_STEP and isinstance(exc, WorkerDiedError):
            if _RAISE_TEXT in str(exc):
                return exc
        if fault.kind is FaultKind.FAIL_LOAD and isinstance(exc, EngineStartupError):
            if _LOAD_TEXT in str(exc):
                return exc
    return None


def describe_chain(error: BaseException) -> str:
    """``Type: message <- Type: message ...`` along the cause chain."""
    return " <- ".join(f"{type(exc).__name__}: {exc}" for exc in cause_chain(error))


# ------------------------------------------------------------------ workload


class StreamPlan(enum.Enum):
    """What a stream's caller does."""

    RUN = "run"  # reads to the end
    CANCEL = "cancel"  # cancels its own cancel scope part-way
    CLOSE = "close"  # calls ``aclose()`` part-way
    ABORT = "abort"  # calls ``engine.abort(request_id)`` part-way and reads on


@dataclass(frozen=True)
class StreamSpec:
    """One stream of a round. The caller acts (per ``plan``) after ``act_after_tokens``
    tokens, or ``act_after_seconds`` after the start when that is set instead."""

    request_id: str
    prompt: str
    params: SamplingParams
    plan: StreamPlan = StreamPlan.RUN
    act_after_tokens: int | None = None
    act_after_seconds: float | None = None


@dataclass
class StreamRecord:
    """What one stream saw. ``outcome`` is None while it runs, then one of
    "completed" (a finished output), "dead" (EngineDeadError), "cancelled" (by its
    caller: cancel scope or ``aclose``), "failed" (anything else) or "hung" (still
    running at the deadline)."""

    spec: StreamSpec
    outputs: int = 0
    tokens: int = 0
    last_output: RequestOutput | None = None
    outcome: str | None = None
    error: BaseException | None = None
    ended_at: float | None = None

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    def note(self, output: RequestOutput) -> None:
        """Count one output and its tokens (per the stream's output kind)."""
        self.outputs += 1
        self.last_output = output
        got = sum(len(c.token_ids) for c in output.outputs)
        if self.spec.params.output_kind == RequestOutputKind.DELTA:
            self.tokens += got
        else:
            self.tokens = got

    def describe(self) -> str:
        """A line that identifies the stream and how far it got."""
        p = self.spec.params
        head = (
            f"stream {self.request_id!r} (plan {self.spec.plan.value}, max_tokens {p.max_tokens}, "
            f"n {p.n}, {p.output_kind.name}): {self.outputs} outputs, {self.tokens} tokens"
        )
        return f"{head}, last output: {_describe_output(self.last_output)}"


def _describe_output(output: RequestOutput | None) -> str:
    if output is None:
        return "none"
    parts = [
        f"#{c.index} {len(c.token_ids)} tokens, finish_reason={c.finish_reason}, "
        f"text={c.text[-24:]!r}"
        for c in output.outputs
    ]
    return f"finished={output.finished} [{'; '.join(parts)}]"


_WORDS: Final = (
    "the engine streams tokens while faults strike at random moments and every "
    "request must end loudly never silently nor half way chaos soak worker actor"
).split()


def plan_streams(
    rng: random.Random, prefix: str, num_streams: int, max_tokens: tuple[int, int]
) -> list[StreamSpec]:
    """A seeded mix of streams. Stream 0 is the anchor: it reads to the end, DELTA,
    n=1, with the largest ``max_tokens`` (so a fault moment can always land on it)."""
    low, high = max_tokens
    if not 1 <= low <= high or high < 2:
        raise ValueError(f"max_tokens: need 1 <= low <= high and high >= 2, got {max_tokens}")
    specs = []
    for i in range(num_streams):
        anchor = i == 0
        kind = (
            RequestOutputKind.DELTA
            if anchor
            else rng.choice(
                [RequestOutputKind.DELTA] * 3
                + [RequestOutputKind.FINAL_ONLY] * 2
                + [RequestOutputKind.CUMULATIVE]
            )
        )
        tokens = high if anchor else rng.randint(low, high)
        greedy = rng.random() < 0.5
        params = SamplingParams(
            n=1 if anchor or rng.random() < 0.75 else rng.randint(2, 3),
            max_tokens=tokens,
            temperature=0.0 if greedy else 0.8,
            seed=None if greedy else rng.randrange(2**31),
            ignore_eos=anchor or rng.random() < 0.8,
            stop=None if anchor or rng.random() < 0.9 else [rng.choice(["e", "th", " a"])],
            output_kind=kind,
        )
        plan = (
            StreamPlan.RUN
            if anchor
            else rng.choices(list(StreamPlan), weights=[0.55, 0.15, 0.1, 0.2])[0]
        )
        if plan is StreamPlan.CLOSE and kind == RequestOutputKind.FINAL_ONLY:
            plan = StreamPlan.CANCEL  # nothing arrives before the end to close on
        after_tokens: int | None = None
        after_seconds: float | None = None
        if plan is not StreamPlan.RUN:
            if kind == RequestOutputKind.FINAL_ONLY or rng.random() < 0.3:
                after_seconds = round(rng.uniform(0.0, 1.0), 3)
            else:
                after_tokens = rng.randint(1, tokens)
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 40)))
        specs.append(StreamSpec(f"{prefix}-s{i}", words, params, plan, after_tokens, after_seconds))
    return specs


def random_fault(rng: random.Random, name: str, anchor_max_tokens: int) -> Fault:
    """A fault of kind ``name`` (one of ``ALL_FAULTS``) at a seeded random moment.

    Live faults strike after the anchor stream (stream 0) got 1..max_tokens-1
    tokens, or 0..0.5 s after the start; RAISE_ON_STEP on a step the anchor
    alone guarantees will run.
    """
    if name not in ALL_FAULTS:
        raise ValueError(f"fault: unknown fault {name!r}; known: {', '.join(ALL_FAULTS)}")
    if name == FaultKind.FAIL_LOAD.value:
        return Fault(FaultKind.FAIL_LOAD, when=AtStartup())
    if name == FaultKind.RAISE_ON_STEP.value:
        return Fault(FaultKind.RAISE_ON_STEP, when=OnStep(rng.randint(1, anchor_max_tokens - 1)))
    when: Moment
    if rng.random() < 0.7:
        when = AfterTokens(0, rng.randint(1, anchor_max_tokens - 1))
    else:
        when = AfterDelay(round(rng.uniform(0.0, 0.5), 3))
    if name.startswith("kill:"):
        return Fault(FaultKind.KILL_ACTOR, actor=name.removeprefix("kill:"), when=when)
    return Fault(FaultKind(name), when=when)


# ------------------------------------------------------------------ one round


@dataclass(frozen=True)
class ChaosConfig:
    """How the harness runs each round.

    ``stream_deadline``: every stream must end this many seconds after the
    fault (after the death, for RAISE_ON_STEP, whose moment the parent cannot
    see). ``death_timeout``: the engine must be dead by then.
    ``sigstop_args``: engine arguments for SIGSTOP rounds only, which also
    warm the worker up with one request before the streams start: a short
    heartbeat, so that it sees the hang within the deadline, and a small step
    budget, so that no honest step of a loaded CPU outlasts the heartbeat's
    timeout (a step the worker is busy with delays its answer to a ping).
    """

    model: str | None = "toy"
    executor: Literal["process", "inproc"] = "process"
    num_streams: int = 16
    max_tokens: tuple[int, int] = (1, 24)
    stream_deadline: float = 2.0
    death_timeout: float = 10.0
    workload_timeout: float = 60.0
    exit_timeout: float = 15.0
    sigstop_args: Mapping[str, Any] = field(
        default_factory=lambda: {
            "heartbeat_interval": 0.2,
            "heartbeat_timeout": 1.0,
            "max_num_batched_tokens": 64,
        }
    )
    engine_args: Mapping[str, Any] = field(
        default_factory=lambda: {
            "max_model_len": 512,
            "num_kv_blocks": 400,
            "disable_log_stats": True,
        }
    )


@dataclass
class RoundResult:
    """Everything one round observed; :func:`check_round` judges it."""

    index: int
    seed: int
    fault: Fault
    streams: list[StreamRecord] = field(default_factory=list)
    injected: BaseException | None = None
    fault_time: float | None = None  # trio clock; the death time for RAISE_ON_STEP
    death_time: float | None = None
    dead_error: BaseException | None = None
    startup_error: BaseException | None = None
    worker_pid: int | None = None
    stream_deadline: float = 2.0
    timings: dict[str, float] = field(default_factory=dict)  # seconds: start, workload, exit
    problems: list[str] = field(default_factory=list)  # broken invariants seen while running
    leaked_processes: list[str] = field(default_factory=list)
    leaked_tasks: list[str] = field(default_factory=list)

    def count(self, outcome: str) -> int:
        return sum(1 for s in self.streams if s.outcome == outcome)

    @property
    def fault_to_last_end(self) -> float | None:
        """Seconds from the fault to the last stream's end (0 if none outlived it)."""
        if self.fault_time is None:
            return None
        ends = [s.ended_at for s in self.streams if s.ended_at is not None]
        return max([0.0, *(end - self.fault_time for end in ends)])


class ChaosInvariantError(AssertionError):
    """A chaos round broke the engine's failure contract; the message says where."""


async def run_round(
    fault: Fault,
    specs: Sequence[StreamSpec],
    *,
    config: ChaosConfig | None = None,
    index: int = 0,
    seed: int = 0,
) -> RoundResult:
    """Start an engine, drive ``specs`` concurrently, inject ``fault``, record the aftermath.

    Never raises for a broken invariant (see :func:`check_round`); harness
    errors propagate. Blocks for the round's length (seconds); cancellable.
    """
    config = config or ChaosConfig()
    result = RoundResult(index, seed, fault, [StreamRecord(spec) for spec in specs])
    result.stream_deadline = config.stream_deadline
    args = dict(config.engine_args)
    args["executor"] = config.executor
    if fault.kind is FaultKind.SIGSTOP:
        args.update(config.sigstop_args)
    children_before = _child_pids()
    tasks_before = _live_tasks()
    clock = trio.current_time()
    with trio.CancelScope() as exit_guard:
        try:
            async with open_engine(config.model, faults=fault.engine_faults(), **args) as engine:
                result.timings["start"] = trio.current_time() - clock
                clock = trio.current_time()
                if fault.kind is FaultKind.FAIL_LOAD:
                    result.problems.append("open_engine started although loading was made to fail")
                else:
                    await _drive(engine, result, config)
                result.timings["workload"] = trio.current_time() - clock
                clock = trio.current_time()
                exit_guard.deadline = clock + config.exit_timeout
        except EngineStartupError as exc:
            result.timings["start"] = trio.current_time() - clock
            clock = trio.current_time()
            result.startup_error = exc
            if fault.kind is not FaultKind.FAIL_LOAD:
                raise
            if find_cause(exc, fault) is None:
                result.problems.append(
                    f"the start-up error lacks {fault.expected_cause}: {describe_chain(exc)}"
                )
    result.timings["exit"] = trio.current_time() - clock
    if exit_guard.cancelled_caught:
        result.problems.append(f"open_engine did not exit within {config.exit_timeout:g} s")
    result.leaked_processes = [
        _describe_process(pid) for pid in sorted(_child_pids() - children_before)
    ]
    pid = result.worker_pid
    if pid is not None and pid not in _child_pids() and _alive(pid):
        result.leaked_processes.append(_describe_process(pid))
    current = trio.lowlevel.current_task()
    result.leaked_tasks = sorted(
        f"{task.name} (parent: {task.parent_nursery.parent_task.name if task.parent_nursery else '-'})"
        for task in _live_tasks() - tasks_before
        if task is not current
    )
    return result


async def _drive(engine: AsyncEngine, result: RoundResult, config: ChaosConfig) -> None:
    fault = result.fault
    result.worker_pid = engine.executor.pid
    records = result.streams
    remaining = len(records)
    all_ended = trio.Event()
    moment = trio.Event()
    watched = fault.when.stream if isinstance(fault.when, AfterTokens) else None

    def on_progress(i: int, record: StreamRecord) -> None:
        nonlocal remaining
        if i == watched and (
            record.outcome is not None
            or isinstance(fault.when, AfterTokens)
            and record.tokens >= fault.when.tokens
        ):
            moment.set()
        if record.outcome is not None:
            remaining -= 1
            if remaining == 0:
                all_ended.set()
                moment.set()

    if not records:
        all_ended.set()
    if fault.kind is FaultKind.SIGSTOP:  # pay the worker's first-step costs up front
        await _generate_once(engine, f"chaos-r{result.index}-warm-up")
    async with trio.open_nursery() as nursery:
        for i, record in enumerate(records):
            nursery.start_soon(_run_stream, engine, i, record, on_progress, nursery)
        # -- the fault's moment
        with trio.move_on_after(config.workload_timeout) as waited:
            if isinstance(fault.when, AfterTokens):
                await moment.wait()
            elif isinstance(fault.when, AfterDelay):
                await trio.sleep(fault.when.seconds)
            else:  # OnStep: the worker strikes by itself
                await engine.supervisor.dead.wait()
        if waited.cancelled_caught:
            result.problems.append(
                f"the fault's moment {fault.when!r} did not come within "
                f"{config.workload_timeout:g} s; streams: "
                + "; ".join(r.describe() for r in records if r.outcome is None)
            )
        if fault.is_live:
            if engine.errored:
                result.problems.append(
                    "the engine died before the fault was applied: "
                    + describe_chain(engine.dead_error)
                )
            result.fault_time = trio.current_time()
            result.injected = apply_fault(engine, fault)
        # -- the death
        with trio.move_on_after(config.death_timeout):
            await engine.supervisor.dead.wait()
        if engine.errored:
            result.death_time = trio.current_time()
            result.dead_error = engine.dead_error
        else:
            result.problems.append(
                f"the engine was still alive {config.death_timeout:g} s after the fault"
            )
        if result.fault_time is None:
            result.fault_time = result.death_time
        # -- every stream ends
        start = result.fault_time if result.fault_time is not None else trio.current_time()
        with trio.move_on_at(start + config.stream_deadline):
            await all_ended.wait()
        for record in records:
            if record.outcome is None:
                record.outcome = "hung"
        nursery.cancel_scope.cancel()  # the hung streams, and pending delayed aborts
    if engine.errored:
        await _check_dead_engine(engine, result)


async def _check_dead_engine(engine: AsyncEngine, result: RoundResult) -> None:
    """The calls a caller makes on a dead engine must fail at once with EngineDeadError."""
    error = engine.dead_error
    if not isinstance(error, EngineDeadError):
        result.problems.append(f"dead_error is not an EngineDeadError: {error!r}")
    elif find_cause(error, result.fault, result.injected) is None:
        result.problems.append(
            f"dead_error's cause chain lacks {result.fault.expected_cause}: {describe_chain(error)}"
        )
    if engine.is_running or not engine.is_stopped:
        result.problems.append(
            f"a dead engine reports is_running={engine.is_running} is_stopped={engine.is_stopped}"
        )
    checks: list[tuple[str, Callable[[], Any]]] = [
        ("check_health", engine.check_health),
        ("a new generate", lambda: _generate_once(engine, f"chaos-r{result.index}-late")),
    ]
    for what, call in checks:
        try:
            with trio.fail_after(1.0):
                await call()
        except EngineDeadError:
            continue
        except trio.TooSlowError:
            result.problems.append(f"{what} on a dead engine did not return within 1 s")
        except Exception as exc:
            result.problems.append(f"{what} on a dead engine raised {exc!r}, not EngineDeadError")
        else:
            result.problems.append(f"{what} on a dead engine did not raise")


async def _generate_once(engine: AsyncEngine, request_id: str) -> None:
    """One single-token request, read to the end."""
    async with engine.generate("one more", SamplingParams(max_tokens=1), request_id) as s:
        async for _ in s:
            pass


async def _run_stream(
    engine: AsyncEngine,
    i: int,
    record: StreamRecord,
    on_progress: Callable[[int, StreamRecord], None],
    nursery: trio.Nursery,
) -> None:
    """Drive one stream per its plan and record how it ended (see StreamRecord)."""
    spec = record.spec
    closed = False
    acted = False
    try:
        with trio.CancelScope() as scope:
            if spec.act_after_seconds is not None:
                if spec.plan is StreamPlan.CANCEL:
                    scope.deadline = trio.current_time() + spec.act_after_seconds
                elif spec.plan is StreamPlan.ABORT:
                    nursery.start_soon(
                        _abort_later, engine, spec.request_id, spec.act_after_seconds
                    )
            stream = engine.generate(spec.prompt, spec.params, spec.request_id)
            async with stream:
                async for output in stream:
                    record.note(output)
                    on_progress(i, record)
                    due = (
                        spec.act_after_tokens is not None and record.tokens >= spec.act_after_tokens
                    )
                    if acted or not due or output.finished:
                        continue
                    acted = True
                    if spec.plan is StreamPlan.CANCEL:
                        scope.cancel()
                    elif spec.plan is StreamPlan.CLOSE:
                        await stream.aclose()
                        closed = True
                        break
                    elif spec.plan is StreamPlan.ABORT:
                        await engine.abort(spec.request_id)
    except EngineDeadError as exc:
        _end(record, "dead", exc)
    except Exception as exc:
        _end(record, "failed", exc)
    else:
        if scope.cancelled_caught or closed:
            _end(record, "cancelled")
        elif record.last_output is not None and record.last_output.finished:
            _end(record, "completed")
        else:
            _end(record, "failed")
    finally:
        if record.outcome not in (None, "hung") and record.ended_at is None:
            record.ended_at = trio.current_time()
            on_progress(i, record)


def _end(record: StreamRecord, outcome: str, error: BaseException | None = None) -> None:
    if record.outcome is None:  # "hung" stays hung
        record.outcome = outcome
        record.error = error


async def _abort_later(engine: AsyncEngine, request_id: str, delay: float) -> None:
    await trio.sleep(delay)  # the workload's random moment, not a race fix
    await engine.abort(request_id)


# ------------------------------------------------------------------ judging


def check_round(result: RoundResult) -> list[str]:
    """The broken invariants of one round, each a self-contained diagnosis (empty: all held)."""
    fault = result.fault
    where = f"round {result.index} (seed {result.seed}, fault {fault.name} at {fault.when!r})"
    broken = [f"{where}: {problem}" for problem in result.problems]
    for record in result.streams:
        if record.outcome == "hung":
            broken.append(
                f"{where}: {record.describe()} -- hung: still running "
                f"{result.stream_deadline:g} s after the fault"
            )
        elif record.outcome == "failed":
            error = describe_chain(record.error) if record.error else "no finished output"
            broken.append(f"{where}: {record.describe()} -- failed: {error}")
        elif record.outcome == "dead":
            assert record.error is not None
            if find_cause(record.error, fault, result.injected) is None:
                broken.append(
                    f"{where}: {record.describe()} -- its EngineDeadError lacks "
                    f"{fault.expected_cause}: {describe_chain(record.error)}"
                )
        elif record.outcome == "completed":
            last = record.last_output
            if last is None or not last.finished:
                broken.append(f"{where}: {record.describe()} -- completed unfinished")
    for process in result.leaked_processes:
        broken.append(f"{where}: leaked process {process}")
    for task in result.leaked_tasks:
        broken.append(f"{where}: task left running after open_engine exited: {task}")
    return broken


# ------------------------------------------------------------------ many rounds


@dataclass
class FaultStats:
    """One row of the table: totals over the rounds of one fault."""

    rounds: int = 0
    streams: int = 0
    completed: int = 0
    dead: int = 0
    cancelled: int = 0
    hung: int = 0
    leaked: int = 0
    times: list[float] = field(default_factory=list)

    def add(self, result: RoundResult) -> None:
        self.rounds += 1
        self.streams += len(result.streams)
        self.completed += result.count("completed")
        self.dead += result.count("dead")
        self.cancelled += result.count("cancelled")
        self.hung += result.count("hung")
        self.leaked += len(result.leaked_processes)
        if result.fault_to_last_end is not None:
            self.times.append(result.fault_to_last_end)


def summarize(results: Sequence[RoundResult]) -> dict[str, FaultStats]:
    """Per fault name, in ``ALL_FAULTS`` order."""
    rows: dict[str, FaultStats] = {}
    for result in sorted(results, key=lambda r: _fault_order(r.fault.name)):
        rows.setdefault(result.fault.name, FaultStats()).add(result)
    return rows


def _fault_order(name: str) -> int:
    return ALL_FAULTS.index(name) if name in ALL_FAULTS else len(ALL_FAULTS)


def format_table(results: Sequence[RoundResult]) -> str:
    """The table: per fault, rounds, streams and outcomes, leaks, fault-to-last-end times."""
    header = (
        "fault",
        "rounds",
        "streams",
        "completed",
        "dead-errored",
        "cancelled",
        "hung",
        "leaked procs",
        "fault->end median",
        "fault->end max",
    )
    rows: list[tuple[str, ...]] = [header]
    for name, s in summarize(results).items():
        median = f"{statistics.median(s.times):.3f} s" if s.times else "-"
        worst = f"{max(s.times):.3f} s" if s.times else "-"
        rows.append(
            (
                name,
                *map(str, (s.rounds, s.streams, s.completed, s.dead, s.cancelled, s.hung)),
                str(s.leaked),
                median,
                worst,
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    lines = [
        "  ".join(
            cell.ljust(w) if c == 0 else cell.rjust(w)
            for c, (cell, w) in enumerate(zip(row, widths))
        )
        for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


async def run_chaos(
    rounds: int,
    *,
    seed: int = 0,
    faults: Sequence[str] = ALL_FAULTS,
    config: ChaosConfig | None = None,
    log: Callable[[str], None] | None = print,
) -> list[RoundResult]:
    """Run ``rounds`` rounds, cycling through ``faults`` (names from ``ALL_FAULTS``).

    Round ``i`` is seeded from ``(seed, i)``, so a red round reproduces with
    the same arguments. Prints the table at the end (through ``log``). On the
    first broken invariant, prints the table so far and the diagnosis, and
    raises ChaosInvariantError. Blocks for minutes at large ``rounds``.
    """
    config = config or ChaosConfig()
    if not faults:
        raise ValueError("faults: name at least one fault")
    for name in faults:
        if name not in ALL_FAULTS:
            raise ValueError(f"faults: unknown fault {name!r}; known: {', '.join(ALL_FAULTS)}")
        if config.executor == "inproc" and name in PROCESS_FAULTS:
            raise ValueError(f"faults: {name} needs the worker in a process (executor='process')")
    results: list[RoundResult] = []
    for index in range(rounds):
        round_seed = seed * 1_000_003 + index
        rng = random.Random(round_seed)
        name = faults[index % len(faults)]
        specs = (
            []
            if name == FaultKind.FAIL_LOAD.value
            else plan_streams(rng, f"chaos-r{index}", config.num_streams, config.max_tokens)
        )
        anchor_tokens = specs[0].params.max_tokens if specs else config.max_tokens[1]
        fault = random_fault(rng, name, anchor_tokens or 2)
        started = time.monotonic()
        result = await run_round(fault, specs, config=config, index=index, seed=round_seed)
        results.append(result)
        broken = check_round(result)
        if log is not None:
            took = time.monotonic() - started
            status = "ok" if not broken else "BROKEN"
            parts = " ".join(f"{k} {v:.1f}" for k, v in result.timings.items())
            log(
                f"round {index:3d} {fault.name:<17} {status:<6} {took:5.1f} s ({parts})"
                f"  {fault.when!r}"
            )
        if broken:
            message = "\n".join(broken)
            if log is not None:
                log(format_table(results))
                log(message)
            raise ChaosInvariantError(message)
    if log is not None:
        log(format_table(results))
    return results


# ------------------------------------------------------------------ processes and tasks


def _child_pids() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def _describe_process(pid: int) -> str:
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            return (
                f"pid {pid} ({process.status()}): {' '.join(process.cmdline()) or process.name()}"
            )
    except psutil.Error as exc:
        return f"pid {pid} ({type(exc).__name__})"


def _live_tasks() -> set[trio.lowlevel.Task]:
    """Every task of this trio run, walking the task tree from the root."""
    tasks: set[trio.lowlevel.Task] = set()
    stack = [trio.lowlevel.current_root_task()]
    while stack:
        task = stack.pop()
        if task is None or task in tasks:
            continue
        tasks.add(task)
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return tasks


# ------------------------------------------------------------------ command line


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m legato.testing.chaos``: run rounds, print the table; exit 1 if any broke."""
    parser = argparse.ArgumentParser(
        prog="python -m legato.testing.chaos",
        description="Inject faults into legato engines and check they fail loudly and completely.",
    )
    parser.add_argument("--rounds", type=int, default=len(ALL_FAULTS), help="rounds in all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--faults",
        default=None,
        help=f"comma-separated, cycled through (default: all of {', '.join(ALL_FAULTS)}; "
        "with --executor inproc, all but the signals)",
    )
    parser.add_argument("--model", default="toy", help="model directory (default: the toy model)")
    parser.add_argument("--executor", choices=["process", "inproc"], default="process")
    parser.add_argument("--streams", type=int, default=ChaosConfig.num_streams)
    parser.add_argument("--max-tokens", type=int, default=ChaosConfig.max_tokens[1])
    parser.add_argument("--stream-deadline", type=float, default=ChaosConfig.stream_deadline)
    parser.add_argument("-v", "--verbose", action="store_true", help="show the engine's logs")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.CRITICAL)
    if args.faults is None:
        faults = [f for f in ALL_FAULTS if args.executor == "process" or f not in PROCESS_FAULTS]
    else:
        faults = [name.strip() for name in args.faults.split(",") if name.strip()]
    config = ChaosConfig(
        model=args.model,
        executor=args.executor,
        num_streams=args.streams,
        max_tokens=(1, args.max_tokens),
        stream_deadline=args.stream_deadline,
    )
    print(
        f"chaos: {args.rounds} rounds, seed {args.seed}, faults {', '.join(faults)}, "
        f"{config.num_streams} streams a round, executor {config.executor}"
    )
    try:
        trio.run(
            lambda: run_chaos(
                args.rounds,
                seed=args.seed,
                faults=faults,
                config=config,
                log=lambda line: print(line, flush=True),
            )
        )
    except ChaosInvariantError:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
