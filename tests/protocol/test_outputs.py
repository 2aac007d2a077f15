"""RequestOutput, CompletionOutput and PoolingRequestOutput in vLLM's shape."""

from __future__ import annotations

from legato.protocol.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from legato.protocol.params import LoRARequest
from legato.protocol.wire import decode, encode


def output(*completions: CompletionOutput, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", "p", [1, 2], None, list(completions), finished)


def test_vllms_fields_with_their_defaults() -> None:
    out = output(CompletionOutput(0, "a", [3]))
    assert out.lora_request is None and out.kv_transfer_params is None
    assert out.encoder_prompt is None and out.encoder_prompt_token_ids is None
    assert out.multi_modal_placeholders == {}
    assert out.outputs[0].lora_request is None
    lora = LoRARequest("a", 1, "/adapters/a")
    full = RequestOutput(
        "r", None, [1], None, [], True, num_cached_tokens=3, lora_request=lora,
        kv_transfer_params={"k": 1},
    )  # fmt: skip
    assert full.lora_request is lora and full.kv_transfer_params == {"k": 1}
    assert decode(encode(full)) == full  # the new fields cross the wire


def test_request_output_takes_vllms_positional_order() -> None:
    """vLLM builds it positionally: ``..., finished, metrics, lora_request,
    encoder_prompt, encoder_prompt_token_ids, num_cached_tokens``."""
    lora = LoRARequest("a", 1, "/adapters/a")
    metrics = RequestMetrics(arrival_time=1.0)
    out = RequestOutput("r", "p", [1], None, [], True, metrics, lora, None, None, 4)
    assert out.metrics is metrics and out.lora_request is lora and out.num_cached_tokens == 4


def test_add_aggregates_deltas_by_index() -> None:
    out = output(CompletionOutput(0, "he", [1], -1.0, [{1: Logprob(-1.0)}]))
    out.add(
        output(
            CompletionOutput(0, "llo", [2, 3], -2.5, [{2: Logprob(-0.5)}, {3: Logprob(-1.0)}]),
            CompletionOutput(1, "x", [9]),
        ),
        aggregate=True,
    )
    first, second = out.outputs
    assert (first.text, first.token_ids, first.cumulative_logprob) == ("hello", [1, 2, 3], -2.5)
    assert first.logprobs is not None and [next(iter(p)) for p in first.logprobs] == [1, 2, 3]
    assert (second.index, second.text) == (1, "x")  # a new index is appended
    out.add(output(CompletionOutput(0, "!", [4], None, None, "stop", 7), finished=True), True)
    assert out.finished and first.text == "hello!"
    assert (first.finish_reason, first.stop_reason) == ("stop", 7)


def test_add_without_aggregate_replaces_each_completion() -> None:
    out = output(CompletionOutput(0, "he", [1]), CompletionOutput(1, "a", [5]))
    newer = CompletionOutput(1, "ab", [5, 6], finish_reason="length")
    out.add(output(newer, finished=True), aggregate=False)
    assert out.outputs[0].text == "he" and out.outputs[1] is newer and out.finished


def test_pooling_output_in_vllms_order_with_a_list_view() -> None:
    result = PoolingRequestOutput("e", PoolingOutput([0.5, 0.25]), [1, 2], 2, True)
    assert result.num_cached_tokens == 2 and result.finished
    assert result.outputs.embedding == [0.5, 0.25]
