"""InputProcessor: vLLM's ``process_inputs`` / ``assign_request_id`` / ``preprocess`` over
legato's Renderer, and the EngineCoreRequest it builds as a prompt the renderer takes."""

from __future__ import annotations

from typing import Any

import pytest

from legato.frontend.input_processor import InputProcessor
from legato.frontend.renderer import Renderer
from legato.protocol.errors import ValidationError
from legato.protocol.inputs import EngineCoreRequest
from legato.protocol.params import LoRARequest, PoolingParams, SamplingParams


@pytest.fixture
def renderer(toy_tokenizer: Any) -> Renderer:
    return Renderer(
        toy_tokenizer, max_model_len=64, vocab_size=len(toy_tokenizer), eos_token_ids=[1]
    )


def test_process_inputs_builds_vllms_request_as_the_engine_renders(renderer: Renderer) -> None:
    processor = InputProcessor(renderer)
    params = SamplingParams(max_tokens=4)
    lora = LoRARequest("sql", 1, "/adapters/sql")
    request = processor.process_inputs(
        "r1", {"prompt": "Hello there", "cache_salt": "s"}, params, ("generate",), 5.0, lora,
        None, {"traceparent": "x"}, 3,
    )  # fmt: skip
    assert request.prompt_token_ids == renderer.encode("Hello there")
    assert (request.request_id, request.arrival_time, request.priority) == ("r1", 5.0, 3)
    assert request.params is params and request.pooling_params is None
    assert request.lora_request is lora and request.cache_salt == "s"
    assert request.eos_token_id == 1 and request.prompt == "Hello there"
    # The request is a prompt the renderer takes back: same tokens, same salt.
    again = renderer.render_prompt(request)
    assert (again.text, again.token_ids, again.cache_salt) == (
        "Hello there",
        request.prompt_token_ids,
        "s",
    )
    processor.assign_request_id(request)
    assert request.external_req_id == "r1" and request.request_id.startswith("r1-")
    assert len(request.request_id) == len("r1-") + 8
    pooled = processor.process_inputs(
        "e", [5, 6], PoolingParams(task="embed"), ("generate", "embed")
    )
    assert pooled.sampling_params is None and pooled.params.task == "embed"  # type: ignore[union-attr]


def test_process_inputs_refuses_what_the_engine_would_not_serve(renderer: Renderer) -> None:
    processor = InputProcessor(renderer)
    with pytest.raises(ValidationError) as caught:
        processor.process_inputs("e", "hi", PoolingParams(task="embed"), ("generate",))
    assert caught.value.field == "params"
    with pytest.raises(ValidationError, match="data_parallel_rank"):
        processor.process_inputs("r", "hi", SamplingParams(), data_parallel_rank=1)
    with pytest.raises(TypeError, match="request_id"):
        processor.process_inputs(7, "hi", SamplingParams())  # type: ignore[arg-type]
    assert processor.preprocess("Hello") == {
        "type": "token", "prompt_token_ids": renderer.encode("Hello"), "prompt": "Hello"
    }  # fmt: skip
    assert processor.get_tokenizer() is renderer.tokenizer


def test_embeds_and_encoder_decoder_prompts_are_refused_by_name(renderer: Renderer) -> None:
    for prompt, field in [
        ({"prompt_embeds": [[0.1, 0.2]]}, "prompt_embeds"),
        ({"encoder_prompt": "a", "decoder_prompt": "b"}, "prompt"),
    ]:
        with pytest.raises(ValidationError) as caught:
            renderer.render_prompt(prompt)
        assert caught.value.field == field
    request = InputProcessor(renderer).process_inputs("r", "hi", SamplingParams())
    request.prompt_embeds = object()
    with pytest.raises(ValidationError, match="prompt_embeds"):
        renderer.render_prompt(request)
    request.prompt_embeds, request.prompt_token_ids = None, [10**9]
    with pytest.raises(ValidationError):  # a hand-built request is checked again
        renderer.render_prompt(request)
    assert isinstance(request, EngineCoreRequest)
