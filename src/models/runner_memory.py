"""``RunnerMemory``: the model runner's memory: sizing and allocating the paged KV
cache (after a profile run on CUDA; on the CPU in anonymous memory maps, zero pages
the kernel supplies on first write, so an unused block costs no resident memory), capturing the decode CUDA graphs over it,
``sleep`` / ``wake_up`` (drop or offload the KV cache and weights, and bring
them back), ``reload_weights`` (new weights from a checkpoint) and ``reset_kv_cache``. A mixin of ``ModelRunner``, which holds the state
declared here. Never imports trio.
"""

from __future__ import annotations

import gc
import math
import mmap
import resource
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..config import EngineConfig
from .config import ModelConfig
from .cpu_linear import pack_linears, unpack_linears
from .cuda_graphs import CaptureMode, DecodeGraphRunner, capture_sizes
from .llama import KVCache, LlamaForCausalLM
from .loader import fill_weights
from .step_metadata import build_metadata

if TYPE_CHECKING:
    from .tensor_parallel import TensorParallel


_CPU_KV_BUDGET = 1 << 30  # bytes for the KV cache on CPU when nothing says otherwise
_CUDA_MEMORY_FRACTION = 0.9  # of the free GPU memory, after weights and activations
_PRIVATE_ANONYMOUS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS


class RunnerMemory:
    """Mixin: what the model runner holds in memory, and the calls that free and restore it."""

    config: EngineConfig
    model_config: ModelConfig
    model_dir: Path
    model: LlamaForCausalLM
    device: torch.device
    dtype: torch.dtype
    block_size: int
    kv_block_bytes: int
    kv_caches: list[KVCache]
    decode_graphs: DecodeGraphRunner | None
    verify_graphs: DecodeGraphRunner | None
    parallel: TensorParallel | None
    _weights_state: str  # "loaded" | "offloaded" | "dropped"
    _packed_bytes: int
    _param_shapes: dict[str, tuple[int, ...]]
    _keep_quantized: bool
    _checkpoint_config: ModelConfig
    _graph_settings: tuple[CaptureMode, list[int]] | None
    _kv_maps: list[mmap.mmap]  # the CPU KV cache's memory maps (empty on CUDA)
    num_kv_blocks: int
    max_model_len: int

    def _count_kv_blocks(self, wanted_len: int) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if cfg.kv_cache_memory is not None:
            budget = cfg.kv_cache_memory
        elif self.device.type == "cuda":
            activations = int(self.profile_run()["activation_bytes"])
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * _CUDA_MEMORY_FRACTION) - activations
        else:
            needed = -(-wanted_len // self.block_size) * cfg.max_num_seqs * self.kv_block_bytes
            budget = min(_CPU_KV_BUDGET, needed)
        blocks = budget // self.kv_block_bytes
        if blocks < 1:
            raise ValueError(
                f"kv_cache_memory: {budget} bytes cannot hold one KV block "
                f"({self.kv_block_bytes} bytes)"
            )
        return int(blocks)

    def _allocate_kv_cache(self) -> list[KVCache]:
        """Every layer's zeroed ``(key, value)`` blocks. On the CPU each tensor lies in its
        own private anonymous memory map: it reads as zeros, and a page becomes resident
        only when a KV write first lands on it (``torch.zeros`` would touch every page at
        start: the whole budget resident before the first request)."""
        mcfg = self.model_config
        shape = (self.num_kv_blocks, self.block_size, mcfg.num_kv_heads, mcfg.head_dim)
        self._kv_maps = []
        if self.device.type != "cpu":
            return [
                (
                    torch.zeros(shape, dtype=self.dtype, device=self.device),
                    torch.zeros(shape, dtype=self.dtype, device=self.device),
                )
                for _ in range(mcfg.num_layers)
            ]
        return [
            (self._mapped_zeros(shape), self._mapped_zeros(shape)) for _ in range(mcfg.num_layers)
        ]

    def _mapped_zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        memory = mmap.mmap(-1, math.prod(shape) * self.dtype.itemsize, flags=_PRIVATE_ANONYMOUS)
        self._kv_maps.append(memory)
        return torch.frombuffer(memory, dtype=torch.uint8).view(self.dtype).view(shape)

    # ------------------------------------------------------- decode graphs

    def capture_decode_graphs(
        self, sizes: Sequence[int] | None = None, *, mode: CaptureMode = "cuda"
    ) -> None:
        """Capture the decode forward at ``sizes`` (default :func:`capture_sizes` of
        ``max_num_seqs``); from then on pure-decode steps that fit replay them. With n-gram
        speculation (``num_speculative_tokens`` k) the verification forward is captured
        too, at the same sizes with ``k + 1`` rows a sequence (``verify_graphs``).

        ``mode="emulate"`` (tests, CPU) records the forward over the static
        buffers and replays it eagerly. Raises ``ValueError`` for a backend that
        is not graph-safe and ``RuntimeError`` when a CUDA capture fails.
        Recaptured by :meth:`wake_up` after a :meth:`sleep`. Blocks while capturing.
        """
        chosen = list(sizes) if sizes is not None else capture_sizes(self.config.max_num_seqs)
        self.decode_graphs = self.verify_graphs = None
        spec = self.config.speculative_config
        query_lens = [1]
        if spec is not None and spec.model is None:  # a draft model keeps its steps eager
            query_lens.append(spec.num_speculative_tokens + 1)
        built: list[DecodeGraphRunner] = []
        for query_len in query_lens:
            graphs = DecodeGraphRunner(
                self.model,
                self.kv_caches,
                sizes=chosen,
                max_model_len=self.max_model_len,
                block_size=self.block_size,
                device=self.device,
                mode=mode,
                query_len=query_len,
            )
            try:
                graphs.capture()
            except Exception as exc:
                if mode != "cuda":
                    raise
                raise RuntimeError(
                    f"capturing the decode CUDA graphs failed ({exc}); "
                    "enforce_eager=True runs without them"
                ) from exc
            built.append(graphs)
        self.decode_graphs = built[0]
        self.verify_graphs = built[1] if len(built) > 1 else None
        self._graph_settings = (mode, built[0].sizes)

    # ------------------------------------------------------- sleep and wake

    def profile_run(self) -> dict[str, Any]:
        """A dummy forward + sample at ``max_num_batched_tokens``; returns figures.

        Uses a scratch KV cache, so the real cache is untouched. Keys:
        ``num_tokens``, ``num_seqs``, ``seconds``, ``weights_bytes``,
        ``kv_cache_bytes``, ``kv_block_bytes``, ``activation_bytes`` (CUDA:
        measured peak above the baseline; CPU: estimate from the shapes),
        ``peak_memory_bytes`` (CUDA: allocator peak; CPU: process peak RSS).
        """
        if getattr(self, "_weights_state", "loaded") != "loaded":
            raise RuntimeError("the model runner is asleep: call wake_up() first")
        cfg, mcfg = self.config, self.model_config
        max_len = getattr(self, "max_model_len", None) or mcfg.max_position_embeddings
        budget = cfg.token_budget(self.device.type)
        num_seqs = max(1, min(cfg.max_num_seqs, budget))
        per_seq = min(max_len, -(-budget // num_seqs))
        q_lens = np.full(num_seqs, per_seq, dtype=np.int64)
        blocks_per_seq = -(-per_seq // self.block_size)
        table = np.arange(num_seqs * blocks_per_seq, dtype=np.int32).reshape(num_seqs, -1)
        shape = (num_seqs * blocks_per_seq, self.block_size, mcfg.num_kv_heads, mcfg.head_dim)
        is_cuda = self.device.type == "cuda"
        if is_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            baseline = torch.cuda.memory_allocated(self.device)
        scratch = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(mcfg.num_layers)
        ]
        starts = np.zeros(num_seqs, dtype=np.int64)
        order = np.argsort(q_lens != 1, kind="stable")
        meta, seq_of_token, _ = build_metadata(
            starts[order], q_lens[order], table[order], self.block_size, self.device
        )
        ids = torch.zeros(len(seq_of_token), dtype=torch.long, device=self.device)
        began = time.perf_counter()
        hidden = self.model(ids, scratch, meta)
        last = torch.tensor(meta.query_start_loc_host[1:], device=self.device) - 1
        logits = self.model.compute_logits(hidden.index_select(0, last))
        torch.softmax(logits.float(), dim=-1).argmax(dim=-1).tolist()
        seconds = time.perf_counter() - began
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        weights += getattr(self, "_packed_bytes", 0)
        scratch_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in scratch)
        if is_cuda:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            activation = max(0, peak - baseline - scratch_bytes)
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            width = max(mcfg.hidden_size * 4, 2 * mcfg.intermediate_size)
            activation = len(seq_of_token) * width * 4 + num_seqs * mcfg.vocab_size * 4 * 3
        del scratch, hidden, logits
        return {
            "num_tokens": len(seq_of_token),
            "num_seqs": num_seqs,
            "seconds": seconds,
            "weights_bytes": weights,
            "kv_cache_bytes": sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)
            if getattr(self, "kv_caches", None)
            else 0,
            "kv_block_bytes": self.kv_block_bytes,
            "activation_bytes": int(activation),
            "peak_memory_bytes": int(peak),
        }

    @property
    def sleeping(self) -> bool:
        """True while the KV cache or the weights are not in place."""
        return not self.kv_caches or self._weights_state != "loaded"

    @torch.inference_mode()
    def sleep(self, level: int = 1) -> None:
        """Free memory: level 1 drops the KV cache (and offloads weights to CPU on CUDA);
        level 2 also drops the weights (reloaded from disk by :meth:`wake_up`).

        The KV contents are lost either way; held request state is kept (the
        scheduler decides what to do with running requests).
        """
        if level not in (1, 2):
            raise ValueError(f"level: must be 1 or 2, got {level!r}")
        self.decode_graphs = self.verify_graphs = None  # they hold the cache and weights
        self.model.release_decode_stack()  # so does the fused decode stack
        self.kv_caches = []
        self._kv_maps = []  # unmapped once the last tensor over them is gone
        if level == 2:
            unpack_linears(self.model)
            self.model.drop_quantized()
            self._packed_bytes = 0
            for param in self.model.parameters():
                param.data = torch.empty(0, dtype=self.dtype, device=self.device)
            self._weights_state = "dropped"
        elif self.device.type != "cpu" and self._weights_state == "loaded":
            for param in self.model.parameters():
                param.data = param.data.to("cpu")
            self._weights_state = "offloaded"
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what :meth:`sleep` freed: ``tags`` None = everything, else a
        subset of ``"weights"`` and ``"kv_cache"``. The KV cache comes back zeroed.
        """
        wanted = set(tags) if tags is not None else {"weights", "kv_cache"}
        unknown = wanted - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"tags: unknown tag(s) {sorted(unknown)}; expected weights, kv_cache")
        if "weights" in wanted and self._weights_state == "dropped":
            self._fill_weights_from(self.model_dir)
        elif "weights" in wanted and self._weights_state == "offloaded":
            for param in self.model.parameters():
                param.data = param.data.to(self.device)
            self._weights_state = "loaded"
        if "kv_cache" in wanted and not self.kv_caches:
            self.kv_caches = self._allocate_kv_cache()
        if not self.sleeping and self.decode_graphs is None and self._graph_settings is not None:
            mode, sizes = self._graph_settings
            self.capture_decode_graphs(sizes, mode=mode)

    def _fill_weights_from(self, model_dir: Path) -> None:
        """Allocate the dropped weights again and fill them from ``model_dir`` (this
        rank's share), packed for the CPU linears as at start."""
        for name, param in self.model.named_parameters():
            param.data = torch.empty(self._param_shapes[name], dtype=self.dtype, device=self.device)
        if self.parallel is None:
            fill_weights(self.model, model_dir, keep_quantized=self._keep_quantized)
            self.model.set_int8_max_rows(1 if self.config.gguf_activations == "int8" else 0)
        else:
            self.parallel.fill_weights(self.model, model_dir, self._checkpoint_config)
        self._packed_bytes = pack_linears(self.model)
        self._weights_state = "loaded"

    @torch.inference_mode()
    def reload_weights(self, model_dir: str | Path) -> None:
        """Replace the weights with ``model_dir``'s, a checkpoint of the same architecture
        (vLLM's weight update from a local checkpoint). The KV cache and the requests'
        state are kept: the next step runs on the new weights. A later level-2 sleep
        wakes up with these weights. Raises if the weights are not in place (sleeping)
        or the checkpoint does not fit; the weights are then undefined until a
        successful reload."""
        if self._weights_state != "loaded":
            raise RuntimeError("the weights are not loaded (the engine sleeps): wake it up first")
        self.decode_graphs = self.verify_graphs = None  # they hold the weight addresses
        unpack_linears(self.model)
        self.model.drop_quantized()
        self._packed_bytes = 0
        self._weights_state = "dropped"
        self._fill_weights_from(Path(model_dir))
        self.model_dir = Path(model_dir)
        if self.decode_graphs is None and self._graph_settings is not None:
            mode, sizes = self._graph_settings
            self.capture_decode_graphs(sizes, mode=mode)

    @torch.inference_mode()
    def reset_kv_cache(self) -> None:
        """Zero every KV block (the contents of the prefix cache are gone). On the CPU the
        pages go back to the kernel (``MADV_DONTNEED``: they read as zeros again and are no
        longer resident), in place: the tensors keep their addresses."""
        if self._kv_maps:
            for memory in self._kv_maps:
                memory.madvise(mmap.MADV_DONTNEED)
            return
        for key_cache, value_cache in self.kv_caches:
            key_cache.zero_()
            value_cache.zero_()
