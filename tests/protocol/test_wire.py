"""The wire codec: exact round trips, and nothing but WireError from hostile bytes."""

from __future__ import annotations

import dataclasses
import enum
import inspect
from typing import Any

import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import legato.protocol
from legato.config import EngineConfig
from legato.protocol import messages
from legato.protocol.messages import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineRequest,
    FinishReason,
    GrammarBitmask,
    HealthPing,
    HealthPong,
    ModelRunnerOutput,
    NewRequestData,
    RunnerSamplingParams,
    SchedulerOutput,
    SchedulerStats,
    SpecDecodingStats,
    TokenLogprobs,
    UtilityCall,
    UtilityResult,
    WorkerError,
    WorkerInit,
    WorkerReady,
)
from legato.protocol.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from legato.protocol.params import LoRARequest, PoolingParams, RequestOutputKind, SamplingParams
from legato.protocol.structured import StructuredOutputsParams
from legato.protocol.wire import (
    HEADER_SIZE,
    WIRE_MAGIC,
    WIRE_TYPES,
    WIRE_VERSION,
    WireError,
    decode,
    encode,
    frame,
    frame_header,
    read_frame_header,
)

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ------------------------------------------------------------------ strategies

ints = st.integers(-(2**63), 2**63 - 1)
small = st.integers(0, 10_000)
floats = st.floats(allow_nan=False)  # NaN != NaN would defeat equality, not the codec
text = st.text(max_size=12)
token_ids = st.lists(st.integers(0, 2**31), max_size=12)
natives: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | ints | floats | text | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=4) | small, inner, max_size=4)
    ),
    max_leaves=12,
)
json_values: st.SearchStrategy[Any] = st.recursive(  # extra_args takes JSON only
    st.none() | st.booleans() | ints | st.floats(allow_nan=False, allow_infinity=False) | text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12,
)


