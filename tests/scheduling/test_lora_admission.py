"""The scheduler with LoRA and pooling requests: at most max_loras adapters running,
adapters and pooling params reach the runner, pooling requests end with their vector."""

from __future__ import annotations

from legato.config import EngineConfig
from legato.protocol.messages import (
    EngineRequest,
    FinishReason,
    ModelRunnerOutput,
    SchedulerOutput,
)
from legato.protocol.params import LoRARequest, PoolingParams, SamplingParams
from legato.scheduling.scheduler import Scheduler


def _scheduler(**kw: object) -> Scheduler:
    config = EngineConfig(
        model="unused", num_kv_blocks=64, max_model_len=256, block_size=16,
        enable_lora=True, **kw,  # type: ignore[arg-type]
    ).resolved(max_model_len=256, num_kv_blocks=64)  # fmt: skip
    return Scheduler(config)


def _request(rid: str, lora_id: int | None = None, **kw: object) -> EngineRequest:
    lora = LoRARequest(f"l{lora_id}", lora_id, "/unused") if lora_id else None
    return EngineRequest(
        rid,
        list(range(10, 30)),
        SamplingParams(max_tokens=2, ignore_eos=True),
        0.0,
        lora_name=lora.lora_name if lora else None,
        lora_request=lora,
        **kw,  # type: ignore[arg-type]
    )


def _run_step(
    sched: Scheduler, plan: SchedulerOutput, pooled: dict[str, list[float]] | None = None
) -> list[str]:
    ids = list(plan.num_scheduled_tokens)
    sampled = [[] if pooled and rid in pooled else [7] for rid in ids]
    out = sched.update_from_output(
        plan, ModelRunnerOutput.from_lists(plan.step_id, ids, sampled, pooled=pooled or {})
    )
    return [o.request_id for o in out.outputs if o.finished]


def test_at_most_max_loras_adapters_run_together() -> None:
    sched = _scheduler(max_loras=2)
    for rid, lora in [("a1", 1), ("b1", 2), ("a2", 1), ("base", None), ("c1", 3), ("late", None)]:
        sched.add_request(_request(rid, lora))
    plan = sched.schedule()
    # a1, b1, a2 (adapter 1 runs already) and base start; c1 would be a third adapter:
    # it waits, and the FCFS queue waits behind it.
    assert list(plan.num_scheduled_tokens) == ["a1", "b1", "a2", "base"]
    by_id = {n.request_id: n for n in plan.new_requests}
    assert by_id["a1"].lora_request == LoRARequest("l1", 1, "/unused")
    assert by_id["base"].lora_request is None
    _run_step(sched, plan)
    for _ in range(10):
        plan = sched.schedule()
        if any(n.request_id == "c1" for n in plan.new_requests):
            break
        _run_step(sched, plan)
    # c1 started only once adapters 1 and 2 had both left.
    assert not sched.requests.keys() & {"a1", "b1", "a2"}


def test_without_lora_limit_all_start() -> None:
    """The same queue on an engine with room for three adapters: everything starts."""
    sched = _scheduler(max_loras=3)
    for rid, lora in [("a1", 1), ("b1", 2), ("c1", 3), ("base", None)]:
        sched.add_request(_request(rid, lora))
    assert list(sched.schedule().num_scheduled_tokens) == ["a1", "b1", "c1", "base"]


def test_pooling_request_ends_with_its_vector_and_skips_the_prefix_cache() -> None:
    sched = _scheduler(max_loras=1)
    sched.add_request(_request("gen"))
    plan = sched.schedule()
    _run_step(sched, plan)  # gen's prompt blocks are now cached
    sched.add_request(_request("emb", pooling_params=PoolingParams()))
    plan = sched.schedule()
    (new,) = plan.new_requests
    assert new.pooling_params == PoolingParams() and new.num_computed_tokens == 0
    out = sched.update_from_output(
        plan, ModelRunnerOutput.from_lists(plan.step_id, list(plan.num_scheduled_tokens),
                                [[7], []], pooled={"emb": [0.5, 0.5]})
    )  # fmt: skip
    (emb,) = [o for o in out.outputs if o.request_id == "emb"]
    assert emb.pooled == [0.5, 0.5] and emb.finish_reason is FinishReason.STOP
    assert emb.new_token_ids == []
    assert "emb" not in sched.requests
