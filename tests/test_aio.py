"""legato.aio: the engine for asyncio code, held to the trio engine's behaviour tests.

Each test is a plain function that runs its own ``asyncio.run`` (pytest runs trio
by default); the trio engine is the reference where outputs are compared.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import psutil
import pytest
import trio

import legato.aio as aio
from legato import EngineDeadError, LoRARequest, RequestOutput, RequestOutputKind, SamplingParams
from legato.engine import open_engine as open_trio_engine
from legato.protocol.errors import ValidationError
from legato.protocol.params import PoolingParams

DELTA = RequestOutputKind.DELTA
CUMULATIVE = RequestOutputKind.CUMULATIVE
FINAL = RequestOutputKind.FINAL_ONLY
ENGINE_ARGS: dict[str, Any] = dict(max_model_len=512, num_kv_blocks=600, disable_log_stats=True)
PROMPTS = ["The quick brown fox", "hello world", "a b c d e f g", "legato"]


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run_with_engine(
    toy_model_dir: Any, body: Callable[[aio.AioEngine], Awaitable[Any]], **engine_args: Any
) -> Any:
    async def main() -> Any:
        args = {"executor": "inproc", **ENGINE_ARGS, **engine_args}
        async with aio.open_engine(str(toy_model_dir), **args) as engine:
            return await body(engine)

    return asyncio.run(main())


async def collect(engine: Any, prompt: Any, params: SamplingParams, rid: str) -> list[Any]:
    outs = []
    async with engine.generate(prompt, params, rid) as stream:
        async for out in stream:
            outs.append(out)
    return outs


def summary(outs: list[RequestOutput]) -> list[tuple[str, tuple[int, ...], Any, bool]]:
    return [
        (o.outputs[0].text, tuple(o.outputs[0].token_ids), o.outputs[0].finish_reason, o.finished)
        for o in outs
    ]


def children() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


def reaped(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_outputs_are_identical_to_the_trio_engines(toy_model_dir: Any) -> None:
    """Every prompt and output kind, all streams at once: the same outputs as the trio
    engine's (where a consumer lags, DELTA merges and CUMULATIVE skips, so those are
    compared joined and by their last output); embeddings too."""
    kinds = [DELTA, CUMULATIVE, FINAL]
    jobs = [(p, k, f"{i}-{k.name}") for i, p in enumerate(PROMPTS) for k in kinds]
    embed = PoolingParams(task="embed")

    def joined(outs: list[RequestOutput], kind: RequestOutputKind) -> Any:
        if kind == CUMULATIVE:  # a lagging consumer skips some: each is a prefix of the last
            last = summary(outs)[-1]
            assert all(last[1][: len(ids)] == ids for _, ids, _, _ in summary(outs))
            return last
        if kind == FINAL:
            return summary(outs)
        text = "".join(o.outputs[0].text for o in outs)
        ids = [t for o in outs for t in o.outputs[0].token_ids]
        return text, ids, outs[-1].outputs[0].finish_reason, outs[-1].finished

    async def trio_side() -> dict[str, Any]:
        got: dict[str, Any] = {}
        args = {"executor": "inproc", **ENGINE_ARGS}
        async with open_trio_engine(str(toy_model_dir), **args) as engine:

            async def one(prompt: str, kind: RequestOutputKind, rid: str) -> None:
                got[rid] = joined(
                    await collect(engine, prompt, greedy(24, output_kind=kind), rid), kind
                )

            async with trio.open_nursery() as nursery:
                for job in jobs:
                    nursery.start_soon(one, *job)
            async for e in engine.encode(PROMPTS[0], embed, "emb"):
                got["emb"] = e.outputs.data.tolist()
        return got

    async def aio_side(engine: aio.AioEngine) -> dict[str, Any]:
        got: dict[str, Any] = {}

        async def one(prompt: str, kind: RequestOutputKind, rid: str) -> None:
            got[rid] = joined(
                await collect(engine, prompt, greedy(24, output_kind=kind), rid), kind
            )

        await asyncio.gather(*(one(*job) for job in jobs))
        async for e in engine.encode(PROMPTS[0], embed, "emb"):
            got["emb"] = e.outputs.data.tolist()
        return got

    expected = trio.run(trio_side)
    got = run_with_engine(toy_model_dir, aio_side)
    assert set(got) == set(expected) and len(got) == len(jobs) + 1
    assert got == expected
    assert all(len(got[f"{i}-DELTA"][1]) == 24 for i in range(len(PROMPTS)))


def test_cancelled_tasks_abort_their_requests_within_one_step(
    toy_model_dir: Any, gate_steps: Any
) -> None:
    """A hundred streams; every tenth task is cancelled while it reads. After the step
    already on its way, the engine holds nothing (a StepGate in the engine thread)."""

    async def body(engine: aio.AioEngine) -> None:
        gate = await engine.call_in_engine(_make_gate(gate_steps))
        finished: dict[int, int] = {}
        cancelled: list[int] = []

        async def one(i: int) -> None:
            params = greedy(30 if i % 10 else 400, output_kind=DELTA)
            got = 0
            try:
                async with engine.generate(f"prompt {i}", params, f"c{i}") as stream:
                    async for out in stream:
                        got += len(out.outputs[0].token_ids)
                        if i % 10 == 0 and got >= 1 + i // 10:
                            task = asyncio.current_task()
                            assert task is not None
                            task.cancel()  # lands at the stream's next wait
                finished[i] = got
            except asyncio.CancelledError:
                cancelled.append(i)

        await asyncio.gather(*(one(i) for i in range(100)))
        assert sorted(cancelled) == list(range(0, 100, 10))
        assert all(finished[i] == 30 for i in range(100) if i % 10)
        await engine.call_in_engine(lambda _: gate.assert_done_within_one_step())
        gate.open()
        for i in cancelled:  # the ids are free again
            assert (await collect(engine, "again", greedy(3), f"c{i}"))[-1].finished

    run_with_engine(toy_model_dir, body)


def _make_gate(gate_steps: Any) -> Callable[[Any], Awaitable[Any]]:
    async def make(trio_engine: Any) -> Any:
        return gate_steps(trio_engine)

    return make


@pytest.mark.parametrize("how", ["break", "aclose"])
def test_consumers_that_stop_early_leave_nothing_behind(
    toy_model_dir: Any, gate_steps: Any, how: str
) -> None:
    async def body(engine: aio.AioEngine) -> None:
        gate = await engine.call_in_engine(_make_gate(gate_steps))

        async def one(i: int) -> None:
            got = 0
            stream = engine.generate(f"early stop {i}", greedy(300, output_kind=DELTA), f"e{i}")
            async for out in stream:
                got += len(out.outputs[0].token_ids)
                if got >= 20:
                    if how == "aclose":
                        await stream.aclose()
                    else:
                        break
            assert got >= 20

        await asyncio.gather(*(one(i) for i in range(8)))
        gc.collect()  # `break` leaves the stream to the collector (CPython frees it at once)
        await engine.call_in_engine(lambda _: gate.assert_done_within_one_step())

    run_with_engine(toy_model_dir, body)


def test_abort_bad_input_and_duplicate_ids(toy_model_dir: Any) -> None:
    async def body(engine: aio.AioEngine) -> None:
        first: dict[int, asyncio.Event] = {i: asyncio.Event() for i in range(3)}
        results: dict[int, RequestOutput] = {}

        async def one(i: int) -> None:
            async with engine.generate(f"abort {i}", greedy(300), f"a{i}") as stream:
                async for out in stream:
                    results[i] = out
                    if out.outputs[0].token_ids:
                        first[i].set()

        tasks = [asyncio.create_task(one(i)) for i in range(3)]
        for ev in first.values():
            await ev.wait()
        with pytest.raises(ValidationError, match="already running") as info:
            await collect(engine, "dup", greedy(2), "a0")
        assert info.value.field == "request_id"
        with pytest.raises(ValidationError) as bad:
            async with engine.generate("x", greedy(2), "bad", lora_request="a"):  # type: ignore[arg-type]
                pass
        assert bad.value.field == "lora_request"
        await engine.abort(["a0", "a1", "a2", "no-such-request"])
        await asyncio.gather(*tasks)
        for out in results.values():
            assert out.finished and out.outputs[0].finish_reason == "abort"
            assert 0 < len(out.outputs[0].token_ids) < 300
        await engine.wait_until_idle()
        assert (await collect(engine, "after", greedy(2), "a0"))[-1].finished

    run_with_engine(toy_model_dir, body)


def test_control_calls_pause_sleep_and_tokenizer(toy_model_dir: Any, toy_tokenizer: Any) -> None:
    async def body(engine: aio.AioEngine) -> None:
        before = summary(await collect(engine, PROMPTS[0], greedy(12), "s0"))[-1]
        await engine.sleep(level=1)
        assert await engine.is_sleeping()
        held = asyncio.create_task(collect(engine, PROMPTS[0], greedy(12), "s1"))
        await asyncio.sleep(0)
        await engine.wake_up()
        assert not await engine.is_sleeping()
        assert summary(await held)[-1] == before
        await engine.pause_generation(mode="keep")
        assert await engine.is_paused()
        held = asyncio.create_task(collect(engine, PROMPTS[0], greedy(12), "s2"))
        await engine.resume_generation()
        assert summary(await held)[-1] == before
        assert not await engine.is_paused()
        assert await engine.reset_prefix_cache() is True
        with pytest.raises(ValueError, match="mode"):
            await engine.pause_generation(mode="nope")  # type: ignore[arg-type]
        tokenizer = await engine.get_tokenizer()
        assert tokenizer.encode("hello world") == toy_tokenizer.encode("hello world")
        assert await engine.get_supported_tasks() == ("generate", "embed")
        assert await engine.list_loras() == set()
        await engine.check_health()
        assert engine.is_running and not engine.errored

    run_with_engine(toy_model_dir, body)


def test_lora_family(toy_model_dir: Any, make_toy_adapter: Any) -> None:
    adapter = make_toy_adapter(r=4, targets=("q_proj", "v_proj"), seed=1)
    lora = LoRARequest("a", 1, str(adapter.path))
    prompt = {"prompt_token_ids": [5, 300, 71, 1200, 9, 44, 803, 17]}

    async def body(engine: aio.AioEngine) -> None:
        assert await engine.add_lora(lora) is True
        assert await engine.list_loras() == {1}
        assert await engine.pin_lora(1) is True
        async with engine.generate(prompt, greedy(8), "l1", lora_request=lora) as stream:
            async for out in stream:
                final = out
        assert final.outputs[0].token_ids == adapter.greedy(prompt["prompt_token_ids"], 8)
        with pytest.raises(ValidationError):
            await engine.add_lora(LoRARequest("missing", 2, str(toy_model_dir / "nope")))
        assert await engine.remove_lora(1) is True
        assert await engine.list_loras() == set()

    run_with_engine(
        toy_model_dir, body, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8
    )


def test_engine_death_fails_every_stream(toy_model_dir: Any) -> None:
    """An injected worker fault kills the engine: every open stream raises EngineDeadError
    (its cause kept), later calls raise it at once, and the worker is reaped."""
    pids: list[int] = []

    async def body(engine: aio.AioEngine) -> None:
        pid = engine.engine.executor.pid
        assert pid is not None
        pids.append(pid)
        errors: list[BaseException] = []
        progress = asyncio.Event()

        async def one(i: int) -> None:
            try:
                async with engine.generate(
                    f"doomed {i}", greedy(400, output_kind=DELTA), f"d{i}"
                ) as s:
                    async for _ in s:
                        progress.set()
            except EngineDeadError as exc:
                errors.append(exc)

        # The hang guard: every stream must end soon after the death.
        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(10))), 60)
        assert len(errors) == 10
        assert engine.errored and not engine.is_running and engine.is_stopped
        assert engine.dead_error.__cause__ is not None
        assert all(e is engine.dead_error for e in errors)
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await collect(engine, "after death", greedy(2), "late")
        with pytest.raises(EngineDeadError):
            await engine.pause_generation()
        await engine.abort("d0")  # never raises

    run_with_engine(
        toy_model_dir, body, executor="process", faults={"worker": {"raise_on_step": 8}}
    )
    assert reaped(pids[0])
    assert children() == []


def test_leaving_the_engine_ends_streams_other_tasks_read(toy_model_dir: Any) -> None:
    async def body_outer() -> list[BaseException]:
        errors: list[BaseException] = []
        started = [asyncio.Event() for _ in range(4)]

        async def one(engine: aio.AioEngine, i: int) -> None:
            try:
                async with engine.generate(f"open {i}", greedy(400), f"o{i}") as s:
                    async for _ in s:
                        started[i].set()
            except EngineDeadError as exc:
                errors.append(exc)

        async with aio.open_engine(str(toy_model_dir), **ENGINE_ARGS) as engine:
            tasks = [asyncio.create_task(one(engine, i)) for i in range(4)]
            for ev in started:
                await ev.wait()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        with pytest.raises(EngineDeadError, match="shut down"):
            await collect(engine, "late", greedy(2), "late")
        return errors

    errors = asyncio.run(body_outer())
    assert len(errors) == 4 and all("shut down" in str(e) for e in errors)
    assert children() == []


def _in_thread(fn: Callable[[], Any], seconds: float) -> None:
    """Run ``fn`` in a thread; fail if it has not returned within ``seconds`` (a hang guard)."""
    failure: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "hung"
    if failure:
        raise failure[0]


def test_asyncio_run_returning_with_streams_and_engine_open_does_not_hang(
    toy_model_dir: Any,
) -> None:
    """``main`` returns while a background task holds the engine and four tasks read
    streams: ``asyncio.run`` cancels them all, the engine shuts down, the worker goes."""
    seen: dict[str, Any] = {}

    async def main() -> None:
        ready = asyncio.Event()

        async def consume(engine: aio.AioEngine, i: int, started: asyncio.Event) -> None:
            async with engine.generate(f"left open {i}", greedy(400), f"l{i}") as s:
                async for _ in s:
                    started.set()

        async def serve() -> None:
            async with aio.open_engine(str(toy_model_dir), **ENGINE_ARGS) as engine:
                seen["runner"] = engine._runner
                seen["pid"] = engine.engine.executor.pid
                started = [asyncio.Event() for _ in range(4)]
                for i in range(4):
                    asyncio.create_task(consume(engine, i, started[i]))  # noqa: RUF006
                for ev in started:
                    await ev.wait()
                ready.set()
                await asyncio.Event().wait()  # until cancelled

        seen["serve"] = asyncio.create_task(serve())
        await ready.wait()

    _in_thread(lambda: asyncio.run(main()), 60)
    assert seen["runner"].done.is_set()
    assert reaped(seen["pid"])
    assert children() == []


def test_a_loop_closed_with_the_engine_open_shuts_it_down(toy_model_dir: Any) -> None:
    """The app closes its loop without ever leaving ``open_engine`` (streams open): the
    engine thread notices by itself, shuts the engine down and reaps the worker."""
    loop = asyncio.new_event_loop()
    manager = aio.open_engine(str(toy_model_dir), **ENGINE_ARGS)
    engine = loop.run_until_complete(manager.__aenter__())
    pid = engine.engine.executor.pid
    assert pid is not None

    async def open_streams() -> None:
        started = [asyncio.Event() for _ in range(3)]

        async def consume(i: int) -> None:
            async for _ in engine.generate(f"closed {i}", greedy(400), f"z{i}"):
                started[i].set()

        for i in range(3):
            asyncio.create_task(consume(i))  # noqa: RUF006
        for ev in started:
            await ev.wait()

    loop.run_until_complete(open_streams())
    runner = engine._runner
    loop.close()
    assert runner.done.wait(30), "the engine thread outlived its event loop"
    assert reaped(pid)


def test_startup_failure_raises_from_open_engine(tmp_path: Any) -> None:
    async def main() -> None:
        async with aio.open_engine(str(tmp_path / "missing"), **ENGINE_ARGS):
            raise AssertionError("started without a model")  # pragma: no cover

    def run() -> None:
        with pytest.raises(ValueError, match="model"):
            asyncio.run(main())

    _in_thread(run, 60)  # a start-up error must reach open_engine, not leave it waiting
    assert children() == []
