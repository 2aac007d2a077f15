"""The model worker: owns the model runner and answers the engine's frames.

``Worker.handle`` is the one dispatcher; both executors call it (the process
executor through this module's ``serve`` loop in a child process, the
in-process executor in a thread):

    SchedulerOutput     -> ModelRunnerOutput           (a runner error is fatal)
    SchedulerOutput(grammar_bitmask_follows)
                        -> no answer: the forward runs, sampling waits for
    GrammarBitmask      -> that step's ModelRunnerOutput
    HealthPing          -> HealthPong
    UtilityCall         -> UtilityResult               (public runner methods only)

A step sent with ``grammar_bitmask_follows`` is answered by the next step
frame, its GrammarBitmask (the engine computes the rows while the forward
runs); pings and utility calls in between are answered as usual. Any other
step frame before it is fatal (``UnexpectedFrame``). A worker that never gets
the bitmask just holds the step: it exits at the end of stdin as always.

Run as ``python -m legato.workers.worker`` it speaks length-prefixed msgpack frames
(``legato.protocol.wire``) on stdin / stdout. Every frame's header carries an
id: the engine numbers its frames from 1, and each answer carries the id of
the frame it answers, so the engine routes answers by id (a caller that
stopped waiting never reads its answer, and nothing else shifts). Frames are
answered one at a time, in order:

    WorkerInit          -> WorkerReady | WorkerError(fatal)   (first frame only)
    any other frame     -> Worker.handle's answer (if any) | WorkerError(fatal)
    end of stdin        -> exit 0

The real stdout is kept for frames; anything printed goes to stderr. A fatal
error is reported as a frame (with the id of the frame that caused it) and
the process exits non-zero, so the parent sees both the message and the
exit. Nothing is ever unpickled.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, BinaryIO, Self

from ..protocol import messages as m
from ..protocol import wire
from ..protocol.errors import ValidationError
from ..protocol.runner import Runner
from ..serving_gc import tune_gc_for_serving
from .step_timeline import StepTimeline
from .weight_transfer import DiskWeightTransfer


class UnexpectedFrame(Exception):
    """A frame of a type the worker does not serve: the engine and worker disagree."""


def read_frame(
    stream: BinaryIO, on_header: Callable[[], None] | None = None
) -> tuple[int, object] | None:
    """One frame's id and decoded message, or None at a clean end of stream. Blocks.
    ``on_header`` runs once the header has arrived (the step timeline's mark)."""
    header = stream.read(wire.HEADER_SIZE)
    if not header:
        return None
    if on_header is not None:
        on_header()
    if len(header) < wire.HEADER_SIZE:
        raise wire.WireError("truncated frame header")
    size, frame_id = wire.read_frame_header(header)
    payload = stream.read(size)
    if len(payload) < size:
        raise wire.WireError("truncated frame")
    return frame_id, wire.decode(payload)


def write_frame(stream: BinaryIO, frame_id: int, message: object) -> None:
    """Write one answer. A step's answer that cannot be encoded (too many logprobs for
    one frame, say) is replaced by one that fails the step's requests: they fail, not
    the worker."""
    try:
        data = wire.frame(message, frame_id)
    except wire.WireError as exc:
        if not isinstance(message, m.ModelRunnerOutput):
            raise
        print(f"legato worker: step {message.step_id}'s answer: {exc}", file=sys.stderr)
        reason = "this request's output could not be sent from the model worker"
        ids = message.req_ids
        failed = m.ModelRunnerOutput(
            message.step_id, ids, [0] * len(ids), [], failed=dict.fromkeys(ids, reason)
        )
        data = wire.frame(failed, frame_id)
    stream.write(data)
    stream.flush()


class _FaultPlan:
    """Chaos hooks chosen by the parent at start (see ``legato.testing.chaos``)."""

    def __init__(self, spec: dict[str, Any] | None) -> None:
        spec = spec or {}
        self.fail_load = bool(spec.get("fail_load", False))
        self.stall_load = float(spec.get("stall_load", 0.0))  # seconds loading takes longer
        raise_on_step = spec.get("raise_on_step")
        self.raise_on_step = int(raise_on_step) if raise_on_step is not None else None
        short_reply_on_step = spec.get("short_reply_on_step")
        self.short_reply_on_step = (
            int(short_reply_on_step) if short_reply_on_step is not None else None
        )
        # a utility method that raises on this worker (a tensor-parallel rank's failure)
        self.fail_utility: str | None = spec.get("fail_utility")
        self.steps = 0

    def before_step(self) -> None:
        self.steps += 1
        if self.raise_on_step is not None and self.steps >= self.raise_on_step:
            raise RuntimeError(f"injected fault: model runner raised on step {self.steps}")

    def after_step(self, output: m.ModelRunnerOutput) -> m.ModelRunnerOutput:
        """From step ``short_reply_on_step`` on, the answer leaves out its last request."""
        if self.short_reply_on_step is not None and self.steps >= self.short_reply_on_step:
            if output.req_ids:
                dropped = output.num_sampled[-1]
                output.req_ids = output.req_ids[:-1]
                output.num_sampled = output.num_sampled[:-1]
                kept = len(output.sampled_token_ids) - dropped
                output.sampled_token_ids = output.sampled_token_ids[:kept]
        return output


def _build_runner(init: m.WorkerInit, faults: _FaultPlan, parallel: Any) -> Runner:
    from ..config import EngineConfig
    from .runner_registry import build_runner

    if faults.fail_load:
        raise RuntimeError("injected fault: weight loading failed")
    if faults.stall_load:
        time.sleep(faults.stall_load)  # a load that takes this long (start-up timeouts)
    return build_runner(EngineConfig(**init.config), parallel)


class _Profiler:
    """torch.profiler around the steps between ``start_profile`` and ``stop_profile``."""

    def __init__(self) -> None:
        self._profile: Any = None
        self._trace_dir = ""

    def start_profile(self, trace_dir: str) -> None:
        import torch

        if self._profile is not None:
            raise RuntimeError("a profile is already running")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        os.makedirs(trace_dir, exist_ok=True)
        self._trace_dir = trace_dir
        self._profile = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profile.__enter__()

    def stop_profile(self) -> str:
        """Stop and write a Chrome trace; returns its path."""
        if self._profile is None:
            raise RuntimeError("no profile is running")
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        path = os.path.join(self._trace_dir, f"legato-worker-{os.getpid()}-{time.time_ns()}.json")
        profile.export_chrome_trace(path)
        return path


class Worker:
    """The model runner and what serves it: the chaos faults, the profiler, the dispatcher.

    ``Worker.start(init)`` builds the runner (blocks while the weights load;
    raises what loading raised). ``handle`` answers one frame; it raises only
    for a fatal error (the runner failed a step, or ``UnexpectedFrame``),
    after which the worker must not be used again.
    """

    def __init__(self, runner: Runner, faults: _FaultPlan) -> None:
        self.runner = runner
        self._faults = faults
        self._profiler = _Profiler()
        self._weights = DiskWeightTransfer(runner)
        # A step whose forward ran and whose GrammarBitmask has not come yet.
        self._awaiting_bitmask: tuple[int, Any] | None = None

    @classmethod
    def start(cls, init: m.WorkerInit, parallel: Any = None) -> Self:
        """``parallel``: this process's ``legato.models.tensor_parallel.TensorParallel``
        when it is one rank of a tensor-parallel group."""
        faults = _FaultPlan(init.inject_fault)
        return cls(_build_runner(init, faults, parallel), faults)

    def get_model(self) -> Any:
        """The model (a ``torch.nn.Module``), as vLLM's worker gives it to
        ``collective_rpc`` callables and ``apply_model`` (None for a runner without one,
        the null-model runner)."""
        return getattr(self.runner, "model", None)

    @property
    def model_runner(self) -> Runner:
        """vLLM's name for the runner."""
        return self.runner

    def ready(self) -> m.WorkerReady:
        runner = self.runner
        return m.WorkerReady(
            pid=os.getpid(),
            num_kv_blocks=int(runner.num_kv_blocks),
            max_model_len=int(runner.max_model_len),
            vocab_size=int(runner.vocab_size),
            eos_token_ids=[int(t) for t in runner.eos_token_ids],
            dtype=str(runner.dtype).removeprefix("torch."),
            device=str(runner.device),
            kv_sliding_window=runner.kv_sliding_window,
        )

    def handle(self, message: object) -> object | None:
        """The answer to one frame; None for a step whose GrammarBitmask follows (see the
        module docstring). Raises only for fatal errors (see the class docstring)."""
        if isinstance(message, m.SchedulerOutput | m.GrammarBitmask):
            return self._step(message)
        if isinstance(message, m.HealthPing):
            return m.HealthPong(message.seq, message.sent_time)
        if isinstance(message, m.UtilityCall):
            return self.call_utility(message)
        raise UnexpectedFrame(f"unexpected frame {type(message).__name__}")

    def _step(self, message: m.SchedulerOutput | m.GrammarBitmask) -> m.ModelRunnerOutput | None:
        """Run a step whole, or its forward now and its sampling when its bitmask comes."""
        pending = self._awaiting_bitmask
        if isinstance(message, m.GrammarBitmask):
            if pending is None or pending[0] != message.step_id:
                waiting = "no step" if pending is None else f"step {pending[0]}"
                raise UnexpectedFrame(
                    f"GrammarBitmask for step {message.step_id} while {waiting} waits for one"
                )
            self._awaiting_bitmask = None
            return self._faults.after_step(self.runner.sample_tokens(pending[1], message.rows))
        if pending is not None:
            raise UnexpectedFrame(
                f"step {message.step_id} arrived before step {pending[0]}'s GrammarBitmask"
            )
        self._faults.before_step()
        if message.grammar_bitmask_follows:
            self._awaiting_bitmask = (message.step_id, self.runner.execute_model(message))
            return None
        return self._faults.after_step(self.runner.execute(message))

    def call_utility(self, call: m.UtilityCall) -> m.UtilityResult:
        """Run ``runner.<method>(*args, **kwargs)``; public methods only.

        ``start_profile`` / ``stop_profile`` are the worker's own (torch
        profiler), as are vLLM's weight-update calls (``init_weight_transfer_engine``,
        ``start_weight_update``, ``update_weights``, ``finish_weight_update``: see
        :mod:`legato.workers.weight_transfer`). A method that raises, or returns something that is not
        plain msgpack data, answers with the error; the worker stays healthy.
        """
        target: Any = self.runner
        if call.method in ("start_profile", "stop_profile"):
            target = self._profiler
        elif call.method in DiskWeightTransfer.METHODS:
            target = self._weights
        if call.method.startswith("_") or not callable(getattr(target, call.method, None)):
            return m.UtilityResult(call.call_id, error=f"unknown worker method {call.method!r}")
        try:
            if call.method == self._faults.fail_utility:
                raise RuntimeError(f"injected fault: {call.method} failed on this worker")
            answer = m.UtilityResult(
                call.call_id, result=getattr(target, call.method)(*call.args, **call.kwargs)
            )
            wire.encode(answer)  # the result must be plain msgpack data
        except ValidationError as exc:  # the field crosses the boundary as a field, not text
            return m.UtilityResult(
                call.call_id,
                error=f"{type(exc).__name__}: {exc}",
                error_field=exc.field,
                error_reason=exc.reason,
            )
        except Exception as exc:
            return m.UtilityResult(call.call_id, error=f"{type(exc).__name__}: {exc}")
        return answer


def serve(
    inp: BinaryIO, out: BinaryIO, start: Callable[[m.WorkerInit], Worker] = Worker.start
) -> int:
    """Serve frames until ``inp`` ends. Returns the process exit code.

    ``start`` builds the Worker from the WorkerInit frame (a tensor-parallel
    rank joins its group there first).
    """
    frame = read_frame(inp)
    frame_id, first = frame if frame is not None else (0, None)
    if not isinstance(first, m.WorkerInit):
        error = m.WorkerError("first frame must be WorkerInit", "WireError", fatal=True)
        write_frame(out, frame_id, error)
        return 2
    try:
        worker = start(first)
    except Exception as exc:
        traceback.print_exc()
        write_frame(out, frame_id, m.WorkerError(str(exc), type(exc).__name__, fatal=True))
        return 1
    tune_gc_for_serving()  # the model and its runner are built: what steps allocate is young
    write_frame(out, frame_id, worker.ready())
    timeline = StepTimeline.from_env()
    while True:
        frame = read_frame(inp, timeline.read if timeline else None)
        if frame is None:
            return 0
        frame_id, message = frame
        if timeline:
            timeline.decoded()
        try:
            answer = worker.handle(message)
        except UnexpectedFrame as exc:
            write_frame(out, frame_id, m.WorkerError(str(exc), "WireError", fatal=True))
            return 2
        except Exception as exc:
            traceback.print_exc()
            write_frame(out, frame_id, m.WorkerError(str(exc), type(exc).__name__, fatal=True))
            return 1
        if timeline:
            timeline.computed()
        if answer is not None:
            write_frame(out, frame_id, answer)
        if timeline:
            timeline.done(message)


def main() -> None:
    inp = sys.stdin.buffer
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not corrupt frames
    threads = os.environ.get("LEGATO_WORKER_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    try:
        code = serve(inp, out)
    except wire.WireError as exc:
        print(f"legato worker: bad frame from the engine: {exc}", file=sys.stderr)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
