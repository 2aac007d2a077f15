"""The model worker: a child process that owns the ModelRunner.

Run as ``python -m legato.worker``. It speaks length-prefixed msgpack frames
(``legato.protocol.wire``) on stdin / stdout, strictly one answer per frame, in
order:

    WorkerInit          -> WorkerReady | WorkerError(fatal)   (first frame only)
    SchedulerOutput     -> ModelRunnerOutput | WorkerError(fatal)
    HealthPing          -> HealthPong
    UtilityCall         -> UtilityResult
    end of stdin        -> exit 0

The real stdout is kept for frames; anything printed goes to stderr. A fatal
error is reported as a frame and the process exits non-zero, so the parent
sees both the message and the exit. Nothing is ever unpickled.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any, BinaryIO

from .protocol import messages as m
from .protocol import wire


def read_frame(stream: BinaryIO) -> object | None:
    """One decoded frame, or None at a clean end of stream. Blocks."""
    header = stream.read(wire.HEADER_SIZE)
    if not header:
        return None
    if len(header) < wire.HEADER_SIZE:
        raise wire.WireError("truncated frame header")
    size = wire.read_frame_length(header)
    payload = stream.read(size)
    if len(payload) < size:
        raise wire.WireError("truncated frame")
    return wire.decode(payload)


def write_frame(stream: BinaryIO, message: object) -> None:
    payload = wire.encode(message)
    stream.write(wire.frame_header(len(payload)) + payload)
    stream.flush()


class _FaultPlan:
    """Chaos hooks chosen by the parent at start (see ``legato.testing.chaos``)."""

    def __init__(self, spec: dict[str, Any] | None) -> None:
        spec = spec or {}
        self.fail_load = bool(spec.get("fail_load", False))
        raise_on_step = spec.get("raise_on_step")
        self.raise_on_step = int(raise_on_step) if raise_on_step is not None else None
        self.steps = 0

    def before_step(self) -> None:
        self.steps += 1
        if self.raise_on_step is not None and self.steps >= self.raise_on_step:
            raise RuntimeError(f"injected fault: model runner raised on step {self.steps}")


def _build_runner(init: m.WorkerInit, faults: _FaultPlan) -> Any:
    from .config import EngineConfig

    if faults.fail_load:
        raise RuntimeError("injected fault: weight loading failed")
    config = EngineConfig(**init.config)
    if config.runner == "null":
        from .testing.null_model import NullModelRunner

        return NullModelRunner(config)
    from .models.runner import ModelRunner

    return ModelRunner(config)


def _ready(runner: Any) -> m.WorkerReady:
    return m.WorkerReady(
        pid=os.getpid(),
        num_kv_blocks=int(runner.num_kv_blocks),
        max_model_len=int(runner.max_model_len),
        vocab_size=int(runner.vocab_size),
        eos_token_ids=[int(t) for t in runner.eos_token_ids],
        dtype=str(runner.dtype).removeprefix("torch."),
        device=str(runner.device),
    )


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


_PROFILER = _Profiler()


def call_utility(runner: Any, call: m.UtilityCall) -> m.UtilityResult:
    """Run ``runner.<method>(*args, **kwargs)``; public methods only.

    ``start_profile`` / ``stop_profile`` are the worker's own (torch profiler).
    """
    if call.method in ("start_profile", "stop_profile"):
        runner = _PROFILER
    if call.method.startswith("_") or not callable(getattr(runner, call.method, None)):
        return m.UtilityResult(call.call_id, error=f"unknown worker method {call.method!r}")
    try:
        answer = m.UtilityResult(
            call.call_id, result=getattr(runner, call.method)(*call.args, **call.kwargs)
        )
        wire.encode(answer)  # the result must be plain msgpack data
    except Exception as exc:
        return m.UtilityResult(call.call_id, error=f"{type(exc).__name__}: {exc}")
    return answer


def serve(inp: BinaryIO, out: BinaryIO) -> int:
    """Serve frames until stdin closes. Returns the process exit code."""
    first = read_frame(inp)
    if not isinstance(first, m.WorkerInit):
        write_frame(out, m.WorkerError("first frame must be WorkerInit", "WireError", fatal=True))
        return 2
    faults = _FaultPlan(first.inject_fault)
    try:
        runner = _build_runner(first, faults)
    except Exception as exc:
        traceback.print_exc()
        write_frame(out, m.WorkerError(str(exc), type(exc).__name__, fatal=True))
        return 1
    write_frame(out, _ready(runner))
    while True:
        message = read_frame(inp)
        if message is None:
            return 0
        if isinstance(message, m.SchedulerOutput):
            try:
                faults.before_step()
                write_frame(out, runner.execute(message))
            except Exception as exc:
                traceback.print_exc()
                write_frame(out, m.WorkerError(str(exc), type(exc).__name__, fatal=True))
                return 1
        elif isinstance(message, m.HealthPing):
            write_frame(out, m.HealthPong(message.seq, message.sent_time))
        elif isinstance(message, m.UtilityCall):
            write_frame(out, call_utility(runner, message))
        else:
            error = f"unexpected frame {type(message).__name__}"
            write_frame(out, m.WorkerError(error, "WireError", fatal=True))
            return 2


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
