"""Speculative decoding's worker parts: n-gram proposals and the verification of drafts
(greedy acceptance, and rejection sampling that keeps the target distribution)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from legato.config import SpeculativeConfig
from legato.models.ngram_proposer import NgramProposer
from legato.models.rejection_sampler import verify
from legato.models.sampler import SamplingMetadata

# The chi-square distribution's 99.9% quantile for 5 degrees of freedom (a 6-token vocabulary):
# a correct sampler fails a test below once in a thousand runs per comparison, and the
# seeds are fixed, so the figures are the same on every run.
CHI2_DF5_999 = 20.515


def proposer(k: int = 3, lo: int = 1, hi: int = 3) -> NgramProposer:
    return NgramProposer(
        SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=hi, prompt_lookup_min=lo)
    )


def test_ngram_proposes_the_continuation_of_the_longest_latest_match() -> None:
    p = proposer(k=3, lo=1, hi=3)
    #            0  1  2  3  4  5  6  7  8  9 10
    tokens = np.array([5, 6, 7, 8, 9, 1, 6, 7, 4, 5, 6, 7])
    # suffix [5 6 7] occurs at 0: continuation 8 9 1 (the 2-gram [6 7] occurs later, at 6,
    # but the longest match wins)
    assert p.propose(tokens) == [8, 9, 1]
    # the latest occurrence of the 1-gram [7] before the end is at 7: continuation 4 5 6
    assert proposer(k=3, lo=1, hi=1).propose(tokens) == [4, 5, 6]
    assert p.propose(tokens, limit=2) == [8, 9]  # room before max_model_len
    assert p.propose(np.array([1, 2, 3, 4])) == []  # nothing repeats
    assert proposer(lo=2, hi=3).propose(np.array([1, 2, 3, 2])) == []  # below prompt_lookup_min
    # the continuation may run to the end of the tokens: fewer than k drafts
    assert p.propose(np.array([3, 4, 3])) == [4, 3]


def test_ngram_lookup_skips_byte_matches_that_straddle_tokens() -> None:
    """256's bytes (00 01 00 00) occur inside 2**24 followed by 0 (00 00 00 01 00 00 00 00),
    two bytes in: not a token of the array, so no draft; an aligned 256 earlier is found."""
    straddling = np.array([2**24, 0, 7, 256], dtype=np.int32)
    assert proposer(k=2, lo=1, hi=1).propose(straddling) == []
    aligned = np.array([256, 9, 2**24, 0, 7, 256], dtype=np.int32)
    assert proposer(k=2, lo=1, hi=1).propose(aligned) == [9, 2**24]


def _md(rows: int, temperature: float = 1.0, seed: int = 0) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.full((rows,), temperature),
        greedy=None,
        all_greedy=temperature == 0.0,
        top_k=None,
        top_p=None,
        min_p=None,
        generators={},
        engine_generator=torch.Generator().manual_seed(seed),
    )


def test_greedy_verification_accepts_the_drafts_the_argmax_agrees_with() -> None:
    vocab = 8
    # Request A: argmaxes 3, 4, 5 (drafts 3, 4: both accepted, bonus 5);
    # request B: argmaxes 1, 2 (draft 6 refused: the argmax 1 replaces it).
    argmaxes = [3, 4, 5, 1, 2]
    logits = torch.full((5, vocab), -1.0)
    logits[torch.arange(5), torch.tensor(argmaxes)] = 2.0
    md = _md(5, temperature=0.0)
    md.temperature = torch.ones(5)
    out = verify(logits, md, [[3, 4], [6]])
    assert out.tokens == [[3, 4, 5], [1]]


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rejection_sampling_keeps_the_target_distribution(temperature: float) -> None:
    """Each emitted token is distributed as the target, whatever the drafts: the first
    token as row 0's distribution, and (given the first draft was accepted) the second
    as row 1's. Draft 2 is likely under row 0, draft 5 unlikely under row 1."""
    vocab, n = 6, 12000
    rows0 = torch.tensor([0.2, -1.0, 1.5, 0.3, -0.5, 0.0])
    rows1 = torch.tensor([1.0, 0.5, -0.3, 0.2, 0.0, -1.2])
    rows2 = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.4, 0.5])
    logits = torch.stack([rows0, rows1, rows2]).repeat(n, 1)
    out = verify(logits, _md(3 * n, temperature, seed=1), [[2, 5]] * n)
    first = np.array([t[0] for t in out.tokens])
    p0 = torch.softmax(rows0 / temperature, -1).numpy()
    p1 = torch.softmax(rows1 / temperature, -1).numpy()
    counts0 = np.bincount(first, minlength=vocab)
    assert _chi_square(counts0, p0) < CHI2_DF5_999, (counts0 / n, p0)
    after_draft = np.array([t[1] for t in out.tokens if t[0] == 2])
    counts1 = np.bincount(after_draft, minlength=vocab)
    assert _chi_square(counts1, p1) < CHI2_DF5_999, (counts1 / counts1.sum(), p1)
    # and speculation did speed things up: draft 2 is accepted about p0[2] of the time
    assert abs((first == 2).mean() - p0[2]) < 0.03
    assert max(len(t) for t in out.tokens) == 3 and min(len(t) for t in out.tokens) == 1


