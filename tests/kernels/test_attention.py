"""Triton paged attention against the reference: decode (split and unsplit), prefill, mixed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from legato.kernels import attention, attention_decode, reference

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16

# (group, head_dim, block_size, dtype, split_tokens); num_kv_heads is 2 throughout.
DECODE_CASES = [
    (1, 64, 16, f32, None),
    (2, 128, 32, f16, 64),
    (4, 64, 16, f32, 64),
    (4, 64, 16, bf16, 64),  # bf16 runs the fp32-dot path under the interpreter
    (8, 128, 16, f16, None),
    (8, 64, 32, f32, 128),
    (2, 80, 16, f32, 64),
]


@pytest.mark.parametrize(("group", "head_dim", "block_size", "dtype", "split"), DECODE_CASES)
def test_decode_matches_reference(
    paged_batch: Callable[..., Any],
    tol: Callable[[torch.dtype], dict[str, float]],
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    split: int | None,
) -> None:
    seq_lens = [1, 17, 150, 300, 233]
    b = paged_batch(
        seq_lens,
        [1] * len(seq_lens),
        num_heads=2 * group,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=group + head_dim,
    )
    out = attention.paged_attention_decode(*b.args(), b.scale, split_tokens=split)
    expected = reference.paged_attention(*b.args(), b.scale)
    torch.testing.assert_close(out, expected, **tol(dtype))


def test_decode_split_planner_uses_several_splits(
    paged_batch: Callable[..., Any], tol: Callable[[torch.dtype], dict[str, float]]
) -> None:
    """One long sequence: the automatic plan splits the context and the reduce pass merges it."""
    b = paged_batch([290], [1], num_heads=4, num_kv_heads=1, head_dim=64, block_size=16, dtype=f32)
    num_splits, split_tokens = attention_decode.plan_splits(1, 1, 290, b.query.device)
    assert num_splits > 1 and split_tokens % 64 == 0
    expected = reference.paged_attention(*b.args(), b.scale)
    out = attention.paged_attention_decode(*b.args(), b.scale, max_seq_len=290)
    torch.testing.assert_close(out, expected, **tol(f32))
    # An underestimated bound plans too few splits; the last one runs to the end.
    out = attention.paged_attention_decode(*b.args(), b.scale, max_seq_len=100, split_tokens=64)
    torch.testing.assert_close(out, expected, **tol(f32))


def test_decode_skips_sequences_without_query(
    paged_batch: Callable[..., Any], tol: Callable[[torch.dtype], dict[str, float]]
) -> None:
    b = paged_batch(
        [40, 90, 70], [1, 0, 1], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=f32
    )
    out = attention.paged_attention_decode(*b.args(), b.scale, split_tokens=64)
    torch.testing.assert_close(out, reference.paged_attention(*b.args(), b.scale), **tol(f32))


# (seq_lens, query_lens, group, head_dim, block_size, dtype)
PREFILL_CASES = [
    # whole prompts, one shorter than a KV tile, none a power of two
    ([37, 150, 5], [37, 150, 5], 1, 64, 16, f32),
    # chunked prefill after a cached prefix, a full prefill and decodes in one batch
    ([300, 120, 65, 201], [40, 1, 65, 1], 4, 128, 32, f16),
    # prefix-cache hit, decode, a sequence with no new tokens this step
    ([210, 33, 90], [100, 1, 0], 8, 64, 16, f32),
    ([130, 77], [30, 77], 2, 80, 16, f32),
    ([100, 9, 260], [100, 1, 3], 2, 128, 16, f16),
    ([90, 41], [20, 1], 2, 64, 32, bf16),
]


@pytest.mark.parametrize(
    ("seq_lens", "query_lens", "group", "head_dim", "block_size", "dtype"), PREFILL_CASES
)
def test_prefill_matches_reference(
    paged_batch: Callable[..., Any],
    tol: Callable[[torch.dtype], dict[str, float]],
    seq_lens: list[int],
    query_lens: list[int],
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
) -> None:
    b = paged_batch(
        seq_lens,
        query_lens,
        num_heads=2 * group,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=len(seq_lens) + group,
    )
    out = attention.paged_attention_prefill(*b.args(), b.scale)
    expected = reference.paged_attention(*b.args(), b.scale)
    torch.testing.assert_close(out, expected, **tol(dtype))


def test_prefill_small_tiles_and_odd_group(
    paged_batch: Callable[..., Any], tol: Callable[[torch.dtype], dict[str, float]]
) -> None:
    """Group 3 leaves padding rows in each query tile; 16-row tiles give many tiles per prompt."""
    b = paged_batch(
        [70, 45], [50, 1], num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, dtype=f32
    )
    out = attention.paged_attention_prefill(*b.args(), b.scale, block_m=16, block_n=32)
    torch.testing.assert_close(out, reference.paged_attention(*b.args(), b.scale), **tol(f32))


def test_strided_query_view(
    paged_batch: Callable[..., Any], tol: Callable[[torch.dtype], dict[str, float]]
) -> None:
    """A query sliced out of a fused QKV projection (token stride != H * D) works as is."""
    b = paged_batch(
        [60, 20], [60, 1], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=f32
    )
    fused = torch.randn(b.query.shape[0], 8 * 64, device=b.query.device)
    fused[:, : 4 * 64] = b.query.reshape(-1, 4 * 64)
    query = fused[:, : 4 * 64].view(-1, 4, 64)
    assert not query.is_contiguous()
    args = (query, *b.args()[1:])
    out = attention.paged_attention(*args, b.scale)
    torch.testing.assert_close(out, reference.paged_attention(*b.args(), b.scale), **tol(f32))


@pytest.mark.parametrize("hint", [None, 1])
def test_dispatch_decode(
    paged_batch: Callable[..., Any],
    tol: Callable[[torch.dtype], dict[str, float]],
    monkeypatch: pytest.MonkeyPatch,
    hint: int | None,
) -> None:
    b = paged_batch(
        [33, 80], [1, 1], num_heads=4, num_kv_heads=1, head_dim=64, block_size=16, dtype=f32
    )
    monkeypatch.setattr(attention, "paged_attention_prefill", _forbidden)
    out = attention.paged_attention(*b.args(), b.scale, max_query_len=hint)
    torch.testing.assert_close(out, reference.paged_attention(*b.args(), b.scale), **tol(f32))


@pytest.mark.parametrize("hint", [None, 5])
def test_dispatch_mixed(
    paged_batch: Callable[..., Any],
    tol: Callable[[torch.dtype], dict[str, float]],
    monkeypatch: pytest.MonkeyPatch,
    hint: int | None,
) -> None:
    # T == num_seqs although one sequence has two new tokens: the lengths decide.
    b = paged_batch(
        [33, 80, 20], [2, 1, 0], num_heads=4, num_kv_heads=1, head_dim=64, block_size=16, dtype=f32
    )
    monkeypatch.setattr(attention, "paged_attention_decode", _forbidden)
    out = attention.paged_attention(*b.args(), b.scale, max_query_len=hint)
    torch.testing.assert_close(out, reference.paged_attention(*b.args(), b.scale), **tol(f32))


def _forbidden(*args: object, **kwargs: object) -> torch.Tensor:
    raise AssertionError("dispatched to the wrong kernel")


# (seq_lens, query_lens, window, block_size): decodes past and within the window, a fresh
# prompt longer than the window, a chunk after a cached prefix, a window under one KV tile
WINDOW_CASES = [
    ([300, 20, 150], [1, 1, 1], 48, 16),
    ([130, 90, 300, 17], [130, 1, 40, 17], 37, 16),
    ([200, 64], [70, 1], 16, 32),
]


@pytest.mark.parametrize(("seq_lens", "query_lens", "window", "block_size"), WINDOW_CASES)
def test_sliding_window_matches_reference(
    paged_batch: Callable[..., Any],
    tol: Callable[[torch.dtype], dict[str, float]],
    seq_lens: list[int],
    query_lens: list[int],
    window: int,
    block_size: int,
) -> None:
    """Each query sees only its last ``window`` positions: decode (split and not) and prefill."""
    b = paged_batch(
        seq_lens, query_lens, num_heads=4, num_kv_heads=2, head_dim=64,
        block_size=block_size, dtype=f32, seed=window,
    )  # fmt: skip
    expected = reference.paged_attention(*b.args(), b.scale, sliding_window=window)
    full = reference.paged_attention(*b.args(), b.scale)
    assert not torch.allclose(expected, full)  # the window changes the answer here
    out = attention.paged_attention(*b.args(), b.scale, sliding_window=window)
    torch.testing.assert_close(out, expected, **tol(f32))
    if all(q <= 1 for q in query_lens):
        for split in (None, 16):
            out = attention.paged_attention_decode(
                *b.args(), b.scale, split_tokens=split, sliding_window=window
            )
            torch.testing.assert_close(out, expected, **tol(f32))
    else:
        out = attention.paged_attention_prefill(
            *b.args(), b.scale, block_m=16, block_n=16, sliding_window=window
        )
        torch.testing.assert_close(out, expected, **tol(f32))


def test_reference_window_is_transformers_mask() -> None:
    """The reference's window is transformers' sliding-window overlay: ``kv > q - window``."""
    from transformers.masking_utils import sliding_window_overlay

    from legato.kernels.reference import paged_attention as ref

    window, n = 5, 12
    g = torch.Generator().manual_seed(0)
    k = torch.randn(n, 1, 8, generator=g)
    v = torch.randn(n, 1, 8, generator=g)
    q = torch.randn(n, 1, 8, generator=g)
    out = ref(
        q, k.view(1, n, 1, 8), v.view(1, n, 1, 8), torch.zeros(1, 1, dtype=torch.int32),
        torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32), 1.0,
        sliding_window=window,
    )  # fmt: skip
    overlay = sliding_window_overlay(window)
    mask = torch.tensor(
        [[kv <= qi and bool(overlay(0, 0, qi, kv)) for kv in range(n)] for qi in range(n)]
    )
    scores = (q[:, 0] @ k[:, 0].T).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(out[:, 0], torch.softmax(scores, -1) @ v[:, 0])


@pytest.mark.parametrize(
    ("seq_lens", "query_lens", "window"),
    [([300, 20, 150], [1, 1, 1], None), ([130, 90, 40], [130, 1, 17], 37)],
)
def test_softcap_matches_reference(
    paged_batch: Callable[..., Any],
    tol: Callable[[torch.dtype], dict[str, float]],
    seq_lens: list[int],
    query_lens: list[int],
    window: int | None,
) -> None:
    """Gemma 2's soft cap (``cap * tanh(scores / cap)``), decode (split and not) and prefill,
    with and without a window; the cap is small enough to change the answer."""
    b = paged_batch(
        seq_lens, query_lens, num_heads=4, num_kv_heads=2, head_dim=64,
        block_size=16, dtype=f32, seed=5,
    )  # fmt: skip
    scale = b.scale * 8  # large scores, so the cap matters
    kwargs: dict[str, Any] = {"sliding_window": window, "softcap": 2.0}
    expected = reference.paged_attention(*b.args(), scale, **kwargs)
    uncapped = reference.paged_attention(*b.args(), scale, sliding_window=window)
    assert not torch.allclose(expected, uncapped, atol=1e-3)
    out = attention.paged_attention(*b.args(), scale, **kwargs)
    torch.testing.assert_close(out, expected, **tol(f32))
    if all(q <= 1 for q in query_lens):
        out = attention.paged_attention_decode(*b.args(), scale, split_tokens=16, **kwargs)
    else:
        out = attention.paged_attention_prefill(*b.args(), scale, block_m=16, block_n=16, **kwargs)
    torch.testing.assert_close(out, expected, **tol(f32))
