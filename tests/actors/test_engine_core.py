"""The engine core on its own: the step (plan -> execute -> apply) and the actor loop,
with and without overlap (async scheduling), on the toy model in this process."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import trio

from legato.actors.engine_core import EngineCore
from legato.actors.inproc_executor import InprocExecutor
from legato.config import EngineConfig
from legato.metrics.records import StepStats
from legato.protocol import messages as m
from legato.protocol.params import SamplingParams
from legato.scheduling.core_steps import AbortRequests, AddRequests, CoreSteps, FinishRequests
from legato.scheduling.scheduler import Scheduler

PROMPTS = [[5, 17, 42, 7], [9, 9, 31], [101, 3, 58, 22, 14, 6], [77], [12, 40, 40, 2, 8]]


def config(model: Path, **kw: Any) -> EngineConfig:
    args: dict[str, Any] = dict(
        model=str(model), executor="inproc", max_model_len=64, num_kv_blocks=64, block_size=4
    )
    args.update(kw)
    return EngineConfig(**args)


def request(i: int, **params: Any) -> m.EngineRequest:
    params.setdefault("temperature", 0.0)
    return m.EngineRequest(f"r{i}", PROMPTS[i], SamplingParams(**params), time.monotonic())


class Finished:
    """What the loop produced for each request: tokens, finish reason, stop reason."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.ends: dict[str, tuple[m.FinishReason, int | str | None]] = {}

    def take(self, outputs: m.EngineCoreOutputs) -> None:
        for out in outputs.outputs:
            assert out.request_id not in self.ends, f"output after the end of {out.request_id}"
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                self.ends[out.request_id] = (out.finish_reason, out.stop_reason)


async def run_core(
    model: Path,
    requests: list[m.EngineRequest],
    *,
    async_scheduling: bool,
    abort_after: dict[str, int] | None = None,
    max_num_seqs: int = 8,
) -> tuple[Finished, int]:
    """Run ``requests`` through an EngineCore until each ends; abort ``abort_after[id]``
    once it has that many tokens. Returns what came out and the most steps in flight."""
    executor = InprocExecutor(config(model, max_num_seqs=max_num_seqs))
    result = Finished()
    most_in_flight = 0
    async with trio.open_nursery() as nursery:
        ready: m.WorkerReady = await nursery.start(executor.run)
        cfg = config(model, max_num_seqs=max_num_seqs).resolved(
            max_model_len=64, num_kv_blocks=ready.num_kv_blocks
        )
        send, recv = trio.open_memory_channel[m.EngineCoreOutputs](math.inf)
        core = EngineCore(Scheduler(cfg), executor, send, async_scheduling=async_scheduling)
        submit_step = executor.submit_step

        def counting_submit(step: m.SchedulerOutput) -> Any:
            nonlocal most_in_flight
            answer = submit_step(step)
            most_in_flight = max(most_in_flight, core.num_steps_in_flight + 1)
            return answer

        executor.submit_step = counting_submit  # type: ignore[method-assign]
        nursery.start_soon(core.run)
        core.submit(AddRequests(requests))
        pending_aborts = dict(abort_after or {})
        with trio.fail_after(60):
            while len(result.ends) < len(requests):
                result.take(await recv.receive())
                for rid, count in list(pending_aborts.items()):
                    if len(result.tokens.get(rid, [])) >= count:
                        del pending_aborts[rid]
                        core.submit(AbortRequests([rid]))
            await core.wait_idle()
        assert core.scheduler.kv.num_used_blocks == 0
        nursery.cancel_scope.cancel()
    return result, most_in_flight


def stop_params(reference: Finished) -> list[m.EngineRequest]:
    """Requests whose stops fire part-way through the reference run's greedy tokens."""
    reqs = []
    for i in range(len(PROMPTS)):
        tokens = reference.tokens[f"r{i}"]
        if i % 3 == 0:
            reqs.append(request(i, max_tokens=5 + i, ignore_eos=True))
        elif i % 3 == 1:
            stop = tokens[4]
            reqs.append(request(i, max_tokens=20, stop_token_ids=[stop], ignore_eos=True))
        else:  # a stop token that min_tokens does not hold back
            stop = next(t for t in tokens[2:] if t not in tokens[:2])
            reqs.append(
                request(i, max_tokens=20, stop_token_ids=[stop], min_tokens=2, ignore_eos=True)
            )
    return reqs


