"""OutputSlot: put never blocks and merges what the consumer has not taken; get waits, is cancellable."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from legato.actors.output_slot import OutputSlot
from legato.protocol.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from legato.protocol.params import RequestOutputKind

DELTA = RequestOutputKind.DELTA
CUMULATIVE = RequestOutputKind.CUMULATIVE


def completion(
    index: int,
    text: str,
    token_ids: list[int],
    *,
    finish_reason: str | None = None,
    stop_reason: int | str | None = None,
    cumulative_logprob: float | None = None,
    logprobs: list[dict[int, Logprob]] | None = None,
) -> CompletionOutput:
    return CompletionOutput(
        index, text, token_ids, cumulative_logprob, logprobs, finish_reason, stop_reason
    )


def output(*completions: CompletionOutput, finished: bool = False, t: float = 0.0) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        prompt="p",
        prompt_token_ids=[1, 2],
        prompt_logprobs=None,
        outputs=list(completions),
        finished=finished,
        num_cached_tokens=0,
        metrics=RequestMetrics(arrival_time=0.0, last_token_time=t),
    )


def test_delta_outputs_merge_per_completion_until_taken() -> None:
    slot = OutputSlot(DELTA)
    lp = [{5: Logprob(-0.5, 1, "a")}]
    first = output(completion(0, "He", [5], cumulative_logprob=-0.5, logprobs=lp), t=1.0)
    first.prompt_logprobs = [None, {2: Logprob(-1.0, 1, "x")}]
    slot.put(first)
    slot.put(
        output(completion(1, "Yo", [7], cumulative_logprob=-1.0, logprobs=[{7: Logprob(-1.0)}]))
    )
    slot.put(output(completion(0, "llo", [6, 8], cumulative_logprob=-2.0, logprobs=lp * 2), t=2.0))
    slot.put(
        output(
            completion(
                0,
                "!",
                [9],
                finish_reason="stop",
                stop_reason=9,
                cumulative_logprob=-3.0,
                logprobs=lp,
            ),
            finished=True,
            t=3.0,
        )
    )
    merged = slot.get_nowait()
    assert merged is not None
    assert [c.index for c in merged.outputs] == [0, 1]
    zero, one = merged.outputs
    assert (zero.text, zero.token_ids) == ("Hello!", [5, 6, 8, 9])
    assert zero.logprobs == lp * 4
    assert (zero.cumulative_logprob, zero.finish_reason, zero.stop_reason) == (-3.0, "stop", 9)
    assert (one.text, one.token_ids, one.finish_reason) == ("Yo", [7], None)
    assert merged.finished is True
    assert merged.prompt_logprobs == first.prompt_logprobs
    assert merged.metrics is not None and merged.metrics.last_token_time == 3.0
    assert slot.get_nowait() is None


def test_cumulative_outputs_replace_the_pending_one() -> None:
    slot = OutputSlot(CUMULATIVE)
    slot.put(output(completion(0, "He", [5])))
    slot.put(output(completion(0, "Hello", [5, 6])))
    taken = slot.get_nowait()
    assert taken is not None and taken.outputs[0].text == "Hello"
    assert slot.get_nowait() is None


def test_a_thousand_puts_without_a_consumer_arrive_as_one_merged_delta() -> None:
    # The producer never waits; a slow consumer gets everything in one piece.
    slot = OutputSlot(DELTA)
    for i in range(1000):
        slot.put(output(completion(0, str(i % 10), [i])))
    merged = slot.get_nowait()
    assert merged is not None
    assert merged.outputs[0].text == "0123456789" * 100
    assert merged.outputs[0].token_ids == list(range(1000))


async def test_get_waits_for_a_put() -> None:
    slot = OutputSlot(DELTA)
    got: list[RequestOutput] = []

    async def consumer() -> None:
        got.append(await slot.get())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consumer)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []
        slot.put(output(completion(0, "a", [1])))
        slot.put(output(completion(0, "b", [2])))
    assert [o.outputs[0].text for o in got] == ["ab"]


async def test_get_is_a_checkpoint_even_when_ready() -> None:
    slot = OutputSlot(DELTA)
    slot.put(output(completion(0, "a", [1])))
    with trio.testing.assert_checkpoints():
        await slot.get()


async def test_cancelled_get_takes_nothing() -> None:
    slot = OutputSlot(DELTA)
    with trio.move_on_after(0.01) as scope:
        await slot.get()  # nothing there: waits, then is cancelled
    assert scope.cancelled_caught
    slot.put(output(completion(0, "a", [1])))
    with trio.CancelScope() as scope:
        scope.cancel()
        await slot.get()  # ready, but cancelled at the checkpoint before taking
    assert scope.cancelled_caught
    taken = await slot.get()
    assert taken.outputs[0].text == "a"


async def test_error_takes_precedence_and_sticks() -> None:
    slot = OutputSlot(DELTA)
    slot.put(output(completion(0, "a", [1])))
    first, second = RuntimeError("first"), RuntimeError("second")
    slot.put_error(first)
    slot.put_error(second)  # the first error wins
    slot.put(output(completion(0, "b", [2])))  # ignored after an error
    for _ in range(2):
        with pytest.raises(RuntimeError, match="first"):
            await slot.get()
    with pytest.raises(RuntimeError, match="first"):
        slot.get_nowait()


async def test_put_error_wakes_a_waiting_consumer() -> None:
    slot = OutputSlot(CUMULATIVE)

    async def consumer() -> None:
        with pytest.raises(ValueError, match="boom"):
            await slot.get()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consumer)
        await trio.testing.wait_all_tasks_blocked()
        slot.put_error(ValueError("boom"))


async def test_a_second_consumer_is_refused() -> None:
    slot = OutputSlot(DELTA)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(slot.get)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.BusyResourceError):
            await slot.get()
        nursery.cancel_scope.cancel()


def test_usable_without_trio_by_polling() -> None:
    # A synchronous engine (LLMEngine.step) polls with get_nowait; nothing waits in get.
    slot = OutputSlot(DELTA)
    assert slot.get_nowait() is None
    slot.put(output(completion(0, "a", [1])))
    assert slot.ready
    taken = slot.get_nowait()
    assert taken is not None and taken.outputs[0].text == "a"
    slot.put_error(RuntimeError("x"))
    with pytest.raises(RuntimeError):
        slot.get_nowait()
