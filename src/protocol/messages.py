"""Messages between actors and processes, batched per step, never per token.

msgspec Structs (``array_like``: encoded as arrays of their fields, in
order; ``gc=False``: they hold no cycles, so the garbage collector never
scans them); ``wire.py`` encodes each one explicitly for process boundaries.
Field types are part of the contract: the decoder checks them.

The flow of one engine step:

    EngineRequest ──► scheduler ──SchedulerOutput──► model runner
    model runner ──ModelRunnerOutput──► scheduler ──EngineCoreOutputs──► detokenizer

Never imports torch or trio.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import field

from .params import LoRARequest, PoolingParams, SamplingParams


class Message(msgspec.Struct, array_like=True, gc=False, forbid_unknown_fields=True):
    """Base of every message: a Struct encoded as the array of its fields (no more, no fewer)."""


class FinishReason(enum.IntEnum):
    """Why a request stopped. ``str()`` gives the OpenAI / vLLM spelling."""

    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # aborted by the caller, a pause(mode="abort") or a disconnect
    ERROR = 3  # this request failed; the engine itself is healthy

    def __str__(self) -> str:
        return self.name.lower()


# ---------------------------------------------------------------- requests


class EngineRequest(Message):
    """A rendered, validated request as the scheduler admits it.

    For n>1 the engine fans a parent request out into n children whose
    ``parent_id`` is the caller's id and whose ``index`` is 0..n-1.
    ``lora_request`` runs it through an adapter (``lora_name`` is its name, a
    prefix-cache key); ``pooling_params`` makes it a pooling (embedding)
    request, finished once its prompt is computed.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    eos_token_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    parent_id: str | None = None
    index: int = 0
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None
    # What the model runner samples with (None: derived from ``sampling_params``). The
    # renderer builds one for a parent request and its n children share it.
    runner_params: RunnerSamplingParams | None = None


# ------------------------------------------------------- scheduler -> runner


class RunnerSamplingParams(Message):
    """The part of a request's ``SamplingParams`` the model runner computes with.

    Nothing else crosses to the worker: stop strings, ``bad_words`` text,
    ``extra_args``, structured-output specs and output options stay in the
    engine's process, so what a caller sends cannot grow a step frame past
    what sampling needs. Token ids are checked against the vocabulary before
    this is built, and sets are deduplicated, so each list is bounded by it. A parent request's n children share one instance
    (the seed, which differs per child, rides in ``NewRequestData.seed``), and
    a step frame carries each instance once (``SchedulerOutput.sampling_params``).
    ``bad_words_token_ids``: token sequences whose last token is banned when the
    output ends with the rest (vLLM's ``bad_words`` semantics).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)

    @classmethod
    def of(
        cls, params: SamplingParams, bad_words_token_ids: list[list[int]] | None = None
    ) -> RunnerSamplingParams:
        """The runner's share of ``params`` (validated ``SamplingParams``)."""
        return cls(
            float(params.temperature),
            float(params.top_p),
            params.top_k,
            float(params.min_p),
            params.min_tokens,
            float(params.repetition_penalty),
            float(params.presence_penalty),
            float(params.frequency_penalty),
            params.logprobs,
            params.prompt_logprobs,
            params.ignore_eos,
            sorted(set(params.stop_token_ids or ())),
            None if params.allowed_token_ids is None else sorted(set(params.allowed_token_ids)),
            dict(params.logit_bias or {}),
            bad_words_token_ids or [],
        )

    def estimated_size(self) -> int:
        """An upper bound on its msgpack size in bytes (for a step's frame budget)."""
        return 64 + 9 * (
            len(self.stop_token_ids)
            + len(self.allowed_token_ids or ())
            + 2 * len(self.logit_bias)
            + sum(len(ids) + 1 for ids in self.bad_words_token_ids)
        )


class NewRequestData(Message):
    """A request the model runner has not seen (or must rebuild after preemption).

    ``output_token_ids`` is non-empty only for a request resumed after a
    preemption: the tokens it had already generated, recomputed as prompt.
    ``block_ids`` is the request's whole block table so far. ``lora_request``
    names the adapter its tokens run through (None: the base model).
    ``pooling_params`` marks a pooling (embedding) request: nothing is sampled
    for it; its pooled hidden state comes back once its prompt is computed.
    ``params_key`` names its ``RunnerSamplingParams`` in the step's
    ``SchedulerOutput.sampling_params`` (shared by a parent's n children);
    ``seed`` is this request's own sampling seed.
    """

    request_id: str
    prompt_token_ids: list[int]
    params_key: str
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None
    seed: int | None = None


