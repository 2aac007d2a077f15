"""Triton kernels, each beside its plain-torch reference in reference.py.

The model code picks a path by name with :func:`get_kernels` and calls the
six hot-path functions through the returned :class:`KernelSet`, whose members
keep the reference signatures. Importing this package is cheap: it imports
neither torch nor triton; the Triton modules (``attention``, ``kv_write``,
``norm``, ``rotary``, ``activation``) are imported only when the "triton"
path is asked for, so ``TRITON_INTERPRET`` must be set before that first call
when the interpreter is wanted. Two kernels sit outside the set and are imported
by their callers directly: ``quantized_matmul`` (weight-only matmul over
GGUF-quantized weights in the layout ``legato.models.quantized`` repacks them
into) and ``fused_moe`` (the mixture-of-experts kernel, imported by the MoE
block on the Triton backend).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    import torch

Backend = Literal["torch", "triton"]

__all__ = [
    "Backend",
    "KernelSet",
    "PagedAttentionFn",
    "get_kernels",
    "triton_available",
    "triton_interpreting",
]


def triton_interpreting() -> bool:
    """Whether Triton kernels run under the CPU interpreter (``TRITON_INTERPRET`` set)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false")


def triton_available() -> bool:
    """Whether the Triton path can run here: triton importable and a CUDA device or the interpreter.

    Does not import triton; imports torch only to ask for a CUDA device.
    """
    if importlib.util.find_spec("triton") is None:
        return False
    if triton_interpreting():
        return True
    import torch

    return torch.cuda.is_available()


class PagedAttentionFn(Protocol):
    """``paged_attention`` as the model calls it: reference positional args plus optional hints.

    ``max_query_len`` / ``max_seq_len`` are host-side upper bounds that let the
    Triton path avoid a device sync; the torch path ignores them. ``sliding_window``:
    each query sees only keys at ``q_pos - sliding_window < k_pos <= q_pos`` (None: all).
    """

    def __call__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
        *,
        max_query_len: int | None = None,
        max_seq_len: int | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor: ...


class WriteKVFn(Protocol):
    def __call__(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...


class RMSNormFn(Protocol):
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...


class FusedAddRMSNormFn(Protocol):
    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class RotaryFn(Protocol):
    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        is_neox: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class SiluAndMulFn(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class KernelSet:
    """The hot-path functions of one backend; each has its reference's contract."""

    backend: Backend
    write_kv: WriteKVFn
    paged_attention: PagedAttentionFn
    rms_norm: RMSNormFn
    fused_add_rms_norm: FusedAddRMSNormFn
    apply_rotary: RotaryFn
    silu_and_mul: SiluAndMulFn


def _torch_kernels() -> KernelSet:
    from . import reference

    return KernelSet(
        backend="torch",
        write_kv=reference.write_kv,
        paged_attention=reference.paged_attention,
        rms_norm=reference.rms_norm,
        fused_add_rms_norm=reference.fused_add_rms_norm,
        apply_rotary=reference.apply_rotary,
        silu_and_mul=reference.silu_and_mul,
    )


def _triton_kernels() -> KernelSet:
    from . import activation, attention, kv_write, norm, rotary

    return KernelSet(
        backend="triton",
        write_kv=kv_write.write_kv,
        paged_attention=attention.paged_attention,
        rms_norm=norm.rms_norm,
        fused_add_rms_norm=norm.fused_add_rms_norm,
        apply_rotary=rotary.apply_rotary,
        silu_and_mul=activation.silu_and_mul,
    )


def get_kernels(backend: Backend) -> KernelSet:
    """The kernel set for ``backend``.

    "torch" always works (plain-torch references, any device). "triton" imports
    the Triton modules on first use and raises ``RuntimeError`` when
    :func:`triton_available` is False.
    """
    if backend == "torch":
        return _torch_kernels()
    if backend == "triton":
        if not triton_available():
            raise RuntimeError(
                "the triton kernel backend needs triton and a CUDA device "
                "(or TRITON_INTERPRET=1 for the CPU interpreter)"
            )
        return _triton_kernels()
    raise ValueError(f"unknown kernel backend {backend!r}; expected 'torch' or 'triton'")
