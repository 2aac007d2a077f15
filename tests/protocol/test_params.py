"""SamplingParams and PoolingParams: vLLM's defaults, every validation rule (a ValidationError
whose ``field`` is vLLM's name and whose ``reason`` says why), the normalisations."""

from __future__ import annotations

import math
from typing import Any

import pytest

from legato.protocol.errors import PromptTooLongError, ValidationError
from legato.protocol.params import LoRARequest, PoolingParams, RequestOutputKind, SamplingParams

NAN = math.nan
INF = math.inf


def assert_names(info: pytest.ExceptionInfo[ValidationError], field: str) -> str:
    """The error is a ValidationError (a ValueError) naming ``field``; its reason."""
    exc = info.value
    assert type(exc) is ValidationError and isinstance(exc, ValueError)
    assert exc.field == field, (exc.field, field)
    assert exc.reason and str(exc) == f"{field}: {exc.reason}"
    return exc.reason


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.best_of) == (1, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)
    assert (p.seed, p.stop, p.stop_token_ids, p.bad_words) == (None, None, None, None)
    assert (p.include_stop_str_in_output, p.ignore_eos) == (False, False)
    assert (p.max_tokens, p.min_tokens) == (16, 0)
    assert (p.logprobs, p.prompt_logprobs) == (None, None)
    assert (p.detokenize, p.skip_special_tokens, p.spaces_between_special_tokens) == (
        True,
        True,
        True,
    )
    assert (p.logits_processors, p.truncate_prompt_tokens) == (None, None)
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert (p.allowed_token_ids, p.logit_bias, p.extra_args) == (None, None, None)
    assert not p.sampling_type_greedy


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("n", {"n": 0}),
        ("n", {"n": True}),
        ("n", {"n": 2.0}),
        ("best_of", {"best_of": 2}),
        ("best_of", {"n": 2, "best_of": 3}),
        ("presence_penalty", {"presence_penalty": -2.1}),
        ("presence_penalty", {"presence_penalty": 2.1}),
        ("presence_penalty", {"presence_penalty": NAN}),
        ("frequency_penalty", {"frequency_penalty": -2.1}),
        ("frequency_penalty", {"frequency_penalty": 2.1}),
        ("frequency_penalty", {"frequency_penalty": NAN}),
        ("repetition_penalty", {"repetition_penalty": 0.0}),
        ("repetition_penalty", {"repetition_penalty": -1.0}),
        ("repetition_penalty", {"repetition_penalty": NAN}),
        ("temperature", {"temperature": -0.1}),
        ("temperature", {"temperature": NAN}),
        ("temperature", {"temperature": "hot"}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.01}),
        ("top_p", {"top_p": NAN}),
        ("top_k", {"top_k": -2}),
        ("top_k", {"top_k": 1.5}),
        ("min_p", {"min_p": -0.1}),
        ("min_p", {"min_p": 1.1}),
        ("min_p", {"min_p": NAN}),
        ("seed", {"seed": 1.5}),
        ("max_tokens", {"max_tokens": 0}),
        ("max_tokens", {"max_tokens": True}),
        ("min_tokens", {"min_tokens": -1}),
        ("min_tokens", {"min_tokens": 17}),  # > max_tokens=16
        ("min_tokens", {"min_tokens": 5, "max_tokens": 4}),
        ("logprobs", {"logprobs": -2}),
        ("prompt_logprobs", {"prompt_logprobs": -2}),
        ("truncate_prompt_tokens", {"truncate_prompt_tokens": 0}),
        ("stop", {"stop": ""}),
        ("stop", {"stop": ["ok", ""]}),
        ("stop", {"stop": [3]}),
        ("stop", {"stop": ["x"], "detokenize": False}),
        ("stop_token_ids", {"stop_token_ids": [-1]}),
        ("stop_token_ids", {"stop_token_ids": [1.0]}),
        ("stop_token_ids", {"stop_token_ids": [True]}),
        ("stop_token_ids", {"stop_token_ids": ["2"]}),
        ("allowed_token_ids", {"allowed_token_ids": []}),
        ("allowed_token_ids", {"allowed_token_ids": [-3]}),
        ("allowed_token_ids", {"allowed_token_ids": [2.5]}),
        ("allowed_token_ids", {"allowed_token_ids": [False]}),
        ("logit_bias", {"logit_bias": {-1: 1.0}}),
        ("logit_bias", {"logit_bias": {1.5: 1.0}}),
        ("logit_bias", {"logit_bias": {True: 1.0}}),
        ("logit_bias", {"logit_bias": {"50256": 1.0}}),
        ("logit_bias", {"logit_bias": {3: NAN}}),
        ("logit_bias", {"logit_bias": {3: INF}}),
        ("logit_bias", {"logit_bias": {3: "big"}}),
        ("bad_words", {"bad_words": [""]}),
        ("logits_processors", {"logits_processors": ["not callable"]}),
        ("logits_processors", {"logits_processors": [lambda ids, logits: logits]}),
        ("output_kind", {"output_kind": 7}),
        ("output_kind", {"output_kind": "delta"}),
    ],
)
def test_each_rule_names_its_field(field: str, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValidationError) as info:
        SamplingParams(**kwargs)
    assert_names(info, field)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 3, "best_of": 3},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"repetition_penalty": 0.01},
        {"top_p": 1e-3},
        {"top_k": -1},
        {"min_p": 1.0},
        {"max_tokens": None, "min_tokens": 10_000},
        {"min_tokens": 16},
        {"logprobs": -1, "prompt_logprobs": 0},
        {"logits_processors": []},
        {"stop_token_ids": [], "allowed_token_ids": [0]},
        {"logit_bias": {0: -100, 7: 100.0}},
        {"temperature": 100.0, "seed": -(2**63)},
    ],
)
def test_edges_that_are_allowed(kwargs: dict[str, Any]) -> None:
    SamplingParams(**kwargs)


