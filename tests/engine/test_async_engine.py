"""The actor engine through its EngineClient facade, on the toy model."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import psutil
import pytest
import trio
import trio.testing

from legato import EngineDeadError, RequestOutput, RequestOutputKind, SamplingParams
from legato.actors.frontend import INLINE_MAX_PROMPT_CHARS
from legato.engine import AsyncEngine, open_engine
from legato.metrics.logger_base import StatLoggerBase
from legato.protocol.errors import EngineStartupError, PromptTooLongError, ValidationError

DELTA = RequestOutputKind.DELTA
FINAL = RequestOutputKind.FINAL_ONLY
ENGINE_ARGS: dict[str, Any] = dict(max_model_len=512, num_kv_blocks=600, disable_log_stats=True)


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture
async def engine(toy_model_dir: Any) -> AsyncIterator[AsyncEngine]:
    async with open_engine(str(toy_model_dir), executor="inproc", **ENGINE_ARGS) as eng:
        yield eng


async def run_one(
    engine: AsyncEngine, prompt: Any, params: SamplingParams, rid: str
) -> list[RequestOutput]:
    outs = []
    async with engine.generate(prompt, params, rid) as stream:
        async for out in stream:
            outs.append(out)
    return outs


def children() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


async def assert_idle(engine: AsyncEngine) -> None:
    with trio.fail_after(10):
        await engine.wait_until_idle()
    assert engine.num_kv_blocks_used == 0
    assert not engine.frontend.processor.has_unfinished_requests()


@pytest.mark.parametrize("kind", [DELTA, FINAL])
async def test_hundred_concurrent_requests_get_exactly_their_tokens(
    engine: AsyncEngine, kind: RequestOutputKind
) -> None:
    counts: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        outs = await run_one(engine, f"request number {i}", greedy(10, output_kind=kind), f"r{i}")
        counts[i] = [len(o.outputs[0].token_ids) for o in outs]
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        assert outs[-1].outputs[0].finish_reason == "length"

    async with trio.open_nursery() as nursery:
        for i in range(100):
            nursery.start_soon(one, i)
    assert len(counts) == 100
    for per_output in counts.values():
        assert sum(per_output) == 10
        if kind == FINAL:
            assert per_output == [10]
    await assert_idle(engine)


async def test_greedy_matches_transformers(engine: AsyncEngine, toy_model_dir: Any) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    prompt = "The quick brown fox jumps over the lazy dog."
    outs = await run_one(engine, prompt, greedy(48), "g")
    ours = outs[-1].outputs[0].token_ids
    model = AutoModelForCausalLM.from_pretrained(str(toy_model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([outs[-1].prompt_token_ids])
    with torch.inference_mode():
        ref = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=48,
            min_new_tokens=48,
            do_sample=False,
        )
    assert ours == ref[0, ids.shape[1] :].tolist()


async def test_cancelled_scopes_abort_their_requests_and_free_blocks(
    engine: AsyncEngine, gate_steps: Any
) -> None:
    gate = gate_steps(engine)
    finished: dict[int, int] = {}
    cancelled: list[int] = []

    async def one(i: int) -> None:
        # The cancelled ones could run for hundreds of steps more if abort did nothing.
        params = greedy(30 if i % 10 else 400, output_kind=DELTA)
        with trio.CancelScope() as scope:
            got = 0
            async with engine.generate(f"prompt {i}", params, f"c{i}") as stream:
                async for out in stream:
                    got += len(out.outputs[0].token_ids)
                    if i % 10 == 0 and got >= 1 + i // 10:
                        scope.cancel()  # staggered: request 0 after 1 token, 90 after 10
            finished[i] = got
        if scope.cancelled_caught:
            cancelled.append(i)

    async with trio.open_nursery() as nursery:
        for i in range(100):
            nursery.start_soon(one, i)
    assert sorted(cancelled) == list(range(0, 100, 10))
    assert all(finished[i] == 30 for i in range(100) if i % 10)
    await gate.assert_done_within_one_step()
    gate.open()
    await assert_idle(engine)
    for i in cancelled:  # the ids are free again
        outs = await run_one(engine, "again", greedy(3), f"c{i}")
        assert outs[-1].finished


async def test_abort_ends_streams_with_reason_abort(engine: AsyncEngine) -> None:
    results: dict[int, RequestOutput] = {}
    started = {i: trio.Event() for i in range(5)}

    async def one(i: int) -> None:
        async with engine.generate(
            f"abort test {i}",
            greedy(200, output_kind=FINAL if i >= 5 else RequestOutputKind.CUMULATIVE),
            f"a{i}",
        ) as s:
            async for out in s:
                results[i] = out
                if i < 5 and out.outputs[0].token_ids:
                    started[i].set()

    async with trio.open_nursery() as nursery:
        for i in range(50):
            nursery.start_soon(one, i)
        for ev in started.values():
            await ev.wait()
        await engine.abort([f"a{i}" for i in range(5)] + ["no-such-request"])
    for i in range(5):
        assert results[i].finished and results[i].outputs[0].finish_reason == "abort"
        assert len(results[i].outputs[0].token_ids) > 0
    for i in range(5, 50):
        assert results[i].outputs[0].finish_reason == "length"
        assert len(results[i].outputs[0].token_ids) == 200
    await assert_idle(engine)


@pytest.mark.parametrize("how", ["break", "aclose"])
async def test_consumers_that_stop_early_leave_nothing_behind(
    engine: AsyncEngine, how: str, gate_steps: Any
) -> None:
    gate = gate_steps(engine)

    async def one(i: int) -> None:
        got = 0
        stream = engine.generate(f"early stop {i}", greedy(300, output_kind=DELTA), f"e{i}")
        if how == "aclose":
            async for out in stream:
                got += len(out.outputs[0].token_ids)
                if got >= 20:
                    await stream.aclose()
        else:
            async for out in stream:
                got += len(out.outputs[0].token_ids)
                if got >= 20:
                    break
        assert got >= 20

    async with trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(one, i)
    await gate.assert_done_within_one_step()  # 280 tokens each were still to come


async def test_stop_strings_spanning_token_boundaries(engine: AsyncEngine) -> None:
    tok = engine.tokenizer
    base = await run_one(engine, "Stop strings:", greedy(40), "s0")
    ids = base[-1].outputs[0].token_ids
    text = base[-1].outputs[0].text
    # A stop string that starts inside token k and ends inside token k+1.
    k, span = None, ""
    for k in range(5, len(ids) - 2):
        left, right = tok.decode(ids[k : k + 1]), tok.decode(ids[k + 1 : k + 2])
        if len(left) >= 2 and len(right) >= 2:
            span = left[-1:] + right[:1]
            break
    assert span, "the toy model's output has no pair of multi-character tokens"
    cut = text.find(span)
    assert cut > 0
    for include in (False, True):
        params = greedy(40, stop=[span], include_stop_str_in_output=include, output_kind=DELTA)
        outs = await run_one(engine, "Stop strings:", params, f"s{include}")
        streamed = "".join(o.outputs[0].text for o in outs)
        assert streamed == text[: cut + (len(span) if include else 0)]
        assert outs[-1].outputs[0].finish_reason == "stop"
        assert outs[-1].outputs[0].stop_reason == span
    await assert_idle(engine)


async def test_streamed_text_is_the_decoded_tokens(engine: AsyncEngine) -> None:
    outs = await run_one(engine, "héllo 世界 🙂", greedy(60, output_kind=DELTA), "utf8")
    text = "".join(o.outputs[0].text for o in outs)
    token_ids = [t for o in outs for t in o.outputs[0].token_ids]
    assert text == engine.tokenizer.decode(token_ids, skip_special_tokens=True)


async def test_n_completions_and_seeds(engine: AsyncEngine) -> None:
    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    first = (await run_one(engine, "Three ways:", params, "n3"))[-1]
    assert first.request_id == "n3" and len(first.outputs) == 3
    assert sorted(c.index for c in first.outputs) == [0, 1, 2]
    assert all(len(c.token_ids) == 12 for c in first.outputs)
    second = (await run_one(engine, "Three ways:", params, "n3"))[-1]
    assert [c.text for c in first.outputs] == [c.text for c in second.outputs]
    await assert_idle(engine)


async def test_pause_abort_wait_keep(engine: AsyncEngine) -> None:
    # abort: in-flight requests end with reason abort.
    got: dict[str, RequestOutput] = {}
    first_token = trio.Event()

    async def consume(rid: str, params: SamplingParams) -> None:
        async with engine.generate("pause test", params, rid) as s:
            async for out in s:
                got[rid] = out
                if out.outputs[0].token_ids:
                    first_token.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume, "p-abort", greedy(400))
        await first_token.wait()
        await engine.pause_generation(mode="abort")
    assert got["p-abort"].outputs[0].finish_reason == "abort"
    assert await engine.is_paused()
    # New requests wait while paused.
    late_done = trio.Event()

    async def late() -> None:
        await consume("p-late", greedy(5))
        late_done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(late)
        await trio.testing.wait_all_tasks_blocked()
        assert "p-late" not in got
        await engine.resume_generation()
        await engine.resume_generation()  # idempotent
    assert late_done.is_set() and got["p-late"].outputs[0].finish_reason == "length"

    # wait: returns once in-flight requests have finished.
    first_token = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume, "p-wait", greedy(40))
        await first_token.wait()
        await engine.pause_generation(mode="wait")
        assert engine.num_kv_blocks_used == 0
    assert got["p-wait"].outputs[0].finish_reason == "length"
    await engine.resume_generation()

    # keep: a request paused mid-way continues after resume and gets all its tokens.
    first_token = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume, "p-keep", greedy(60))
        await first_token.wait()
        await engine.pause_generation(mode="keep")
        await trio.testing.wait_all_tasks_blocked()  # the consumer takes what came before
        frozen = len(got["p-keep"].outputs[0].token_ids)
        await trio.testing.wait_all_tasks_blocked()
        assert len(got["p-keep"].outputs[0].token_ids) == frozen < 60
        await engine.resume_generation()
    assert len(got["p-keep"].outputs[0].token_ids) == 60
    await assert_idle(engine)


async def test_a_prompt_too_large_to_render_inline_runs_like_its_token_ids(
    toy_model_dir: Any,
) -> None:
    """Over the inline limit a prompt renders in a worker thread, with the engine's
    own tokenizer copy; its outputs are those of the same prompt given as token ids."""
    text = "the " * 1100  # 4,400 characters, 1,102 toy tokens
    assert len(text) > INLINE_MAX_PROMPT_CHARS
    args = dict(ENGINE_ARGS, max_model_len=2048, num_kv_blocks=400)
    async with open_engine(str(toy_model_dir), executor="inproc", **args) as engine:
        offload = engine.frontend.offload_renderer
        assert offload is not None and offload.tokenizer is not engine.renderer.tokenizer
        by_text = await run_one(engine, text, greedy(6), "text")
        ids = by_text[0].prompt_token_ids
        assert ids is not None and len(ids) == 1102
        by_ids = await run_one(engine, ids, greedy(6), "ids")
    assert by_text[-1].outputs[0].token_ids == by_ids[-1].outputs[0].token_ids
    assert by_text[-1].outputs[0].text == by_ids[-1].outputs[0].text


async def test_per_request_errors_fail_only_that_request(engine: AsyncEngine) -> None:
    with pytest.raises(ValueError, match="prompt"):
        await run_one(engine, {"prompt_token_ids": []}, greedy(4), "bad1")
    with pytest.raises(PromptTooLongError):
        await run_one(engine, "word " * 600, greedy(4), "bad2")
    with pytest.raises(ValueError, match="prompt_token_ids"):
        await run_one(engine, {"prompt_token_ids": [1, 10**9]}, greedy(4), "bad4")
    outs = await run_one(engine, "the next one works", greedy(4), "good")
    assert outs[-1].outputs[0].finish_reason == "length"
    assert not engine.errored
    await engine.check_health()


async def test_duplicate_live_request_id_is_refused(engine: AsyncEngine) -> None:
    started = trio.Event()
    async with trio.open_nursery() as nursery:

        async def long() -> None:
            async with engine.generate("dup", greedy(100, output_kind=DELTA), "same") as s:
                async for _ in s:
                    started.set()

        nursery.start_soon(long)
        await started.wait()
        with pytest.raises(ValidationError, match="already running") as info:
            await run_one(engine, "dup", greedy(2), "same")
        assert info.value.field == "request_id"
        await engine.abort("same")
    assert (await run_one(engine, "dup", greedy(2), "same"))[-1].finished


WORKER_FAULTS: dict[str, Any] = {
    "runner_raises": {"raise_on_step": 8},
    "short_reply": {"short_reply_on_step": 8},  # a malformed answer is the worker's death
    "sigkill": None,
}


@pytest.mark.parametrize("fault", list(WORKER_FAULTS))
async def test_engine_death_fails_every_stream(toy_model_dir: Any, fault: str) -> None:
    spec = WORKER_FAULTS[fault]
    faults = {"worker": spec} if spec is not None else None
    errors: list[BaseException] = []
    progress = trio.Event()
    async with open_engine(str(toy_model_dir), faults=faults, **ENGINE_ARGS) as engine:
        pid = engine.executor.pid
        assert pid is not None and psutil.pid_exists(pid)

        async def one(i: int) -> None:
            try:
                async with engine.generate(
                    f"doomed {i}", greedy(400, output_kind=DELTA), f"d{i}"
                ) as s:
                    async for _ in s:
                        progress.set()
            except EngineDeadError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(one, i)
            await progress.wait()
            if fault == "sigkill":
                engine.executor.kill()
            with trio.fail_after(10):
                await engine.supervisor.dead.wait()
            # Every stream must end within 2 s of the death.
            nursery.cancel_scope.deadline = trio.current_time() + 2
        assert not nursery.cancel_scope.cancelled_caught, "a stream hung after the engine died"
        assert len(errors) == 10
        assert engine.errored and not engine.is_running and engine.is_stopped
        assert (
            isinstance(engine.dead_error, EngineDeadError)
            and engine.dead_error.__cause__ is not None
        )
        if fault == "short_reply":
            assert "does not match its requests" in str(engine.dead_error.__cause__)
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await run_one(engine, "after death", greedy(2), "late")
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert children() == []


async def test_startup_failures_are_clear_and_reap_the_worker(
    toy_model_dir: Any, tmp_path: Any
) -> None:
    with pytest.raises(ValueError, match="model"):
        async with open_engine(str(tmp_path / "missing")):
            pass
    with pytest.raises(EngineStartupError, match="weight loading failed"):
        async with open_engine(
            str(toy_model_dir), faults={"worker": {"fail_load": True}}, **ENGINE_ARGS
        ):
            pass
    assert children() == []
    # A load slower than engine_ready_timeout: vLLM's TimeoutError (an EngineStartupError
    # too), at the timeout, not when the load would have ended; the worker is reaped.
    stalled = {"worker": {"stall_load": 600}}
    with trio.fail_after(60), pytest.raises(TimeoutError, match="not ready within 2.0 s") as info:
        async with open_engine(
            str(toy_model_dir), faults=stalled, engine_ready_timeout=2.0, **ENGINE_ARGS
        ):
            pass
    assert isinstance(info.value, EngineStartupError)
    assert children() == []


async def test_offline_llm_and_llm_engine_match_async_engine(
    engine: AsyncEngine, toy_model_dir: Any
) -> None:
    from legato.config import EngineConfig
    from legato.llm import LLM, LLMEngine

    prompts = ["one prompt", "another, longer prompt here", "x"]
    expected = []
    for i, p in enumerate(prompts):
        expected.append((await run_one(engine, p, greedy(16), f"o{i}"))[-1].outputs[0].token_ids)

    def offline() -> tuple[list[list[int]], list[list[int]]]:
        with LLM(str(toy_model_dir), executor="inproc", **ENGINE_ARGS) as llm:
            batch = [
                o.outputs[0].token_ids for o in llm.generate(prompts, greedy(16), use_tqdm=False)
            ]
            # One bad prompt among good ones raises its own error, not a group around it.
            bad = [prompts[0], {"prompt_token_ids": []}, "w " * 600, prompts[1]]
            with pytest.raises(ValidationError) as caught:
                llm.generate(bad, greedy(300), use_tqdm=False)
            assert caught.value.field == "prompt"
            again = llm.generate(prompts, greedy(16), use_tqdm=False)
            assert [o.outputs[0].token_ids for o in again] == batch
        stepwise = LLMEngine(EngineConfig(model=str(toy_model_dir), **ENGINE_ARGS))
        for i, p in enumerate(prompts):
            stepwise.add_request(f"s{i}", p, greedy(16, output_kind=FINAL))
        done: dict[str, list[int]] = {}
        while stepwise.has_unfinished_requests():
            for out in stepwise.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        return batch, [done[f"s{i}"] for i in range(len(prompts))]

    batch, stepwise = await trio.to_thread.run_sync(offline)
    assert batch == expected
    assert stepwise == expected


async def test_a_reused_id_gets_only_its_own_tokens(engine: AsyncEngine, gate_steps: Any) -> None:
    """An id is free again as soon as its stream has ended, even with a step of its
    predecessor in flight: that step's token must not reach the new request."""
    own = (await run_one(engine, "a fresh prompt", greedy(8), "reference"))[-1]
    gate = gate_steps(engine)
    first_tokens = {i: trio.Event() for i in range(4)}
    scopes: dict[int, trio.CancelScope] = {}

    async def old(i: int) -> None:
        with trio.CancelScope() as scopes[i]:
            async with engine.generate("the old one", greedy(300, output_kind=DELTA), f"c{i}") as s:
                async for _ in s:
                    first_tokens[i].set()

    results: dict[int, list[int]] = {}

    async def new(i: int) -> None:
        outs = await run_one(engine, "a fresh prompt", greedy(8, output_kind=DELTA), f"c{i}")
        results[i] = [t for o in outs for t in o.outputs[0].token_ids]

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(old, i)
        for event in first_tokens.values():
            await event.wait()
        gate.close()
        await gate.wait_held()  # a step computing the old requests is on its way
        for scope in scopes.values():
            scope.cancel()
        await trio.testing.wait_all_tasks_blocked()  # the old streams have ended
        for i in range(4):
            nursery.start_soon(new, i)
        await trio.testing.wait_all_tasks_blocked()  # the new ones are registered
        gate.open()
    assert results == {i: own.outputs[0].token_ids for i in range(4)}
    await assert_idle(engine)