class CachedRequestData(Message):
    """What changed for the requests the runner already holds, one step, as parallel arrays.

    ``req_ids[i]`` resumes at ``num_computed_tokens[i]``. Only requests with
    news appear in the maps: ``new_block_ids[id]`` are appended to its block
    table (a request gets a block every ``block_size`` tokens, so most steps
    carry few), ``new_token_ids[id]`` are sampled tokens the scheduler accepted
    that the runner does not hold yet (the runner appends its own samples, so
    this is empty in steady state). One message per step, whatever the batch
    size: no per-request object is built, encoded or decoded.
    """

    req_ids: list[str] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    new_token_ids: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.num_computed_tokens) != len(self.req_ids):
            raise ValueError(
                f"num_computed_tokens: {len(self.num_computed_tokens)} entries "
                f"for {len(self.req_ids)} req_ids"
            )


class SchedulerOutput(Message):
    """One step's plan: which requests compute how many tokens.

    ``num_scheduled_tokens[id]`` tokens are computed for each scheduled request,
    starting at its ``num_computed_tokens``. A request whose scheduled tokens
    reach the end of its known tokens gets one sampled token back; a partial
    prefill chunk gets none. ``finished_req_ids`` and ``preempted_req_ids``
    tell the runner which per-request state to drop.
    """

    step_id: int
    new_requests: list[NewRequestData]
    cached_requests: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    # Structured outputs: request id -> its token bitmask row for this step (int32 words,
    # little-endian bytes; bit t allows token t), for the constrained requests only.
    grammar_bitmask: dict[str, bytes] = field(default_factory=dict)
    # True: this step's rows come in a GrammarBitmask frame sent after it (the engine
    # computes them while the forward runs); the worker samples once they arrive.
    grammar_bitmask_follows: bool = False
    # The sampling parameters of ``new_requests``, each once: NewRequestData.params_key
    # -> its parameters.
    sampling_params: dict[str, RunnerSamplingParams] = field(default_factory=dict)
    # Speculative decoding: request id -> the draft tokens it verifies this step. They
    # follow its known tokens and are part of its ``num_scheduled_tokens`` (a decode
    # with k drafts computes k + 1 tokens); the runner's answer holds the drafts it
    # accepted and one more token.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Speculative decoding: request id -> the most drafts the runner proposes for it after
    # this step's sample (0: none), where fewer could be verified (it backs off or its
    # draft length is shorter, drafts are off at this batch size, or with a draft model
    # the step cost leaves them out); a request not listed gets up to
    # ``num_speculative_tokens``.
    draft_limits: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class GrammarBitmask(Message):
    """The token bitmask rows of a step sent with ``grammar_bitmask_follows``.

    Sent right after the engine computed them, while the step's forward runs;
    always the next step frame the worker gets after that step. ``rows`` has
    ``SchedulerOutput.grammar_bitmask``'s form (a request with no row samples
    unconstrained: its grammar failed and its token is discarded). The worker
    answers this frame with the step's ModelRunnerOutput.
    """

    step_id: int
    rows: dict[str, bytes] = field(default_factory=dict)


# ------------------------------------------------------- runner -> scheduler


class TokenLogprobs(Message):
    """Log-probabilities at one position: the chosen token first, then the top-k.

    ``ranks[i]`` is the 1-based rank of ``token_ids[i]`` in the full distribution.
    """

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


