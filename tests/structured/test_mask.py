"""The sampler's structured-outputs hook: a row's bitmask decides which tokens it can sample."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from legato.kernels import reference
from legato.models.sampler import SamplingMetadata, sample
from legato.structured import allocate_bitmask
from legato.structured.mask import apply_token_bitmask_bytes, bitmask_tensor

V = 70  # not a multiple of 32: the last bitmask word is partial


def _metadata(rows: int, *, greedy: bool) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.ones(rows),
        greedy=None,
        all_greedy=greedy,
        top_k=None,
        top_p=None,
        min_p=None,
        generators={},
        engine_generator=torch.Generator().manual_seed(0),
    )


def _only(tokens: list[int]) -> np.ndarray:
    row = np.zeros(allocate_bitmask(1, V).shape[1], dtype=np.int32)
    for t in tokens:
        row[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    return row


def test_greedy_picks_the_best_allowed_token_and_other_rows_are_free() -> None:
    logits = torch.arange(V, dtype=torch.float32).repeat(3, 1)  # the last token is best
    md = _metadata(3, greedy=True)
    mask = np.stack([_only([5, 40]), _only([63])])
    md.token_bitmask = bitmask_tensor(mask, mask.shape[1], logits.device)
    md.bitmask_rows = torch.tensor([0, 2])
    assert sample(logits, md).sampled.tolist() == [40, V - 1, 63]


def test_random_sampling_never_leaves_the_mask() -> None:
    gen = torch.Generator().manual_seed(3)
    allowed = [1, 33, 34, 66]
    mask = _only(allowed)[None].repeat(64, axis=0)
    md = _metadata(64, greedy=False)
    md.token_bitmask = bitmask_tensor(mask.tobytes(), mask.shape[1], torch.device("cpu"))
    md.bitmask_rows = torch.arange(64)
    drawn = sample(torch.randn(64, V, generator=gen) * 5, md).sampled.tolist()
    assert set(drawn) <= set(allowed) and len(set(drawn)) > 1


def test_logprobs_are_those_of_the_masked_distribution() -> None:
    logits = torch.zeros(1, V)
    md = _metadata(1, greedy=True)
    md.token_bitmask = bitmask_tensor(_only([2, 3])[None], 3, logits.device)
    md.bitmask_rows = torch.tensor([0])
    md.logprob_rows, md.num_logprobs = [0], [3]
    out = sample(logits, md)
    entry = out.logprobs[0]
    assert entry.token_ids[1:3] == [2, 3] or entry.token_ids[1:3] == [3, 2]
    assert abs(entry.logprobs[1] - np.log(0.5)) < 1e-5
    assert entry.logprobs[3] == float("-inf")


@pytest.mark.parametrize(
    ("vocab", "words", "rows"),
    [(100, 4, [2, 0]), (64, 2, [0, 1, 2]), (70, 2, [1]), (3000, 90, [0, 2])],
)
def test_byte_table_path_matches_the_reference(vocab: int, words: int, rows: list[int]) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), generator=gen).to(torch.int32)
    index = torch.tensor(rows)
    expected = logits.clone()
    reference.apply_token_bitmask(expected, bitmask, index)
    apply_token_bitmask_bytes(logits, bitmask, index)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
