"""Speculative decoding with a draft model: the same outputs as without it.

The target is the toy model; the draft is its one-layer cut (same tokenizer,
embeddings and LM head: :func:`~legato.models.layer_cut.cut_layers`), which agrees
with the target often enough that drafts are accepted, and not always, so
rejections and rollbacks happen too. The comparisons reuse the n-gram tests'
helpers (``compare`` checks that drafts were accepted).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from legato import RequestOutput, SamplingParams
from legato.config import EngineConfig
from legato.llm import LLMEngine
from legato.metrics.records import StepStats
from legato.models.layer_cut import cut_layers

from .test_spec_decode import (
    PROMPTS,
    SpecCounts,
    assert_chaos_ends_every_stream,
    assert_kv_freed_after_aborts,
    compare,
    run,
    tokens,
)


@pytest.fixture(scope="session")
def toy_draft_dir(toy_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy model's first three layers (of four), as a draft model directory: close
    enough to the target that some drafts survive the per-request back-off, not so
    close that none is rejected."""
    return cut_layers(toy_model_dir, tmp_path_factory.mktemp("toy-draft"), 3)


def draft_spec(draft_dir: Path, k: int = 4) -> dict[str, Any]:
    return {"model": str(draft_dir), "num_speculative_tokens": k}


def test_greedy_outputs_are_token_identical_with_a_draft_model(toy_draft_dir: Path) -> None:
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    plain, speculative, counts = compare("toy", PROMPTS, params, draft_spec(toy_draft_dir))
    assert tokens(speculative) == tokens(plain)
    assert all(len(t) == 60 for t in tokens(speculative))
    assert counts.accepted < counts.draft_tokens  # some were rejected: rollbacks ran
    assert sum(counts.per_pos) == counts.accepted


def test_a_draft_equal_to_the_target_is_always_accepted(
    toy_model_dir: Path, tmp_path: Path
) -> None:
    """The draft's own KV cache (shared block ids, scratch blocks while proposing) is
    right only if a draft that is the target itself predicts exactly the target's
    tokens: every draft accepted, greedy and sampled (q == p accepts always)."""
    whole = cut_layers(toy_model_dir, tmp_path / "whole", 4)
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=40, temperature=temperature, seed=1, ignore_eos=True)
        outs, counts = run("toy", PROMPTS, params, draft_spec(whole))
        assert all(len(t) == 40 for t in tokens(outs))
        assert counts.draft_tokens > 60 and counts.accepted == counts.draft_tokens, counts


@dataclass
class Preemptions(SpecCounts):
    preempted: int = 0

    def record_step(self, step: StepStats) -> None:
        super().record_step(step)
        self.preempted += step.num_preempted_reqs


def test_the_draft_cache_follows_the_target_through_preemptions(
    toy_model_dir: Path, tmp_path: Path
) -> None:
    """With KV blocks for about half the requests, requests are preempted, recomputed
    and their blocks reused by others: a draft equal to the target still has every
    draft accepted (its cache, on the target's block ids, stays right), and the
    outputs are as without it."""
    whole = cut_layers(toy_model_dir, tmp_path / "whole", 4)
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    prompts = [p[:150] for p in PROMPTS * 2]
    outputs = []
    for spec in (None, draft_spec(whole)):
        counts = Preemptions()
        config = EngineConfig(
            model="toy",
            speculative_config=spec,  # type: ignore[arg-type]
            max_model_len=200,
            num_kv_blocks=30,
            disable_log_stats=True,
        )
        engine = LLMEngine(config, stat_loggers=[counts])
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        finals: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert isinstance(out, RequestOutput)
                if out.finished:
                    finals[out.request_id] = out
        assert engine.scheduler.kv.num_used_blocks == 0
        assert counts.preempted > 0, "nothing was preempted: the test proves nothing"
        outputs.append(tokens([finals[f"r{i}"] for i in range(len(prompts))]))
    assert counts.draft_tokens > 100 and counts.accepted == counts.draft_tokens, counts
    assert outputs[0] == outputs[1]