class ModelRunnerOutput(Message):
    """Sampled tokens of one step, flat: one list for the whole batch.

    ``req_ids`` are the scheduled requests in the step's order;
    ``num_sampled[i]`` tokens of ``sampled_token_ids`` (taken in order) belong
    to ``req_ids[i]``: one, or none for a partial prefill chunk.
    ``logprobs`` (requests that asked) holds one entry per sampled token;
    ``prompt_logprobs`` holds one entry per prompt position computed this step
    (None for the first prompt token). ``pooled`` holds the pooled hidden
    state of each pooling request whose prompt finished this step.
    ``failed`` names the requests the runner could not compute (their LoRA adapter
    could not be read again, say): each fails alone with that message.
    """

    step_id: int
    req_ids: list[str]
    num_sampled: list[int]
    sampled_token_ids: list[int]
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    pooled: dict[str, list[float]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # requests not computed: why
    # Speculative decoding: request id -> the drafts proposed for its next step
    # (requests that sampled this step; none: nothing to propose).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # The runner's own time for the step (seconds: forward, sampling, proposals), which
    # the scheduler's draft policy learns step costs from; 0: not measured.
    step_seconds: float = 0.0

    def __post_init__(self) -> None:
        if len(self.num_sampled) != len(self.req_ids):
            raise ValueError(
                f"num_sampled: {len(self.num_sampled)} entries for {len(self.req_ids)} req_ids"
            )
        if (
            sum(self.num_sampled) != len(self.sampled_token_ids)
            or min(self.num_sampled, default=0) < 0
        ):
            raise ValueError(
                f"num_sampled: counts must be >= 0 and add up to the "
                f"{len(self.sampled_token_ids)} sampled_token_ids"
            )

    @classmethod
    def from_lists(
        cls, step_id: int, req_ids: list[str], sampled: list[list[int]], **fields: Any
    ) -> ModelRunnerOutput:
        """Build from each request's sampled tokens (for tests and tools)."""
        flat = [t for tokens in sampled for t in tokens]
        return cls(step_id, req_ids, [len(tokens) for tokens in sampled], flat, **fields)

    def sampled_lists(self) -> list[list[int]]:
        """Each request's sampled tokens, in ``req_ids`` order (for tests and tools)."""
        out: list[list[int]] = []
        pos = 0
        for n in self.num_sampled:
            out.append(self.sampled_token_ids[pos : pos + n])
            pos += n
        return out


# ------------------------------------------------- scheduler -> detokenizer


class SpecDecodingStats(Message):
    """Speculative decoding since the previous stats, as vLLM's ``spec_decode`` series:
    requests verified with drafts, their draft tokens, the drafts accepted, and the
    drafts accepted at each draft position (index 0: the first draft)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


class SchedulerStats(Message):
    """Per-step figures for metrics and the log line."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use, 0..1
    num_blocks_total: int = 0
    num_blocks_used: int = 0
    prefix_cache_queries: int = 0  # tokens looked up this step
    prefix_cache_hits: int = 0  # tokens found this step
    num_preempted: int = 0  # preemptions this step
    num_scheduled_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    # With enable_lora: requests per adapter name, as vLLM's (vllm:lora_requests_info).
    running_lora_adapters: dict[str, int] | None = None
    waiting_lora_adapters: dict[str, int] | None = None
    spec_decoding: SpecDecodingStats | None = None  # with speculative_config

    # ---- vLLM's SchedulerStats names, for stat loggers written for vLLM

    @property
    def num_running_reqs(self) -> int:
        return self.num_running

    @property
    def num_waiting_reqs(self) -> int:
        return self.num_waiting

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """This step's prefix-cache lookups, as vLLM's (tokens, as vLLM counts them)."""
        return PrefixCacheStats(queries=self.prefix_cache_queries, hits=self.prefix_cache_hits)


@dataclass(frozen=True)
class PrefixCacheStats:
    """vLLM's ``PrefixCacheStats``: one step's prefix-cache lookups (``requests`` is
    not counted separately here; ``reset`` is never set)."""

    queries: int = 0
    hits: int = 0
    requests: int = 0
    reset: bool = False


class EngineCoreOutput(Message):
    """What happened to one request in one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # set with FinishReason.ERROR
    pooled: list[float] | None = None  # a pooling request's vector, with its finish
    # With ERROR, when the request's own input caused it: the field (its output constraint).
    error_field: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(Message):
    """Every request's news from one step."""

    outputs: list[EngineCoreOutput]
    timestamp: float
    scheduler_stats: SchedulerStats | None = None


# ------------------------------------------------------------------ health


class HealthPing(Message):
    seq: int
    sent_time: float


class HealthPong(Message):
    seq: int
    sent_time: float


class UtilityCall(Message):
    """Call a named method on the worker(s); answered by UtilityResult."""

    call_id: int
    method: str
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)


class UtilityResult(Message):
    call_id: int
    result: Any = None
    error: str | None = None  # set when the call raised; the message of the error
    # set when the call raised a ValidationError: the field it names and the reason
    error_field: str | None = None
    error_reason: str | None = None
    # under tensor parallelism: every rank's result, in rank order (``result`` is rank
    # 0's); ``error`` is then the first failing rank's, prefixed with "rank N: "
    rank_results: list[Any] | None = None


# ------------------------------------------------------ executor <-> worker


class WorkerInit(Message):
    """First frame to a worker process: what to load."""

    config: dict[str, Any]  # EngineConfig.to_dict(), with model resolved to a path
    inject_fault: dict[str, Any] | None = None  # chaos testing: see legato.testing.chaos


class WorkerReady(Message):
    """The worker's answer to WorkerInit once the model is loaded."""

    pid: int
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    dtype: str
    device: str
    # the window every layer attends through, when all share one (else None): the
    # scheduler then releases KV blocks that fall out of it
    kv_sliding_window: int | None = None


class WorkerError(Message):
    """The worker could not do what a frame asked; ``fatal`` means it will exit."""

    message: str
    error_type: str
    fatal: bool = False
