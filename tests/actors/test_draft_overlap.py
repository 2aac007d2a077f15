"""The engine core measures what a drafted step gives up under async scheduling (the
worker's wait while the loop applies it and plans the next, with no step planned ahead)
and hands it to the draft policy (``StepCost.observe_overlap``); without async scheduling
every step waits alike, and nothing is measured. The toy model with n-gram drafts, the
engine core's real loop and an in-process executor."""

from __future__ import annotations

import math
import time
from pathlib import Path

import trio

from legato.actors.engine_core import EngineCore
from legato.actors.inproc_executor import InprocExecutor
from legato.config import EngineConfig, SpeculativeConfig
from legato.protocol import messages as m
from legato.protocol.params import SamplingParams
from legato.scheduling.core_steps import AddRequests
from legato.scheduling.scheduler import Scheduler

# Repeating prompts: the n-gram proposer finds their continuations, so steps hold drafts.
PROMPTS = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [12, 13] * 6, [14, 15, 16, 17, 18] * 3]


async def _gaps(model: Path, async_scheduling: bool) -> tuple[list[float], float]:
    """Run the prompts to 24 tokens each: the overlap waits measured, and the drafts
    verified (a decayed count: 0 if none)."""
    spec = SpeculativeConfig.of(
        {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        }
    )
    args = dict(model=str(model), executor="inproc", max_model_len=128, num_kv_blocks=64)
    executor = InprocExecutor(EngineConfig(**args, block_size=4, speculative_config=spec))
    async with trio.open_nursery() as nursery:
        ready: m.WorkerReady = await nursery.start(executor.run)
        cfg = EngineConfig(**args, block_size=4, speculative_config=spec).resolved(
            max_model_len=128, num_kv_blocks=ready.num_kv_blocks
        )
        scheduler = Scheduler(cfg)
        send, recv = trio.open_memory_channel[m.EngineCoreOutputs](math.inf)
        core = EngineCore(scheduler, executor, send, async_scheduling=async_scheduling)
        nursery.start_soon(core.run)
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        core.submit(
            AddRequests(
                [
                    m.EngineRequest(f"r{i}", p, params, time.monotonic())
                    for i, p in enumerate(PROMPTS)
                ]
            )
        )
        finished = 0
        with trio.fail_after(60):
            while finished < len(PROMPTS):
                outputs = await recv.receive()
                finished += sum(o.finish_reason is not None for o in outputs.outputs)
            await core.wait_idle()
        nursery.cancel_scope.cancel()
    assert scheduler.step_cost is not None
    return list(scheduler.step_cost.gaps), scheduler.step_cost.drafted


async def test_a_drafted_step_under_async_scheduling_measures_the_overlap_it_gives_up(
    toy_model_dir: Path,
) -> None:
    gaps, drafts = await _gaps(toy_model_dir, async_scheduling=True)
    assert drafts > 0  # steps verified drafts, planned with no step ahead
    assert gaps and all(0 <= g < 5.0 for g in gaps)
    overlap_free, drafts = await _gaps(toy_model_dir, async_scheduling=False)
    assert drafts > 0 and overlap_free == []
