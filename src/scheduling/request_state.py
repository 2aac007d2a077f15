"""Request: the scheduler's per-request state, one plain object per live request.

The scheduler (policy) moves a :class:`Request` between its queues and the
KV-cache manager (resource) hangs the request's blocks off its id; both read
the token lists kept here. Pure Python, driven synchronously: never imports
torch or trio.
"""

from __future__ import annotations

import enum
import sys
from typing import TYPE_CHECKING

from ..protocol.messages import EngineRequest, FinishReason, RunnerSamplingParams
from ..protocol.params import LoRARequest, PoolingParams, SamplingParams

if TYPE_CHECKING:
    from ..structured.grammar import GrammarState
    from .draft_policy import DraftLength


class RequestStatus(enum.IntEnum):
    """Where a request is: waiting (never started or preempted), running, finished."""

    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Request:
    """One request's tokens, progress and limits as the scheduler tracks them.

    ``all_token_ids`` is the prompt followed by every accepted output token;
    ``num_computed_tokens`` of them have their KV in the cache (it is reset to 0
    by a preemption). ``block_hashes[i]`` is the chained prefix hash of full
    block ``i`` of ``all_token_ids``; the KV-cache manager fills it lazily.
    ``num_tokens_sent`` is how many of ``all_token_ids`` the model runner knows.
    ``num_output_placeholders`` counts the tokens that steps already planned
    will sample but whose answers have not come back yet (a step is planned
    before the one in flight answers): the scheduler counts them as known
    tokens to compute, and the runner fills them in with its own samples.
    ``reset_step`` is the last step planned when a preemption restarted the
    request: answers of that step and earlier ones are stale for it.
    ``spec_token_ids`` (speculative decoding) are the drafts the runner proposed with
    its last sample, verified in the request's next step (if it is a plain decode), as
    many as its ``draft_length`` (:mod:`.draft_policy`) admits.

    Figures fixed at admission that keep the per-step checks cheap:
    ``token_limit`` is the length of ``all_token_ids`` at which the request
    reaches a length limit (the prompt plus ``max_tokens``, or ``max_model_len``;
    0 for a pooling request, which samples nothing), and ``stopping_token_ids``
    the tokens that may stop it (EOS unless ``ignore_eos``, and ``stop_token_ids``).

    The KV-cache manager keeps two figures here for the scheduler's per-step
    checks: ``num_kv_slots``, the tokens the blocks it holds have room for (0
    when it holds none), and ``num_cached_blocks``, its leading full blocks
    already published in the prefix cache.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "arrival_time",
        "arrival_seq",
        "priority",
        "eos_token_id",
        "ignore_eos",
        "min_tokens",
        "max_tokens",
        "stop_token_ids",
        "stopping_token_ids",
        "token_limit",
        "lora_request",
        "pooling_params",
        "cache_extra_keys",
        "all_token_ids",
        "output_token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_tokens_sent",
        "num_preemptions",
        "block_hashes",
        "num_kv_slots",
        "num_cached_blocks",
        "status",
        "finish_reason",
        "stop_reason",
        "sort_key",
        "num_output_placeholders",
        "reset_step",
        "grammar",
        "runner_params",
        "seed",
        "spec_token_ids",
        "draft_length",
    )

    def __init__(
        self,
        request: EngineRequest,
        seq: int,
        max_model_len: int | None = None,
        grammar: GrammarState | None = None,
    ) -> None:
        """Wrap an admitted request; ``seq`` breaks ties between equal arrival times;
        ``grammar`` constrains its sampling (structured outputs).

        ``max_model_len`` (prompt and output tokens) bounds ``token_limit``; None: no bound.
        """
        params: SamplingParams = request.sampling_params
        self.request_id: str = request.request_id
        self.prompt_token_ids: list[int] = list(request.prompt_token_ids)
        self.sampling_params: SamplingParams = params
        # What the runner samples with, shared by a parent's children (one copy per frame).
        self.runner_params: RunnerSamplingParams = request.runner_params or RunnerSamplingParams.of(
            params
        )
        self.seed: int | None = params.seed
        self.arrival_time: float = request.arrival_time
        self.priority: int = request.priority
        self.eos_token_id: int | None = request.eos_token_id
        self.ignore_eos: bool = params.ignore_eos
        self.min_tokens: int = params.min_tokens
        self.max_tokens: int | None = params.max_tokens  # None: up to max_model_len
        self.stop_token_ids: frozenset[int] = frozenset(params.stop_token_ids or ())
        self.stopping_token_ids: frozenset[int] = (
            self.stop_token_ids
            if self.ignore_eos or self.eos_token_id is None
            else self.stop_token_ids | {self.eos_token_id}
        )
        self.lora_request: LoRARequest | None = request.lora_request
        self.pooling_params: PoolingParams | None = request.pooling_params
        # Anything besides the tokens that decides whether cached KV may be reused.
        self.cache_extra_keys: tuple[str | None, str | None] | None = (
            (request.lora_name, request.cache_salt)
            if request.lora_name is not None or request.cache_salt is not None
            else None
        )
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_prompt_tokens: int = len(self.prompt_token_ids)
        limit = sys.maxsize if self.max_tokens is None else self.num_prompt_tokens + self.max_tokens
        if max_model_len is not None:
            limit = min(limit, max_model_len)
        self.token_limit: int = 0 if self.pooling_params is not None else limit
        self.num_computed_tokens: int = 0
        self.num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 before
        self.num_tokens_sent: int = 0
        self.num_preemptions: int = 0
        self.block_hashes: list[bytes] = []
        self.num_kv_slots: int = 0
        self.num_cached_blocks: int = 0
        self.status: RequestStatus = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        # Priority order: lower value first, then earlier arrival, then admission order.
        self.arrival_seq = seq  # admission order (a pause holds those after its boundary)
        self.sort_key: tuple[int, float, int] = (request.priority, request.arrival_time, seq)
        self.num_output_placeholders: int = 0
        self.reset_step: int = 0
        self.grammar = grammar
        self.spec_token_ids: list[int] = []  # drafts the runner proposed for its next step
        self.draft_length: DraftLength | None = None  # made by the scheduler's first proposal

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def started(self) -> bool:
        """True once the request has been scheduled at least once (it is in flight)."""
        return self.num_cached_tokens >= 0

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
