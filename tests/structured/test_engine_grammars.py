"""Structured outputs through the whole engine (renderer, scheduler loop, worker's sampler) on
the toy model: its outputs are noise, so only the grammar makes them match."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import trio

from legato import SamplingParams
from legato.engine import AsyncEngine, open_engine
from legato.protocol.errors import EngineGenerateError, ValidationError
from legato.protocol.structured import StructuredOutputsParams as Structured
from legato.structured import GrammarError, GrammarState

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{2}-[a-c]{2}"
LONG = r"[a-c]{120}"


@pytest.fixture
async def engine(toy_model_dir: Path) -> AsyncIterator[AsyncEngine]:
    # Few KV blocks (256 tokens): any two ~140-token constrained requests preempt each other.
    async with open_engine(
        str(toy_model_dir),
        executor="inproc",
        max_model_len=256,
        num_kv_blocks=16,
        disable_log_stats=True,
    ) as eng:
        yield eng


async def texts(engine: AsyncEngine, prompt: str, params: SamplingParams, rid: str) -> list[str]:
    """The final text of each of the request's choices."""
    final = None
    async with engine.generate(prompt, params, rid) as stream:
        async for out in stream:
            final = out
    assert final is not None and final.finished
    return [c.text for c in sorted(final.outputs, key=lambda c: c.index)]


def count_preemptions(engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ids the scheduler preempts from now on (it still preempts them)."""
    preempted: list[str] = []
    preempt = engine.scheduler._preempt

    def counting(req: Any) -> None:
        preempted.append(req.request_id)
        preempt(req)

    monkeypatch.setattr(engine.scheduler, "_preempt", counting)
    return preempted


async def test_constraints_hold_for_n_seeds_and_under_preemption(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    preempted = count_preemptions(engine, monkeypatch)
    json_params = SamplingParams(
        temperature=1.0, max_tokens=120, n=2, seed=7, structured_outputs=Structured(json=SCHEMA)
    )
    regex_params = SamplingParams(
        temperature=1.0, max_tokens=20, structured_outputs=Structured(regex=REGEX)
    )
    choice_params = SamplingParams(
        temperature=1.0, max_tokens=20, logprobs=3, structured_outputs={"choice": ["yes", "no"]}
    )
    long_params = SamplingParams(
        temperature=1.0, max_tokens=130, structured_outputs=Structured(regex=LONG)
    )
    free = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    results: dict[str, list[str]] = {}

    async def run(rid: str, params: SamplingParams) -> None:
        results[rid] = await texts(engine, "a b c d e f g h", params, rid)

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(run, f"long{i}", long_params)
        for i in range(3):
            nursery.start_soon(run, f"json{i}", json_params)
        nursery.start_soon(run, "free", free)
        nursery.start_soon(run, "regex", regex_params)
        nursery.start_soon(run, "choice", choice_params)
    assert preempted  # the KV cache was too small for all of them at once
    for i in range(3):
        for text in results[f"json{i}"]:
            jsonschema.validate(json.loads(text), SCHEMA)
    # Seeds: the same seeded request gives the same choices every time.
    assert results["json0"] == results["json1"] == results["json2"]
    assert results["json0"][0] != results["json0"][1]  # children seed + 0, seed + 1
    assert re.fullmatch(REGEX, results["regex"][0])
    assert results["choice"][0] in ("yes", "no")
    for i in range(4):
        assert re.fullmatch(LONG, results[f"long{i}"][0]), results[f"long{i}"]
    # Constrained requests were among the preempted: their grammars resumed in step.
    assert any(not rid.startswith("free") for rid in preempted), preempted
    assert not re.fullmatch(r"[a-c]*", results["free"][0])  # the masks went to their own rows


async def test_logprobs_are_those_of_the_masked_distribution(engine: AsyncEngine) -> None:
    params = SamplingParams(
        temperature=1.0, max_tokens=8, logprobs=5, structured_outputs=Structured(choice=["yes"])
    )
    final = None
    async with engine.generate("a b", params, "lp") as stream:
        async for out in stream:
            final = out
    assert final is not None
    (choice,) = final.outputs
    assert choice.text == "yes"
    assert choice.logprobs is not None and len(choice.logprobs) == len(choice.token_ids)
    written = ""
    for token_id, position in zip(choice.token_ids, choice.logprobs):
        # Every candidate with any probability continues "yes" (or ends it): the logprobs
        # are the masked distribution's, as the sampler drew from it.
        for candidate, lp in position.items():
            if lp.logprob > float("-inf"):
                text = engine.tokenizer.decode([candidate])
                assert "yes".startswith(written + text) or written == "yes", (written, text)
        assert position[token_id].logprob > float("-inf")
        written += engine.tokenizer.decode([token_id], skip_special_tokens=True)


async def test_a_bad_constraint_fails_its_request_alone(engine: AsyncEngine) -> None:
    with pytest.raises(ValidationError) as info:
        await texts(
            engine, "a", SamplingParams(structured_outputs={"json": {"type": "nonsense"}}), "bad"
        )
    assert info.value.field == "structured_outputs.json"
    with pytest.raises(ValidationError) as info:
        await texts(engine, "a", SamplingParams(structured_outputs={"grammar": "start: ("}), "bad")
    assert info.value.field == "structured_outputs.grammar"
    good = SamplingParams(max_tokens=20, structured_outputs=Structured(regex=REGEX))
    assert re.fullmatch(REGEX, (await texts(engine, "a", good, "good"))[0])


class GrammarThatBreaks(GrammarState):
    """A test double for a grammar engine failing mid-request: a real state whose ``accept``
    raises once it has taken ``after`` tokens."""

    after = 3

    def accept(self, token_ids: Any) -> None:
        if self.num_accepted + len(token_ids) > self.after:
            self.error = "injected failure"
            raise GrammarError(self.error)
        super().accept(token_ids)


async def test_a_grammar_failing_mid_request_fails_that_request_alone(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    grammars = engine.renderer.grammars
    assert grammars is not None
    compile_real = grammars.compile

    def compile_breaking(requests: Any) -> None:
        compile_real(requests)
        for request in requests:
            if request.request_id.startswith("breaks"):
                request.grammar.__class__ = GrammarThatBreaks

    monkeypatch.setattr(grammars, "compile", compile_breaking)
    constrained = SamplingParams(
        temperature=1.0, max_tokens=120, structured_outputs={"json": SCHEMA}
    )
    results: dict[str, Any] = {}

    async def run(rid: str, params: SamplingParams) -> None:
        try:
            results[rid] = await texts(engine, "a b c", params, rid)
        except EngineGenerateError as exc:
            results[rid] = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "breaks", constrained)
        nursery.start_soon(run, "fine", constrained)
        nursery.start_soon(run, "free", SamplingParams(max_tokens=30, ignore_eos=True))
    assert isinstance(results["breaks"], EngineGenerateError)
    assert "injected failure" in str(results["breaks"])
    jsonschema.validate(json.loads(results["fine"][0]), SCHEMA)
    assert results["free"][0]
    assert engine.is_running
    await engine.wait_until_idle()
    assert engine.num_kv_blocks_used == 0
