"""The sampler and the per-request sampling state that feeds it (vLLM semantics)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from legato.models.input_batch import InputBatch
from legato.models.sampler import apply_penalties, inverse_transform, random_sample, sample
from legato.protocol.messages import CachedRequestData, NewRequestData, RunnerSamplingParams
from legato.protocol.params import SamplingParams

V = 8
EOS = 7
CPU = torch.device("cpu")
# A known distribution: probabilities 1/2, 1/4, 1/8, 1/16, 1/32, 1/64, 1/128, 1/128.
PROBS = torch.tensor([64, 32, 16, 8, 4, 2, 1, 1], dtype=torch.float32) / 128
LOGITS = PROBS.log()


def _batch(
    params: list[SamplingParams],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    seed: int = 0,
) -> tuple[InputBatch, np.ndarray]:
    batch = InputBatch(4, 64, 4, V, [EOS], CPU, seed)
    for i, p in enumerate(params):
        prompt = prompts[i] if prompts else [0]
        out = outputs[i] if outputs else []
        new = NewRequestData(f"r{i}", prompt, f"r{i}", list(range(16)), 0, out, seed=p.seed)
        batch.add(new, RunnerSamplingParams.of(p))
    return batch, np.array([batch.row(f"r{i}") for i in range(len(params))])


def _draw(params: SamplingParams, n: int, logits: torch.Tensor = LOGITS) -> list[int]:
    """``n`` samples for one request (``n`` identical rows drawn at once)."""
    batch, rows = _batch([params])
    md = batch.sampling_metadata(np.repeat(rows, n))
    return sample(logits.repeat(n, 1), md).sampled.tolist()


def test_greedy_is_argmax() -> None:
    assert _draw(SamplingParams(temperature=0.0), 5) == [0] * 5


def test_top_k_1_equals_greedy() -> None:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(0))
    draws = _draw(SamplingParams(temperature=1.5, top_k=1), 300, logits)
    assert set(draws) == {int(logits.argmax())}


def test_temperature_sampling_follows_the_distribution() -> None:
    draws = _draw(SamplingParams(temperature=1.0), 8000)
    freq = np.bincount(draws, minlength=V) / len(draws)
    assert np.abs(freq - PROBS.numpy()).max() < 0.03


def test_inverse_transform_never_returns_a_token_of_zero_mass() -> None:
    """Zero-mass tokens at both ends and in the middle: the extremes of ``u`` land on
    the first and last tokens of positive mass, the mass boundaries on the next token."""
    row = torch.tensor([0.0, 0.5, 0.0, 1.5, 0.0])  # mass 2, unnormalised
    u = torch.tensor([[0.0], [0.2499], [0.25], [0.9999], [1.0]])
    got = inverse_transform(row.repeat(5, 1), u).tolist()
    assert got == [1, 1, 3, 3, 3]


def test_sampling_follows_the_distribution_over_a_wide_vocabulary() -> None:
    """A 49,152-token vocabulary (the default model's): cumulative sums over all of it
    still give each region of the vocabulary its mass."""
    vocab = 49152
    probs = torch.full((vocab,), 0.25 / (vocab - 2))
    probs[0], probs[-1] = 0.0, 0.25  # a zero-mass first token, a heavy last one
    probs[vocab // 2] = 0.5
    batch = InputBatch(4, 64, 4, vocab, [], CPU, 0)
    batch.add(NewRequestData("r", [0], "r", [0], 0), RunnerSamplingParams.of(SamplingParams()))
    md = batch.sampling_metadata(np.repeat(np.array([batch.row("r")]), 400))
    logits = probs.log().repeat(400, 1)  # 10 x 400 draws keeps the batch at 79 MB
    draws = np.array([t for _ in range(10) for t in sample(logits.clone(), md).sampled.tolist()])
    assert 0 not in draws
    shares = [np.mean(draws == vocab // 2), np.mean(draws == vocab - 1)]
    rest = np.mean((draws != vocab // 2) & (draws != vocab - 1))
    assert abs(shares[0] - 0.5) < 0.03 and abs(shares[1] - 0.25) < 0.03 and abs(rest - 0.25) < 0.03


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_p=0.7), {0, 1}),  # 1/2 + 1/4 is the smallest set with mass >= 0.7
        (SamplingParams(top_p=0.8), {0, 1, 2}),
        (SamplingParams(min_p=0.3), {0, 1}),  # p >= 0.3 * 1/2
        (SamplingParams(min_p=0.1), {0, 1, 2, 3}),  # 1/16 >= 0.1 * 1/2
        (SamplingParams(top_k=3), {0, 1, 2}),
        (SamplingParams(top_k=4, top_p=0.7), {0, 1}),
        (SamplingParams(allowed_token_ids=[3, 5, 6]), {3, 5, 6}),
    ],
)
def test_truncation_never_leaves_the_allowed_set(params: SamplingParams, allowed: set[int]) -> None:
    draws = _draw(params, 3000)
    assert set(draws) == allowed  # never outside, and every allowed token shows up


def test_top_p_renormalises_within_the_nucleus() -> None:
    draws = _draw(SamplingParams(top_p=0.7), 6000)
    assert abs(draws.count(0) / len(draws) - 2 / 3) < 0.03


def test_logit_bias() -> None:
    assert set(_draw(SamplingParams(temperature=0.0, logit_bias={5: 100.0}), 3)) == {5}
    assert set(_draw(SamplingParams(logit_bias={4: 100.0}), 200)) == {4}
    assert 0 not in _draw(SamplingParams(logit_bias={0: -100.0}), 500)


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(V)
    logits[EOS], logits[3] = 5.0, 4.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    batch, rows = _batch([params])
    assert sample(logits[None].clone(), batch.sampling_metadata(rows)).sampled.tolist() == [0]
    batch.update(CachedRequestData(["r0"], [1], new_token_ids={"r0": [1]}))
    assert sample(logits[None].clone(), batch.sampling_metadata(rows)).sampled.tolist() == [0]
    batch.update(CachedRequestData(["r0"], [2], new_token_ids={"r0": [1]}))
    assert sample(logits[None].clone(), batch.sampling_metadata(rows)).sampled.tolist() == [EOS]


def test_min_tokens_with_ignore_eos_masks_only_stop_ids() -> None:
    logits = torch.zeros(V)
    logits[EOS], logits[3] = 5.0, 4.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[EOS], ignore_eos=True)
    batch, rows = _batch([params])
    assert sample(logits[None].clone(), batch.sampling_metadata(rows)).sampled.tolist() == [3]
    params = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    batch, rows = _batch([params])
    assert sample(logits[None].clone(), batch.sampling_metadata(rows)).sampled.tolist() == [EOS]


def test_penalties_match_hand_computed_logits() -> None:
    """Repetition over prompt + output tokens; presence and frequency over output tokens."""
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0, 3.0, 0.0, -2.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.3, frequency_penalty=0.5)
    # prompt has tokens 1 and 2; outputs so far: 2, 4, 4 (and 4 arrives later as a delta)
    batch, rows = _batch([params], prompts=[[1, 2, 1]], outputs=[[2, 4]])
    batch.update(CachedRequestData(["r0"], [5], new_token_ids={"r0": [4]}))
    md = batch.sampling_metadata(rows)
    assert md.penalties is not None
    got = logits.clone()
    apply_penalties(got, md.penalties)
    expected = logits.clone()
    expected[0, 1] = -1.0 * 2.0  # prompt only: repetition (negative logit: multiplied)
    expected[0, 2] = 0.5 / 2.0 - 0.5 * 1 - 0.3  # prompt + one output
    expected[0, 4] = 1.0 / 2.0 - 0.5 * 2 - 0.3  # two outputs
    torch.testing.assert_close(got, expected)


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0, 0, 0, 0, 0, 0]])
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    batch, rows = _batch([params], outputs=[[0]])
    assert sample(logits.clone(), batch.sampling_metadata(rows)).sampled.tolist() == [1]
    batch, rows = _batch([SamplingParams(temperature=0.0)], outputs=[[0]])
    assert sample(logits.clone(), batch.sampling_metadata(rows)).sampled.tolist() == [0]


def test_seeded_requests_reproducible_whatever_the_batch() -> None:
    """A seeded request draws the same tokens alone, first, or last among companions."""
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(5))
    seeded = SamplingParams(temperature=1.0, seed=42)
    runs = []
    for companions, position in (([], 0), ([SamplingParams(), SamplingParams(seed=7)], 0),
                                 ([SamplingParams(top_p=0.9), SamplingParams()], 2)):  # fmt: skip
        params = list(companions)
        params.insert(position, seeded)
        batch, rows = _batch(params, seed=len(companions) * 11)
        drawn = []
        for step in range(6):
            step_logits = logits[step].repeat(len(params), 1)
            token = sample(step_logits, batch.sampling_metadata(rows)).sampled[position].item()
            drawn.append(int(token))
            for i in range(len(params)):
                news = {f"r{i}": [int(token)]}
                batch.update(CachedRequestData([f"r{i}"], [step + 1], new_token_ids=news))
        runs.append(drawn)
    assert runs[0] == runs[1] == runs[2]


def _wide_batch(engine_seed: int, params: list[SamplingParams]) -> tuple[InputBatch, np.ndarray]:
    """A 64-token vocabulary, so that independent draws rarely coincide."""
    batch = InputBatch(4, 64, 4, 64, [], CPU, engine_seed)
    for i, p in enumerate(params):
        batch.add(
            NewRequestData(f"r{i}", [0], f"r{i}", [0], 0, seed=p.seed), RunnerSamplingParams.of(p)
        )
    return batch, np.array([batch.row(f"r{i}") for i in range(len(params))])


def test_seeded_draws_depend_on_seed_and_output_position() -> None:
    flat = torch.zeros(2, 64)
    batch, rows = _wide_batch(0, [SamplingParams(seed=1), SamplingParams(seed=2)])
    first = sample(flat.clone(), batch.sampling_metadata(rows)).sampled.tolist()
    again = sample(flat.clone(), batch.sampling_metadata(rows)).sampled.tolist()
    assert first == again  # same output position: the same draw (a retry is reproducible)
    seqs: list[list[int]] = [[], []]
    for step in range(4):
        tokens = sample(flat.clone(), batch.sampling_metadata(rows)).sampled.tolist()
        for i in range(2):
            seqs[i].append(tokens[i])
            news = {f"r{i}": [tokens[i]]}
            batch.update(CachedRequestData([f"r{i}"], [step + 1], new_token_ids=news))
    assert seqs[0] != seqs[1]
    assert len(set(seqs[0])) > 1  # later positions draw afresh


def test_unseeded_rows_follow_the_engine_seed() -> None:
    draws = []
    for engine_seed in (3, 3, 4):
        batch, rows = _wide_batch(engine_seed, [SamplingParams(), SamplingParams()])
        draws.append(
            [
                sample(torch.zeros(2, 64), batch.sampling_metadata(rows)).sampled.tolist()
                for _ in range(3)
            ]
        )
    assert draws[0] == draws[1] != draws[2]


def test_logprobs_of_raw_distribution_with_ranks() -> None:
    """Top-k logprobs come from the raw logits, before temperature, penalties and bias."""
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0, 0.5, 2.5, -3.0]])
    raw = torch.log_softmax(logits, dim=-1)[0]
    params = SamplingParams(temperature=0.0, logprobs=3, logit_bias={4: 50.0})
    batch, rows = _batch([params])
    out = sample(logits.clone(), batch.sampling_metadata(rows))
    assert out.sampled.tolist() == [4]
    entry = out.logprobs[0]
    assert entry.token_ids == [4, 1, 6, 2]
    assert entry.ranks == [7, 1, 2, 3]
    for token, lp in zip(entry.token_ids, entry.logprobs):
        assert math.isclose(lp, raw[token].item(), abs_tol=1e-6)


def test_logprobs_zero_and_whole_vocab() -> None:
    logits = torch.tensor([LOGITS.tolist(), LOGITS.tolist()])
    batch, rows = _batch(
        [SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=0.0, logprobs=-1)]
    )
    out = sample(logits, batch.sampling_metadata(rows))
    assert out.logprobs[0].token_ids == [0] and out.logprobs[0].ranks == [1]
    assert len(out.logprobs[1].token_ids) == V + 1
    assert out.logprobs[1].ranks == [1, *range(1, V + 1)]


def test_mixed_batch_greedy_and_random_rows() -> None:
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=2), SamplingParams()]
    batch, rows = _batch(params)
    for _ in range(20):
        tokens = sample(LOGITS.repeat(3, 1), batch.sampling_metadata(rows)).sampled.tolist()
        assert tokens[0] == 0 and tokens[1] in (0, 1)


def test_top_k_rows_beside_rows_without_it() -> None:
    params = [SamplingParams(top_k=2), SamplingParams(), SamplingParams(top_k=100)]
    batch, rows = _batch(params)
    seen: list[set[int]] = [set(), set(), set()]
    for _ in range(300):
        tokens = sample(LOGITS.repeat(3, 1), batch.sampling_metadata(rows)).sampled.tolist()
        for i, t in enumerate(tokens):
            seen[i].add(t)
    assert seen[0] == {0, 1}
    assert len(seen[1]) >= 5 and len(seen[2]) >= 5


def test_a_row_of_nan_mass_still_draws_a_token_inside_the_vocabulary() -> None:
    """A hostile temperature can overflow a row's logits into NaN; the draw must stay a
    token id the next step can embed (it once came back as V and killed the worker)."""
    probs = torch.tensor([[float("nan")] * 5, [0.1, 0.2, 0.3, 0.2, 0.2]])
    drawn = random_sample(probs, {}, torch.Generator().manual_seed(0))
    assert 0 <= int(drawn[0]) < 5 and 0 <= int(drawn[1]) < 5
