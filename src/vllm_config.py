"""vLLM's configuration surface over legato's one ``EngineConfig``.

Code written for vLLM reads ``engine.vllm_config.model_config.max_model_len``,
``await client.get_model_config()`` and builds engines from ``EngineArgs``. This
module gives it those names:

- :class:`VllmConfig` and its parts (:class:`ModelConfig`, :class:`CacheConfig`,
  :class:`SchedulerConfig`, :class:`ParallelConfig`, :class:`DeviceConfig`,
  :class:`LoRAConfig`, :class:`ObservabilityConfig`, :class:`DecodingConfig`):
  frozen, read-only views built from an ``EngineConfig`` (:meth:`VllmConfig.of`).
  They carry the fields vLLM users commonly read, under vLLM's names; setting one
  raises ``dataclasses.FrozenInstanceError``. Change a running engine through its
  methods, a new one through ``EngineArgs``/``EngineConfig``.
- :class:`EngineArgs` (and :class:`AsyncEngineArgs`): vLLM's field names for what
  legato supports. vLLM fields legato does not support are accepted only at vLLM's
  default and refused by name otherwise (``pipeline_parallel_size=2`` is a
  ValueError naming it); a name vLLM does not have either is a TypeError.

Where legato differs: ``ModelConfig.dtype`` is the dtype's name (``"bfloat16"``),
not a ``torch.dtype``; ``hf_config`` and the multimodal and speculative parts are
absent. ``EngineArgs.create_engine_config`` returns the view; the engine itself
runs on ``to_engine_config()``.

Never imports torch, trio or the engine: a configuration module only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from .config import DType, EngineConfig


@dataclass(frozen=True)
class ModelConfig:
    """vLLM's ``ModelConfig`` fields that legato has."""

    model: str | None
    tokenizer: str | None
    served_model_name: str | None
    max_model_len: int | None  # None until the engine has loaded the model
    dtype: str  # the dtype's name; "auto" until the engine has loaded the model
    seed: int
    max_logprobs: int
    enforce_eager: bool
    tokenizer_mode: str = "auto"
    trust_remote_code: bool = False
    revision: str | None = None
    runner_type: str = "generate"
    skip_tokenizer_init: bool = False
    is_multimodal_model: bool = False
    is_encoder_decoder: bool = False
    pooling_type: str = "LAST"  # vLLM: pooler_config.pooling_type


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_gpu_blocks: int | None  # the KV blocks the engine runs with, once known
    num_gpu_blocks_override: int | None
    kv_cache_memory_bytes: int | None
    enable_prefix_caching: bool
    cache_dtype: str = "auto"


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None
    enable_chunked_prefill: bool
    policy: Literal["fcfs", "priority"]
    async_scheduling: bool

    @property
    def chunked_prefill_enabled(self) -> bool:
        """vLLM's older name for ``enable_chunked_prefill``."""
        return self.enable_chunked_prefill


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class DeviceConfig:
    device: str  # "auto", "cpu" or "cuda"


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int | None


@dataclass(frozen=True)
class ObservabilityConfig:
    log_stats: bool
    otlp_traces_endpoint: str | None = None  # no tracing in legato
    collect_detailed_traces: list[str] | None = None


@dataclass(frozen=True)
class DecodingConfig:
    """Structured outputs (vLLM's ``StructuredOutputsConfig``, formerly ``DecodingConfig``):
    legato compiles every grammar with llguidance, vLLM's "guidance" backend."""

    backend: str = "guidance"
    disable_fallback: bool = True
    disable_any_whitespace: bool = False


@dataclass(frozen=True)
class VllmConfig:
    """The whole configuration under vLLM's names; ``engine_config`` is legato's own."""

    engine_config: EngineConfig
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    lora_config: LoRAConfig | None  # None unless enable_lora, as vLLM's
    observability_config: ObservabilityConfig
    decoding_config: DecodingConfig

    @property
    def structured_outputs_config(self) -> DecodingConfig:
        """vLLM's newer name for ``decoding_config``."""
        return self.decoding_config

    @classmethod
    def of(cls, config: EngineConfig, *, dtype: str | None = None) -> VllmConfig:
        """The view of ``config``; ``dtype``: the dtype the model was loaded in, if known."""
        return cls(
            engine_config=config,
            model_config=ModelConfig(
                model=config.model,
                tokenizer=config.tokenizer or config.model,
                served_model_name=config.served_model_name or config.model,
                max_model_len=config.max_model_len,
                dtype=dtype or config.dtype,
                seed=config.seed,
                max_logprobs=config.max_logprobs,
                enforce_eager=config.enforce_eager,
                pooling_type=config.pooling_type,
            ),
            cache_config=CacheConfig(
                block_size=config.block_size,
                num_gpu_blocks=config.num_kv_blocks,
                num_gpu_blocks_override=config.num_kv_blocks,
                kv_cache_memory_bytes=config.kv_cache_memory,
                enable_prefix_caching=config.enable_prefix_caching,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.token_budget(),
                max_model_len=config.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                policy=config.scheduling_policy,
                async_scheduling=config.async_scheduling,
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=config.tensor_parallel_size,
                nnodes=config.nnodes,
                node_rank=config.node_rank,
                master_addr=config.master_addr,
                master_port=config.master_port,
            ),
            device_config=DeviceConfig(device=config.device),
            lora_config=LoRAConfig(config.max_loras, config.max_lora_rank, config.max_cpu_loras)
            if config.enable_lora
            else None,
            observability_config=ObservabilityConfig(log_stats=not config.disable_log_stats),
            decoding_config=DecodingConfig(),
        )