def optional(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | strategy


def _valid_sampling(kw: dict[str, Any]) -> bool:
    return not (kw["stop"] and not kw["detokenize"])


structured_outputs = st.one_of(
    st.builds(
        StructuredOutputsParams,
        json=st.one_of(
            st.dictionaries(text, st.integers(-9, 9) | text | st.booleans(), max_size=3),
            st.just('{"type": "object"}'),
        ),
        disable_any_whitespace=st.booleans(),
    ),
    st.builds(StructuredOutputsParams, regex=text),
    st.builds(StructuredOutputsParams, choice=st.lists(text, min_size=1, max_size=3)),
    st.builds(StructuredOutputsParams, grammar=text, field=st.just("guided_grammar")),
    st.builds(StructuredOutputsParams, json_object=st.just(True), spec_field=optional(text)),
)

sampling_params = (
    st.fixed_dictionaries(
        {
            "n": st.integers(1, 4),
            "presence_penalty": st.floats(-2, 2),
            "frequency_penalty": st.floats(-2, 2),
            "repetition_penalty": st.floats(0.01, 10),
            "temperature": st.floats(0, 5),
            "top_p": st.floats(0.01, 1),
            "top_k": st.integers(-1, 100),
            "min_p": st.floats(0, 1),
            "seed": optional(ints),
            "stop": optional(st.lists(st.text(min_size=1, max_size=5), max_size=3)),
            "stop_token_ids": optional(token_ids),
            "bad_words": optional(st.lists(st.text(min_size=1, max_size=5), max_size=3)),
            "include_stop_str_in_output": st.booleans(),
            "ignore_eos": st.booleans(),
            "max_tokens": optional(st.integers(8, 4096)),
            "min_tokens": st.integers(0, 8),
            "logprobs": optional(st.integers(-1, 20)),
            "prompt_logprobs": optional(st.integers(-1, 20)),
            "detokenize": st.booleans(),
            "skip_special_tokens": st.booleans(),
            "logits_processors": st.sampled_from([None, []]),
            "truncate_prompt_tokens": optional(st.integers(1, 4096)),
            "output_kind": st.sampled_from(RequestOutputKind),
            "allowed_token_ids": optional(st.lists(st.integers(0, 2**31), min_size=1, max_size=5)),
            "logit_bias": optional(
                st.dictionaries(st.integers(0, 2**31), st.floats(-100, 100), max_size=4)
            ),
            "extra_args": optional(st.dictionaries(text, json_values, max_size=3)),
            "structured_outputs": optional(structured_outputs),
        }
    )
    .filter(_valid_sampling)
    .map(lambda kw: SamplingParams(**kw))
)

logprob = st.builds(Logprob, logprob=floats, rank=optional(ints), decoded_token=optional(text))
position_logprobs = st.dictionaries(small, logprob, max_size=3)
token_logprobs = st.builds(
    TokenLogprobs, token_ids=token_ids, logprobs=st.lists(floats), ranks=token_ids
)
lora_request = st.builds(
    LoRARequest,
    lora_name=text.filter(bool),
    lora_int_id=st.integers(1, 2**31 - 1),
    lora_path=text,
    base_model_name=optional(text),
)
completion = st.builds(
    CompletionOutput,
    index=small,
    text=text,
    token_ids=token_ids,
    cumulative_logprob=optional(floats),
    logprobs=optional(st.lists(position_logprobs, max_size=3)),
    finish_reason=optional(st.sampled_from(["stop", "length", "abort"])),
    stop_reason=optional(ints | text),
    lora_request=optional(lora_request),
)
metrics = st.builds(
    RequestMetrics,
    arrival_time=floats,
    first_scheduled_time=optional(floats),
    first_token_time=optional(floats),
    last_token_time=optional(floats),
    finished_time=optional(floats),
)
pooling_output = st.builds(PoolingOutput, data=st.lists(floats, max_size=8))
pooling_params = st.builds(
    PoolingParams,
    task=st.sampled_from(["embed", "classify", "score", "encode"]),
    dimensions=optional(st.integers(1, 4096)),
    normalize=st.booleans(),
)
runner_params = sampling_params.map(RunnerSamplingParams.of)
new_request = st.builds(
    NewRequestData,
    request_id=text,
    prompt_token_ids=token_ids,
    params_key=text,
    block_ids=token_ids,
    num_computed_tokens=small,
    output_token_ids=token_ids,
    lora_request=optional(lora_request),
    pooling_params=optional(pooling_params),
    seed=optional(ints),
)
cached_request = st.lists(st.tuples(text, small), max_size=4).flatmap(
    lambda rows: st.builds(
        CachedRequestData,
        req_ids=st.just([r for r, _ in rows]),
        num_computed_tokens=st.just([n for _, n in rows]),
        new_block_ids=st.dictionaries(text, token_ids, max_size=2),
        new_token_ids=st.dictionaries(text, token_ids, max_size=2),
    )
)
spec_decoding_stats = st.builds(
    SpecDecodingStats,
    num_drafts=small,
    num_draft_tokens=small,
    num_accepted_tokens=small,
    num_accepted_tokens_per_pos=st.lists(small, max_size=4),
)
scheduler_stats = st.builds(
    SchedulerStats,
    num_running=small,
    num_waiting=small,
    kv_cache_usage=st.floats(0, 1),
    num_blocks_total=small,
    num_blocks_used=small,
    prefix_cache_queries=small,
    prefix_cache_hits=small,
    num_preempted=small,
    num_scheduled_tokens=small,
    num_prefill_tokens=small,
    num_decode_tokens=small,
    spec_decoding=optional(spec_decoding_stats),
)
core_output = st.builds(
    EngineCoreOutput,
    request_id=text,
    new_token_ids=token_ids,
    new_logprobs=optional(st.lists(token_logprobs, max_size=2)),
    new_prompt_logprobs=optional(st.lists(optional(token_logprobs), max_size=2)),
    finish_reason=optional(st.sampled_from(FinishReason)),
    stop_reason=optional(ints | text),
    num_cached_tokens=small,
    error=optional(text),
    error_field=optional(text),
)

STRATEGIES: dict[type, st.SearchStrategy[Any]] = {
    SamplingParams: sampling_params,
    PoolingParams: pooling_params,
    LoRARequest: lora_request,
    StructuredOutputsParams: structured_outputs,
    RequestOutputKind: st.sampled_from(RequestOutputKind),
    Logprob: logprob,
    RequestMetrics: metrics,
    CompletionOutput: completion,
    RequestOutput: st.builds(
        RequestOutput,
        request_id=text,
        prompt=optional(text),
        prompt_token_ids=optional(token_ids),
        prompt_logprobs=optional(st.lists(optional(position_logprobs), max_size=3)),
        outputs=st.lists(completion, max_size=3),
        finished=st.booleans(),
        num_cached_tokens=optional(small),
        metrics=optional(metrics),
        lora_request=optional(lora_request),
        encoder_prompt=optional(text),
        encoder_prompt_token_ids=optional(token_ids),
        kv_transfer_params=optional(st.dictionaries(text, ints, max_size=2)),
    ),
    PoolingOutput: pooling_output,
    PoolingRequestOutput: st.builds(
        PoolingRequestOutput,
        request_id=text,
        outputs=pooling_output,
        prompt_token_ids=token_ids,
        num_cached_tokens=small,
        finished=st.booleans(),
    ),
    EngineRequest: st.builds(
        EngineRequest,
        request_id=text,
        prompt_token_ids=token_ids,
        sampling_params=sampling_params,
        arrival_time=floats,
        priority=ints,
        eos_token_id=optional(small),
        lora_name=optional(text),
        cache_salt=optional(text),
        parent_id=optional(text),
        index=small,
        runner_params=optional(runner_params),
    ),
    RunnerSamplingParams: runner_params,
    NewRequestData: new_request,
    CachedRequestData: cached_request,
    SchedulerOutput: st.builds(
        SchedulerOutput,
        step_id=small,
        new_requests=st.lists(new_request, max_size=3),
        cached_requests=cached_request,
        num_scheduled_tokens=st.dictionaries(text, small, max_size=4),
        total_num_scheduled_tokens=small,
        finished_req_ids=st.lists(text, max_size=3),
        preempted_req_ids=st.lists(text, max_size=3),
        grammar_bitmask=st.dictionaries(text, st.binary(max_size=16), max_size=2),
        grammar_bitmask_follows=st.booleans(),
        sampling_params=st.dictionaries(text, runner_params, max_size=2),
        scheduled_spec_decode_tokens=st.dictionaries(text, token_ids, max_size=2),
    ),
    GrammarBitmask: st.builds(
        GrammarBitmask,
        step_id=small,
        rows=st.dictionaries(text, st.binary(max_size=16), max_size=3),
    ),
    TokenLogprobs: token_logprobs,
    ModelRunnerOutput: st.builds(
        lambda step_id, samples, **fields: ModelRunnerOutput.from_lists(
            step_id, [r for r, _ in samples], [t for _, t in samples], **fields
        ),
        step_id=small,
        samples=st.lists(st.tuples(text, token_ids), max_size=4),
        logprobs=st.dictionaries(text, st.lists(token_logprobs, max_size=2), max_size=2),
        prompt_logprobs=st.dictionaries(
            text, st.lists(optional(token_logprobs), max_size=2), max_size=2
        ),
        pooled=st.dictionaries(text, st.lists(floats, max_size=4), max_size=2),
        spec_token_ids=st.dictionaries(text, token_ids, max_size=2),
    ),
    SchedulerStats: scheduler_stats,
    SpecDecodingStats: spec_decoding_stats,
    EngineCoreOutput: core_output,
    EngineCoreOutputs: st.builds(
        EngineCoreOutputs,
        outputs=st.lists(core_output, max_size=3),
        timestamp=floats,
        scheduler_stats=optional(scheduler_stats),
    ),
    FinishReason: st.sampled_from(FinishReason),
    HealthPing: st.builds(HealthPing, seq=ints, sent_time=floats),
    HealthPong: st.builds(HealthPong, seq=ints, sent_time=floats),
    UtilityCall: st.builds(
        UtilityCall,
        call_id=ints,
        method=text,
        args=st.lists(natives, max_size=3),
        kwargs=st.dictionaries(text, natives, max_size=3),
    ),
    UtilityResult: st.builds(UtilityResult, call_id=ints, result=natives, error=optional(text)),
    WorkerInit: st.builds(
        WorkerInit,
        config=st.dictionaries(text, natives, max_size=4),
        inject_fault=optional(st.dictionaries(text, natives, max_size=2)),
    ),
    WorkerReady: st.builds(
        WorkerReady,
        pid=small,
        num_kv_blocks=small,
        max_model_len=small,
        vocab_size=small,
        eos_token_ids=token_ids,
        dtype=text,
        device=text,
    ),
    WorkerError: st.builds(WorkerError, message=text, error_type=text, fatal=st.booleans()),
    EngineConfig: st.builds(
        EngineConfig,
        model=optional(text),
        tokenizer=optional(text),
        dtype=st.sampled_from(["auto", "float32", "bfloat16", "float16"]),
        device=st.sampled_from(["auto", "cpu", "cuda"]),
        seed=ints,
        max_model_len=optional(st.integers(1, 2048)),
        block_size=st.sampled_from([8, 16, 32]),
        num_kv_blocks=optional(st.integers(1, 10_000)),
        kv_cache_memory=optional(st.integers(1, 2**40)),
        max_num_seqs=st.integers(1, 512),
        scheduling_policy=st.sampled_from(["fcfs", "priority"]),
        executor=st.sampled_from(["process", "inproc"]),
        enforce_eager=st.booleans(),
        attention_backend=st.sampled_from(["auto", "torch", "triton"]),
        heartbeat_interval=st.floats(0.1, 1),
        heartbeat_timeout=st.floats(2, 30),
        profile_dir=optional(text),
    ),
}
any_wire_object = st.one_of(*STRATEGIES.values())


def _payload(obj: object) -> Any:
    return msgpack.unpackb(encode(obj), strict_map_key=False)[3]


def _frame(
    tag: int, payload: Any, *, version: Any = WIRE_VERSION, magic: Any = WIRE_MAGIC
) -> bytes:
    return msgpack.packb([magic, version, tag, payload], use_bin_type=True)


def _tag(cls: type) -> int:
    return next(tag for tag, c in WIRE_TYPES.items() if c is cls)


def _decode_or_wire_error(data: bytes) -> None:
    try:
        obj = decode(data)
    except WireError:
        return
    assert type(obj) in WIRE_TYPES.values()
    assert decode(encode(obj)) is not None  # whatever decodes is a valid object that encodes again


# ------------------------------------------------------------------ round trips


def test_every_message_type_is_registered_and_has_a_strategy() -> None:
    in_messages = {
        obj
        for _, obj in inspect.getmembers(messages, inspect.isclass)
        if obj.__module__ == messages.__name__
        and obj is not messages.Message
        and (issubclass(obj, msgspec.Struct) or issubclass(obj, enum.Enum))
    }
    assert in_messages <= set(WIRE_TYPES.values())
    assert set(STRATEGIES) == set(WIRE_TYPES.values())
    assert len(set(WIRE_TYPES.values())) == len(WIRE_TYPES)


@pytest.mark.parametrize("cls", list(STRATEGIES), ids=lambda cls: cls.__name__)
@FAST
@given(data=st.data())
def test_round_trip_is_exact(cls: type, data: st.DataObject) -> None:
    obj = data.draw(STRATEGIES[cls])
    frame = encode(obj)
    back = decode(frame, expected=cls)
    assert type(back) is cls
    assert back == obj
    assert encode(back) == frame


def test_float_fields_accept_ints_and_come_back_as_floats() -> None:
    back = decode(_frame(_tag(HealthPing), [1, 3]))
    assert back == HealthPing(seq=1, sent_time=3.0)
    assert type(back.sent_time) is float  # type: ignore[attr-defined]
    assert type(decode(encode(HealthPing(seq=1, sent_time=3))).sent_time) is float


def test_logits_processors_empty_list_crosses() -> None:
    params = SamplingParams(logits_processors=[])
    assert decode(encode(params)) == params


def test_public_names() -> None:
    assert legato.protocol.WireError is WireError
    assert legato.protocol.encode is encode
    assert legato.protocol.decode is decode
    assert issubclass(WireError, ValueError)


# ------------------------------------------------------------------ hostile bytes


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_raise_only_wire_error(data: bytes) -> None:
    _decode_or_wire_error(data)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(WIRE_TYPES)), natives)
