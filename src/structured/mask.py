"""Applying a step's token bitmask to the logits: the sampler's one structured-outputs hook.

:func:`apply_token_bitmask` runs the Triton kernel for CUDA logits (when
Triton is there) and the plain-torch reference otherwise; both keep
:func:`legato.kernels.reference.apply_token_bitmask`'s contract. The bitmask
comes from :meth:`legato.structured.GrammarCompiler.fill_bitmasks` as numpy;
:func:`bitmask_tensor` moves it to the logits' device.

Imports torch; never trio.
"""

from __future__ import annotations

import numpy as np
import torch

from ..kernels import reference, triton_available


def bitmask_tensor(bitmask: np.ndarray | bytes, words: int, device: torch.device) -> torch.Tensor:
    """``int32[rows, words]`` on ``device`` from a numpy bitmask or its raw bytes (the wire form)."""
    if isinstance(bitmask, bytes | bytearray | memoryview):
        array = np.frombuffer(bitmask, dtype=np.int32)
        if array.size % words:
            raise ValueError(
                f"bitmask of {array.size} words is not a whole number of {words}-word rows"
            )
        array = array.reshape(-1, words).copy()  # torch wants a writable buffer
    else:
        array = bitmask
    host = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32))
    return host.to(device, non_blocking=device.type == "cuda")


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Set disallowed tokens of ``logits[rows]`` to ``-inf``, in place."""
    if rows.numel() == 0:
        return
    if logits.is_cuda and triton_available():
        from ..kernels import token_mask

        token_mask.apply_token_bitmask(logits, bitmask, rows)
    else:
        reference.apply_token_bitmask(logits, bitmask, rows)
