"""OpenAI bodies -> prompts and SamplingParams through the pydantic models alone, and the
response builders (pure, no server)."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from legato.protocol.errors import ValidationError
from legato.protocol.outputs import Logprob
from legato.protocol.params import RequestOutputKind, SamplingParams
from legato.server import openai_schemas as schemas
from legato.server.asgi import dumps
from legato.server.openai_protocol import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateParams,
    parse_request,
    validation_error,
)


def parse(body: dict[str, Any], chat: bool = False, max_n: int = 4) -> tuple[Any, SamplingParams]:
    """The body's model and its SamplingParams, as the handlers build them."""
    typed = parse_request(ChatCompletionRequest if chat else CompletionRequest, body)
    return typed, typed.to_sampling_params(max_n=max_n)


def field_of(body: dict[str, Any], chat: bool = False) -> str:
    with pytest.raises(ValidationError) as info:
        parse(body, chat)
    return info.value.field


def prompts_of(prompt: Any) -> list[Any]:
    typed: CompletionRequest = parse_request(CompletionRequest, {"prompt": prompt})
    return typed.prompts()


def test_prompt_forms() -> None:
    assert prompts_of("a") == ["a"]
    assert prompts_of(["a", "b"]) == ["a", "b"]
    assert prompts_of([1, 2]) == [{"prompt_token_ids": [1, 2]}]
    assert prompts_of([[1], [2, 3]]) == [
        {"prompt_token_ids": [1]},
        {"prompt_token_ids": [2, 3]},
    ]
    for bad in ([], [1, "a"], [[1], []], [True], 3, {"a": 1}, [[1.5]]):
        with pytest.raises(ValidationError) as info:
            prompts_of(bad)
        assert info.value.field.startswith("prompt")
    with pytest.raises(ValidationError) as info:
        prompts_of(["x"] * (MAX_PROMPTS + 1))
    assert info.value.field == "prompt" and "at most 256" in info.value.reason
    salted = parse_request(CompletionRequest, {"prompt": [[1]], "cache_salt": "s"}).prompts()
    assert salted == [{"prompt_token_ids": [1], "cache_salt": "s"}]


def test_completion_fields_map_to_sampling_params() -> None:
    body = {
        "model": "m", "prompt": "p", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "n": 2,
        "stop": "x", "seed": 3, "logprobs": 2, "presence_penalty": 0.1, "frequency_penalty": 0.2,
        "user": "u", "echo": True, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
        "ignore_eos": True, "min_tokens": 1, "stop_token_ids": [1], "skip_special_tokens": False,
        "include_stop_str_in_output": True, "logit_bias": {"5": -1}, "stream": True,
        "stream_options": {"include_usage": True}, "unknown": object(),
    }  # fmt: skip
    request, p = parse(body)
    assert (p.max_tokens, p.temperature, p.top_p, p.n, p.stop, p.seed, p.logprobs) == (
        7,
        0.5,
        0.9,
        2,
        ["x"],
        3,
        2,
    )
    assert (p.top_k, p.min_p, p.repetition_penalty, p.ignore_eos, p.min_tokens) == (
        5,
        0.1,
        1.1,
        True,
        1,
    )
    assert (p.stop_token_ids, p.skip_special_tokens, p.include_stop_str_in_output) == (
        [1],
        False,
        True,
    )
    assert p.logit_bias == {5: -1.0} and p.output_kind == RequestOutputKind.DELTA
    assert (request.echo, request.stream, request.include_usage, request.model) == (
        True,
        True,
        True,
        "m",
    )
    defaults = parse({"prompt": "p", "max_tokens": None}, max_n=1)[1]
    assert defaults.max_tokens == 16 and defaults.n == 1  # OpenAI's and vLLM's completions default


