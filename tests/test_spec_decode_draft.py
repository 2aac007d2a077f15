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
from pathlib import Path
from typing import Any

import pytest

from legato import SamplingParams
from legato.config import EngineConfig
from legato.models.layer_cut import cut_layers

from .test_spec_decode import PROMPTS, compare, run, tokens


@pytest.fixture(scope="session")
def toy_draft_dir(toy_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy model's first layer, as a draft model directory."""
    return cut_layers(toy_model_dir, tmp_path_factory.mktemp("toy-draft"), 1)


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