def test_stop_string_becomes_a_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]  # type: ignore[arg-type]


def test_sequences_are_copied_into_lists() -> None:
    ids = [5, 6]
    params = SamplingParams(stop_token_ids=ids, allowed_token_ids=(1, 2), bad_words=("x",))  # type: ignore[arg-type]
    assert params.stop_token_ids == [5, 6] and params.stop_token_ids is not ids
    assert params.allowed_token_ids == [1, 2]
    assert params.bad_words == ["x"]
    assert params.all_stop_token_ids == {5, 6}


def test_logit_bias_values_become_floats() -> None:
    params = SamplingParams(logit_bias={3: 2})
    assert params.logit_bias == {3: 2.0}
    assert type(params.logit_bias[3]) is float


def test_greedy_resets_truncation_knobs() -> None:
    params = SamplingParams(temperature=0.0, top_p=0.5, top_k=10, min_p=0.2)
    assert (params.top_p, params.top_k, params.min_p) == (1.0, 0, 0.0)
    assert params.sampling_type_greedy
    sampled = SamplingParams(temperature=0.5, top_p=0.5, top_k=10, min_p=0.2)
    assert (sampled.top_p, sampled.top_k, sampled.min_p) == (0.5, 10, 0.2)


def test_greedy_hides_otherwise_invalid_truncation_knobs_as_vllm_does() -> None:
    assert SamplingParams(temperature=0.0, top_p=0.0).top_p == 1.0


def test_output_kind_from_int() -> None:
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA  # type: ignore[arg-type]
    assert (
        SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY).output_kind
        is RequestOutputKind.FINAL_ONLY
    )


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("stop_token_ids", {"stop_token_ids": [1, 100]}),
        ("allowed_token_ids", {"allowed_token_ids": [100]}),
        ("logit_bias", {"logit_bias": {100: 1.0}}),
    ],
)
def test_validate_against_vocab(field: str, kwargs: dict[str, Any]) -> None:
    params = SamplingParams(**kwargs)
    params.validate_against_vocab(101)
    with pytest.raises(ValidationError) as info:
        params.validate_against_vocab(100)
    assert assert_names(info, field) == "token id 100 is outside the vocabulary (100)"


def test_clone_validates_and_copies() -> None:
    params = SamplingParams(stop=["x"], stop_token_ids=[1], logit_bias={1: 1.0})
    copy = params.clone(temperature=0.5)
    assert copy.temperature == 0.5 and copy.stop == ["x"]
    assert copy.stop is not params.stop and copy.logit_bias is not params.logit_bias
    with pytest.raises(ValueError, match="^top_p: "):
        params.clone(top_p=2.0)