def test_random_payloads_raise_only_wire_error(tag: int, payload: Any) -> None:
    _decode_or_wire_error(_frame(tag, payload))
    _decode_or_wire_error(_frame(tag, [payload]))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_wire_object, st.data())
def test_mutated_frames_raise_only_wire_error(obj: object, data: st.DataObject) -> None:
    frame = bytearray(encode(obj))
    where = data.draw(st.integers(0, len(frame) - 1))
    how = data.draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete"]))
    if how == "flip":
        frame[where] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "set":
        frame[where] = data.draw(st.integers(0, 255))
    elif how == "truncate":
        del frame[where:]
    elif how == "insert":
        frame[where:where] = data.draw(st.binary(min_size=1, max_size=4))
    else:
        del frame[where]
    _decode_or_wire_error(bytes(frame))


def test_every_truncation_is_rejected() -> None:
    cached = CachedRequestData(["r"], [3], {"r": [2]}, {"r": [1]})
    frame = encode(SchedulerOutput(1, [], cached, {"r": 1}, 1))
    for end in range(len(frame)):
        with pytest.raises(WireError, match="malformed frame"):
            decode(frame[:end])


def test_trailing_bytes_are_rejected() -> None:
    with pytest.raises(WireError, match="malformed frame"):
        decode(encode(HealthPong(1, 2.0)) + b"\x00")


