"""Small model building blocks: linear, embedding, RMSNorm, MLP, attention (rotary: rotary.py).

Each is a tiny ``nn.Module`` whose parameters are allocated empty (no random
init) in the target dtype and device, to be filled by the loader. The maths
goes through a :class:`~legato.models.attention_backend.Backend`, so the same
modules run on the plain-torch path and on the Triton kernels.

Never imports trio.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .attention_backend import Backend, StepContext
from .quantized import QuantizedLinear, QuantizedWeight


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x W^T (+ b)``; ``W`` is ``[out_features, in_features]`` as in checkpoints.

    ``packed``, when set (:func:`legato.models.cpu_linear.pack_linears`), computes
    the same product from a prepacked copy of the weights and replaces them;
    ``quantized``, when set (a GGUF file's weights kept quantized), holds the weight
    instead of ``weight``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.weight = _empty(out_features, in_features, dtype=dtype, device=device)
        self.bias = _empty(out_features, dtype=dtype, device=device) if bias else None
        # Any callable that computes this product (cpu_linear.PackedLinear): layers never
        # import the packing code, which imports them.
        self.packed: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.quantized: QuantizedLinear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            out = self.quantized(x)
            return out if self.bias is None else out.add_(self.bias)
        if self.packed is not None:
            return self.packed(x)
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """Token embedding table ``[vocab, hidden]``; ``quantized``, when set, holds it instead
    (the looked-up rows are dequantized)."""

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _empty(vocab, hidden, dtype=dtype, device=device)
        self.quantized: QuantizedWeight | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            rows = self.quantized.dequantize(ids.reshape(-1).long())
            return rows.to(self.weight.dtype).view(*ids.shape, -1)
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm with weight; ``forward(x, residual)`` is the fused add + norm."""

    def __init__(
        self, size: int, eps: float, backend: Backend, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.weight = _empty(size, dtype=dtype, device=device)
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual += x``; returns ``(norm(residual), residual)``."""
        return self.backend.fused_add_rms_norm(x, residual, self.weight, self.eps)


ACTIVATIONS = ("silu", "swish", "gelu_pytorch_tanh")
"""Gated MLP activations, named as in transformers' configs."""


class MLP(nn.Module):
    """Gated feed-forward with fused gate/up projection: ``down(act(gate) * up)``.

    ``activation`` "silu" (SwiGLU) goes through the backend's fused op;
    "gelu_pytorch_tanh" (GeGLU, Gemma) is plain torch on every backend.
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        bias: bool,
        backend: Backend,
        dtype: torch.dtype,
        device: torch.device,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            supported = ", ".join(ACTIVATIONS)
            raise ValueError(f"hidden_act: {activation!r} is not supported ({supported})")
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias, dtype, device)
        self.down_proj = Linear(intermediate, hidden, bias, dtype, device)
        self.backend = backend
        self.gelu = activation == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.gelu:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") * up
        else:
            act = self.backend.silu_and_mul(gate_up)
        out: torch.Tensor = self.down_proj(act)
        return out


class Attention(nn.Module):
    """Grouped-query attention over the paged KV cache, fused qkv projection.

    ``qk_norm`` adds per-head RMSNorm of queries and keys before rotary (Qwen3).
    ``sliding_window``: each query sees only its last that many positions (None: all).
    ``scale``: the score scale (default ``head_dim ** -0.5``); ``softcap``: scores become
    ``softcap * tanh(scores / softcap)`` (Gemma 2).
    """

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        eps: float,
        backend: Backend,
        dtype: torch.dtype,
        device: torch.device,
        sliding_window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.scale = scale if scale is not None else head_dim**-0.5
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, qkv_bias, dtype, device)
        self.o_proj = Linear(self.q_size, hidden, o_bias, dtype, device)
        self.q_norm = RMSNorm(head_dim, eps, backend, dtype, device) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps, backend, dtype, device) if qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        step: StepContext,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(num_tokens, -1, self.head_dim)
        heads = self.num_heads + self.num_kv_heads
        qk, v = qkv[:, :heads], qkv[:, heads:]
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat(
                (self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1
            )
        q, k = step.rotary(qk, self.num_heads)
        out = step.attention(
            q, k, v, kv_cache[0], kv_cache[1], self.scale,
            sliding_window=self.sliding_window, softcap=self.softcap,
        )  # fmt: skip
        projected: torch.Tensor = self.o_proj(out.reshape(num_tokens, self.q_size))
        return projected
