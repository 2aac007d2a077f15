"""Main-process cost of one engine-core step at steady-state decode, no trio, no worker.

Drives a real ``Scheduler`` through ``CoreSteps`` (with the engine's
``EngineGrammars`` hooks and a stats sink, as ``AsyncEngine`` wires them) over
N running requests that each decode one token per step, and answers every
step with the null-model runner's ``ModelRunnerOutput`` (built outside the
timed region). With overlap (the engine's default) step N+1 is planned before
step N is applied, as the engine-core loop does. Timed per step:

* ``plan``: ``CoreSteps.plan`` (``Scheduler.schedule`` and the SchedulerOutput);
* ``apply``: ``CoreSteps.apply`` (``Scheduler.update_from_output`` and the
  EngineCoreOutputs);
* ``wire``: the executor's main-process frame work: encoding the step,
  decoding the runner's answer.

Times are CPU time of this thread (``time.thread_time_ns``), so another
process on the machine does not count; means over the timed steps (a KV block is allocated every ``block_size``
steps, so a median would hide it); of ``--repeat`` runs, the one with the
least plan + apply time is shown (the others were disturbed more by whatever
else ran). Prints a table; sizes are arguments::

    python benchmarks/engine_core_step.py
    python benchmarks/engine_core_step.py --running 256 --steps 2000 --no-overlap
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from collections import deque

from legato.config import EngineConfig
from legato.metrics.records import StepStats
from legato.null_runner import NullModelRunner
from legato.protocol import wire
from legato.protocol.messages import EngineRequest, ModelRunnerOutput
from legato.protocol.params import SamplingParams
from legato.scheduling.core_steps import CoreSteps, PlannedStep
from legato.scheduling.scheduler import Scheduler
from legato.structured.engine import EngineGrammars

_clock = time.thread_time_ns  # CPU time: what this code costs the main process


class Load:
    """``running`` requests decoding in lockstep, played by the null-model runner."""

    def __init__(self, running: int, steps: int, block_size: int, overlap: bool) -> None:
        prompt = [7, 11, 13, 17, 19]  # about "The quick brown fox"
        max_len = len(prompt) + steps + 8  # alive through every step
        config = EngineConfig(
            runner="null",
            max_model_len=max_len,
            block_size=block_size,
            num_kv_blocks=running * (-(-max_len // block_size) + 1) + 1,
            max_num_seqs=running,
            max_num_batched_tokens=max(2048, running * len(prompt)),
        )
        self.stats: list[StepStats] = []
        self.steps = CoreSteps(
            Scheduler(config), self.stats.append, EngineGrammars(None, 32000, [2])
        )
        self.runner = NullModelRunner(config)
        self.depth = 2 if overlap else 1
        self.sent: deque[tuple[PlannedStep, ModelRunnerOutput]] = deque()
        params = SamplingParams(max_tokens=max_len - len(prompt), ignore_eos=True)
        self.steps.add_requests(
            [
                EngineRequest(f"r{i}", list(prompt), params, time.monotonic(), eos_token_id=2)
                for i in range(running)
            ]
        )

    def step(self) -> tuple[int, int, int]:
        """One turn of the engine-core loop: plan (and send) a step, apply the oldest
        answer. Returns (plan ns, apply ns, wire ns)."""
        t0 = _clock()
        planned = self.steps.plan()
        t1 = _clock()
        plan_ns = t1 - t0
        wire_ns = 0
        if planned is not None:
            t0 = _clock()
            frame = wire.encode(planned.plan)
            t1 = _clock()
            wire_ns += t1 - t0
            answer = self.runner.execute(wire.decode(frame, expected=type(planned.plan)))
            answer_frame = wire.encode(answer)
            t0 = _clock()
            decoded = wire.decode(answer_frame, expected=ModelRunnerOutput)
            t1 = _clock()
            wire_ns += t1 - t0
            self.sent.append((planned, decoded))
        apply_ns = 0
        if self.sent and (planned is None or len(self.sent) >= self.depth):
            oldest, runner_out = self.sent.popleft()
            t0 = _clock()
            self.steps.apply(oldest, runner_out)
            apply_ns = _clock() - t0
        self.stats.clear()
        return plan_ns, apply_ns, wire_ns


def measure(running: int, steps: int, warmup: int, block_size: int, overlap: bool) -> list[float]:
    load = Load(running, steps + warmup, block_size, overlap)
    for _ in range(warmup):  # prefill, and past the first block boundaries
        load.step()
    totals = [0, 0, 0]
    gc.collect()
    for _ in range(steps):
        for i, ns in enumerate(load.step()):
            totals[i] += ns
    assert load.steps.scheduler.get_num_unfinished_requests() == running
    return [ns / steps / 1000 for ns in totals]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=1000, help="timed steps per size")
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3, help="runs per size; the best is shown")
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    import torch

    print(
        f"cpu: {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores; "
        f"block_size={args.block_size} overlap={args.overlap}, "
        f"thread CPU time, mean of {args.steps} steps, best of {args.repeat}"
    )
    header = (
        f"{'running':>8}{'plan us':>10}{'apply us':>10}{'plan+apply':>12}"
        f"{'us/req':>8}{'wire us':>9}{'all us/req':>12}"
    )
    print(header)
    print("-" * len(header))
    for running in args.running:
        runs = [
            measure(running, args.steps, args.warmup, args.block_size, args.overlap)
            for _ in range(args.repeat)
        ]
        plan, apply, frames = min(runs, key=lambda run: run[0] + run[1])
        core = plan + apply
        print(
            f"{running:>8}{plan:>10.1f}{apply:>10.1f}{core:>12.1f}{core / running:>8.2f}"
            f"{frames:>9.1f}{(core + frames) / running:>12.2f}"
        )


if __name__ == "__main__":
    main()