def test_oversized_frames_are_rejected_both_ways() -> None:
    frame = encode(UtilityCall(0, "x" * 100, [], {}))
    with pytest.raises(WireError, match="over the limit"):
        decode(frame, max_size=len(frame) - 1)
    assert decode(frame, max_size=len(frame)) == UtilityCall(0, "x" * 100, [], {})
    with pytest.raises(
        WireError, match=r"UtilityCall \(tag 50\) frame is \d+ bytes, over the limit"
    ):
        encode(UtilityCall(0, "x" * 100, [], {}), max_size=50)


def test_a_whole_frame_is_its_header_then_its_payload() -> None:
    call = UtilityCall(3, "ping", [1], {})
    data = frame(call, 7)
    assert read_frame_header(data[:HEADER_SIZE]) == (len(data) - HEADER_SIZE, 7)
    assert decode(data[HEADER_SIZE:]) == call
    with pytest.raises(WireError, match="over the limit"):
        frame(UtilityCall(0, "x" * 100, [], {}), 1, max_size=50)


@pytest.mark.parametrize(
    "data",
    [
        b"\xdd\xff\xff\xff\xff",  # array of 4 billion elements, none present
        b"\xdf\xff\xff\xff\xff",  # map of 4 billion entries
        b"\xdb\xff\xff\xff\xff",  # 4 GiB string
        b"\xc6\xff\xff\xff\xff",  # 4 GiB bytes
        b"\x94\xa6legato\x01\x17\xdd\x7f\xff\xff\xff",  # a frame whose payload claims 2**31 fields
    ],
)
def test_huge_declared_lengths_are_rejected_without_allocating(data: bytes) -> None:
    with pytest.raises(WireError, match="malformed frame|not a legato frame"):
        decode(data)