def test_pooling_params() -> None:
    assert PoolingParams() == PoolingParams(task="embed", dimensions=None, normalize=True)
    for task in ("embed", "classify", "score", "encode"):
        PoolingParams(task=task)
    with pytest.raises(ValidationError) as info:
        PoolingParams(task="generate")
    assert assert_names(info, "task") == "unknown pooling task 'generate'"
    for kwargs, field in (
        ({"dimensions": 0}, "dimensions"),
        ({"dimensions": True}, "dimensions"),
        ({"normalize": "yes"}, "normalize"),
    ):
        with pytest.raises(ValidationError) as info:
            PoolingParams(**kwargs)
        assert_names(info, field)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"top_k": 2**64}, "top_k"),
        ({"max_tokens": 2**40}, "max_tokens"),
        ({"n": 2**31}, "n"),
        ({"seed": 2**64}, "seed"),
        ({"skip_special_tokens": {}}, "skip_special_tokens"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"detokenize": "yes"}, "detokenize"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"allowed_token_ids": "12"}, "allowed_token_ids"),
        ({"logit_bias": [1]}, "logit_bias"),
    ],
)
def test_values_no_worker_could_hold_are_refused_by_name(kwargs: dict[str, Any], field: str) -> None:
    # Such values used to pass validation and then kill the engine inside the model worker.
    with pytest.raises(ValidationError) as info:
        SamplingParams(**kwargs)
    assert_names(info, field)


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "presence_penalty", "top_p"])
def test_infinities_are_refused_by_name(field: str) -> None:
    with pytest.raises(ValidationError) as info:
        SamplingParams(**{field: math.inf})
    assert assert_names(info, field).startswith("must be a finite number")


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"json": 3}, "structured_outputs.json"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"regex": 1}, "structured_outputs.regex"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"wibble": "x"}, "structured_outputs.wibble"),
        ({"regex": "a", "grammar": "b"}, "structured_outputs"),
        ("a string", "structured_outputs"),
    ],
)
def test_structured_outputs_errors_name_the_sub_field(value: Any, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        SamplingParams(structured_outputs=value)
    assert_names(info, field)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"lora_name": "", "lora_int_id": 1}, "lora_name"),
        ({"lora_name": "a", "lora_int_id": 0}, "lora_int_id"),
        ({"lora_name": "a", "lora_int_id": 1, "lora_path": 3}, "lora_path"),
        ({"lora_name": "a", "lora_int_id": 1, "base_model_name": 3}, "base_model_name"),
    ],
)
def test_lora_request_errors_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        LoRARequest(**kwargs)
    assert_names(info, field)


def test_validation_error_renamed_keeps_type_and_reason() -> None:
    exc = PromptTooLongError("prompt_token_ids", "has 9 tokens, over 8")
    assert (exc.field, exc.reason, str(exc)) == (
        "prompt_token_ids",
        "has 9 tokens, over 8",
        "prompt_token_ids: has 9 tokens, over 8",
    )
    renamed = exc.renamed("prompt")
    assert type(renamed) is PromptTooLongError
    assert (renamed.field, renamed.reason, str(renamed)) == (
        "prompt",
        "has 9 tokens, over 8",
        "prompt: has 9 tokens, over 8",
    )
    assert exc.renamed("prompt_token_ids") is exc
    nested = ValidationError("structured_outputs.json", "bad").under("params")
    assert (nested.field, str(nested)) == (
        "params.structured_outputs.json",
        "params.structured_outputs.json: bad",
    )


def test_validation_error_is_public_and_a_value_error() -> None:
    import legato

    with pytest.raises(legato.ValidationError) as info:
        legato.SamplingParams(top_p=1.5)
    assert isinstance(info.value, ValueError)
    assert (info.value.field, str(info.value).split(":")[0]) == ("top_p", "top_p")


@pytest.mark.parametrize(
    "extra_args, reason",
    [
        ({"k": 2**64}, "64 bits"),
        ({"k": -(2**63) - 1}, "64 bits"),
        ({7: "x"}, "keys must be strings"),
        ({"k": float("nan")}, "finite"),
        ({"k": {"k": {"k": {"k": {"k": {"k": {"k": {"k": 1}}}}}}}}, "nested deeper"),
        ({"k": list(range(300))}, "more than 256 values"),
        ({"k": "x" * 70_000}, "characters"),
        ({"k": object()}, "JSON values"),
        ([1], "must be an object"),
    ],
)
def test_extra_args_are_bounded_json(extra_args: Any, reason: str) -> None:
    """Free-form, so bounded: nothing in it can be costly to copy or fail to encode."""
    with pytest.raises(ValidationError) as info:
        SamplingParams(extra_args=extra_args)
    assert info.value.field == "extra_args" and reason in info.value.reason


def test_extra_args_take_plain_json() -> None:
    args = {"a": [1, 2.5, None, True, "s"], "b": {"c": -(2**63)}}
    assert SamplingParams(extra_args=args).extra_args == args