async def test_cache_salt_keeps_prefix_caches_apart(engine: AsyncEngine) -> None:
    ids = list(range(5, 5 + 200))

    async def cached(prompt: Any, rid: str) -> int:
        out = (await run_one(engine, prompt, greedy(2), rid))[-1]
        assert out.num_cached_tokens is not None
        return out.num_cached_tokens

    assert await cached({"prompt_token_ids": ids, "cache_salt": "tenant-a"}, "a1") == 0
    assert await cached({"prompt_token_ids": ids, "cache_salt": "tenant-b"}, "b1") == 0
    assert await cached({"prompt_token_ids": ids}, "none1") == 0
    assert await cached({"prompt_token_ids": ids, "cache_salt": "tenant-a"}, "a2") >= 192
    assert await cached({"prompt_token_ids": ids, "cache_salt": "tenant-b"}, "b2") >= 192
    assert await cached({"prompt_token_ids": ids}, "none2") >= 192
    text = "the same words for everyone " * 8
    assert await cached({"prompt": text, "cache_salt": "tenant-a"}, "ta1") == 0
    assert await cached({"prompt": text, "cache_salt": "tenant-c"}, "tc1") == 0
    assert await cached({"prompt": text, "cache_salt": "tenant-a"}, "ta2") > 0
    for salt in ("", 5, ["x"]):
        with pytest.raises(ValidationError) as caught:
            await run_one(engine, {"prompt_token_ids": ids, "cache_salt": salt}, greedy(2), "bad")
        assert caught.value.field == "cache_salt"
    await assert_idle(engine)


