"""A per-frame timeline of the worker's serve loop, for benchmarks only.

Off unless ``LEGATO_STEP_TIMELINE`` names a file (``{pid}`` in it becomes the worker's
process id, so engines side by side, as in ``benchmarks/spec_decode.py``, write one file
each); then each step frame appends one tab-separated line: step id, prefill tokens,
decode rows, draft tokens verified, the wall seconds the worker waited for the frame
(idle), spent decoding it, computing its answer and writing it, and the process CPU
seconds of the compute (CPU / wall near the thread count means both cores were busy;
near 1, one core idled). ``benchmarks/serve_timeline.py`` sums a file. Must never
import torch or the model code: it times them from outside.
"""

from __future__ import annotations

import os
import time
from typing import TextIO

from ..protocol import messages as m

ENV = "LEGATO_STEP_TIMELINE"
COLUMNS = (
    "step",
    "prefill_tokens",
    "decode_rows",
    "draft_tokens",
    "wait_s",
    "decode_s",
    "compute_s",
    "compute_cpu_s",
    "write_s",
)


def step_kind(message: object) -> tuple[int, int, int]:
    """(prefill tokens, decode rows, draft tokens) of a SchedulerOutput: a request
    scheduling one token, or one and the drafts it verifies, is a decode row (and its
    drafts); more is a prefill chunk."""
    if not isinstance(message, m.SchedulerOutput):
        return 0, 0, 0
    prefill = rows = drafts = 0
    for req_id, n in message.num_scheduled_tokens.items():
        verified = len(message.scheduled_spec_decode_tokens.get(req_id, ()))
        if n == 1 + verified:
            rows += 1
            drafts += verified
        else:
            prefill += n
    return prefill, rows, drafts


class StepTimeline:
    """Marks taken around one frame: call the marks in order, ``done`` writes the line."""

    def __init__(self, sink: TextIO) -> None:
        self._sink = sink
        self._sink.write("\t".join(COLUMNS) + "\n")
        self._last_end = time.perf_counter()
        self._marks: list[float] = []

    @classmethod
    def from_env(cls) -> StepTimeline | None:
        path = os.environ.get(ENV)
        if not path:
            return None
        path = path.replace("{pid}", str(os.getpid()))
        return cls(open(path, "w", buffering=1))  # noqa: SIM115 - lives as long as the worker

    def read(self) -> None:
        """The frame's header has arrived (the wait ends)."""
        self._marks = [time.perf_counter()]

    def decoded(self) -> None:
        self._marks.append(time.perf_counter())
        self._cpu = time.process_time()

    def computed(self) -> None:
        self._marks.append(time.perf_counter())
        self._cpu = time.process_time() - self._cpu

    def done(self, message: object) -> None:
        end = time.perf_counter()
        got, decoded, computed = self._marks
        if isinstance(message, m.SchedulerOutput | m.GrammarBitmask):
            step = getattr(message, "step_id", -1)
            prefill, rows, drafts = step_kind(message)
            fields = (
                step,
                prefill,
                rows,
                drafts,
                got - self._last_end,
                decoded - got,
                computed - decoded,
                self._cpu,
                end - computed,
            )
            self._sink.write(
                "\t".join(f"{v:.6f}" if isinstance(v, float) else str(v) for v in fields) + "\n"
            )
        self._last_end = end
