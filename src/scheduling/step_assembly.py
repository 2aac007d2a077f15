"""A planned step, assembled into the runner's message (``SchedulerOutput``).

``assemble_step`` turns a ``StepPlan`` into the ``SchedulerOutput`` the runner
executes: the running requests as ``CachedRequestData`` (advanced while they
were planned), the admitted ones as ``NewRequestData`` (advanced here), each
distinct ``RunnerSamplingParams`` once. ``new_request_bytes`` and
``STEP_FRAME_BUDGET`` bound what admitted requests add to the step's frame, so
a step never outgrows the wire's limit. Pure Python; never imports torch or trio.
"""

from __future__ import annotations

from ..protocol import wire
from ..protocol.messages import (
    CachedRequestData,
    NewRequestData,
    RunnerSamplingParams,
    SchedulerOutput,
)
from .kv_cache import KVCacheManager
from .request_state import Request
from .step_plan import StepPlan

# What the requests admitted in one step may add to its frame, in bytes (a quarter of
# the wire's limit): a step admits new requests until the next would pass it, and at
# least one. A request's own share is bounded by its prompt and the vocabulary.
STEP_FRAME_BUDGET = wire.MAX_FRAME_SIZE // 4


def new_request_bytes(req: Request, plan: StepPlan) -> int:
    """An upper bound on the bytes ``req`` adds to a step frame as a new request."""
    size = 64 + 9 * (2 * len(req.all_token_ids) + 8)  # its tokens and block ids
    if all(other.runner_params is not req.runner_params for other in plan.new[-16:]):
        size += req.runner_params.estimated_size()  # a parent's children share one copy
    return size


def assemble_step(
    step_id: int,
    plan: StepPlan,
    kv: KVCacheManager,
    finished_ids: list[str],
    preempted_ids: list[str],
) -> SchedulerOutput:
    """The runner's message for a non-empty ``plan``; advances the admitted requests'
    computed tokens (and placeholders) and appends whether each samples to
    ``plan.samples``, after the running ones'."""
    num_scheduled = plan.num_scheduled
    samples = plan.samples
    new_data: list[NewRequestData] = []
    # Each distinct RunnerSamplingParams once (n children share one), named by the
    # first request that uses it.
    params_keys: dict[int, str] = {}
    params_table: dict[str, RunnerSamplingParams] = {}
    for req in plan.new:  # admitted (or resumed) this step: after the running ones
        n = num_scheduled[req.request_id]
        params_key = params_keys.get(id(req.runner_params))
        if params_key is None:
            params_key = params_keys[id(req.runner_params)] = req.request_id
            params_table[params_key] = req.runner_params
        new_data.append(
            NewRequestData(
                req.request_id,
                req.prompt_token_ids,
                params_key,
                kv.get_block_ids(req.request_id),
                req.num_computed_tokens,
                list(req.output_token_ids),
                req.lora_request,
                req.pooling_params,
                req.seed,
            )
        )
        req.num_tokens_sent = req.num_tokens
        req.num_computed_tokens += n
        sampling = req.num_computed_tokens >= req.num_tokens
        if sampling:
            req.num_output_placeholders = 1
        samples.append(sampling)
    cached = CachedRequestData(
        [req.request_id for req in plan.running],
        plan.computed,
        plan.new_block_ids,
        plan.new_token_ids,
    )
    return SchedulerOutput(
        step_id,
        new_data,
        cached,
        num_scheduled,
        sum(num_scheduled.values()),
        finished_ids,
        preempted_ids,
        sampling_params=params_table,
        scheduled_spec_decode_tokens=plan.spec_tokens,
        draft_limits=plan.draft_limits,
    )