async def test_prompt_text_and_tokenization_kwargs_are_honoured(engine: AsyncEngine) -> None:
    tok = engine.tokenizer
    text = "Hello there, tokenizer"
    ids = tok.encode(text)
    out = (await run_one(engine, ids, greedy(2), "ids"))[-1]
    assert out.prompt is None

    async def last(stream: Any) -> RequestOutput:
        async with stream:
            outs = [out async for out in stream]
        return outs[-1]

    out = await last(engine.generate(ids, greedy(2), "named", prompt_text=text))
    assert out.prompt == text and out.prompt_token_ids == ids

    async def prompt_ids(kwargs: dict[str, Any]) -> list[int]:
        out = await last(engine.generate(text, greedy(1), "kw", tokenization_kwargs=kwargs))
        return list(out.prompt_token_ids or [])

    assert await prompt_ids({}) == ids
    assert await prompt_ids({"add_special_tokens": False}) == tok.encode(
        text, add_special_tokens=False
    )
    assert await prompt_ids({"truncation": True, "max_length": 3}) == tok.encode(
        text, truncation=True, max_length=3
    )
    for kwargs, field in [
        ({"padding": True}, "tokenization_kwargs"),
        ({"max_length": 0}, "tokenization_kwargs.max_length"),
        ({"truncation": True}, "tokenization_kwargs.max_length"),
        ({"add_special_tokens": "no"}, "tokenization_kwargs.add_special_tokens"),
    ]:
        with pytest.raises(ValidationError) as caught:
            engine.generate(text, greedy(1), "kw", tokenization_kwargs=kwargs)
        assert caught.value.field == field
    with pytest.raises(ValidationError, match="prompt_text"):
        engine.generate(ids, greedy(1), "pt", prompt_text=5)  # type: ignore[arg-type]