def test_unknown_tag() -> None:
    with pytest.raises(WireError, match="unknown type tag 999"):
        decode(_frame(999, []))
    with pytest.raises(WireError, match="unknown type tag 'x'"):
        decode(_frame("x", []))  # type: ignore[arg-type]


def test_wrong_version_and_magic() -> None:
    payload = _payload(HealthPong(1, 2.0))
    with pytest.raises(WireError, match="unsupported wire version 2; this side speaks 1"):
        decode(_frame(_tag(HealthPong), payload, version=2))
    with pytest.raises(WireError, match="unsupported wire version True"):
        decode(_frame(_tag(HealthPong), payload, version=True))
    with pytest.raises(WireError, match="not a legato frame"):
        decode(_frame(_tag(HealthPong), payload, magic="vllm"))
    with pytest.raises(WireError, match="not a legato frame"):
        decode(msgpack.packb({"legato": 1}))


def test_expected_type_mismatch() -> None:
    with pytest.raises(
        WireError, match=r"expected a SchedulerOutput frame, got tag 49 \(HealthPong\)"
    ):
        decode(encode(HealthPong(1, 2.0)), expected=SchedulerOutput)


def test_wrong_arity() -> None:
    tag = _tag(HealthPing)
    with pytest.raises(WireError, match=r"bad frame: HealthPing \(tag 48\): Expected `array` of"):
        decode(_frame(tag, [1]))
    with pytest.raises(WireError, match="bad frame: HealthPing"):
        decode(_frame(tag, [1, 2.0, 3]))
    with pytest.raises(WireError, match=r"Expected `array`, got `object`"):
        decode(_frame(tag, {"seq": 1, "sent_time": 2.0}))


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (["1", 2.0], r"Expected `int`, got `str` - at `\$\[0\]`"),
        ([True, 2.0], r"Expected `int`, got `bool` - at `\$\[0\]`"),
        ([1.0, 2.0], r"Expected `int`, got `float` - at `\$\[0\]`"),
        ([1, "2"], r"Expected `float`, got `str` - at `\$\[1\]`"),
        ([1, None], r"Expected `float`, got `None` - at `\$\[1\]`"),
        ([1, b"2"], r"Expected `float`, got `bytes` - at `\$\[1\]`"),
    ],
)
def test_wrong_field_types(payload: list[Any], message: str) -> None:
    with pytest.raises(WireError, match=r"bad frame: HealthPing \(tag 48\): " + message):
        decode(_frame(_tag(HealthPing), payload))