async def test_overlap_changes_no_output(toy_model_dir: Path) -> None:
    """Greedy tokens, stop tokens, min_tokens, max_tokens and aborts come out the same
    with the overlap on and off; the overlap does put two steps in flight."""
    plain = [request(i, max_tokens=20, ignore_eos=True) for i in range(len(PROMPTS))]
    reference, depth = await run_core(toy_model_dir, plain, async_scheduling=False)
    assert depth == 1
    reqs = stop_params(reference)
    aborts = {"r0": 3, "r4": 1}
    runs = {}
    for overlap in (False, True):
        runs[overlap], depth = await run_core(
            toy_model_dir, reqs, async_scheduling=overlap, abort_after=aborts
        )
        assert depth == (2 if overlap else 1)
    off, on = runs[False], runs[True]
    for i in range(len(PROMPTS)):
        rid = f"r{i}"
        assert reference.tokens[rid][: len(off.tokens[rid])] == off.tokens[rid]
        if rid in aborts:
            # An abort lands after a number of steps that depends on timing: the
            # tokens before it are the same, and the end is an abort on both paths.
            assert off.ends[rid] == on.ends[rid] == (m.FinishReason.ABORT, None)
            shorter = min(len(off.tokens[rid]), len(on.tokens[rid]))
            assert off.tokens[rid][:shorter] == on.tokens[rid][:shorter]
            assert shorter >= aborts[rid]
        else:
            assert on.tokens[rid] == off.tokens[rid]
            assert on.ends[rid] == off.ends[rid]
    # The stops did fire part-way (so the comparison covers them).
    assert off.ends["r1"] == (m.FinishReason.STOP, reference.tokens["r1"][4])
    assert len(off.tokens["r2"]) > 2 and off.ends["r2"][0] is m.FinishReason.STOP
    assert off.ends["r3"] == (m.FinishReason.LENGTH, None) and len(off.tokens["r3"]) == 8


async def test_overlap_with_preemption_changes_no_greedy_output(toy_model_dir: Path) -> None:
    """Too few KV blocks for everyone: requests are preempted and recomputed while a
    step is in flight; greedy tokens still match the plain path's."""
    reqs = [request(i, max_tokens=24, ignore_eos=True) for i in range(len(PROMPTS))]
    # 17 usable blocks of 4 tokens: the five requests (up to 8 blocks each) cannot all fit.
    off = await run_with_blocks(toy_model_dir, reqs, False, 18)
    on = await run_with_blocks(toy_model_dir, reqs, True, 18)
    assert on == off


async def run_with_blocks(
    model: Path, reqs: list[m.EngineRequest], overlap: bool, blocks: int
) -> dict[str, list[int]]:
    executor = InprocExecutor(config(model, num_kv_blocks=blocks))
    result = Finished()
    preempted = 0
    async with trio.open_nursery() as nursery:
        await nursery.start(executor.run)
        cfg = config(model, num_kv_blocks=blocks).resolved(max_model_len=64, num_kv_blocks=blocks)
        send, recv = trio.open_memory_channel[m.EngineCoreOutputs](math.inf)

        def record(stats: StepStats) -> None:
            nonlocal preempted
            if stats.scheduler is not None:
                preempted += stats.scheduler.num_preempted

        core = EngineCore(Scheduler(cfg), executor, send, record, async_scheduling=overlap)
        nursery.start_soon(core.run)
        core.submit(AddRequests(reqs))
        with trio.fail_after(60):
            while len(result.ends) < len(reqs):
                result.take(await recv.receive())
        nursery.cancel_scope.cancel()
    assert preempted > 0
    assert all(end == (m.FinishReason.LENGTH, None) for end in result.ends.values())
    return result.tokens


