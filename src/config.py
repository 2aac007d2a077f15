"""EngineConfig: the one frozen configuration object passed down to every part.

Names follow vLLM's engine arguments wherever vLLM has the concept. Fields the
engine can only know after loading the model (``max_model_len``,
``num_kv_blocks``) may be None here; the engine resolves them once the model
runner reports, with :meth:`EngineConfig.resolved`, before the scheduler starts.

Never imports torch or trio.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

DType = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]

_SPEC_FIELDS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "model",
    "disable_by_batch_size",
    "num_speculative_tokens_per_batch_size",
)
_SPEC_MAX_TOKENS = 16  # drafts per request per step: more is never worth a verification


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, as vLLM's ``speculative_config`` spells it.

    ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": M,
    "prompt_lookup_min": m}``: each step proposes up to ``k`` tokens per request
    by prompt lookup (the continuation of the latest earlier match of the last
    ``m..M`` tokens), and the model verifies them in one forward. Only one of
    ``prompt_lookup_min`` / ``prompt_lookup_max`` given: the other takes its
    value; neither: both are 5 (vLLM's defaults). ``"disable_by_batch_size": N``
    (vLLM's, at least 2): no drafts are verified while more than ``N`` requests run.
    ``"num_speculative_tokens_per_batch_size": [[start, end, K], ...]`` (vLLM's dynamic
    speculative decoding): while ``start..end`` requests run, at most ``K`` drafts each
    (``K <= num_speculative_tokens``; 0: none; outside every range: ``k``).
    Each request also sizes its own drafts from its recent acceptance, down to none
    while they keep missing (``legato.scheduling.draft_policy``). ``{"model": path,
    "num_speculative_tokens": k}`` (method ``"draft_model"``): a smaller checkpoint
    with the target's tokenizer proposes ``k`` tokens per step
    (:mod:`legato.models.draft_proposer`); one process only (tensor parallelism
    refuses it). Built by :meth:`of`; a bad value is a ValueError naming the field
    (``speculative_config.<name>``).
    """

    method: Literal["ngram", "draft_model"] = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    disable_by_batch_size: int | None = None
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    model: str | None = None  # the draft model's directory (method "draft_model")

    @classmethod
    def of(cls, value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        """The config ``value`` describes (a vLLM-style dict, or one already built)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                f"speculative_config: expected a dict such as "
                f'{{"method": "ngram", "num_speculative_tokens": 3}}, got {type(value).__name__}'
            )
        unknown = sorted(set(value) - set(_SPEC_FIELDS))
        if unknown:
            raise ValueError(
                f"speculative_config.{unknown[0]}: unknown field; "
                f"expected some of {', '.join(_SPEC_FIELDS)}"
            )
        draft = value.get("model")
        method = value.get("method", "ngram" if draft is None else "draft_model")
        if method not in ("ngram", "[ngram]", "draft_model"):
            raise ValueError(
                f"speculative_config.method: unknown method {method!r}; "
                "legato has 'ngram' and 'draft_model'"
            )
        if method == "draft_model" and draft is None:
            raise ValueError("speculative_config.model: required by method 'draft_model'")
        if method != "draft_model" and draft is not None:
            raise ValueError(
                f"speculative_config.method: {method!r} takes no draft model; "
                "leave method out or use 'draft_model'"
            )
        if draft is not None and (not isinstance(draft, str) or not draft):
            raise ValueError(f"speculative_config.model: expected a directory, got {draft!r}")
        k = value.get("num_speculative_tokens")
        if k is None:
            raise ValueError("speculative_config.num_speculative_tokens: required")
        _positive("speculative_config.num_speculative_tokens", k)
        if k > _SPEC_MAX_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens: at most {_SPEC_MAX_TOKENS}, got {k}"
            )
        given_hi, given_lo = value.get("prompt_lookup_max"), value.get("prompt_lookup_min")
        hi: int = given_hi if given_hi is not None else given_lo if given_lo is not None else 5
        lo: int = given_lo if given_lo is not None else hi
        _positive("speculative_config.prompt_lookup_max", hi)
        _positive("speculative_config.prompt_lookup_min", lo)
        if lo > hi:
            raise ValueError(
                f"speculative_config.prompt_lookup_min: {lo} exceeds prompt_lookup_max ({hi})"
            )
        by_batch = value.get("disable_by_batch_size")
        if by_batch is not None:
            _positive("speculative_config.disable_by_batch_size", by_batch)
            if by_batch < 2:
                raise ValueError(
                    f"speculative_config.disable_by_batch_size: at least 2, got {by_batch}"
                )
        table = _draft_table(value.get("num_speculative_tokens_per_batch_size"), k)
        if draft is not None:
            return cls("draft_model", k, hi, lo, by_batch, table, draft)
        return cls("ngram", k, hi, lo, by_batch, table)

    def drafts_at(self, num_running: int) -> int:
        """The most drafts a request verifies while ``num_running`` requests run."""
        by_batch = self.disable_by_batch_size
        if by_batch is not None and num_running > by_batch:
            return 0
        for start, end, k in self.num_speculative_tokens_per_batch_size or ():
            if start <= num_running <= end:
                return k
        return self.num_speculative_tokens


STEP_TOKENS = 2048
"""The default step token budget (``max_num_batched_tokens``) on a GPU, as vLLM's server."""

STEP_TOKENS_CPU = 1024
"""The default step token budget on a CPU (see ``EngineConfig.token_budget``)."""


@dataclass(frozen=True)
class EngineConfig:
    # A local HF checkpoint dir or GGUF file; None = the embedded default model
    # (SmolLM2-135M-Instruct); "toy" = the toy model (see legato.model_source).
    model: str | None = None
    tokenizer: str | None = None  # tokenizer dir if not the model dir
    served_model_name: str | None = None  # the name clients use; default: from `model`
    dtype: DType = "auto"
    device: Device = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None  # vLLM: num_gpu_blocks_override
    kv_cache_memory: int | None = None  # bytes, when no block count is given
    max_num_seqs: int = 256
    # Tokens one step computes at most (prefill chunks and decodes together). None: chosen
    # for the device the worker runs on (``token_budget``): STEP_TOKENS_CPU on a CPU, where
    # a step's time grows with its tokens, else STEP_TOKENS (vLLM's server default).
    max_num_batched_tokens: int | None = None
    # What that default is chosen for: "latency" (a server: on a CPU the smaller budget,
    # so a burst of prompts holds the running decodes and the next prompt's first token
    # for less) or "throughput" (an offline LLM: no first token to wait for, so
    # STEP_TOKENS on every device, as offline batches ran before STEP_TOKENS_CPU; at batch
    # 64 on the CPU the two measured within noise: fp32 +2%, bf16 -1.6% in alternating
    # pairs). An explicit budget is kept either way.
    budget_for: Literal["latency", "throughput"] = "latency"
    # Requests the engine holds at once (rendering, queued, running or held by a pause);
    # one more is refused with EngineBusyError (check_admission), and the engine core's
    # inbox is bounded by it. LLM's batches stay under it by themselves.
    max_live_requests: int = 4096
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # Overlap: plan step N+1 while the worker computes step N (same outputs either way).
    async_scheduling: bool = True
    executor: Literal["process", "inproc"] = "process"
    # "null": the null-model runner (legato.null_runner), which answers every
    # step instantly with a fixed token; it measures the control plane, nothing else.
    runner: Literal["model", "null"] = "model"
    enforce_eager: bool = False
    # A GGUF file's quantized weights stay quantized on the CPU (legato.models.quantized);
    # True dequantizes them to fp32 at load (the reference path, 4-7x the memory).
    gguf_dequantize: bool = False
    # Kept-quantized GGUF matmuls: "int8" holds a one-row input (a decode step of one
    # stream) as int8 digits per block of 32 and sums integer products (llama.cpp's scheme,
    # the fast path); "fp32" keeps fp32 throughout (the fidelity path: the dequantized
    # model's greedy tokens).
    gguf_activations: Literal["int8", "fp32"] = "int8"
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    heartbeat_interval: float = 5.0
    heartbeat_timeout: float = 60.0  # a long CPU prefill step must not count as a hang
    # Seconds the process executors wait for the worker's WorkerReady (model loaded) before
    # start-up fails with TimeoutError (vLLM's VLLM_ENGINE_READY_TIMEOUT_S, 600 s there too)
    engine_ready_timeout: float = 600.0
    disable_log_stats: bool = False
    log_stats_interval: float = 10.0
    # Publish the metrics vLLM has a name for under that name (vllm:...) as well as legato:...
    vllm_metric_names: bool = False
    profile_dir: str | None = None
    max_logprobs: int = 20
    # Tensor parallelism (legato.workers.rank_worker): one worker process per rank in a
    # torch.distributed group (gloo on CPU, NCCL on CUDA), ranks split evenly over
    # ``nnodes`` hosts; the engine runs on node 0, other nodes run ``legato worker``.
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"  # rank 0's host: the rendezvous store listens there
    master_port: int = 0  # 0: a free port (one node only)
    # LoRA (as vLLM): adapters per step (device slots), their largest rank, adapters
    # kept loaded in host memory (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Pooling (encode / embeddings): how a prompt's final hidden states become one
    # vector (vLLM's pooler_config.pooling_type): "LAST" token, "MEAN" or "CLS" (first).
    pooling_type: Literal["LAST", "MEAN", "CLS"] = "LAST"
    # Speculative decoding (vLLM's speculative_config): a SpeculativeConfig, or its
    # fields as a dict, normalised to a SpeculativeConfig here. None: off.
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        spec = SpeculativeConfig.of(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec)
        _positive("block_size", self.block_size)
        _positive("max_num_seqs", self.max_num_seqs)
        if self.budget_for not in ("latency", "throughput"):
            raise ValueError("budget_for: must be 'latency' or 'throughput'")
        if self.max_num_batched_tokens is not None:
            _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_live_requests", self.max_live_requests)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        if self.kv_cache_memory is not None:
            _positive("kv_cache_memory", self.kv_cache_memory)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype: unknown dtype {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device: unknown device {self.device!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy: unknown policy {self.scheduling_policy!r}")
        if self.executor not in ("process", "inproc"):
            raise ValueError(f"executor: unknown executor {self.executor!r}")
        if self.runner not in ("model", "null"):
            raise ValueError(f"runner: unknown runner {self.runner!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend: unknown backend {self.attention_backend!r}")
        if self.gguf_activations not in ("int8", "fp32"):
            raise ValueError(f"gguf_activations: {self.gguf_activations!r} is not int8 or fp32")
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("nnodes", self.nnodes)
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"nnodes: {self.nnodes} nodes cannot share {self.tensor_parallel_size} ranks evenly"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank: must be in [0, {self.nnodes}), got {self.node_rank}")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"master_port: not a port: {self.master_port}")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("master_port: several nodes need an agreed port (not 0)")
        if spec is not None and spec.model is not None and self.tensor_parallel_size > 1:
            raise ValueError(
                "speculative_config.model: a draft model runs in one process; "
                f"tensor_parallel_size={self.tensor_parallel_size} cannot run it "
                '(use {"method": "ngram"} there)'
            )
        if self.tensor_parallel_size > 1 and self.executor != "process":
            raise ValueError("executor: tensor_parallel_size > 1 needs the process executor")
        _positive("max_loras", self.max_loras)
        _positive("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_loras is not None:
            _positive("max_cpu_loras", self.max_cpu_loras)
            if self.max_cpu_loras < self.max_loras:
                raise ValueError(
                    f"max_cpu_loras: must be >= max_loras ({self.max_loras}), "
                    f"got {self.max_cpu_loras}"
                )
        if self.pooling_type not in ("LAST", "MEAN", "CLS"):
            raise ValueError(
                f"pooling_type: unknown pooling {self.pooling_type!r}; expected LAST, MEAN or CLS"
            )
        if not self.engine_ready_timeout > 0:
            raise ValueError(
                f"engine_ready_timeout: must be > 0 seconds, got {self.engine_ready_timeout!r}"
            )
        if self.heartbeat_interval <= 0 or self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError("heartbeat_timeout: must exceed heartbeat_interval > 0")
        if not self.enable_chunked_prefill and self.max_model_len is not None:
            if self.token_budget() < self.max_model_len:
                raise ValueError(
                    "max_num_batched_tokens: must be >= max_model_len without chunked prefill"
                )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from engine keyword arguments; an unknown name is a clear TypeError."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def token_budget(self, device: str | None = None) -> int:
        """The step's token budget: ``max_num_batched_tokens`` if given, else the default
        for ``device`` ("cpu", "cuda"; None: not known, the GPU default) and
        ``budget_for`` (a CPU's smaller one only for "latency").

        Why a CPU gets a smaller one: there a prefill token costs about as much at 1024
        tokens a step as at 2048 (the matmuls run at the same fraction of peak), so a
        larger step buys little throughput; in a server it only holds every running decode
        for the whole step (about 2.7 s at 2048 tokens for the 135M default model on 2
        cores) and makes each arriving prompt queue behind a longer one (time to first
        token)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if device == "cpu" and self.budget_for == "latency":
            return STEP_TOKENS_CPU
        return STEP_TOKENS

    def resolved(
        self, *, max_model_len: int, num_kv_blocks: int, device: str | None = None
    ) -> EngineConfig:
        """A copy with the values learnt from the loaded model filled in (and the step
        token budget for ``device``, the worker's, when none was given)."""
        return dataclasses.replace(
            self,
            max_model_len=max_model_len,
            num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=self.token_budget(device),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _draft_table(value: Any, k: int) -> tuple[tuple[int, int, int], ...] | None:
    """``num_speculative_tokens_per_batch_size`` checked: ``[[start, end, K], ...]``."""
    name = "speculative_config.num_speculative_tokens_per_batch_size"
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise ValueError(f"{name}: expected a list of [start, end, K], got {type(value).__name__}")
    table: list[tuple[int, int, int]] = []
    for entry in value:
        if (
            not isinstance(entry, list | tuple)
            or len(entry) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in entry)
        ):
            raise ValueError(f"{name}: each entry is [start, end, K] (integers), got {entry!r}")
        start, end, drafts = entry
        if not 1 <= start <= end or not 0 <= drafts <= k:
            raise ValueError(
                f"{name}: [{start}, {end}, {drafts}] needs 1 <= start <= end and "
                f"0 <= K <= num_speculative_tokens ({k})"
            )
        table.append((start, end, drafts))
    return tuple(table)


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
