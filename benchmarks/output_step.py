"""Main-process cost of one step's outputs at steady-state decode: the other half of
``engine_core_step.py``.

N requests of the default model's tokenizer (SmolLM2's, byte-level BPE) each
decode one ordinary token per step (DELTA, n=1, no stop strings: what the
null-model benchmark streams). Timed per step, in thread CPU time
(``time.thread_time_ns``), means over the timed steps, the best of ``--repeat``
runs:

* ``process``: ``OutputProcessor.process_outputs`` on the step's
  ``EngineCoreOutputs`` (detokenize, build each RequestOutput, put it into the
  request's slot), and each slot's output taken, as a consumer would;
* ``wake``: the same with a trio task parked on every slot, each woken by its
  output and taking it (``OutputSlot.get``): the delivery a stream pays for.

The collector is off while timing (``control_plane.py --default-gc`` shows its
cost). Prints a table; sizes are arguments::

    python benchmarks/output_step.py
    python benchmarks/output_step.py --streams 256 --steps 400
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import time
from collections.abc import Iterator
from typing import Any

import trio
import trio.testing

from legato.actors.output_slot import OutputSlot
from legato.default_model import default_model_dir
from legato.outputs.output_processor import OutputProcessor
from legato.protocol.messages import EngineCoreOutput, EngineCoreOutputs
from legato.protocol.params import RequestOutputKind, SamplingParams
from legato.tokenizer_loading import load_tokenizer

_clock = time.thread_time_ns  # CPU time: what this costs the main process
PROMPT = "The quick brown fox"


class Load:
    """``streams`` requests registered with an OutputProcessor, and their steps' outputs."""

    def __init__(self, tokenizer: Any, streams: int, steps: int) -> None:
        params = SamplingParams(ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        prompt_ids = tokenizer.encode(PROMPT)
        self.processor = OutputProcessor(tokenizer)
        self.slots = [OutputSlot(params.output_kind) for _ in range(streams)]
        for i, slot in enumerate(self.slots):
            self.processor.add_request(
                f"r{i}", PROMPT, prompt_ids, params, time.monotonic(), slot=slot
            )
        token_id = tokenizer.encode(" fox")[-1]  # an ordinary whole token
        # One more step than timed: the first token of a request is not an ordinary one.
        self.steps = [
            EngineCoreOutputs(
                [EngineCoreOutput(f"r{i}", [token_id]) for i in range(streams)], time.monotonic()
            )
            for _ in range(steps + 1)
        ]


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """A full collection, then no automatic ones until the block ends."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def measure_process(tokenizer: Any, streams: int, steps: int) -> float:
    """Mean ns per step of processing the outputs and taking each slot's."""
    load = Load(tokenizer, streams, steps)
    first, *timed = load.steps
    load.processor.process_outputs(first)
    for slot in load.slots:
        slot.get_nowait()
    with collector_off():
        start = _clock()
        for outputs in timed:
            load.processor.process_outputs(outputs)
            for slot in load.slots:
                assert slot.get_nowait() is not None
        return (_clock() - start) / steps


async def measure_wake(tokenizer: Any, streams: int, steps: int) -> float:
    """Mean ns per step of processing the outputs with a task parked on every slot."""
    load = Load(tokenizer, streams, steps)
    taken = 0

    async def consume(slot: OutputSlot) -> None:
        nonlocal taken
        while True:
            await slot.get()
            taken += 1

    async with trio.open_nursery() as nursery:
        for slot in load.slots:
            nursery.start_soon(consume, slot)
        first, *timed = load.steps
        load.processor.process_outputs(first)
        await trio.testing.wait_all_tasks_blocked()
        with collector_off():
            start = _clock()
            for outputs in timed:
                load.processor.process_outputs(outputs)
                # Two checkpoints: every consumer woken by this step runs before the next.
                await trio.lowlevel.checkpoint()
                await trio.lowlevel.checkpoint()
            elapsed = _clock() - start
        nursery.cancel_scope.cancel()
    assert taken == streams * (steps + 1), taken
    return elapsed / steps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per size")
    parser.add_argument("--repeat", type=int, default=5, help="runs per size; the best is shown")
    args = parser.parse_args()
    import torch

    tokenizer = load_tokenizer(str(default_model_dir()))
    print(
        f"cpu: {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores; "
        f"thread CPU time, mean of {args.steps} steps, best of {args.repeat}, collector off"
    )
    header = f"{'streams':>8}{'process us':>12}{'us/req':>8}{'wake us':>10}{'us/req':>8}"
    print(header)
    print("-" * len(header))
    for streams in args.streams:
        process = min(measure_process(tokenizer, streams, args.steps) for _ in range(args.repeat))
        wake = min(
            trio.run(measure_wake, tokenizer, streams, args.steps) for _ in range(args.repeat)
        )
        print(
            f"{streams:>8}{process / 1000:>12.1f}{process / 1000 / streams:>8.2f}"
            f"{wake / 1000:>10.1f}{wake / 1000 / streams:>8.2f}"
        )


if __name__ == "__main__":
    main()