# vLLM EngineArgs fields legato has no counterpart for, with vLLM's defaults: accepted at
# the default (code that spells the default out keeps working), refused by name otherwise.
_UNSUPPORTED_AT_DEFAULT: dict[str, tuple[Any, str]] = {
    "pipeline_parallel_size": (1, "pipeline parallelism is not supported"),
    "data_parallel_size": (1, "data parallelism is not supported (one engine core)"),
    "distributed_executor_backend": (None, "the executor is legato's own (EngineConfig.executor)"),
    "quantization": (None, "quantized checkpoints load as GGUF files, not through this flag"),
    "kv_cache_dtype": ("auto", "the KV cache is kept in the model's dtype"),
    "load_format": ("auto", "weights load from safetensors or one GGUF file"),
    "tokenizer_mode": ("auto", "the tokenizer is loaded with transformers"),
    "trust_remote_code": (False, "models are legato's own code; none is loaded from the hub"),
    "revision": (None, "models are local directories; there is no hub revision"),
    "enable_expert_parallel": (False, "expert parallelism is not supported"),
    "cpu_offload_gb": (0, "weight offloading is not supported"),
    "swap_space": (4, "preempted requests recompute; nothing is swapped"),
    "skip_tokenizer_init": (False, "the engine always renders with its tokenizer"),
    "limit_mm_per_prompt": (None, "multimodal inputs are not supported"),
    "enable_prompt_embeds": (False, "prompt embeddings are not supported: models take token ids"),
}


@dataclass
class EngineArgs:
    """vLLM's engine arguments, for what legato supports (see the module docstring).

    ``to_engine_config()`` is the EngineConfig an engine runs on;
    ``create_engine_config()`` its VllmConfig view. Legato's own settings with
    no vLLM name (``executor``, ``attention_backend``, heartbeats...) go in
    ``legato_options``, checked as EngineConfig's keyword arguments.
    """

    model: str | None = None
    tokenizer: str | None = None
    served_model_name: str | list[str] | None = None
    dtype: DType = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    async_scheduling: bool = True
    enforce_eager: bool = False
    disable_log_stats: bool = False
    max_logprobs: int = 20
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # vLLM fields legato does not support: only vLLM's default is accepted.
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    load_format: str = "auto"
    tokenizer_mode: str = "auto"
    trust_remote_code: bool = False
    revision: str | None = None
    speculative_config: dict[str, Any] | None = None
    enable_expert_parallel: bool = False
    cpu_offload_gb: float = 0
    swap_space: float = 4
    skip_tokenizer_init: bool = False
    limit_mm_per_prompt: dict[str, int] | None = None
    enable_prompt_embeds: bool = False
    # vLLM's WeightTransferConfig: legato has its "disk" backend only (see
    # legato.workers.weight_transfer); None, {"backend": "disk"} or an object with that backend
    weight_transfer_config: Any = None
    legato_options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, (default, why) in _UNSUPPORTED_AT_DEFAULT.items():
            value = getattr(self, name)
            if value != default and not (default is None and value in ({}, [])):
                raise ValueError(f"{name}: {why}; legato accepts only {default!r}, got {value!r}")
        transfer = self.weight_transfer_config
        if transfer is not None:
            backend = transfer.get("backend") if isinstance(transfer, dict) else None
            backend = getattr(transfer, "backend", backend)
            if backend != "disk":
                raise ValueError(
                    "weight_transfer_config: legato updates weights from a local checkpoint "
                    f"only (backend 'disk'), got backend {backend!r}"
                )
        names = self.served_model_name
        if isinstance(names, list) and len(names) > 1:
            raise ValueError(f"served_model_name: legato serves one name, got {names!r}")
        renamed = {"num_kv_blocks", "kv_cache_memory", "served_model_name", "model"}
        clash = sorted(set(self.legato_options) & ({f.name for f in _ARG_FIELDS} | renamed))
        if clash:
            raise ValueError(f"legato_options: {', '.join(clash)} are EngineArgs fields")

    def to_engine_config(self) -> EngineConfig:
        """The EngineConfig these arguments describe; EngineConfig's own checks apply
        (a bad value is a ValueError naming the field)."""
        names = self.served_model_name
        name = names[0] if isinstance(names, list) and names else names
        shared = {
            f.name: getattr(self, f.name)
            for f in _ARG_FIELDS
            if f.name in _ENGINE_FIELDS and f.name not in ("served_model_name",)
        }
        return EngineConfig.from_kwargs(
            **shared,
            served_model_name=name or None,
            num_kv_blocks=self.num_gpu_blocks_override,
            kv_cache_memory=self.kv_cache_memory_bytes,
            **self.legato_options,
        )

    def create_engine_config(self) -> VllmConfig:
        """vLLM's name: the configuration as a VllmConfig view."""
        return VllmConfig.of(self.to_engine_config())


@dataclass
class AsyncEngineArgs(EngineArgs):
    """vLLM's arguments for the async engine: the same as EngineArgs here."""

    enable_log_requests: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.enable_log_requests:
            raise ValueError("enable_log_requests: per-request logging is not supported")


_ARG_FIELDS = tuple(f for f in dataclasses.fields(EngineArgs) if f.name != "legato_options")
_ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))
