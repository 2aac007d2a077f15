"""Recoverable faults stay recoverable: one bad request fails alone, the engine keeps serving.

Every case here is an error the engine can pin on one request (design.md,
"Failure semantics"): a tokenizer that raises on one prompt (a test double), a
prompt too long for the model, an empty prompt, invalid parameters or prompt
types. That request fails with a clear error naming the field; a bystander
stream running meanwhile gets all its tokens; the engine stays healthy
(``check_health`` passes, ``errored`` is False); the failed request's id is
free again and the next request succeeds (vLLM's processor-error test).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from legato import EngineGenerateError, RequestOutput, RequestOutputKind, SamplingParams
from legato.engine import AsyncEngine, open_engine
from legato.protocol.errors import PromptTooLongError, ValidationError

ENGINE_ARGS: dict[str, Any] = dict(
    executor="inproc", max_model_len=512, num_kv_blocks=600, disable_log_stats=True
)
BYSTANDER_TOKENS = 40


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture
async def engine(toy_model_dir: Path) -> AsyncIterator[AsyncEngine]:
    async with open_engine(str(toy_model_dir), **ENGINE_ARGS) as eng:
        yield eng


async def run_one(
    engine: AsyncEngine, prompt: Any, params: Any, request_id: str
) -> list[RequestOutput]:
    with trio.fail_after(30):
        outputs = []
        async with engine.generate(prompt, params, request_id) as stream:
            async for output in stream:
                outputs.append(output)
        return outputs


async def with_bystander(engine: AsyncEngine, body: Callable[[], Awaitable[None]]) -> None:
    """Run ``body`` while a long stream is in flight; that stream must get all its tokens."""
    got: list[RequestOutput] = []
    first_token = trio.Event()

    async def bystander() -> None:
        params = greedy(BYSTANDER_TOKENS, output_kind=RequestOutputKind.DELTA)
        async with engine.generate("an innocent bystander", params, "bystander") as stream:
            async for output in stream:
                got.append(output)
                first_token.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(bystander)
        await first_token.wait()
        await body()
    assert sum(len(o.outputs[0].token_ids) for o in got) == BYSTANDER_TOKENS
    assert got[-1].outputs[0].finish_reason == "length"


async def assert_still_serving(engine: AsyncEngine, request_id: str) -> None:
    """Healthy, and the failed request's id works again at once."""
    assert not engine.errored and engine.is_running
    await engine.check_health()
    outputs = await run_one(engine, "the next request works", greedy(3), request_id)
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"


async def assert_idle(engine: AsyncEngine) -> None:
    with trio.fail_after(30):
        await engine.wait_until_idle()
    assert engine.num_kv_blocks_used == 0
    assert not engine.frontend.processor.has_unfinished_requests()


# ------------------------------------------------------------------ the tokenizer raising