def test_draft_model_configs_are_refused_naming_the_field(
    toy_model_dir: Path, toy_draft_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=r"^speculative_config\.model: a draft model runs in one"):
        EngineConfig(speculative_config=draft_spec(toy_draft_dir), tensor_parallel_size=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^speculative_config\.method: 'ngram' takes no draft"):
        EngineConfig(speculative_config={"method": "ngram", **draft_spec(toy_draft_dir)})  # type: ignore[arg-type]
    config = EngineConfig(speculative_config=draft_spec(toy_draft_dir))  # type: ignore[arg-type]
    assert config.speculative_config is not None
    assert config.speculative_config.method == "draft_model"
    assert EngineConfig(**config.to_dict()) == config  # the worker's copy
    from legato.cli import build_parser, engine_kwargs

    flag = json.dumps(draft_spec(toy_draft_dir))
    args = build_parser().parse_args(["serve", "--speculative-config", flag])
    assert EngineConfig(**engine_kwargs(args)) == config

    # At start: a draft whose vocabulary is not the target's.
    other_vocab = tmp_path / "other-vocab"
    shutil.copytree(toy_draft_dir, other_vocab)
    cfg = json.loads((other_vocab / "config.json").read_text())
    (other_vocab / "config.json").write_text(json.dumps({**cfg, "vocab_size": 1000}))
    swapped = tmp_path / "swapped-tokens"
    shutil.copytree(toy_draft_dir, swapped)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    cases = {
        other_vocab: r"the draft's vocab_size is 1000, the target's 2048",
        swapped: rf"the draft's tokenizer differs from the target's \(token {re.escape(repr(a))}",
        tmp_path / "nowhere": r"\S+/nowhere is not a model directory",
    }
    for draft, message in cases.items():
        with pytest.raises(Exception, match=rf"speculative_config\.model: {message}"):
            run(str(toy_model_dir), PROMPTS[:1], SamplingParams(max_tokens=2), draft_spec(draft))


def test_logprobs_stop_strings_max_tokens_and_penalties_are_as_without_drafts(
    toy_draft_dir: Path,
) -> None:
    """Every kind of request in one batch, with and without the draft model (the stop
    string is one the plain greedy output holds, so it does stop there)."""
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    probe, _ = run("toy", PROMPTS[:1], greedy, None)
    stop = probe[0].outputs[0].text[30:42]
    assert stop.strip()
    requests = {
        "greedy": (PROMPTS[0], greedy),
        "stop": (PROMPTS[0], SamplingParams(max_tokens=40, temperature=0.0, stop=[stop])),
        "logprobs": (
            PROMPTS[1],
            SamplingParams(max_tokens=30, temperature=0.0, logprobs=3, ignore_eos=True),
        ),
        "short": (PROMPTS[2], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)),
        "penalties": (
            PROMPTS[1],
            SamplingParams(
                max_tokens=40,
                temperature=0.0,
                ignore_eos=True,
                repetition_penalty=1.15,
                frequency_penalty=0.4,
                presence_penalty=0.2,
            ),
        ),
        "min_tokens": (PROMPTS[2], SamplingParams(max_tokens=30, temperature=0.0, min_tokens=30)),
    }
    names = list(requests)
    plain_outs, draft_outs, _ = compare(
        "toy",
        [requests[n][0] for n in names],
        [requests[n][1] for n in names],
        draft_spec(toy_draft_dir),
    )
    plain, spec = dict(zip(names, plain_outs)), dict(zip(names, draft_outs))
    for name in names:
        assert tokens([spec[name]]) == tokens([plain[name]]), name
    a, b = plain["stop"].outputs[0], spec["stop"].outputs[0]
    assert a.stop_reason == stop and a.finish_reason == "stop"
    assert (b.text, b.finish_reason, b.stop_reason) == (a.text, a.finish_reason, a.stop_reason)
    assert len(spec["short"].outputs[0].token_ids) == 7
    assert len(spec["min_tokens"].outputs[0].token_ids) == 30
    got, want = spec["logprobs"].outputs[0].logprobs, plain["logprobs"].outputs[0].logprobs
    assert got is not None and want is not None and len(got) == len(want) == 30
    for g, w in zip(got, want, strict=True):
        assert list(g) == list(w)  # the chosen token, then the same top 3
        for token_id, lp in w.items():
            assert g[token_id].logprob == pytest.approx(lp.logprob, abs=2e-3)


