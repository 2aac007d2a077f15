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
from legato.protocol.errors import EngineDeadError, EngineGenerateError, ValidationError
from legato.protocol.params import RequestOutputKind
from legato.protocol.structured import StructuredOutputsParams as Structured
from legato.structured import GrammarError, GrammarState
from legato.testing.chaos import (
    AfterTokens,
    ChaosConfig,
    Fault,
    FaultKind,
    StreamSpec,
    check_round,
    find_cause,
    run_round,
)

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
    """The final text of each of the request's choices. With n>1 a CUMULATIVE output
    carries the choices that advanced in its step (vLLM's way), so they are folded by index."""
    final = None
    by_index: dict[int, str] = {}
    async with engine.generate(prompt, params, rid) as stream:
        async for out in stream:
            final = out
            by_index.update((c.index, c.text) for c in out.outputs)
    assert final is not None and final.finished
    return [by_index[i] for i in sorted(by_index)]


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


def break_grammars(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch, grammar_class: type[Any]
) -> None:
    """Requests whose id starts with "breaks" compile to a ``grammar_class`` grammar."""
    grammars = engine.renderer.grammars
    assert grammars is not None
    compile_real = grammars.compile

    def compile_breaking(requests: Any) -> dict[str, Any]:
        states = compile_real(requests)
        for request_id, state in states.items():
            if request_id.startswith("breaks"):
                state.__class__ = grammar_class
        return states

    monkeypatch.setattr(grammars, "compile", compile_breaking)