def test_nested_error_names_the_path() -> None:
    requests = [NewRequestData(f"r{i}", [1, 2], "p", [0], 0) for i in range(3)]
    table = {"p": RunnerSamplingParams.of(SamplingParams(top_p=0.5))}
    payload = _payload(
        SchedulerOutput(1, requests, CachedRequestData(), {}, 0, sampling_params=table)
    )
    payload[9]["p"][1] = "high"
    with pytest.raises(WireError) as caught:
        decode(_frame(_tag(SchedulerOutput), payload))
    assert str(caught.value) == (
        "bad frame: SchedulerOutput (tag 23): Expected `float`, got `str` - at `$[9][...][1]`"
    )


def test_error_path_through_dicts_and_optionals() -> None:
    logprobs = {"a": [TokenLogprobs([1], [-0.5], [1])]}
    payload = _payload(ModelRunnerOutput(1, ["a"], [1], [1], logprobs))
    payload[4]["a"][0][1][0] = "x"
    with pytest.raises(WireError, match=r"Expected `float`, got `str` - at `\$\[4\]\[\.\.\.\]"):
        decode(_frame(_tag(ModelRunnerOutput), payload))
    payload = _payload(CompletionOutput(0, "", [], logprobs=[{5: Logprob(-1.0)}]))
    payload["logprobs"][0] = {"5": payload["logprobs"][0][5]}
    with pytest.raises(WireError, match=r"Expected `int`, got `str` - at `key` in `\$.logprobs"):
        decode(_frame(_tag(CompletionOutput), payload))


