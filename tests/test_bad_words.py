"""``bad_words`` with vLLM's semantics (F12), against a reference written from vLLM's code:
``SamplingParams.update_from_tokenizer`` (which token sequences a word bans) and
``v1/sample/ops/bad_words.py`` (a sequence's last token is banned when the output so far
ends with the rest). The engine's greedy output must be the reference's walk over the
engine's own logprobs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from legato import LLM, SamplingParams
from legato.models.input_batch import bad_words_banned

ENGINE_ARGS: dict[str, Any] = dict(max_model_len=128, num_kv_blocks=64, disable_log_stats=True)


def reference_token_ids(tokenizer: Any, bad_words: list[str]) -> list[list[int]]:
    """vLLM's ``update_from_tokenizer``, as written there."""
    out: list[list[int]] = []
    for bad_word in bad_words:
        for add_prefix_space in [False, True]:
            prefix = " " if add_prefix_space else ""
            prompt = prefix + bad_word.lstrip()
            ids = tokenizer.encode(prompt, add_special_tokens=False)
            if (not add_prefix_space) or (
                add_prefix_space and ids[0] != out[-1][0] and len(ids) == len(out[-1])
            ):
                out.append(ids)
    return out


def reference_banned(bad_words_ids: list[list[int]], past: list[int]) -> set[int]:
    """vLLM's ``_apply_bad_words_single_batch``: the tokens set to -inf."""
    banned = set()
    for ids in bad_words_ids:
        if len(ids) > len(past) + 1:
            continue
        prefix_length = len(ids) - 1
        actual = past[-prefix_length:] if prefix_length > 0 else []
        if actual == ids[:prefix_length]:
            banned.add(ids[-1])
    return banned


@pytest.fixture(scope="module")
def llm(toy_model_dir: Path) -> Any:
    with LLM(str(toy_model_dir), executor="inproc", **ENGINE_ARGS) as engine:
        yield engine


def test_words_tokenize_and_ban_as_in_vllm(llm: Any) -> None:
    renderer = llm.engine.renderer if hasattr(llm, "engine") else llm.renderer
    words = ["hello", " world", "the cat", "x", "  spaced out"]
    params = SamplingParams(bad_words=words)
    assert renderer.bad_words_token_ids(params) == reference_token_ids(renderer.tokenizer, words)
    seqs = [[5], [7, 8], [1, 2, 3]]
    for past in ([], [7], [1, 2], [9, 1, 2], [2]):
        assert set(bad_words_banned(seqs, past)) == reference_banned(seqs, past), past


def test_greedy_output_is_the_reference_walk(llm: Any) -> None:
    prompt = "Once upon a time"
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    natural = llm.generate([prompt], greedy)[0].outputs[0].token_ids
    renderer = llm.engine.renderer if hasattr(llm, "engine") else llm.renderer
    # Words the unconstrained output would say: one token, then two in a row.
    words = [renderer.decode([natural[1]]), renderer.decode(natural[3:5])]
    words = [w for w in words if w.strip()] or ["the"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, bad_words=words)
    got = llm.generate([prompt], params)[0].outputs[0].token_ids
    bad_ids = reference_token_ids(renderer.tokenizer, words)
    prompt_ids = renderer.encode(prompt)
    walk: list[int] = []
    for _ in range(8):  # the reference: the best token the rule leaves, from the engine's logits
        step = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20, ignore_eos=True)
        out = llm.generate([prompt_ids + walk], step)[0].outputs[0]
        ranked = sorted(out.logprobs[0].items(), key=lambda kv: -kv[1].logprob)
        banned = reference_banned(bad_ids, walk)
        walk.append(next(t for t, _ in ranked if t not in banned))
    assert got == walk
    assert got != natural  # the words did change the output