async def test_finish_requests_frees_blocks_and_keeps_the_reason(toy_model_dir: Path) -> None:
    """FinishRequests (a stop string, a user's abort) frees the request at once and
    produces no output; the loop goes idle."""
    executor = InprocExecutor(config(toy_model_dir))
    async with trio.open_nursery() as nursery:
        ready: m.WorkerReady = await nursery.start(executor.run)
        cfg = config(toy_model_dir).resolved(max_model_len=64, num_kv_blocks=ready.num_kv_blocks)
        send, recv = trio.open_memory_channel[m.EngineCoreOutputs](math.inf)
        scheduler = Scheduler(cfg)
        core = EngineCore(scheduler, executor, send, async_scheduling=True)
        nursery.start_soon(core.run)
        core.submit(AddRequests([request(0, max_tokens=60, ignore_eos=True)]))
        first = await recv.receive()
        assert first.outputs[0].request_id == "r0"
        live = scheduler.requests["r0"]
        core.submit(FinishRequests(["r0"], m.FinishReason.ABORT))
        with trio.fail_after(10):
            await core.wait_idle()
        assert live.finish_reason is m.FinishReason.ABORT
        assert scheduler.kv.num_used_blocks == 0
        nursery.cancel_scope.cancel()


def test_core_steps_plan_execute_apply_with_a_runner_in_this_thread(toy_model_dir: Path) -> None:
    """The synchronous step LLMEngine drives: queue times reach the stats once, an
    abort ends a request with one ABORT output, nothing to plan gives None."""
    from legato.models.runner import ModelRunner

    cfg = config(toy_model_dir)
    runner = ModelRunner(cfg)
    cfg = cfg.resolved(max_model_len=64, num_kv_blocks=runner.num_kv_blocks)
    stats: list[StepStats] = []
    steps = CoreSteps(Scheduler(cfg), stats.append)
    assert steps.plan() is None
    steps.add_requests([request(0, max_tokens=4, ignore_eos=True), request(1, max_tokens=9)])
    outputs = Finished()
    planned = steps.plan()
    assert planned is not None and len(planned.queue_times) == 2
    outputs.take(steps.apply(planned, runner.execute(planned.plan)))
    aborted = steps.abort(["r1", "unknown"])
    assert [(o.request_id, o.finish_reason) for o in aborted] == [("r1", m.FinishReason.ABORT)]
    outputs.take(m.EngineCoreOutputs(aborted, 0.0))
    while (planned := steps.plan()) is not None:
        assert planned.queue_times == []
        outputs.take(steps.apply(planned, runner.execute(planned.plan)))
    assert outputs.ends == {"r0": (m.FinishReason.LENGTH, None), "r1": (m.FinishReason.ABORT, None)}
    assert len(outputs.tokens["r0"]) == 4 and len(outputs.tokens["r1"]) == 1
    assert sum(len(s.queue_time) for s in stats) == 2
    assert not steps.scheduler.has_unfinished_requests()


async def test_a_step_that_cannot_be_encoded_fails_its_requests_not_the_engine(
    toy_model_dir: Path,
) -> None:
    """The process executor encodes each step; one that cannot be (here an id past 64
    bits, an injected fault: validation keeps callers from it) fails the requests in it,
    and the engine core serves the next request."""
    from legato.protocol import wire

    executor = InprocExecutor(config(toy_model_dir))
    result = Finished()
    async with trio.open_nursery() as nursery:
        ready: m.WorkerReady = await nursery.start(executor.run)
        cfg = config(toy_model_dir).resolved(max_model_len=64, num_kv_blocks=ready.num_kv_blocks)
        send, recv = trio.open_memory_channel[m.EngineCoreOutputs](math.inf)
        core = EngineCore(Scheduler(cfg), executor, send, async_scheduling=True)
        submit_step = executor.submit_step

        def encoding_submit(step: m.SchedulerOutput) -> Any:
            wire.encode(step)  # as ProcessExecutor._frame does
            return submit_step(step)

        executor.submit_step = encoding_submit  # type: ignore[method-assign]
        nursery.start_soon(core.run)
        bad = request(0, max_tokens=4)
        bad.runner_params = m.RunnerSamplingParams(logit_bias={2**64: 1.0})
        core.submit(AddRequests([bad]))
        with trio.fail_after(60):
            while "r0" not in result.ends:
                result.take(await recv.receive())
            core.submit(AddRequests([request(1, max_tokens=3, ignore_eos=True)]))
            while "r1" not in result.ends:
                result.take(await recv.receive())
            await core.wait_idle()
        assert result.ends["r0"][0] is m.FinishReason.ERROR
        assert result.ends["r1"][0] is m.FinishReason.LENGTH and len(result.tokens["r1"]) == 3
        assert core.scheduler.kv.num_used_blocks == 0
        nursery.cancel_scope.cancel()