def test_invalid_sampling_params_in_a_frame_is_a_wire_error() -> None:
    payload = _payload(EngineRequest("r", [1], SamplingParams(), 0.0))
    payload[2]["min_tokens"] = 100  # > max_tokens=16
    with pytest.raises(WireError) as caught:
        decode(_frame(_tag(EngineRequest), payload))
    assert type(caught.value) is WireError
    assert "EngineRequest (tag 20): min_tokens: must be <= max_tokens=16, got 100 - at `$[2]`" in (
        str(caught.value)
    )


def test_invalid_config_in_a_frame_is_a_wire_error() -> None:
    payload = _payload(EngineConfig())
    payload["block_size"] = 0
    with pytest.raises(WireError, match=r"EngineConfig \(tag 60\): block_size: must be a positive"):
        decode(_frame(_tag(EngineConfig), payload))
    payload = _payload(EngineConfig())
    payload["dtype"] = "float64"
    with pytest.raises(WireError, match=r"Invalid enum value 'float64' - at `\$.dtype`"):
        decode(_frame(_tag(EngineConfig), payload))


@pytest.mark.parametrize("value", [7, True, "delta", None, 1.0])
def test_enum_values_must_be_members(value: Any) -> None:
    payload = _payload(EngineCoreOutput("r", [1], finish_reason=FinishReason.STOP))
    payload[4] = value
    if value is None:
        assert decode(_frame(_tag(EngineCoreOutput), payload)).finish_reason is None  # type: ignore[attr-defined]
        return
    with pytest.raises(WireError, match=r"EngineCoreOutput \(tag 27\): .* - at `\$\[4\]`"):
        decode(_frame(_tag(EngineCoreOutput), payload))


def test_unions_check_each_arm() -> None:
    payload = _payload(EngineCoreOutput("r", [], stop_reason=3))
    payload[5] = 1.5
    with pytest.raises(
        WireError, match=r"Expected `int \| str \| null`, got `float` - at `\$\[5\]`"
    ):
        decode(_frame(_tag(EngineCoreOutput), payload))
    payload[5] = "</s>"
    assert decode(_frame(_tag(EngineCoreOutput), payload)).stop_reason == "</s>"  # type: ignore[attr-defined]


def test_extension_types_are_rejected() -> None:
    """No extension type is decoded, except msgpack's own timestamp (a datetime: plain data)."""
    payload = _payload(UtilityResult(1, None))
    payload[1] = msgpack.ExtType(5, b"x")
    with pytest.raises(WireError, match="msgpack extension type 5 is not accepted"):
        decode(_frame(_tag(UtilityResult), payload))
    payload[1] = msgpack.Timestamp(1)
    assert decode(_frame(_tag(UtilityResult), payload)).result.timestamp() == 1  # type: ignore[attr-defined]


def test_dict_keys_are_checked() -> None:
    payload = _payload(SamplingParams(logit_bias={1: 0.5}))
    payload["logit_bias"] = {True: 0.5}
    with pytest.raises(
        WireError, match=r"Expected `int`, got `bool` - at `key` in `\$.logit_bias`"
    ):
        decode(_frame(_tag(SamplingParams), payload))


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def test_deeply_nested_any_payloads() -> None:
    """Nesting is bounded by the interpreter's recursion limit on both sides: a hostile frame
    gets a WireError, never a crash."""
    shallow = UtilityCall(1, "m", [_nested(200)], {"k": {"a": _nested(5)}})
    assert decode(encode(shallow)) == shallow
    with pytest.raises(WireError, match="cannot encode UtilityCall"):
        encode(UtilityCall(1, "m", [_nested(100_000)]))
    deep = b"\x94\xa6legato\x01\x33\x93\x01" + b"\x91" * 100_000 + b"\x01\xc0"
    with pytest.raises(WireError, match="malformed frame"):
        decode(deep)


# ------------------------------------------------------------------ encode side


def test_encode_refuses_callables() -> None:
    params = SamplingParams()
    params.logits_processors = [lambda token_ids, logits: logits]
    with pytest.raises(WireError, match="cannot encode SamplingParams \\(tag 1\\): .*function"):
        encode(params)


