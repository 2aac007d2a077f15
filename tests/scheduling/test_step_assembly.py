"""A planned step's frame (scheduling/step_assembly.py): shared params once, a bounded frame."""

from __future__ import annotations

from legato.protocol.params import SamplingParams
from legato.scheduling.scheduler import Scheduler

from .harness import make_config, make_request


def test_a_step_frame_carries_each_shared_runner_params_once() -> None:
    """n children of one request share one RunnerSamplingParams, and the step's frame holds
    it once; stop strings and other detokenizer-only fields never reach it."""
    from legato.protocol import wire
    from legato.protocol.messages import RunnerSamplingParams

    sched = Scheduler(make_config(max_num_seqs=64, num_kv_blocks=256))
    big = SamplingParams(
        max_tokens=2, stop=["Z" * 128] * 16, allowed_token_ids=list(range(100, 20_100))
    )
    shared = RunnerSamplingParams.of(big)
    for i in range(32):
        child = make_request(f"{i}_p", [5, 6], max_tokens=2, stop=["Z" * 128] * 16)
        child.parent_id, child.runner_params = "p", shared
        sched.add_request(child)
    out = sched.schedule()
    assert len(out.new_requests) == 32
    assert list(out.sampling_params.values()) == [shared]
    assert {r.params_key for r in out.new_requests} == set(out.sampling_params)
    frame = wire.encode(out)
    assert len(frame) < 100_000  # one copy of 20k allowed ids (~60 KB); no stop string
    assert b"ZZZZ" not in frame


def test_new_requests_wait_for_a_step_whose_frame_has_room() -> None:
    """Each request's own large parameters count against the step's frame budget: the
    step admits requests until the next would pass it (and at least one)."""
    from legato.protocol.messages import RunnerSamplingParams
    from legato.scheduling.step_assembly import STEP_FRAME_BUDGET

    sched = Scheduler(make_config(max_num_seqs=64, num_kv_blocks=256))
    bias = dict.fromkeys(range(500_000), 1.0)
    per_request = 9 * 2 * len(bias)  # logit_bias: an id and a float each
    for i in range(8):
        request = make_request(f"r{i}", [5, 6])
        request.runner_params = RunnerSamplingParams(logit_bias=bias)  # each its own
        sched.add_request(request)
    first = sched.schedule()
    assert 1 <= len(first.new_requests) <= STEP_FRAME_BUDGET // per_request
    assert len(first.new_requests) < 8
