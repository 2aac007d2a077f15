"""The one dispatch point between the model code and its hot-path implementations.

:func:`select_backend` picks, by ``EngineConfig.attention_backend`` and device:

- ``"torch"`` — :mod:`legato.models.torch_ops`, vectorised plain torch (the CPU
  path, checked against the references in the tests), with the native CPU
  kernels of :mod:`legato.models.cpu_kernels` where they build;
- ``"triton"`` — the Triton kernels from :func:`legato.kernels.get_kernels`,
  which keep the reference signatures (CUDA, or the interpreter);
- ``"auto"`` — triton on CUDA when it can be imported, else torch;
- ``"reference"`` (tests and debugging only) — :mod:`legato.kernels.reference`.

A backend gives the model its elementwise ops (``rms_norm``,
``fused_add_rms_norm``, ``silu_and_mul``) and, once per step,
:meth:`begin_step` turns the step's :class:`AttentionMetadata` into a
:class:`StepContext` whose ``rotary`` and ``attention`` (KV write included)
every layer calls: every hot path of the model goes through the backend, none
bypasses it. ``graph_safe`` says whether a forward can be captured in a CUDA
graph: only the Triton backend qualifies (no host syncs, no shapes or plans
taken from host-side lengths once the hints are fixed).

Never imports trio.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..kernels import reference
from . import cpu_kernels, torch_ops

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """One step's flat batch, built once by the runner and shared by every layer.

    Sequences follow the reference layout (see ``legato.kernels.reference``);
    the first ``num_decodes`` of them have exactly one query row. Host copies of
    the lengths avoid device syncs.

    ``rows_as_decodes``: every query row is to be computed as a decode row (one query
    token attending to its sequence's keys up to itself), as in a speculative verification
    step (a sequence's last token, then its drafts); a model may then run the step through
    its decode path (:mod:`legato.models.decode_stack`), whose arithmetic per row is a plain
    decode step's. Only a hint: any forward computes these rows correctly.
    """

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens_host: list[int]
    query_start_loc_host: list[int]
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    rows_as_decodes: bool = False


class StepContext(Protocol):
    """What every layer calls during one step."""

    def rotary(self, qk: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``qk`` ``[T, H + Hkv, D]`` (queries then keys); returns ``(q, k)``."""
        ...

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        scale: float,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V into the layer's cache, attend; ``[T, H, D]``.

        ``sliding_window``: a query at position ``p`` sees keys ``p - window < k <= p``.
        ``softcap``: scores become ``softcap * tanh(scores / softcap)`` (Gemma 2).
        """
        ...


class Backend(Protocol):
    """Elementwise ops plus the per-step context factory."""

    name: str
    graph_safe: bool  # a forward may be captured in a CUDA graph and replayed

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def begin_step(
        self, meta: AttentionMetadata, cos_sin_cache: torch.Tensor, dtype: torch.dtype
    ) -> StepContext: ...


# ------------------------------------------------------------------ torch


class _TorchStep:
    def __init__(
        self,
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
        dtype: torch.dtype,
        native: bool,
    ) -> None:
        self.native = native
        self.meta = meta
        self.dtype = dtype
        self.positions = meta.positions
        self.cos_sin_cache = cos_sin_cache
        if not native:
            self.cos, self.sin = torch_ops.rotary_tables(cos_sin_cache, meta.positions, dtype)
        # one plan per (window size, soft-capped) the layers use, built on first use
        self.plans: dict[tuple[int | None, bool], torch_ops.AttentionPlan] = {}

    def _plan(self, sliding_window: int | None, capped: bool) -> torch_ops.AttentionPlan:
        plan = self.plans.get((sliding_window, capped))
        if plan is None:
            meta = self.meta
            # the native decode kernel takes no soft cap: capped layers gather
            plan = self.plans[(sliding_window, capped)] = torch_ops.plan_attention(
                meta.block_tables,
                meta.seq_lens_host,
                meta.query_start_loc_host,
                meta.slot_mapping,
                meta.block_size,
                self.dtype,
                meta.num_decodes,
                seq_lens_tensor=meta.seq_lens,
                native=self.native and not capped,
                sliding_window=sliding_window,
            )
        return plan

    def rotary(self, qk: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.native:  # in place: qk is this layer's fresh projection
            cpu_kernels.rotary_neox(qk, self.positions, self.cos_sin_cache)
            return qk[:, :num_heads], qk[:, num_heads:]
        out = torch_ops.rotate_neox(qk, self.cos, self.sin)
        return out[:, :num_heads], out[:, num_heads:]

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        scale: float,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        plan = self._plan(sliding_window, softcap is not None)
        return torch_ops.attend(query, key, value, key_cache, value_cache, plan, scale, softcap)


class TorchBackend:
    """Vectorised plain torch (:mod:`legato.models.torch_ops`).

    With ``native`` (the CPU, a compiler at hand) fp32 and bf16 run the native
    kernels of :mod:`legato.models.cpu_kernels` instead: attention reading the
    paged cache in place, the KV write, norms, activation and rotary in one
    pass each (rotary in place, the fused norm's residual updated in place).
    Not graph-safe: the attention plan's shapes come from host-side lengths.
    """

    name = "torch"
    graph_safe = False

    def __init__(self, *, native: bool = False) -> None:
        self.native = native

    def _native_for(self, x: torch.Tensor) -> bool:
        return self.native and x.dtype in cpu_kernels.DTYPES

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self._native_for(x) and x.dim() == 2:
            return cpu_kernels.rms_norm(x, weight, eps)
        return torch_ops.rms_norm(x, weight, eps)

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._native_for(x) and x.dim() == 2 and residual.is_contiguous():
            return cpu_kernels.rms_norm(x, weight, eps, residual=residual), residual
        return torch_ops.fused_add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if self._native_for(x) and x.dim() == 2:
            return cpu_kernels.silu_and_mul(x)
        return torch_ops.silu_and_mul(x)

    def begin_step(
        self, meta: AttentionMetadata, cos_sin_cache: torch.Tensor, dtype: torch.dtype
    ) -> StepContext:
        native = self.native and dtype in cpu_kernels.DTYPES
        return _TorchStep(meta, cos_sin_cache, dtype, native)


# ---------------------------------------------------------------- kernels


class _KernelStep:
    def __init__(
        self, kernels: Any, meta: AttentionMetadata, cos_sin_cache: torch.Tensor, hints: bool
    ) -> None:
        self.kernels = kernels
        self.meta = meta
        self.cos_sin_cache = cos_sin_cache
        self.hints: dict[str, int] = (
            {"max_query_len": meta.max_query_len, "max_seq_len": meta.max_seq_len} if hints else {}
        )

    def rotary(self, qk: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = qk[:, :num_heads], qk[:, num_heads:]
        rotated: tuple[torch.Tensor, torch.Tensor] = self.kernels.apply_rotary(
            q, k, self.meta.positions, self.cos_sin_cache, True
        )
        return rotated

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        scale: float,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        meta = self.meta
        self.kernels.write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        extra: dict[str, float] = {}
        if sliding_window is not None:
            extra["sliding_window"] = sliding_window
        if softcap is not None:
            extra["softcap"] = softcap
        out: torch.Tensor = self.kernels.paged_attention(
            query,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            scale,
            **self.hints,
            **extra,
        )
        return out


class KernelBackend:
    """Functions with the reference signatures: the references or the Triton kernels.

    Graph-safe when the kernels take the host-side hints (Triton): with
    ``max_query_len`` and ``max_seq_len`` given, no call syncs with the device.
    The references read lengths back (``.tolist()``) and are not.
    """

    def __init__(self, name: str, kernels: Any, *, hints: bool) -> None:
        self.name = name
        self.kernels = kernels
        self.hints = hints  # whether paged_attention takes max_query_len / max_seq_len
        self.graph_safe = hints

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out: torch.Tensor = self.kernels.rms_norm(x, weight, eps)
        return out

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out: tuple[torch.Tensor, torch.Tensor] = self.kernels.fused_add_rms_norm(
            x, residual, weight, eps
        )
        return out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.kernels.silu_and_mul(x)
        return out

    def begin_step(
        self, meta: AttentionMetadata, cos_sin_cache: torch.Tensor, dtype: torch.dtype
    ) -> StepContext:
        del dtype
        return _KernelStep(self.kernels, meta, cos_sin_cache, self.hints)


def _triton_backend() -> KernelBackend:
    from .. import kernels

    return KernelBackend("triton", kernels.get_kernels("triton"), hints=True)


def select_backend(name: str, device: torch.device) -> Backend:
    """The backend for ``name`` ("auto", "torch", "triton", "reference") on ``device``.

    "triton" raises when the Triton kernels cannot be loaded; "auto" falls back
    to torch with a log line.
    """
    native = device.type == "cpu" and cpu_kernels.available()
    if name == "torch":
        return TorchBackend(native=native)
    if name == "reference":
        return KernelBackend("reference", reference, hints=False)
    if name == "triton":
        return _triton_backend()
    if name == "auto":
        if device.type == "cuda":
            try:
                return _triton_backend()
            except (ImportError, AttributeError, RuntimeError) as exc:
                logger.warning("triton kernels unavailable (%s); using the torch backend", exc)
        return TorchBackend(native=native)
    raise ValueError(
        f"attention_backend: unknown backend {name!r}; expected auto, torch, triton or reference"
    )