def test_encode_refuses_unregistered_types() -> None:
    @dataclasses.dataclass
    class Stranger:
        x: int = 0

    with pytest.raises(WireError, match="cannot encode Stranger: not a wire type"):
        encode(Stranger())
    with pytest.raises(WireError, match="cannot encode dict"):
        encode({"a": 1})


def test_wrong_field_types_are_refused_by_the_receiver() -> None:
    """Encoding does not check annotations (the receiving decoder does, loudly); values with
    no msgpack form cannot be encoded at all."""
    with pytest.raises(WireError, match=r"HealthPing \(tag 48\): Expected `int`, got `str`"):
        decode(encode(HealthPing(seq="1", sent_time=0.0)))  # type: ignore[arg-type]
    with pytest.raises(WireError, match="cannot encode UtilityCall .*object"):
        encode(UtilityCall(1, "m", [], {"f": object()}))
    with pytest.raises(WireError, match="cannot encode UtilityResult"):
        encode(UtilityResult(1, 2**70))


def test_encode_widens_subclasses_and_tuples() -> None:
    out = decode(encode(EngineCoreOutput("r", (1, 2), stop_reason=FinishReason.ABORT)))  # type: ignore[arg-type]
    assert out == EngineCoreOutput("r", [1, 2], stop_reason=2)
    assert type(out.stop_reason) is int  # type: ignore[attr-defined]
    assert decode(encode(UtilityCall(1, "m", [(1, 2)]))) == UtilityCall(1, "m", [[1, 2]])


# ------------------------------------------------------------------ stream framing


def test_frame_header_round_trip() -> None:
    frame = encode(HealthPing(1, 2.0))
    header = frame_header(len(frame), 2**64 - 1)
    assert len(header) == HEADER_SIZE == 12
    assert header == len(frame).to_bytes(4, "big") + (2**64 - 1).to_bytes(8, "big")
    assert read_frame_header(header) == (len(frame), 2**64 - 1)
    assert read_frame_header(frame_header(0)) == (0, 0)


def test_frame_header_limits() -> None:
    with pytest.raises(WireError, match="over the limit"):
        read_frame_header(b"\xff\xff\xff\xff" + bytes(8))
    with pytest.raises(WireError, match="over the limit of 10"):
        read_frame_header(frame_header(11), max_size=10)
    with pytest.raises(WireError, match="must be 12 bytes, got 3"):
        read_frame_header(b"\x00\x00\x01")
    with pytest.raises(WireError, match="over the limit"):
        frame_header(100, max_size=10)
    with pytest.raises(WireError, match="must not be negative"):
        frame_header(-1)
    with pytest.raises(WireError, match="over the limit of 4294967295"):
        frame_header(2**32, max_size=2**40)
    for bad_id in (-1, 2**64):
        with pytest.raises(WireError, match="frame id must be in 0 .. 2\\*\\*64-1"):
            frame_header(1, bad_id)


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        (2, [1, 1], "num_sampled: 2 entries for 1 req_ids"),  # a count per request
        (2, [2], "add up to the 1 sampled_token_ids"),  # counts past the flat list
        (2, [-1], "add up to the 1 sampled_token_ids"),
        (3, [], "add up to the 0 sampled_token_ids"),  # tokens missing
    ],
)
def test_runner_output_whose_counts_do_not_match_its_tokens_is_rejected(
    field: int, value: list[int], reason: str
) -> None:
    payload = _payload(ModelRunnerOutput(1, ["a"], [1], [7]))
    payload[field] = value
    with pytest.raises(WireError, match=reason):
        decode(_frame(_tag(ModelRunnerOutput), payload))


def test_cached_requests_need_one_computed_count_per_id() -> None:
    payload = _payload(CachedRequestData(["a", "b"], [3, 4]))
    payload[1] = [3]
    with pytest.raises(WireError, match="num_computed_tokens: 1 entries for 2 req_ids"):
        decode(_frame(_tag(CachedRequestData), payload))
