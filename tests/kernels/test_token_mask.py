"""The Triton token-bitmask kernel against the plain-torch reference (and against a bit loop)."""

from __future__ import annotations

import pytest
import torch

from legato.kernels import reference, token_mask


def _random_case(
    rows: int, vocab: int, words: int, masked_rows: list[int], seed: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(masked_rows), words), generator=gen)
    return logits, bitmask.to(torch.int32), torch.tensor(masked_rows, dtype=torch.int64)


def _by_bits(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The contract spelled out token by token (slow; small sizes only)."""
    out = logits.clone()
    words = bitmask.shape[1]
    for i, row in enumerate(rows.tolist()):
        for t in range(logits.shape[1]):
            word = t // 32
            if word >= words or not (int(bitmask[i, word]) >> (t % 32)) & 1:
                out[row, t] = float("-inf")
    return out


@pytest.mark.parametrize(
    ("vocab", "words"),
    [(100, 4), (64, 2), (70, 2)],  # exact fit, a partial last word, logits wider than the mask
)
def test_reference_matches_the_bit_contract(vocab: int, words: int) -> None:
    logits, bitmask, rows = _random_case(4, vocab, words, [3, 1], seed=vocab, dtype=torch.float32)
    expected = _by_bits(logits, bitmask, rows)
    reference.apply_token_bitmask(logits, bitmask, rows)
    torch.testing.assert_close(logits, expected)
    assert torch.isfinite(logits[[0, 2]]).all()  # rows without a mask are untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("vocab", "words", "masked"),
    [(2500, 79, [0, 2, 5]), (1024, 32, [1]), (3000, 90, [4, 0])],  # 90 * 32 < 3000
)
def test_triton_matches_reference(
    device: str, dtype: torch.dtype, vocab: int, words: int, masked: list[int]
) -> None:
    logits, bitmask, rows = _random_case(6, vocab, words, masked, seed=words, dtype=dtype)
    expected = logits.clone()
    reference.apply_token_bitmask(expected, bitmask, rows)
    got = logits.to(device)
    token_mask.apply_token_bitmask(got, bitmask.to(device), rows.to(device))
    torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=0)
    assert torch.isinf(got.cpu()).sum() > 0


def test_triton_with_no_rows_changes_nothing(device: str) -> None:
    logits = torch.randn(2, 50).to(device)
    before = logits.clone()
    token_mask.apply_token_bitmask(
        logits,
        torch.empty(0, 2, dtype=torch.int32, device=device),
        torch.empty(0, dtype=torch.int64, device=device),
    )
    torch.testing.assert_close(logits, before)
