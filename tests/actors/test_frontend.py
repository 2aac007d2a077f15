"""The front end on its own: render in the caller's task, register, deliver outputs.

A real engine core and the toy model in this process (``InprocExecutor``), the
toy tokenizer, and the Frontend wired to them as the engine wires it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from legato.actors.engine_core import EngineCore
from legato.actors.frontend import (
    INLINE_MAX_PROMPT_CHARS,
    INLINE_MAX_PROMPT_TOKENS,
    Frontend,
    chat_renders_inline,
    renders_inline,
    thread_renderer,
)
from legato.actors.inproc_executor import InprocExecutor
from legato.actors.output_slot import OutputSlot
from legato.config import EngineConfig
from legato.frontend.renderer import Renderer
from legato.outputs.output_processor import OutputProcessor
from legato.protocol import messages as m
from legato.protocol.errors import EngineDeadError, EngineGenerateError, ValidationError
from legato.protocol.outputs import RequestOutput
from legato.protocol.params import RequestOutputKind, SamplingParams
from legato.scheduling.core_steps import AddRequests, FrontendMessage
from legato.scheduling.scheduler import Scheduler

DELTA = RequestOutputKind.DELTA
BIG_PROMPT = "the " * 1100  # 4,400 characters (rendered in a thread), 1,102 toy tokens
assert len(BIG_PROMPT) > INLINE_MAX_PROMPT_CHARS
BIG_CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": BIG_PROMPT}]
SMALL_CHAT = [{"role": "user", "content": "hello there"}]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        output_kind=DELTA,
    )


@dataclass
class Rig:
    frontend: Frontend
    core: EngineCore
    sent: list[FrontendMessage] = field(default_factory=list)

    def added(self) -> list[str]:
        """The engine request ids handed to the core so far."""
        return [
            r.request_id for msg in self.sent if isinstance(msg, AddRequests) for r in msg.requests
        ]


@asynccontextmanager
async def open_rig(
    model: Path, tokenizer: Any, *, offload_tokenizer: Any = None
) -> AsyncIterator[Rig]:
    cfg = EngineConfig(
        model=str(model), executor="inproc", max_model_len=2048, num_kv_blocks=256, block_size=16
    )
    executor = InprocExecutor(cfg)
    async with trio.open_nursery() as nursery:
        ready: m.WorkerReady = await nursery.start(executor.run)
        cfg = cfg.resolved(max_model_len=2048, num_kv_blocks=ready.num_kv_blocks)
        send, recv = trio.open_memory_channel[m.EngineCoreOutputs](math.inf)
        core = EngineCore(Scheduler(cfg), executor, send)
        renderer = Renderer(
            tokenizer,
            max_model_len=2048,
            vocab_size=ready.vocab_size,
            eos_token_ids=ready.eos_token_ids,
        )
        offload = None
        if offload_tokenizer is not None:
            offload = copy.copy(renderer)
            offload.tokenizer = offload_tokenizer
        sent: list[FrontendMessage] = []

        def to_core(message: FrontendMessage) -> None:
            sent.append(message)
            core.submit(message)

        frontend = Frontend(
            renderer,
            OutputProcessor(tokenizer),
            to_core,
            lambda stats: None,
            offload_renderer=offload,
        )
        nursery.start_soon(core.run)
        nursery.start_soon(frontend.deliver, recv)
        yield Rig(frontend, core, sent)
        nursery.cancel_scope.cancel()


async def read_all(slot: OutputSlot) -> list[RequestOutput]:
    outputs = [await slot.get()]
    while not outputs[-1].finished:
        outputs.append(await slot.get())
    return outputs


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for c in out.outputs for t in c.token_ids]


async def run_one(
    frontend: Frontend, rid: str, prompt: Any, params: SamplingParams
) -> list[RequestOutput]:
    slot = OutputSlot(params.output_kind)
    engine_id = await frontend.add_request(rid, prompt, params, slot)
    try:
        return await read_all(slot)
    finally:
        frontend.release(rid, engine_id)


# ------------------------------------------------------------------ rendering and registration


async def test_a_request_is_registered_in_the_callers_task_when_add_request_returns(
    toy_model_dir: Path, toy_tokenizer: Any
) -> None:
    async with open_rig(toy_model_dir, toy_tokenizer) as rig:
        frontend = rig.frontend
        slot = OutputSlot(DELTA)
        engine_id = await frontend.add_request("a", "hello there", greedy(5), slot)
        # Nothing ran in between: the output processor and the core already have it.
        assert engine_id.startswith("a-") and rig.added() == [engine_id]
        assert frontend.processor.get_num_unfinished_requests() == 1
        assert frontend.is_live("a", engine_id)
        outputs = await read_all(slot)
        assert outputs[0].request_id == "a"  # the caller's id, not the engine's
        assert outputs[0].prompt_token_ids == toy_tokenizer.encode("hello there")
        assert len(tokens(outputs)) == 5 and outputs[-1].outputs[0].finish_reason == "length"
        with pytest.raises(ValueError, match="already running"):
            await frontend.add_request("a", "again", greedy(1), OutputSlot(DELTA))
        frontend.release("a", engine_id)
        assert frontend.num_live == 0
        second = await run_one(frontend, "a", "hello there", greedy(5))  # the id is free
        assert tokens(second) == tokens(outputs)


async def test_a_large_prompt_renders_in_a_thread_while_other_streams_run(
    toy_model_dir: Path, toy_tokenizer: Any, held_tokenizer: Any
) -> None:
    """While a big prompt is held mid-render (in its thread), another request is
    rendered, run and finished; the big one then completes with the right tokens.
    Rendered on the event-loop thread, the held tokenizer raises (no trio thread)
    and the big request fails instead."""
    held = held_tokenizer
    async with open_rig(toy_model_dir, toy_tokenizer, offload_tokenizer=held) as rig:
        frontend = rig.frontend
        big_slot = OutputSlot(DELTA)
        big_id: list[str] = []

        async def add_big() -> None:
            big_id.append(await frontend.add_request("big", BIG_PROMPT, greedy(3), big_slot))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(add_big)
            with trio.fail_after(30):
                await held.entered.wait()
            other = await run_one(frontend, "other", "a small prompt", greedy(8))
            assert len(tokens(other)) == 8 and other[-1].finished
            assert not big_id and not big_slot.ready  # still rendering, nothing registered
            held.release.set()
        assert rig.added()[-1] == big_id[0]
        outputs = await read_all(big_slot)
        assert outputs[0].prompt_token_ids == toy_tokenizer.encode(BIG_PROMPT)
        assert len(tokens(outputs)) == 3


async def cancel_once_rendering(held: Any, call: Callable[[], Awaitable[object]]) -> None:
    """Run ``call`` and cancel it once ``held`` (the offload tokenizer) has started
    rendering; fail if ``call`` returns instead of being cancelled."""
    with trio.CancelScope() as scope:

        async def cancel_when_entered() -> None:
            await held.entered.wait()
            scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_when_entered)
            await call()
            pytest.fail("the call returned although its caller was cancelled")
    assert scope.cancelled_caught


async def test_a_caller_cancelled_while_its_prompt_renders_registers_nothing(
    toy_model_dir: Path, toy_tokenizer: Any, held_tokenizer: Any
) -> None:
    held = held_tokenizer
    async with open_rig(toy_model_dir, toy_tokenizer, offload_tokenizer=held) as rig:
        frontend = rig.frontend
        await cancel_once_rendering(
            held, lambda: frontend.add_request("c", BIG_PROMPT, greedy(3), OutputSlot(DELTA))
        )
        # The id is free at once, the render still held in its (abandoned) thread.
        assert frontend.num_live == 0 and not held.finished.is_set()
        again = await run_one(frontend, "c", "short", greedy(2))
        assert again[-1].finished
        held.release.set()
        await trio.to_thread.run_sync(held.finished.wait)
        await trio.testing.wait_all_tasks_blocked()
        assert rig.added() == ["c-2"]  # the second one only: the first one's render was dropped
        with trio.fail_after(10):
            await rig.core.wait_idle()
        assert frontend.processor.get_num_unfinished_requests() == 0
        assert rig.core.scheduler.kv.num_used_blocks == 0


async def test_an_abort_while_the_prompt_renders_ends_the_request_as_abort(
    toy_model_dir: Path, toy_tokenizer: Any, held_tokenizer: Any
) -> None:
    held = held_tokenizer
    async with open_rig(toy_model_dir, toy_tokenizer, offload_tokenizer=held) as rig:
        frontend = rig.frontend
        slot = OutputSlot(DELTA)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(frontend.add_request, "x", BIG_PROMPT, greedy(200), slot)
            with trio.fail_after(30):
                await held.entered.wait()
            frontend.abort(["x"])
            held.release.set()
        outputs = await read_all(slot)
        assert outputs[-1].outputs[0].finish_reason == "abort"
        assert len(tokens(outputs)) < 200
        with trio.fail_after(10):
            await rig.core.wait_idle()
        assert rig.core.scheduler.kv.num_used_blocks == 0


async def test_a_prompt_that_fails_to_render_fails_that_request_alone(
    toy_model_dir: Path, toy_tokenizer: Any
) -> None:
    async with open_rig(toy_model_dir, toy_tokenizer) as rig:
        frontend = rig.frontend
        slot = OutputSlot(DELTA)
        engine_id = await frontend.add_request("bad", [1, 10**9], greedy(3), slot)
        with pytest.raises(ValidationError, match="prompt_token_ids: token id 1000000000"):
            await slot.get()
        assert rig.added() == [] and frontend.is_live("bad", engine_id)  # held until released
        frontend.release("bad", engine_id)

        class Exploding:
            def encode(self, text: str, **kwargs: Any) -> Any:
                raise RuntimeError("tokenizer exploded")

        frontend.renderer = copy.copy(frontend.renderer)
        frontend.renderer.tokenizer = Exploding()
        slot = OutputSlot(DELTA)
        await frontend.add_request("boom", "text", greedy(3), slot)
        with pytest.raises(EngineGenerateError, match="rendering failed: RuntimeError") as caught:
            await slot.get()
        assert caught.value.request_id == "boom" and rig.added() == []


async def test_after_fail_all_streams_and_new_requests_get_the_error(
    toy_model_dir: Path, toy_tokenizer: Any, held_tokenizer: Any
) -> None:
    held = held_tokenizer
    async with open_rig(toy_model_dir, toy_tokenizer, offload_tokenizer=held) as rig:
        frontend = rig.frontend
        open_slot = OutputSlot(DELTA)
        await frontend.add_request("open", "a prompt", greedy(500), open_slot)
        error = EngineDeadError("the engine is dead: test")
        rendering_raised: list[BaseException] = []

        async def add_big() -> None:
            try:
                await frontend.add_request("big", BIG_PROMPT, greedy(3), OutputSlot(DELTA))
            except EngineDeadError as exc:
                rendering_raised.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(add_big)
            with trio.fail_after(30):
                await held.entered.wait()
            frontend.fail_all(error)
            held.release.set()
        with pytest.raises(EngineDeadError) as caught:
            while True:
                await open_slot.get()
        assert caught.value is error
        assert rendering_raised == [error] and not frontend.is_live("big", "big-2")
        with pytest.raises(EngineDeadError):
            await frontend.add_request("new", "x", greedy(1), OutputSlot(DELTA))
        sent = len(rig.sent)
        frontend.abort(["open"])
        assert len(rig.sent) == sent  # nothing reaches a dead core


# ------------------------------------------------------------------ chat templates


async def test_a_large_chat_renders_in_a_thread_while_other_streams_run(
    toy_model_dir: Path, toy_tokenizer: Any, held_tokenizer: Any
) -> None:
    """While a big chat is held mid-render (in its thread), another request is rendered,
    run and finished; the chat then renders as the renderer renders it. Rendered on the
    event-loop thread, the held tokenizer raises and the chat fails instead."""
    async with open_rig(toy_model_dir, toy_tokenizer, offload_tokenizer=held_tokenizer) as rig:
        frontend = rig.frontend
        rendered: list[dict[str, Any]] = []

        async def render_big() -> None:
            rendered.append(await frontend.render_chat_prompt(BIG_CHAT))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(render_big)
            with trio.fail_after(30):
                await held_tokenizer.entered.wait()
            other = await run_one(frontend, "other", "a small prompt", greedy(8))
            assert len(tokens(other)) == 8 and other[-1].finished
            assert not rendered  # still rendering
            held_tokenizer.release.set()
        assert rendered == [frontend.renderer.render_chat_prompt(BIG_CHAT)]
        assert BIG_PROMPT in rendered[0]["prompt"] and len(rendered[0]["prompt_token_ids"]) > 1100
        assert rig.added() == ["other-1"]  # rendering a chat registers nothing


async def test_a_small_chat_renders_inline(
    toy_model_dir: Path, toy_tokenizer: Any, held_tokenizer: Any
) -> None:
    async with open_rig(toy_model_dir, toy_tokenizer, offload_tokenizer=held_tokenizer) as rig:
        frontend = rig.frontend
        with trio.fail_after(10):  # in the thread, the held tokenizer would wait here
            prompt = await frontend.render_chat_prompt(SMALL_CHAT, add_generation_prompt=False)
        assert prompt == frontend.renderer.render_chat_prompt(
            SMALL_CHAT, add_generation_prompt=False
        )
        assert not held_tokenizer.entered.is_set() and not held_tokenizer.finished.is_set()


async def test_a_caller_cancelled_while_its_chat_renders_gets_cancelled_at_once(
    toy_model_dir: Path, toy_tokenizer: Any, held_tokenizer: Any
) -> None:
    async with open_rig(toy_model_dir, toy_tokenizer, offload_tokenizer=held_tokenizer) as rig:
        frontend = rig.frontend
        await cancel_once_rendering(held_tokenizer, lambda: frontend.render_chat_prompt(BIG_CHAT))
        assert not held_tokenizer.finished.is_set()  # the abandoned thread is still held
        # Small chats and prompts go on meanwhile.
        small = await frontend.render_chat_prompt(SMALL_CHAT)
        assert small == frontend.renderer.render_chat_prompt(SMALL_CHAT)
        assert (await run_one(frontend, "after", "short", greedy(2)))[-1].finished
        held_tokenizer.release.set()
        await trio.to_thread.run_sync(held_tokenizer.finished.wait)
        # The thread is free again (the limiter's token came back): the next big chat renders.
        with trio.fail_after(30):
            again = await frontend.render_chat_prompt(BIG_CHAT)
        assert again == frontend.renderer.render_chat_prompt(BIG_CHAT)


async def test_a_large_chat_whose_template_fails_raises_the_field_as_inline(
    toy_model_dir: Path, toy_tokenizer: Any
) -> None:
    bad = "{{ raise_exception('no chats here') }}"
    async with open_rig(toy_model_dir, toy_tokenizer) as rig:
        for chat in (SMALL_CHAT, BIG_CHAT):
            with pytest.raises(ValidationError, match="messages: chat template failed") as caught:
                await rig.frontend.render_chat_prompt(chat, chat_template=bad)
            assert caught.value.field == "messages"
        with pytest.raises(ValidationError) as caught:
            await rig.frontend.render_chat_prompt([*BIG_CHAT, {"content": "no role"}])
        assert caught.value.field == "messages[2]"


# ------------------------------------------------------------------ the threshold


def test_renders_inline_by_size() -> None:
    at, over = "x" * INLINE_MAX_PROMPT_CHARS, "x" * (INLINE_MAX_PROMPT_CHARS + 1)
    ids, more_ids = [1] * INLINE_MAX_PROMPT_TOKENS, [1] * (INLINE_MAX_PROMPT_TOKENS + 1)
    assert renders_inline(at) and not renders_inline(over)
    assert renders_inline({"prompt": at}) and not renders_inline({"prompt": over})
    assert renders_inline(ids) and not renders_inline(more_ids)
    assert renders_inline({"prompt_token_ids": ids, "prompt": over})  # the ids are what is checked
    assert not renders_inline({"prompt_token_ids": more_ids})
    assert renders_inline({"neither": 1})  # an error to report: cheap


def test_chat_renders_inline_by_the_characters_of_roles_and_contents() -> None:
    room = INLINE_MAX_PROMPT_CHARS - len("user")
    at, over = (
        [{"role": "user", "content": "x" * room}],
        [{"role": "user", "content": "x" * (room + 1)}],
    )
    assert chat_renders_inline(at) and not chat_renders_inline(over)
    parts = [{"type": "text", "text": "x" * (room // 2 + 1)}] * 2  # the text of each part
    assert not chat_renders_inline([{"role": "user", "content": parts}])
    many_empty = [{"role": "user", "content": ""}] * (INLINE_MAX_PROMPT_CHARS // 4 + 1)
    assert not chat_renders_inline(many_empty)
    assert chat_renders_inline("not a list") and chat_renders_inline([1, 2])  # errors: cheap


def test_the_thread_renderer_has_a_tokenizer_of_its_own(toy_tokenizer: Any) -> None:
    vocab = len(toy_tokenizer)
    renderer = Renderer(toy_tokenizer, max_model_len=2048, vocab_size=vocab, eos_token_ids=[2])
    twin = thread_renderer(renderer)
    assert twin.tokenizer is not renderer.tokenizer
    assert twin.max_model_len == 2048 and twin.eos_token_id == 2
    assert twin.encode("hello there") == renderer.encode("hello there")