def test_seeded_rows_verify_the_same_whatever_shares_the_batch() -> None:
    row = torch.tensor([0.2, -1.0, 1.5, 0.3, -0.5, 0.0])

    def run(batch_size: int) -> list[int]:
        logits = row.repeat(2 * batch_size, 1)
        md = _md(2 * batch_size, seed=batch_size)
        md.generators = {0: torch.Generator().manual_seed(7), 1: torch.Generator().manual_seed(8)}
        return verify(logits, md, [[2]] * batch_size).tokens[0]

    assert run(1) == run(5) == run(9)


def _reference_propose(tokens: np.ndarray, k: int, lo: int, hi: int) -> list[int]:
    """Prompt lookup by comparing every window: the longest suffix of ``lo..hi`` tokens
    that occurs earlier, its latest occurrence's continuation."""
    length = len(tokens)
    for n in range(min(hi, length - 1), lo - 1, -1):
        suffix = list(tokens[length - n :])
        starts = [s for s in range(length - n) if list(tokens[s : s + n]) == suffix]
        if starts:
            return [int(t) for t in tokens[starts[-1] + n : starts[-1] + n + k]]
    return []


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=0, max_size=40),
    st.integers(1, 5),
    st.integers(1, 4),
    st.integers(0, 3),
    st.sampled_from([np.int32, np.int64]),  # the runner holds int32 tokens
)
def test_ngram_proposals_match_the_window_by_window_reference(
    tokens: list[int], k: int, lo: int, extra: int, dtype: type
) -> None:
    array = np.array(tokens, dtype=dtype)
    got = proposer(k=k, lo=lo, hi=lo + extra).propose(array)
    assert got == _reference_propose(array, k, lo, lo + extra)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rejection_sampling_with_draft_probabilities_keeps_the_target_distribution(
    temperature: float,
) -> None:
    """A draft model's drafts are drawn from its own distribution q (not a point mass):
    accepting ``d`` with probability min(1, p(d)/q(d)) and drawing rejections from
    (p - q)^+ still emits every token as the target's p. The first draft is accepted
    sum(min(p, q)) of the time (what a point-mass test, p(d), would not give)."""
    vocab, n = 6, 12000
    rows0 = torch.tensor([0.2, -1.0, 1.5, 0.3, -0.5, 0.0])
    rows1 = torch.tensor([1.0, 0.5, -0.3, 0.2, 0.0, -1.2])
    rows2 = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.4, 0.5])
    q0 = torch.tensor([0.05, 0.30, 0.25, 0.10, 0.20, 0.10])
    q1 = torch.tensor([0.40, 0.05, 0.05, 0.20, 0.10, 0.20])
    gen = torch.Generator().manual_seed(11)
    d0 = torch.multinomial(q0, n, replacement=True, generator=gen).tolist()
    d1 = torch.multinomial(q1, n, replacement=True, generator=gen).tolist()
    logits = torch.stack([rows0, rows1, rows2]).repeat(n, 1)
    draft_probs = torch.stack([q0, q1, torch.zeros(vocab)]).repeat(n, 1)
    drafts = [[a, b] for a, b in zip(d0, d1, strict=True)]
    out = verify(logits, _md(3 * n, temperature, seed=2), drafts, draft_probs)
    p0 = torch.softmax(rows0 / temperature, -1).numpy()
    p1 = torch.softmax(rows1 / temperature, -1).numpy()
    first = np.array([t[0] for t in out.tokens])
    counts0 = np.bincount(first, minlength=vocab)
    assert _chi_square(counts0, p0) < CHI2_DF5_999, (counts0 / n, p0)
    second = np.array([t[1] for t in out.tokens if len(t) > 1])  # after an accepted draft
    counts1 = np.bincount(second, minlength=vocab)
    assert _chi_square(counts1, p1) < CHI2_DF5_999, (counts1 / counts1.sum(), p1)
    accepted = np.mean([len(t) > 1 for t in out.tokens])
    assert abs(accepted - np.minimum(p0, q0.numpy()).sum()) < 0.02
