"""The renderer: prompts to validated engine requests."""

from __future__ import annotations

from typing import Any

import pytest

from legato import SamplingParams
from legato.frontend.renderer import Renderer
from legato.protocol.errors import PromptTooLongError, ValidationError


@pytest.fixture
def renderer(toy_tokenizer: Any) -> Renderer:
    return Renderer(
        toy_tokenizer, max_model_len=64, vocab_size=len(toy_tokenizer), eos_token_ids=[1, 4]
    )


def test_prompt_forms(renderer: Renderer) -> None:
    text = renderer.render_prompt("héllo")
    assert text.text == "héllo" and text.token_ids[0] == renderer.tokenizer.bos_token_id
    assert renderer.render_prompt({"prompt": "héllo"}).token_ids == text.token_ids
    assert renderer.render_prompt({"prompt_token_ids": [7, 8]}).token_ids == [7, 8]
    assert renderer.render_prompt([7, 8]).token_ids == [7, 8]
    for bad, field in (
        ({"prompt_token_ids": []}, "prompt"),
        ({"prompt_token_ids": [7, "x"]}, "prompt_token_ids"),
        ({"prompt_token_ids": [10**6]}, "prompt_token_ids"),
        ({"nothing": 1}, "prompt"),
        (3.5, "prompt"),
    ):
        with pytest.raises(ValidationError) as info:
            renderer.render_prompt(bad)  # type: ignore[arg-type]
        assert info.value.field == field


def test_limits_fan_out_and_extra_eos_ids(renderer: Renderer) -> None:
    prompt = renderer.render_prompt([5] * 10)
    (one,) = renderer.make_requests("r", prompt, SamplingParams(max_tokens=4))
    assert one.eos_token_id == 1 and one.sampling_params.stop_token_ids == [4]
    (free,) = renderer.make_requests("r", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    assert not free.sampling_params.stop_token_ids
    (unbounded,) = renderer.make_requests("r", prompt, SamplingParams(max_tokens=None))
    assert unbounded.sampling_params.max_tokens == 54
    kids = renderer.make_requests("p", prompt, SamplingParams(n=3, seed=7, max_tokens=2))
    assert [k.request_id for k in kids] == ["0_p", "1_p", "2_p"]
    assert [k.sampling_params.seed for k in kids] == [7, 8, 9]
    assert all(k.parent_id == "p" and k.sampling_params.n == 1 for k in kids)
    # Past max_model_len, max_tokens (and min_tokens) are capped, as vLLM does.
    (capped,) = renderer.make_requests("r", prompt, SamplingParams(max_tokens=60, min_tokens=58))
    assert (capped.sampling_params.max_tokens, capped.sampling_params.min_tokens) == (54, 54)
    with pytest.raises(PromptTooLongError) as info:
        renderer.make_requests("r", renderer.render_prompt([5] * 64), SamplingParams(max_tokens=1))
    assert info.value.field == "prompt"
    with pytest.raises(ValidationError, match="logprobs"):
        renderer.make_requests("r", prompt, SamplingParams(logprobs=50))
    with pytest.raises(ValidationError, match="stop_token_ids"):
        renderer.make_requests("r", prompt, SamplingParams(stop_token_ids=[10**6]))


def test_chat_prompt_has_one_bos(renderer: Renderer) -> None:
    chat = renderer.render_chat_prompt([{"role": "user", "content": "hi"}])
    assert chat["prompt_token_ids"].count(renderer.tokenizer.bos_token_id) == 1
    with pytest.raises(ValidationError, match="messages"):
        renderer.render_chat([])
    with pytest.raises(ValidationError, match=r"messages\[0\]"):
        renderer.render_chat([{"content": "no role"}])


def test_minus_one_logprobs_obey_max_logprobs(toy_tokenizer: Any) -> None:
    """vLLM's rule: -1 means the whole vocabulary, so it passes only when max_logprobs is -1
    (a sentinel must not skip the bound, or one request's output overflows the worker's frame)."""
    vocab = len(toy_tokenizer)
    capped = Renderer(toy_tokenizer, max_model_len=64, vocab_size=vocab, eos_token_ids=[1])
    prompt = capped.render_prompt([5] * 10)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValidationError) as info:
            capped.make_requests("r", prompt, SamplingParams(**{name: -1}))
        assert info.value.field == name and "whole vocabulary" in info.value.reason
        (ok,) = capped.make_requests("r", prompt, SamplingParams(**{name: 20}))
    unbounded = Renderer(
        toy_tokenizer, max_model_len=64, vocab_size=vocab, eos_token_ids=[1], max_logprobs=-1
    )
    (whole,) = unbounded.make_requests("r", prompt, SamplingParams(prompt_logprobs=-1))
    assert whole.sampling_params.prompt_logprobs == -1


def test_children_share_one_runner_params_without_the_detokenizer_fields(
    renderer: Renderer,
) -> None:
    prompt = renderer.render_prompt([5] * 10)
    params = SamplingParams(n=4, seed=3, max_tokens=2, stop=["Z" * 128], extra_args={"k": 1})
    kids = renderer.make_requests("p", prompt, params)
    shared = kids[0].runner_params
    assert shared is not None and all(k.runner_params is shared for k in kids)
    assert not {"stop", "extra_args", "seed", "structured_outputs"} & set(shared.__struct_fields__)