class ReasonSink(StatLoggerBase):
    """A custom stat logger in vLLM's shape: the finish reasons it was told of."""

    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.logs = self.initialized = 0

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if iteration_stats is not None:
            self.reasons += [done.finish_reason for done in iteration_stats.finished_requests]

    def log(self) -> None:
        self.logs += 1

    def log_engine_initialized(self) -> None:
        self.initialized += 1


def test_llm_engine_has_vllms_signatures_and_aborts_finish_as_abort(
    toy_model_dir: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """LLMEngine drives the engine core's step: add_request returns the id, user aborts
    (by the caller's id or the engine's) are forgotten with no further output, as vLLM's
    (the stat logger still sees them finish as "abort"), and the rest run to the end."""
    from legato.config import EngineConfig
    from legato.llm import LLMEngine

    sink = ReasonSink()
    eng = LLMEngine(EngineConfig(model=str(toy_model_dir), **ENGINE_ARGS), stat_loggers=[sink])
    assert sink.initialized == 1
    assert eng.get_supported_tasks() == ("generate", "embed")
    assert eng.get_tokenizer() is eng.tokenizer
    assert eng.add_request("a", "to abort", greedy(50)) == "a"
    assert eng.add_request("b", "to abort too", greedy(50)) == "b"
    assert eng.add_request("c", "runs to the end", greedy(6, output_kind=FINAL)) == "c"
    first = {out.request_id: out for out in eng.step()}
    assert set(first) == {"a", "b"} and not first["a"].finished  # "c" is FINAL_ONLY
    engine_id_of_b = eng.frontend.live["b"].engine_id
    eng.abort_request(["a", "unknown"])
    eng.abort_request(engine_id_of_b, internal=True)
    assert eng.scheduler.get_num_unfinished_requests() == 1  # freed at once
    assert eng.get_num_unfinished_requests() == 1
    ends: dict[str, RequestOutput] = {}
    seen: set[str] = set()
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen.add(out.request_id)
            if out.finished:
                ends[out.request_id] = out
    assert seen == {"c"}  # nothing more of the aborted ones
    assert {rid: o.outputs[0].finish_reason for rid, o in ends.items()} == {"c": "length"}
    assert sorted(sink.reasons) == ["abort", "abort", "length"]  # the stat logger saw them
    eng.remove_logger(sink)
    assert eng.get_num_unfinished_requests() == 0
    assert eng.reset_prefix_cache() is True
    (held,) = eng.collective_rpc("held_requests")
    assert set(held) <= {"c-3"}  # the runner forgot the aborted ones (c: at the next step)
    caplog.set_level("INFO", logger="legato.stats")
    late = ReasonSink()
    eng.add_logger(late)
    eng.do_log_stats()
    assert not caplog.records and late.logs == 0  # disable_log_stats=True: silent
    eng.sleep(1)
    assert eng.is_sleeping()
    eng.wake_up()
    assert not eng.is_sleeping()
    eng.add_request("d", "after waking", greedy(3, output_kind=FINAL))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert len(outs[-1].outputs[0].token_ids) == 3
    assert late.reasons == ["length"] and sink.reasons == ["abort", "abort", "length"]


async def test_tokenize_detokenize_model_info_and_metrics_are_public(
    engine: AsyncEngine, toy_tokenizer: Any
) -> None:
    """What a server needs beyond generate: through the engine's own methods, not its parts."""
    text = "héllo wörld " * 4
    ids = await engine.tokenize(text)
    assert ids == toy_tokenizer.encode(text)
    assert await engine.tokenize(text, add_special_tokens=False) == toy_tokenizer.encode(
        text, add_special_tokens=False
    )
    assert await engine.detokenize(ids, skip_special_tokens=True) == toy_tokenizer.decode(
        ids, skip_special_tokens=True
    )
    big = "the " * (INLINE_MAX_PROMPT_CHARS // 2)  # past the inline limit: the offload thread
    assert await engine.tokenize(big) == toy_tokenizer.encode(big)
    with pytest.raises(ValidationError):
        await engine.detokenize([10**9])
    assert engine.token_text(ids[-1]) == toy_tokenizer.decode([ids[-1]])
    info = engine.model_info()
    assert info.name == engine.model_name and info.max_model_len == engine.config.max_model_len
    assert info.special_tokens.get("eos_token") == toy_tokenizer.eos_token
    assert b"legato:" in engine.metrics_text()
