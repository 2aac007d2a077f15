"""Stop rules and accepted tokens (scheduling/token_acceptance.py), through the scheduler."""

from __future__ import annotations

from legato.protocol.messages import FinishReason, ModelRunnerOutput, TokenLogprobs
from legato.scheduling.scheduler import Scheduler

from .harness import EOS, Harness, make_config, make_request, sampler_from


def test_stop_token_ids_cut_the_output_and_name_the_stop() -> None:
    h = Harness(make_config(), sampler_from({"r": [10, 42, 12]}))
    h.add(make_request("r", 8, stop_token_ids=[42, 43], max_tokens=10))
    h.run()
    assert h.tokens["r"] == [10, 42]
    assert h.final["r"].finish_reason is FinishReason.STOP
    assert h.final["r"].stop_reason == 42


def test_max_tokens_gives_length() -> None:
    h = Harness(make_config(), sampler_from({"r": [5, 6, 7]}))
    h.add(make_request("r", 8, max_tokens=2))
    h.run()
    assert h.tokens["r"] == [5, 6]
    assert str(h.final["r"].finish_reason) == "length"
    assert h.final["r"].stop_reason is None


def test_eos_stops_unless_ignore_eos() -> None:
    h = Harness(make_config(), sampler_from({"a": [5, EOS, 7], "b": [5, EOS, 7]}))
    h.add(make_request("a", 8, max_tokens=3), make_request("b", 8, max_tokens=3, ignore_eos=True))
    h.run()
    assert h.tokens["a"] == [5, EOS]
    assert h.final["a"].finish_reason is FinishReason.STOP and h.final["a"].stop_reason is None
    assert h.tokens["b"] == [5, EOS, 7]
    assert h.final["b"].finish_reason is FinishReason.LENGTH


def test_ignore_eos_still_honours_stop_token_ids() -> None:
    h = Harness(make_config(), sampler_from({"r": [EOS, 9, 11]}))
    h.add(make_request("r", 8, max_tokens=5, ignore_eos=True, stop_token_ids=[9]))
    h.run()
    assert h.tokens["r"] == [EOS, 9] and h.final["r"].stop_reason == 9


def test_min_tokens_suppresses_eos_and_stop_ids() -> None:
    h = Harness(make_config(), sampler_from({"r": [EOS, 42, EOS, 8]}))
    h.add(make_request("r", 8, max_tokens=10, min_tokens=3, stop_token_ids=[42]))
    h.run()
    assert h.tokens["r"] == [EOS, 42, EOS]
    assert h.final["r"].finish_reason is FinishReason.STOP


def test_stop_token_on_the_last_allowed_token_is_a_stop() -> None:
    h = Harness(make_config(), sampler_from({"r": [5, 42]}))
    h.add(make_request("r", 8, max_tokens=2, stop_token_ids=[42]))
    h.run()
    assert h.final["r"].finish_reason is FinishReason.STOP


def test_max_model_len_caps_max_tokens_none() -> None:
    h = Harness(make_config(max_model_len=32, num_kv_blocks=8))
    h.add(make_request("r", 20, max_tokens=None), make_request("full", 32, max_tokens=None))
    h.run()
    assert len(h.tokens["r"]) == 12
    assert h.final["r"].finish_reason is FinishReason.LENGTH
    # A prompt of exactly max_model_len still yields its one token.
    assert len(h.tokens["full"]) == 1 and h.final["full"].finish_reason is FinishReason.LENGTH


def test_multi_token_output_is_truncated_at_the_stop_with_its_logprobs() -> None:
    sched = Scheduler(make_config())
    sched.add_request(make_request("r", 4, max_tokens=10, stop_token_ids=[42]))
    plan = sched.schedule()
    lp = [TokenLogprobs([t], [-0.5], [1]) for t in (10, 42, 12)]
    result = sched.update_from_output(
        plan, ModelRunnerOutput.from_lists(plan.step_id, ["r"], [[10, 42, 12]], logprobs={"r": lp})
    )
    (out,) = result.outputs
    assert out.new_token_ids == [10, 42] and out.new_logprobs == lp[:2]
    assert out.finished and not sched.has_unfinished_requests()


# ----------------------------------------------------------- runner protocol
