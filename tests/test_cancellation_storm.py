"""A cancellation storm: 1,000 requests, half of them abandoned at random moments.

Callers leave in every way trio allows: cancelling their scope (before the
stream is entered, before the first output or after some tokens), a scope
deadline at a random wall-clock moment, ``aclose()``, or ``break`` out of a
bare ``async for``. Afterwards nothing is held anywhere: every KV block is
free, the scheduler and the detokenizer hold no request, and every request id
can be used again. The requests that ran to the end got exactly their tokens.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from legato import RequestOutputKind, SamplingParams
from legato.engine import AsyncEngine, open_engine

NUM_REQUESTS = 1000
ENGINE_ARGS: dict[str, Any] = dict(
    executor="inproc",
    max_num_seqs=256,
    max_model_len=256,
    num_kv_blocks=512,  # tight enough that some requests wait or are preempted
    disable_log_stats=True,
)
LEAVE_HOW = ["scope", "deadline", "aclose", "pre-cancelled", "break"]


@dataclass
class Plan:
    request_id: str
    prompt: str
    params: SamplingParams
    leave: str | None  # None: reads to the end; else one of LEAVE_HOW
    after_tokens: int  # leave once this many tokens arrived (0: before the first output)
    after_seconds: float  # for "deadline"


def make_plans(rng: random.Random) -> list[Plan]:
    leaving = set(rng.sample(range(NUM_REQUESTS), NUM_REQUESTS // 2))
    plans = []
    for i in range(NUM_REQUESTS):
        max_tokens = rng.randint(1, 20)
        params = SamplingParams(
            n=2 if rng.random() < 0.1 else 1,
            max_tokens=max_tokens,
            temperature=rng.choice([0.0, 0.8]),
            seed=i,
            ignore_eos=True,
            output_kind=rng.choice(list(RequestOutputKind)),
        )
        prompt = " ".join(rng.choice(["storm", "cancel", "token", "block", "id"]) for _ in range(2))
        leave = rng.choices(LEAVE_HOW, weights=[4, 2, 3, 1, 1])[0] if i in leaving else None
        if leave in ("aclose", "break") and params.output_kind == RequestOutputKind.FINAL_ONLY:
            leave = "scope"  # no output arrives before the end to leave on
        plans.append(
            Plan(
                f"storm-{i}",
                f"{i}: {prompt}",
                params,
                leave,
                rng.randint(0, max_tokens - 1),
                rng.uniform(0.0, 3.0),
            )
        )
    return plans


async def consume(engine: AsyncEngine, plan: Plan, outcomes: dict[str, str]) -> None:
    """Read ``plan``'s stream, leave as planned; record "done", "left" or a problem."""
    tokens: Counter[int] = Counter()
    finished = None

    def count(output: Any) -> int:
        for c in output.outputs:
            if plan.params.output_kind == RequestOutputKind.DELTA:
                tokens[c.index] += len(c.token_ids)
            else:
                tokens[c.index] = len(c.token_ids)
        return sum(tokens.values())

    left = False
    with trio.CancelScope() as scope:
        if plan.leave == "pre-cancelled":
            scope.cancel()
        elif plan.leave == "deadline":
            scope.deadline = trio.current_time() + plan.after_seconds
        stream = engine.generate(plan.prompt, plan.params, plan.request_id)
        if plan.leave == "break":  # a bare `async for`: the dropped stream aborts itself
            async for output in stream:
                if count(output) >= plan.after_tokens and not output.finished:
                    left = True
                    break
                finished = output
        else:
            async with stream:
                if plan.after_tokens == 0 and plan.leave == "scope":
                    scope.cancel()
                if plan.after_tokens == 0 and plan.leave == "aclose":
                    await stream.aclose()
                    left = True
                async for output in stream:
                    finished = output
                    if count(output) < plan.after_tokens or output.finished:
                        continue
                    if plan.leave == "scope":
                        scope.cancel()
                    elif plan.leave == "aclose":
                        await stream.aclose()
                        left = True
                        break
        del stream
    if scope.cancelled_caught or left:
        outcomes[plan.request_id] = "left"
    elif finished is None or not finished.finished:
        outcomes[plan.request_id] = f"ended without a finished output ({plan})"
    elif plan.leave is None and (
        sorted(tokens) != list(range(plan.params.n))
        or set(tokens.values()) != {plan.params.max_tokens}
    ):
        outcomes[plan.request_id] = f"got tokens {dict(tokens)} ({plan})"
    else:
        outcomes[plan.request_id] = "done"


async def test_a_thousand_requests_half_abandoned_leave_nothing_behind(
    toy_model_dir: Path,
) -> None:
    rng = random.Random(7)
    plans = make_plans(rng)
    outcomes: dict[str, str] = {}
    async with open_engine(str(toy_model_dir), **ENGINE_ARGS) as engine:
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for plan in plans:
                    nursery.start_soon(consume, engine, plan, outcomes)
            await engine.wait_until_idle()
        problems = [f"{rid}: {o}" for rid, o in outcomes.items() if o not in ("done", "left")]
        assert not problems, "\n".join(problems[:10])
        assert len(outcomes) == NUM_REQUESTS
        # The readers that stayed all finished; at least the planned half left.
        assert all(outcomes[p.request_id] == "done" for p in plans if p.leave is None)
        assert Counter(outcomes.values())["left"] >= NUM_REQUESTS // 4
        # Nothing is held anywhere.
        assert engine.num_kv_blocks_used == 0
        assert engine.scheduler.get_num_unfinished_requests() == 0
        assert not engine.frontend.processor.has_unfinished_requests()
        assert not engine.errored
        await engine.check_health()
        # Every id is free again: a sample of each way of leaving, and of finishing.
        sample = [
            plan
            for how in [*LEAVE_HOW, None]
            for plan in rng.sample([p for p in plans if p.leave == how], 8)
        ]
        async with trio.open_nursery() as nursery:
            for plan in sample:
                nursery.start_soon(reuse, engine, plan.request_id)
        await engine.wait_until_idle()
        assert engine.num_kv_blocks_used == 0


async def reuse(engine: AsyncEngine, request_id: str) -> None:
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    with trio.fail_after(30):
        async with engine.generate("again", params, request_id) as stream:
            async for output in stream:
                last = output
    assert last.finished and len(last.outputs[0].token_ids) == 2, request_id


async def test_a_stream_entered_in_a_cancelled_scope_is_never_submitted(
    toy_model_dir: Path,
) -> None:
    async with open_engine(str(toy_model_dir), **ENGINE_ARGS) as engine:
        for _ in range(3):
            with trio.CancelScope() as scope:
                scope.cancel()
                async with engine.generate("never", SamplingParams(max_tokens=5), "pre") as s:
                    async for _ in s:
                        raise AssertionError("a cancelled caller got an output")
            assert scope.cancelled_caught
            assert engine.scheduler.get_num_unfinished_requests() == 0
        await reuse(engine, "pre")  # the id was never taken
