"""A tiny test-only scheduler that drives a ModelRunner with SchedulerOutput messages.

Blocks are handed out sequentially and never reused (one new block when one
fills), every request runs each step (prefill in ``chunk``-token pieces when
set), and a request finishes after ``max_tokens`` outputs. A request may start
from a cached prefix: it shares the first blocks of an earlier request and is
admitted with ``num_computed_tokens > 0``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from legato.models.runner import ModelRunner
from legato.protocol.messages import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
    TokenLogprobs,
)
from legato.protocol.params import SamplingParams


@dataclass
class _Req:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    outputs: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    pending_tokens: list[int] = field(default_factory=list)  # sampled, not yet sent back
    pending_blocks: list[int] = field(default_factory=list)
    sent: bool = False  # the runner has seen it

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs


class MiniScheduler:
    """Drives ``runner`` until every added request has produced its tokens."""

    def __init__(self, runner: ModelRunner, chunk: int | None = None) -> None:
        self.runner = runner
        self.chunk = chunk
        self.block_size = runner.block_size
        self.next_block = 0
        self.running: dict[str, _Req] = {}
        self.done: dict[str, _Req] = {}
        self.finished_ids: list[str] = []
        self.step_id = 0

    def _alloc(self) -> int:
        block = self.next_block
        self.next_block += 1
        if block >= self.runner.num_kv_blocks:
            raise RuntimeError("test scheduler ran out of KV blocks")
        return block

    def add(
        self,
        req_id: str,
        prompt: list[int],
        params: SamplingParams | None = None,
        max_tokens: int = 16,
        prefix_of: str | None = None,
        prefix_blocks: int = 0,
    ) -> None:
        """Queue a request; ``prefix_of`` shares that request's first ``prefix_blocks`` blocks."""
        req = _Req(req_id, list(prompt), params or SamplingParams(temperature=0.0), max_tokens)
        if prefix_of is not None:
            donor = self.done.get(prefix_of) or self.running[prefix_of]
            req.block_ids = donor.block_ids[:prefix_blocks]
            req.pending_blocks = list(req.block_ids)
            req.num_computed = prefix_blocks * self.block_size
            assert req.tokens[: req.num_computed] == donor.tokens[: req.num_computed]
        self.running[req_id] = req

    def step(self) -> None:
        new: list[NewRequestData] = []
        cached: list[CachedRequestData] = []
        scheduled: dict[str, int] = {}
        for req in self.running.values():
            n = len(req.tokens) - req.num_computed
            if self.chunk is not None:
                n = min(n, self.chunk)
            while len(req.block_ids) * self.block_size < req.num_computed + n:
                block = self._alloc()
                req.block_ids.append(block)
                req.pending_blocks.append(block)
            if not req.sent:
                new.append(
                    NewRequestData(
                        req.req_id, list(req.prompt), req.params, list(req.block_ids),
                        req.num_computed, list(req.outputs),
                    )
                )  # fmt: skip
                req.sent = True
            else:
                cached.append(
                    CachedRequestData(
                        req.req_id, req.pending_tokens, req.pending_blocks, req.num_computed
                    )
                )
            req.pending_tokens, req.pending_blocks = [], []
            scheduled[req.req_id] = n
        out = self.runner.execute(
            SchedulerOutput(
                step_id=self.step_id,
                new_requests=new,
                cached_requests=cached,
                num_scheduled_tokens=scheduled,
                total_num_scheduled_tokens=sum(scheduled.values()),
                finished_req_ids=self.finished_ids,
            )
        )
        self.step_id += 1
        self.finished_ids = []
        assert out.req_ids == list(scheduled)
        for req_id, sampled in zip(out.req_ids, out.sampled_token_ids):
            req = self.running[req_id]
            req.num_computed += scheduled[req_id]
            req.prompt_logprobs.extend(out.prompt_logprobs.get(req_id, []))
            if not sampled:
                assert req.num_computed < len(req.tokens)
                continue
            assert req.num_computed == len(req.tokens)
            req.outputs.extend(sampled)
            req.pending_tokens = list(sampled)
            req.logprobs.extend(out.logprobs.get(req_id, []))
            if len(req.outputs) >= req.max_tokens:
                self.done[req_id] = self.running.pop(req_id)
                self.finished_ids.append(req_id)

    def run(self) -> dict[str, list[int]]:
        """Step until nothing runs; the outputs of every finished request."""
        while self.running:
            self.step()
        return {rid: req.outputs for rid, req in self.done.items()}