def test_sampled_requests_finish_at_max_tokens_with_a_draft_model(toy_draft_dir: Path) -> None:
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=3, ignore_eos=True)
    outs, counts = run("toy", PROMPTS, params, draft_spec(toy_draft_dir))
    assert counts.accepted > 0
    assert [len(t) for t in tokens(outs)] == [30, 30, 30]


async def test_kv_usage_returns_to_zero_after_aborts(
    toy_model_dir: Path, toy_draft_dir: Path
) -> None:
    await assert_kv_freed_after_aborts(toy_model_dir, draft_spec(toy_draft_dir))


@pytest.mark.parametrize("fault", ["sigkill", "raise_on_step"])
async def test_a_dead_worker_mid_verification_ends_every_stream(
    toy_model_dir: Path, toy_draft_dir: Path, fault: str
) -> None:
    """The chaos harness with the draft model on (see ``assert_chaos_ends_every_stream``)."""
    await assert_chaos_ends_every_stream(toy_model_dir, draft_spec(toy_draft_dir), fault)


def test_a_draft_model_proposes_no_more_than_the_scheduler_lets_verify(
    toy_draft_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each draft costs the draft model a forward: the runner proposes only what each
    request's draft length and the step cost can let it verify (SchedulerOutput's
    draft_limits), so a request backed off or left out costs no draft forward. Counted
    at the proposer (the real one, wrapped): the drafts proposed beyond those verified are
    at most one a verification (all accepted may raise a limit by one, at the time of the
    proposal unknown) and one a request (its last sample's)."""
    from legato.models.draft_proposer import DraftModelProposer

    proposed: list[int] = []
    propose = DraftModelProposer.propose

    def counted(self: DraftModelProposer, *args: Any) -> dict[int, list[int]]:
        drafts = propose(self, *args)
        proposed.append(sum(len(d) for d in drafts.values()))
        return drafts

    monkeypatch.setattr(DraftModelProposer, "propose", counted)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    outs, counts = run("toy", PROMPTS, params, draft_spec(toy_draft_dir))
    assert all(len(t) == 60 for t in tokens(outs))
    assert counts.accepted < counts.draft_tokens  # rejections: draft lengths shrank
    unverified = sum(proposed) - counts.draft_tokens
    assert unverified <= counts.drafts + 4 * len(PROMPTS), (sum(proposed), counts)


def test_a_draft_skipped_while_drafts_are_off_catches_up_exactly(
    toy_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While more requests run than ``disable_by_batch_size``, no request proposes, so the
    runner skips the draft's forwards; once two requests are left, the draft first computes
    the positions it skipped, then proposes. A draft equal to the target then still has
    every draft accepted: its KV after the catch-up is the target's."""
    from legato.models.draft_proposer import DraftModelProposer

    observed: list[int] = []  # positions the draft computed alongside the target
    observe = DraftModelProposer.observe

    def counted(self: DraftModelProposer, *args: Any) -> None:
        observed.extend(end - start for _, start, end in args[-1])
        observe(self, *args)

    monkeypatch.setattr(DraftModelProposer, "observe", counted)
    whole = cut_layers(toy_model_dir, tmp_path / "whole", 4)
    spec = {**draft_spec(whole), "disable_by_batch_size": 2}
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (25, 50, 70)]
    plain, _ = run("toy", PROMPTS[:3], params, None)
    observed.clear()
    outs, counts = run("toy", PROMPTS[:3], params, spec)
    assert tokens(outs) == tokens(plain)
    computed = sum(len(o.prompt_token_ids or ()) + len(t) - 1 for o, t in zip(outs, tokens(outs)))
    assert sum(observed) <= computed - 3 * 20  # skipped while three requests ran
    assert counts.draft_tokens > 20 and counts.accepted == counts.draft_tokens, counts