class TokenizerThatFailsOn:
    """Test double: the real tokenizer, except ``encode`` raises for prompts holding ``marker``."""

    def __init__(self, inner: Any, marker: str) -> None:
        self._inner = inner
        self._marker = marker

    def encode(self, text: str, **kwargs: Any) -> Any:
        if self._marker in text:
            raise RuntimeError(f"tokenizer exploded on {text!r}")
        return self._inner.encode(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


async def test_a_tokenizer_failure_fails_that_request_alone(engine: AsyncEngine) -> None:
    engine.renderer.tokenizer = TokenizerThatFailsOn(engine.renderer.tokenizer, "POISON")

    async def body() -> None:
        with pytest.raises(EngineGenerateError) as caught:
            await run_one(engine, "a POISON prompt", greedy(4), "poisoned")
        error = caught.value
        assert error.request_id == "poisoned"
        # The message names the kind only (it may reach a client); the cause keeps the detail.
        assert str(error).endswith("rendering failed: RuntimeError"), str(error)
        assert isinstance(error.__cause__, RuntimeError)
        assert "tokenizer exploded on 'a POISON prompt'" in str(error.__cause__)
        await assert_still_serving(engine, "poisoned")

    await with_bystander(engine, body)
    await assert_idle(engine)


async def test_poisoned_requests_among_many_fail_alone(engine: AsyncEngine) -> None:
    engine.renderer.tokenizer = TokenizerThatFailsOn(engine.renderer.tokenizer, "POISON")
    failed: list[int] = []
    finished: list[int] = []

    async def one(i: int) -> None:
        prompt = f"request {i} {'POISON' if i % 3 == 0 else 'fine'}"
        try:
            outputs = await run_one(engine, prompt, greedy(5), f"m{i}")
        except EngineGenerateError as exc:
            assert exc.request_id == f"m{i}"
            failed.append(i)
        else:
            assert outputs[-1].outputs[0].finish_reason == "length"
            finished.append(i)

    async with trio.open_nursery() as nursery:
        for i in range(24):
            nursery.start_soon(one, i)
    assert sorted(failed) == list(range(0, 24, 3))
    assert sorted(finished) == [i for i in range(24) if i % 3]
    await assert_still_serving(engine, "m0")
    await assert_idle(engine)


# ------------------------------------------------------------------ bad prompts and params


BAD_PROMPTS: list[tuple[str, Any, str, str]] = [
    # (case, prompt, field named, message part)
    ("too long", "word " * 600, "prompt", "leave no room within max_model_len=512"),
    ("empty ids", {"prompt_token_ids": []}, "prompt", "must not be empty"),
    ("empty list", [], "prompt", "must not be empty"),
    ("text and empty ids", {"prompt": "", "prompt_token_ids": []}, "prompt", "must not be empty"),
    ("id outside vocab", {"prompt_token_ids": [1, 10**9]}, "prompt_token_ids", "outside"),
    ("negative id", [1, -1], "prompt_token_ids", "outside the vocabulary"),
    ("bool id", {"prompt_token_ids": [1, True]}, "prompt_token_ids", "must be integers"),
    ("ids as text", {"prompt_token_ids": "1 2 3"}, "prompt_token_ids", "list of integers"),
    ("dict without prompt", {"text": "hi"}, "prompt", "needs 'prompt' or 'prompt_token_ids'"),
    ("prompt not text", {"prompt": 5}, "prompt", "must be a string"),
    ("int prompt", 42, "prompt", "unsupported prompt type int"),
]

BAD_PARAMS: list[tuple[str, Any, str, str]] = [
    ("logprobs", greedy(4, logprobs=21), "logprobs", "at most 20"),
    ("prompt_logprobs", greedy(4, prompt_logprobs=21), "prompt_logprobs", "at most 20"),
    ("allowed ids", greedy(4, allowed_token_ids=[5000]), "allowed_token_ids", "outside"),
    ("stop ids", greedy(4, stop_token_ids=[99999]), "stop_token_ids", "outside"),
    ("logit_bias", greedy(4, logit_bias={4096: 1.0}), "logit_bias", "outside"),
    ("not params", {"max_tokens": 3}, "sampling_params", "must be SamplingParams"),
]


async def test_bad_prompts_fail_alone_naming_the_field(engine: AsyncEngine) -> None:
    async def body() -> None:
        for case, prompt, field, message in BAD_PROMPTS:
            with pytest.raises(ValidationError) as caught:
                await run_one(engine, prompt, greedy(4), f"bad-{case}")
            assert caught.value.field == field, case
            assert message in str(caught.value), (case, str(caught.value))
            await assert_still_serving(engine, f"bad-{case}")

    await with_bystander(engine, body)
    await assert_idle(engine)


async def test_too_long_prompts_raise_prompt_too_long(engine: AsyncEngine) -> None:
    with pytest.raises(PromptTooLongError, match="prompt: 5.. prompt tokens leave no room"):
        await run_one(engine, {"prompt_token_ids": [5] * 512}, greedy(1), "long")
    # max_tokens past max_model_len is capped, as vLLM does: the request runs to the
    # limit and ends with finish_reason "length".
    capped = await run_one(engine, {"prompt_token_ids": [5] * 500}, greedy(13), "long")
    assert len(capped[-1].outputs[0].token_ids) == 12
    assert capped[-1].outputs[0].finish_reason == "length"
    await assert_still_serving(engine, "long")


async def test_bad_params_fail_alone_naming_the_field(engine: AsyncEngine) -> None:
    async def body() -> None:
        for case, params, field, message in BAD_PARAMS:
            with pytest.raises(ValidationError) as caught:
                await run_one(engine, "fine prompt", params, f"bad-{case}")
            assert caught.value.field == field, case
            assert message in str(caught.value), (case, str(caught.value))
            await assert_still_serving(engine, f"bad-{case}")

    await with_bystander(engine, body)
    await assert_idle(engine)


async def test_an_empty_text_prompt_is_the_bos_token(engine: AsyncEngine) -> None:
    """As in vLLM: "" tokenizes to the BOS token alone, which is a valid prompt."""
    bos = engine.tokenizer.bos_token_id
    for prompt in ("", {"prompt": ""}):
        outputs = await run_one(engine, prompt, greedy(3), "empty-text")
        assert outputs[-1].prompt_token_ids == [bos]
        assert len(outputs[-1].outputs[0].token_ids) == 3
    await assert_still_serving(engine, "empty-text")


async def test_unsupported_features_are_refused_at_once(engine: AsyncEngine) -> None:
    with pytest.raises(ValidationError, match="lora_request: must be a LoRARequest"):
        engine.generate("hi", greedy(2), "lora", lora_request=object())
    await assert_still_serving(engine, "lora")


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -1.0), ("top_p", 0.0), ("n", 0), ("max_tokens", 0), ("min_tokens", -1)],
)
def test_invalid_sampling_params_are_refused_before_the_engine(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams(**{field: value})
