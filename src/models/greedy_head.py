"""A greedy one-row decode step's last norm, LM head and argmax in one native call.

After the decoder stack (:mod:`.decode_stack`), a plain greedy step of one sequence needs
the argmax of one row of logits and nothing else. The plain path makes that three native
calls with Python between them (the fused add-norm, the one-row int8 LM head, the
argmax), each its own OpenMP region. ``legato_greedy_head_f32`` (``native/lm_head.h``) runs
the three in one region, each thread a share of the head's weight tiles: every logit is the
one-row int8 call's, bit for bit, and the token is ``cpu_kernels.argmax``'s (the first
largest value; a NaN counts as largest). Only for an fp32 model whose LM head is kept
quantized, without bias, on the int8 path (``int8_max_rows >= 1``); the caller runs the three
ops otherwise, and whenever a request needs its logits.

Never imports trio.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from . import cpu_kernels
from .decode_stack import native_projection, takes_native
from .quantized import QuantizedLinear


class GreedyHead:
    """The pointers of one model's final norm and quantized LM head, for the fused call."""

    def __init__(self, head: QuantizedLinear, norm_weight: torch.Tensor, eps: float) -> None:
        """Only for a head :meth:`eligible` accepted."""
        self.head = head
        self.norm_weight = norm_weight  # held: its address is in the key
        self.eps = eps
        self.key = self._key(head, norm_weight)
        self._projection = native_projection(head)
        self._projection_ref = ctypes.byref(self._projection)
        self.logits = torch.empty(head.out_features, dtype=torch.float32)  # reused scratch

    @staticmethod
    def _key(head: QuantizedLinear, norm_weight: torch.Tensor) -> tuple[int, ...]:
        return (id(head), head.int8_max_rows, norm_weight.data_ptr())

    @staticmethod
    def eligible(head: QuantizedLinear | None, norm_weight: torch.Tensor, bias: Any) -> bool:
        """Whether this head and final norm can take the fused call."""
        return (
            head is not None
            and bias is None
            and head.int8_max_rows >= 1
            and takes_native(head)
            and norm_weight.dtype == torch.float32
            and norm_weight.device.type == "cpu"
            and norm_weight.is_contiguous()
            and norm_weight.shape == (head.in_features,)
            and cpu_kernels.available()
        )

    def matches(self, head: QuantizedLinear | None, norm_weight: torch.Tensor) -> bool:
        """Whether these are still the head and norm it was built for."""
        return head is not None and self._key(head, norm_weight) == self.key

    def __call__(
        self, hidden: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For the stack's output of one row (``hidden``, ``residual``: contiguous fp32
        ``[1, H]``): ``residual += hidden`` in place, and ``(norm(residual), token)`` with
        ``token`` int64 ``[1]`` the argmax of its logits; None where the kernel does not take
        the call (another ISA path: nothing written)."""
        width = self.head.in_features
        if not (
            hidden.shape == (1, width) == residual.shape
            and hidden.dtype == residual.dtype == torch.float32
            and hidden.is_contiguous()
            and residual.is_contiguous()
        ):
            raise ValueError("greedy head: expects contiguous fp32 [1, hidden] rows")
        normed = torch.empty_like(hidden)
        token = torch.empty(1, dtype=torch.int64)
        code = cpu_kernels.greedy_head_kernel()(
            hidden.data_ptr(), residual.data_ptr(), self.norm_weight.data_ptr(),
            normed.data_ptr(), self._projection_ref, width, self.head.out_features, self.eps,
            self.logits.data_ptr(), token.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if code == 0:
            return None
        if code != 1:
            raise ValueError(f"greedy head: the kernel refused its arguments (code {code})")
        return normed, token
