"""Applying a step's token bitmask to the logits: the sampler's one structured-outputs hook.

:func:`apply_token_bitmask` runs the Triton kernel for CUDA logits (when
Triton is there) and the plain-torch reference otherwise; both keep
:func:`legato.kernels.reference.apply_token_bitmask`'s contract. The bitmask
comes from :meth:`legato.structured.GrammarCompiler.fill_bitmasks` as numpy;
:func:`bitmask_tensor` moves it to the logits' device.

Imports torch; never trio.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

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
    """Set disallowed tokens of ``logits[rows]`` to ``-inf``, in place.

    CUDA: the Triton kernel. CPU: :func:`apply_token_bitmask_bytes` (the
    reference's bit unpacking and ``masked_fill`` cost ~8x more at batch 32,
    vocab 49152); the reference elsewhere.
    """
    if rows.numel() == 0:
        return
    if logits.is_cuda and triton_available():
        from ..kernels import token_mask

        token_mask.apply_token_bitmask(logits, bitmask, rows)
    elif logits.device.type == "cpu" and sys.byteorder == "little":
        apply_token_bitmask_bytes(logits, bitmask, rows)
    else:
        reference.apply_token_bitmask(logits, bitmask, rows)


_BYTE_PENALTIES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _byte_penalties(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[256, 8]``: for each byte value, 0 where its bit ``i`` is set and -inf where it is clear."""
    table = _BYTE_PENALTIES.get((dtype, device))
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        table = torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf")).to(dtype).to(device)
        _BYTE_PENALTIES[(dtype, device)] = table
    return table


def apply_token_bitmask_bytes(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> None:
    """The reference's contract by table lookup: each mask byte becomes 8 penalties (0 or -inf)
    in one ``embedding`` gather, added to the rows. Needs a little-endian host (byte ``k`` of a
    word holds its bits ``8k..8k+7``). A disallowed logit that is +inf or NaN becomes NaN here
    (-inf in the reference); model logits are finite.
    """
    vocab = logits.shape[-1]
    num, words = bitmask.shape
    as_bytes = bitmask.contiguous().view(torch.uint8).long()  # [R, 4W]
    penalty = F.embedding(as_bytes, _byte_penalties(logits.dtype, logits.device))
    penalty = penalty.reshape(num, words * 32)
    if words * 32 < vocab:
        penalty = F.pad(penalty, (0, vocab - words * 32), value=float("-inf"))
    penalty = penalty[:, :vocab]
    if num == logits.shape[0] and bool((rows == torch.arange(num, device=rows.device)).all()):
        logits.add_(penalty)
    else:
        logits.index_copy_(0, rows, logits.index_select(0, rows).add_(penalty))


def step_bitmask(
    rows_by_id: Mapping[str, bytes],
    sampled_ids: Sequence[str],
    device: torch.device,
    num_rows: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The sampler's ``(token_bitmask, bitmask_rows)`` for one step, or None if no row is
    constrained. ``rows_by_id`` is ``SchedulerOutput.grammar_bitmask``; ``sampled_ids`` are the
    request ids of the logits rows, in order. With ``num_rows`` (speculative decoding),
    request ``sampled_ids[i]`` has ``num_rows[i]`` logits rows one after the other, and its
    entry holds as many bitmask rows (one per verified position)."""
    counts = num_rows if num_rows is not None else [1] * len(sampled_ids)
    picked: list[tuple[int, int, bytes]] = []  # (first logits row, rows, their bitmask)
    first = 0
    for request_id, count in zip(sampled_ids, counts, strict=True):
        data = rows_by_id.get(request_id)
        if data is not None:
            picked.append((first, count, data))
        first += count
    if not picked:
        return None
    words = len(picked[0][2]) // (4 * picked[0][1])
    if words == 0 or any(len(data) != words * 4 * count for _, count, data in picked):
        raise ValueError(
            "grammar_bitmask: each request needs one row per sampled position, "
            "all rows of the same non-zero length"
        )
    bitmask = bitmask_tensor(b"".join(data for _, _, data in picked), words, device)
    logits_rows = [start + j for start, count, _ in picked for j in range(count)]
    rows = torch.tensor(logits_rows, dtype=torch.long, device=device)
    return bitmask, rows