def test_errors_name_the_request_field() -> None:
    assert field_of({"prompt": "p", "n": 5}) == "n"
    assert field_of({"prompt": "p", "seed": "1"}) == "seed"
    assert field_of({"prompt": "p", "logit_bias": {"x": 1}}) == "logit_bias"
    assert field_of({"prompt": "p", "stream": "yes"}) == "stream"
    assert field_of({"prompt": "p", "best_of": 3}) == "best_of"
    assert field_of({"prompt": "p", "min_tokens": 9, "max_tokens": 2}) == "min_tokens"
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert field_of({**chat, "max_completion_tokens": -1}, chat=True) == "max_completion_tokens"
    assert field_of({**chat, "max_tokens": 1.5}, chat=True) == "max_tokens"
    assert field_of({**chat, "logprobs": True, "top_logprobs": -1}, chat=True) == "top_logprobs"
    # tools, tool_choice and response_format are read by chat_outputs / tool_choice (tested there).
    assert field_of({**chat, "functions": [{"name": "f"}]}, chat=True) == "functions"
    assert (
        field_of({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, chat=True)
        == "messages[0].content[0].type"
    )


def test_chat_messages_and_defaults() -> None:
    body = {
        "messages": [
            {"role": "system", "content": None},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "n"},
        ],
        "logprobs": True,
        "top_logprobs": 3,
    }  # fmt: skip
    request, params = parse(body, chat=True, max_n=1)
    assert [message.for_template() for message in request.messages] == [
        {"role": "system", "content": ""},
        {"role": "user", "content": "a\nb", "name": "n"},
    ]
    assert params.max_tokens is None  # up to the context limit
    assert params.logprobs == 3 and request.top_logprobs == 3


def test_logprob_objects() -> None:
    entries = [
        {7: Logprob(-0.5, 2, "b"), 6: Logprob(-0.1, 1, "a"), 9: Logprob(-3.0, 3, "c")},
        {8: Logprob(-0.2, 1, "d")},
    ]

    def decode(token_id: int, lp: Logprob | None) -> str:
        return lp.decoded_token if lp is not None and lp.decoded_token else f"<{token_id}>"

    legacy = schemas.completion_logprobs([7, 8], entries, decode, text_offset=10)
    assert legacy == {
        "tokens": ["b", "d"],
        "token_logprobs": [-0.5, -0.2],
        "top_logprobs": [{"b": -0.5, "a": -0.1, "c": -3.0}, {"d": -0.2}],
        "text_offset": [10, 11],
    }
    chat = schemas.chat_logprobs([7, 8], entries, decode, top_k=2)
    first = chat["content"][0]
    assert (first["token"], first["logprob"], first["bytes"]) == ("b", -0.5, [98])
    assert [t["token"] for t in first["top_logprobs"]] == ["a", "b"]  # by rank
    assert chat["content"][1]["top_logprobs"] == [{"token": "d", "logprob": -0.2, "bytes": [100]}]


def test_json_never_carries_non_finite_numbers() -> None:
    assert (
        dumps({"a": [float("-inf"), float("inf"), float("nan"), 1.5]})
        == b'{"a":[-9999.0,9999.0,null,1.5]}'
    )


def test_websocket_params_model_builds_sampling_params() -> None:
    """The WebSocket ``params`` model: null is "not given" except where it is a value of the
    field (``max_tokens``: no limit), token-id keys come as ints (msgpack) or digit strings
    (JSON), unknown fields and wrong types are refused naming the field, and SamplingParams
    checks the ranges."""
    params = GenerateParams.model_validate({}).to_sampling_params(max_n=4)
    assert (params.max_tokens, params.temperature) == (16, 1.0)
    assert params.output_kind == RequestOutputKind.DELTA
    params = GenerateParams.model_validate(
        {"max_tokens": None, "temperature": None, "logit_bias": {5: 1.5, "7": -2}}
    ).to_sampling_params(max_n=4)
    assert (params.max_tokens, params.temperature) == (None, 1.0)
    assert params.logit_bias == {5: 1.5, 7: -2.0}
    params = GenerateParams.model_validate(
        {"structured_outputs": {"regex": "a+"}, "stop": "x"}
    ).to_sampling_params(max_n=4)
    assert params.structured_outputs is not None and params.structured_outputs.regex == "a+"
    assert params.stop == ["x"]

    def param_of(raw: dict[str, Any]) -> str:
        with pytest.raises((pydantic.ValidationError, ValidationError)) as info:
            GenerateParams.model_validate(raw).to_sampling_params(max_n=4)
        exc = info.value
        return (
            validation_error(exc).field if isinstance(exc, pydantic.ValidationError) else exc.field
        )

    assert param_of({"temperature": "hot"}) == "temperature"
    assert param_of({"ignore_eos": {}}) == "ignore_eos"
    assert param_of({"max_tokens": True}) == "max_tokens"
    assert param_of({"seed": 2**64}) == "seed"
    assert param_of({"logit_bias": {"x": 1}}) == "logit_bias"
    assert param_of({"wibble": 1}) == "wibble"
    assert param_of({"top_p": 1.5}) == "top_p"
    assert param_of({"n": 5}) == "n"
    assert param_of({"structured_outputs": {"wibble": 1}}) == "structured_outputs.wibble"
