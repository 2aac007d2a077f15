"""Triton multi-LoRA (SGMV shrink + expand) against the per-token reference.

Batches mix the base model (slot 0) with several adapters, in decode shape
(one row per request, the BGMV case) and in prefill shape (long runs of one
slot, interleaved), for one slice (o_proj-like) and three (fused qkv).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from legato.kernels import lora, reference

f32, f16 = torch.float32, torch.float16


def _case(
    slots: list[int],
    *,
    in_features: int,
    out_features: list[int],
    rank: int,
    num_slots: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    x = rand(len(slots), in_features)
    a = rand(num_slots, len(out_features) * rank, in_features, scale=0.1)
    a[0].zero_()  # slot 0 is the base model: never written, always zero
    b = rand(num_slots, sum(out_features), rank, scale=0.1)
    b[0].zero_()
    y = rand(len(slots), sum(out_features))
    token_slots = torch.tensor(slots, dtype=torch.int64, device=device)
    return x, a, b, y, token_slots


CASES = [
    # (token slots, in, out slices, rank, slots incl. base, dtype)
    ([1, 0, 2, 3, 1, 2, 0, 3], 64, [48], 8, 4, f32),  # decode, one slice
    ([2, 1, 0, 2, 1], 96, [64, 32, 32], 16, 3, f32),  # decode, fused qkv
    ([1] * 20 + [0] * 7 + [2] * 33 + [1] * 5, 64, [40, 24], 8, 3, f32),  # prefill runs
    ([2, 1, 2, 2, 1, 1, 2], 32, [100, 20, 20], 8, 3, f32),  # slices of unequal widths
    ([3, 3, 0, 1, 2, 0, 1], 64, [64, 32, 32], 16, 4, f16),
    ([0] * 70 + [1] * 3 + [2] * 30, 48, [80], 16, 3, f16),  # more rows than one block
    ([0, 0, 0], 32, [32], 8, 2, f32),  # only the base: y untouched
    ([1, 2, 0, 2, 1], 4096, [32, 16, 16], 8, 3, f32),  # wide input: split-K partial sums
    ([2, 1, 1], 2048, [48], 16, 3, f16),
]


@pytest.mark.parametrize(("slots", "in_f", "outs", "rank", "num_slots", "dtype"), CASES)
def test_add_lora_matches_reference(
    device: str,
    tol: Callable[[torch.dtype], dict[str, float]],
    slots: list[int],
    in_f: int,
    outs: list[int],
    rank: int,
    num_slots: int,
    dtype: torch.dtype,
) -> None:
    x, a, b, y, token_slots = _case(
        slots, in_features=in_f, out_features=outs, rank=rank, num_slots=num_slots,
        dtype=dtype, device=device, seed=len(slots) + rank,
    )  # fmt: skip
    expected = y.clone()
    reference.add_lora(expected, x, a, b, token_slots, outs)
    got = y.clone()
    lora.add_lora(got, x, a, b, token_slots, outs)
    torch.testing.assert_close(got, expected, **tol(dtype))
    base_rows = token_slots == 0
    assert torch.equal(got[base_rows], y[base_rows])  # slot 0 rows are never touched
    if not base_rows.all():
        assert not torch.allclose(got[~base_rows], y[~base_rows])  # the update did happen


def test_shared_meta_and_column_view(device: str, tol: Any) -> None:
    """One precomputed grouping serves several calls; ``y`` may be a column view."""
    slots = [2, 0, 1, 1, 2, 0]
    x, a, b, y, token_slots = _case(
        slots, in_features=32, out_features=[24], rank=8, num_slots=3, dtype=f32,
        device=device, seed=7,
    )  # fmt: skip
    wide = torch.zeros(len(slots), 40, device=device)
    wide[:, 8:32] = y
    meta = lora.lora_meta(token_slots, 3)
    assert meta.counts.tolist() == [2, 2, 2]
    assert meta.order.tolist() == [1, 5, 2, 3, 0, 4]
    for _ in range(2):
        lora.add_lora(wide[:, 8:32], x, a, b, token_slots, [24], meta=meta)
    expected = y.clone()
    for _ in range(2):
        reference.add_lora(expected, x, a, b, token_slots, [24])
    torch.testing.assert_close(wide[:, 8:32], expected, **tol(f32))
    assert torch.count_nonzero(wide[:, :8]) == 0 and torch.count_nonzero(wide[:, 32:]) == 0