async def test_a_grammar_failing_mid_request_fails_that_request_alone(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    break_grammars(engine, monkeypatch, GrammarThatBreaks)
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


# ------------------------------------------------------------------ overlap (async scheduling)


class StepWatch:
    """What the engine core sends its executor from now on: the most steps in flight when
    a constrained step is sent, and how many steps and GrammarBitmask frames went out."""

    def __init__(self, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.most_in_flight = 0
        self.steps = 0
        self.constrained_steps = 0
        self.bitmask_frames = 0
        core, executor = engine.core, engine.core.executor
        submit_step, submit_bitmask = executor.submit_step, executor.submit_bitmask

        def counting_step(step: Any) -> Any:
            answer = submit_step(step)
            self.steps += 1
            if step.grammar_bitmask_follows:
                self.constrained_steps += 1
                self.most_in_flight = max(self.most_in_flight, core.num_steps_in_flight + 1)
            return answer

        def counting_bitmask(answer: Any, rows: Any) -> None:
            self.bitmask_frames += 1
            submit_bitmask(answer, rows)

        monkeypatch.setattr(executor, "submit_step", counting_step)
        monkeypatch.setattr(executor, "submit_bitmask", counting_bitmask)


CONSTRAINED: dict[str, SamplingParams] = {
    "json-greedy": SamplingParams(
        temperature=0.0, max_tokens=120, structured_outputs={"json": SCHEMA}
    ),
    "json-seeded": SamplingParams(
        temperature=1.0, max_tokens=120, n=2, seed=11, structured_outputs={"json": SCHEMA}
    ),
    "regex-seeded": SamplingParams(
        temperature=1.0, seed=5, max_tokens=40, structured_outputs={"regex": r"[a-c]{30}"}
    ),
    "choice-seeded": SamplingParams(
        temperature=1.0, seed=3, max_tokens=10, structured_outputs={"choice": ["yes", "no", "ok"]}
    ),
}


async def run_constrained(engine: AsyncEngine) -> dict[str, list[str]]:
    results: dict[str, list[str]] = {}

    async def run(rid: str, params: SamplingParams) -> None:
        results[rid] = await texts(engine, "a b c d", params, rid)

    async with trio.open_nursery() as nursery:
        for rid, params in CONSTRAINED.items():
            nursery.start_soon(run, rid, params)
    return results


def run_constrained_stepwise(model: Path) -> dict[str, list[str]]:
    """``CONSTRAINED`` through ``LLMEngine`` (the synchronous driver, in this thread)."""
    from legato.config import EngineConfig
    from legato.llm import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(model), max_model_len=256, num_kv_blocks=64))
    for rid, params in CONSTRAINED.items():
        engine.add_request(rid, "a b c d", params.clone(output_kind=RequestOutputKind.FINAL_ONLY))
    results: dict[str, list[str]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = [
                    c.text for c in sorted(out.outputs, key=lambda c: c.index)
                ]
    return results


@pytest.mark.parametrize("executor", ["inproc", "process"])
async def test_constrained_steps_overlap_and_give_the_same_outputs(
    toy_model_dir: Path, executor: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    args: dict[str, Any] = dict(max_model_len=256, num_kv_blocks=64, disable_log_stats=True)
    async with open_engine(
        str(toy_model_dir), executor="inproc", async_scheduling=False, **args
    ) as eng:
        watch = StepWatch(eng, monkeypatch)
        want = await run_constrained(eng)
    assert watch.most_in_flight == 1
    async with open_engine(
        str(toy_model_dir), executor=executor, async_scheduling=True, **args
    ) as eng:
        watch = StepWatch(eng, monkeypatch)
        got = await run_constrained(eng)
        # Constrained requests are planned ahead: two steps with them in flight at once.
        assert watch.most_in_flight == 2
        assert watch.bitmask_frames == watch.constrained_steps > 0
        # A step without constrained requests sends no bitmask frame.
        before = watch.bitmask_frames, watch.steps
        free = SamplingParams(max_tokens=8, ignore_eos=True)
        assert (await texts(eng, "a b", free, "free"))[0]
        assert watch.bitmask_frames == before[0] and watch.steps > before[1]
    assert got == want
    if executor == "inproc":  # LLMEngine's step computes the rows before it samples
        assert await trio.to_thread.run_sync(run_constrained_stepwise, toy_model_dir) == want
    for text in got["json-greedy"] + got["json-seeded"]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert re.fullmatch(r"[a-c]{30}", got["regex-seeded"][0])
    assert got["choice-seeded"][0] in ("yes", "no", "ok")


class GrammarFailingItsRow(GrammarState):
    """A test double for a grammar engine failing while a bitmask row is built: a real state
    that reports an error once it has taken ``after`` tokens."""

    after = 5

    def check(self) -> str | None:
        if self.error is None and self.num_accepted >= self.after:
            self.error = "injected row failure"
        return super().check()


async def test_a_row_failing_under_overlap_fails_that_request_alone_and_drops_its_token(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert engine.config.async_scheduling
    break_grammars(engine, monkeypatch, GrammarFailingItsRow)
    watch = StepWatch(engine, monkeypatch)
    params = SamplingParams(temperature=1.0, max_tokens=30, structured_outputs={"regex": LONG})
    # Its last token is the one sampled without a row: the step that samples it also
    # reaches max_tokens, and the request must still fail, not end with that token.
    last = SamplingParams(temperature=1.0, max_tokens=6, structured_outputs={"regex": LONG})
    seen: dict[str, str] = {}
    results: dict[str, Any] = {}

    async def run(rid: str, params: SamplingParams) -> None:
        try:
            async with engine.generate("a b c", params, rid) as stream:
                async for out in stream:
                    seen[rid] = out.outputs[0].text
            results[rid] = seen[rid]
        except EngineGenerateError as exc:
            results[rid] = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "breaks-mid", params)
        nursery.start_soon(run, "breaks-last", last)
        nursery.start_soon(run, "fine", params)
    for rid in ("breaks-mid", "breaks-last"):
        assert isinstance(results[rid], EngineGenerateError), results[rid]
        assert "injected row failure" in str(results[rid])
        # The token sampled without its row never reached the stream: all it saw matches.
        assert re.fullmatch(r"[a-c]*", seen.get(rid, "")), seen
    assert re.fullmatch(r"[a-c]+", results["fine"])
    assert watch.most_in_flight == 2
    assert engine.is_running
    await engine.wait_until_idle()
    assert engine.num_kv_blocks_used == 0


@pytest.mark.parametrize("kind", [FaultKind.SIGKILL, FaultKind.SIGSTOP])
async def test_a_worker_dying_between_a_step_and_its_bitmask_fails_every_stream(
    toy_model_dir: Path, kind: FaultKind
) -> None:
    """Constrained streams under overlap: the worker often holds a step whose bitmask has
    not come when it is killed or stopped; every stream must still end dead in time."""
    constrained = SamplingParams(
        temperature=1.0, max_tokens=200, structured_outputs={"regex": LONG}
    )
    specs = [StreamSpec(f"chaos-{i}", "a b c", constrained) for i in range(4)]
    config = ChaosConfig(
        model=str(toy_model_dir), num_streams=4, engine_args={"max_model_len": 256}
    )
    fault = Fault(kind, when=AfterTokens(0, 5))
    result = await run_round(fault, specs, config=config)
    assert check_round(result) == []  # every stream ended dead in time; no process left
    assert isinstance(result.dead_error, EngineDeadError)
    assert all(record.outcome == "dead" for record in result.streams)
    assert find_cause(result.dead_error, fault) is not None
