"""The scheduler tests' harness: no model, a fake runner that mirrors what the
scheduler sends it (as a real runner keeps its own copy of each request) and samples
tokens from a function."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from legato.config import EngineConfig
from legato.protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineRequest,
    ModelRunnerOutput,
    SchedulerOutput,
)
from legato.protocol.params import SamplingParams
from legato.scheduling.scheduler import Scheduler

EOS = 2
Sampler = Callable[[str, list[int]], int]


def default_sampler(request_id: str, tokens: list[int]) -> int:
    """Deterministic in (request, position), never EOS: preemption must not change outputs."""
    return 100 + (len(tokens) * 7 + sum(map(ord, request_id))) % 50


@dataclass
class _Mirror:
    tokens: list[int]
    num_computed: int
    block_ids: list[int]


@dataclass
class FakeRunner:
    """Keeps the runner's copy of each request from the scheduler's messages and its own
    samples, and checks it, as ModelRunner does. It rejects every draft it verifies."""

    block_size: int
    sampler: Sampler = default_sampler
    reqs: dict[str, _Mirror] = field(default_factory=dict)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in [*out.finished_req_ids, *out.preempted_req_ids]:
            self.reqs.pop(request_id, None)
        for new in out.new_requests:
            assert new.request_id not in self.reqs
            self.reqs[new.request_id] = _Mirror(
                [*new.prompt_token_ids, *new.output_token_ids],
                new.num_computed_tokens,
                list(new.block_ids),
            )
        cached = out.cached_requests
        assert set(cached.new_token_ids) | set(cached.new_block_ids) <= set(cached.req_ids)
        for request_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens):
            mirror = self.reqs[request_id]
            assert mirror.num_computed == num_computed
            mirror.tokens += cached.new_token_ids.get(request_id, [])
            mirror.block_ids += cached.new_block_ids.get(request_id, [])
        sent = [n.request_id for n in out.new_requests] + cached.req_ids
        assert sorted(sent) == sorted(out.num_scheduled_tokens)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for request_id, n in out.num_scheduled_tokens.items():
            mirror = self.reqs[request_id]
            # Drafts (speculative decoding) are all rejected: their slots are rewritten by
            # the next step, and the request samples one token past its known ones.
            n -= len(out.scheduled_spec_decode_tokens.get(request_id, ()))
            assert n > 0 and mirror.num_computed + n <= len(mirror.tokens)
            mirror.num_computed += n
            assert len(mirror.block_ids) * self.block_size >= mirror.num_computed
            assert 0 not in mirror.block_ids
            req_ids.append(request_id)
            if mirror.num_computed == len(mirror.tokens):
                token = self.sampler(request_id, mirror.tokens)
                mirror.tokens.append(token)  # a runner keeps its own samples
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput.from_lists(out.step_id, req_ids, sampled)


def make_config(**kwargs: Any) -> EngineConfig:
    values: dict[str, Any] = dict(max_model_len=256, num_kv_blocks=64, block_size=16)
    values.update(kwargs)
    return EngineConfig(**values)


_arrival = itertools.count()
_fresh_tokens = itertools.count(1000, 1000)


def make_request(
    request_id: str,
    prompt: list[int] | int,
    *,
    priority: int = 0,
    eos: int | None = EOS,
    **params: Any,
) -> EngineRequest:
    if isinstance(prompt, int):  # that many tokens shared with no other request
        base = next(_fresh_tokens)
        tokens = list(range(base, base + prompt))
    else:
        tokens = prompt
    params.setdefault("max_tokens", 4)
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(**params),
        arrival_time=float(next(_arrival)),
        priority=priority,
        eos_token_id=eos,
    )


class Harness:
    """A scheduler, a fake runner, and everything each request was told."""

    def __init__(self, config: EngineConfig, sampler: Sampler = default_sampler) -> None:
        self.sched = Scheduler(config)
        self.runner = FakeRunner(config.block_size, sampler)
        self.tokens: dict[str, list[int]] = {}
        self.final: dict[str, EngineCoreOutput] = {}
        self.plans: list[SchedulerOutput] = []
        self.results: list[EngineCoreOutputs] = []

    def add(self, *requests: EngineRequest) -> None:
        for request in requests:
            self.sched.add_request(request)

    def record(self, outputs: Iterable[EngineCoreOutput]) -> None:
        for out in outputs:
            assert out.request_id not in self.final
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                self.final[out.request_id] = out

    def step(self) -> SchedulerOutput:
        plan = self.sched.schedule()
        self.plans.append(plan)
        result = self.sched.update_from_output(plan, self.runner.execute(plan))
        self.results.append(result)
        self.record(result.outputs)
        return plan

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("requests did not finish")


def sampler_from(sequences: dict[str, list[int]]) -> Sampler:
    """Each request samples its listed tokens in order."""
    iters = {rid: iter(seq) for rid, seq in sequences.items()}
    return lambda request_id, tokens: next(iters[request_id])


# ------------------------------------------------------------------ stop rules
