"""Speculative decoding end to end: the same outputs with and without n-gram drafts.

Each comparison runs the same requests through ``LLMEngine`` twice (without and with
``speculative_config``) and also checks that drafts were accepted, so the comparison
covers verified steps and not only steps that verified nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio

from legato import RequestOutput, SamplingParams
from legato.config import EngineConfig
from legato.engine import open_engine
from legato.llm import LLMEngine
from legato.metrics.logger_base import StepStatLogger
from legato.metrics.records import StepStats
from legato.protocol.structured import StructuredOutputsParams

NGRAM: dict[str, Any] = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}
ARGS: dict[str, Any] = dict(max_model_len=512, num_kv_blocks=400, disable_log_stats=True)
TEXT = (
    "Speculative decoding proposes several tokens and verifies them in one forward pass. "
    "The quick brown fox jumps over the lazy dog, and the lazy dog sleeps in the sun. "
)
PROMPTS = [
    "Repeat the following text exactly.\n" + TEXT + "\nRepeated text:\n" + TEXT[:40],
    "one two three four five six seven eight nine ten one two three four five",
    "Write a short story about a cat.",
]


@dataclass
class SpecCounts(StepStatLogger):
    """The spec_decode figures of every step."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=list)

    def record_step(self, step: StepStats) -> None:
        spec = step.scheduler.spec_decoding if step.scheduler is not None else None
        if spec is None:
            return
        self.drafts += spec.num_drafts
        self.draft_tokens += spec.num_draft_tokens
        self.accepted += spec.num_accepted_tokens
        for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
            if pos == len(self.per_pos):
                self.per_pos.append(0)
            self.per_pos[pos] += n


def run(
    model: str | None,
    prompts: list[str],
    params: SamplingParams | list[SamplingParams],
    spec: dict[str, Any] | None,
) -> tuple[list[RequestOutput], SpecCounts]:
    counts = SpecCounts()
    engine = LLMEngine(
        EngineConfig(model=model, speculative_config=spec, **ARGS), stat_loggers=[counts]
    )
    per_request = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, per_request, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    finals: dict[str, RequestOutput] = {}
    for _ in range(sum(p.max_tokens or 0 for p in per_request) + 100):  # every step computes
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            assert isinstance(out, RequestOutput)
            if out.finished:
                finals[out.request_id] = out
    assert not engine.has_unfinished_requests(), "the requests stopped making progress"
    assert engine.scheduler.kv.num_used_blocks == 0
    return [finals[f"r{i}"] for i in range(len(prompts))], counts


def compare(
    model: str | None,
    prompts: list[str],
    params: SamplingParams | list[SamplingParams],
    spec: dict[str, Any] = NGRAM,
) -> tuple[list[RequestOutput], list[RequestOutput], SpecCounts]:
    plain, none = run(model, prompts, params, None)
    assert none.drafts == 0
    speculative, counts = run(model, prompts, params, spec)
    assert counts.accepted > 0, "no draft was accepted: the comparison proves nothing"
    return plain, speculative, counts


def tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def test_greedy_outputs_are_token_identical_on_the_toy_model() -> None:
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    plain, speculative, counts = compare("toy", PROMPTS, params)
    assert tokens(speculative) == tokens(plain)
    assert all(len(t) == 60 for t in tokens(speculative))  # max_tokens, exactly
    assert counts.accepted <= counts.draft_tokens
    assert sum(counts.per_pos) == counts.accepted


# The default model, once: every kind of request below in one batch, with and without
# drafts (a run costs a model load and a few hundred decode steps on two cores).
DEFAULT_REQUESTS: dict[str, tuple[str, SamplingParams]] = {
    "greedy-0": (PROMPTS[0], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)),
    "greedy-1": (PROMPTS[1], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)),
    "greedy-2": (PROMPTS[2], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)),
    "stop": (PROMPTS[0], SamplingParams(max_tokens=80, temperature=0.0, stop=["lazy dog sleeps"])),
    "logprobs": (
        PROMPTS[0],
        SamplingParams(max_tokens=40, temperature=0.0, logprobs=3, ignore_eos=True),
    ),
    "short": (PROMPTS[1], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)),
    "penalties-0": (
        PROMPTS[0],
        SamplingParams(
            max_tokens=48,
            temperature=0.0,
            ignore_eos=True,
            repetition_penalty=1.15,
            frequency_penalty=0.4,
            presence_penalty=0.2,
        ),
    ),
    "penalties-1": (
        PROMPTS[1],
        SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, frequency_penalty=0.5),
    ),
    "bans": (
        PROMPTS[0],
        SamplingParams(max_tokens=48, temperature=0.0, min_tokens=40, bad_words=["lazy dog"]),
    ),
    "regex": (
        PROMPTS[0],
        SamplingParams(
            max_tokens=40,
            temperature=0.0,
            structured_outputs=StructuredOutputsParams(regex=r"(the lazy dog ){3}"),
        ),
    ),
}


@dataclass
class Runs:
    plain: dict[str, RequestOutput]
    speculative: dict[str, RequestOutput]
    counts: SpecCounts

    def same_tokens(self, name: str) -> bool:
        return list(self.plain[name].outputs[0].token_ids) == list(
            self.speculative[name].outputs[0].token_ids
        )


@pytest.fixture(scope="module")
def default_runs() -> Runs:
    names = list(DEFAULT_REQUESTS)
    prompts = [DEFAULT_REQUESTS[n][0] for n in names]
    params = [DEFAULT_REQUESTS[n][1] for n in names]
    plain, speculative, counts = compare(None, prompts, params)
    return Runs(dict(zip(names, plain)), dict(zip(names, speculative)), counts)


@pytest.mark.slow  # the default model, with and without drafts (shared: one run)
def test_greedy_outputs_are_token_identical_on_the_default_model(default_runs: Runs) -> None:
    for name in ("greedy-0", "greedy-1", "greedy-2"):
        assert default_runs.same_tokens(name), name
        assert len(default_runs.speculative[name].outputs[0].token_ids) == 48
    counts = default_runs.counts
    assert counts.per_pos[0] >= counts.per_pos[-1] and sum(counts.per_pos) == counts.accepted


@pytest.mark.slow  # the default model, with and without drafts (shared: one run)
def test_stop_strings_end_the_output_where_they_would_without_drafts(default_runs: Runs) -> None:
    a, b = default_runs.plain["stop"].outputs[0], default_runs.speculative["stop"].outputs[0]
    assert a.stop_reason == "lazy dog sleeps"  # the stop string did stop it
    assert (b.text, b.finish_reason, b.stop_reason) == (a.text, a.finish_reason, a.stop_reason)
    assert default_runs.same_tokens("stop")


@pytest.mark.slow  # the default model, with and without drafts (shared: one run)
def test_max_tokens_is_exact_with_drafts(default_runs: Runs) -> None:
    assert len(default_runs.speculative["short"].outputs[0].token_ids) == 7
    assert default_runs.same_tokens("short")


@pytest.mark.slow  # the default model, with and without drafts (shared: one run)
def test_logprobs_are_as_without_drafts(default_runs: Runs) -> None:
    assert default_runs.same_tokens("logprobs")
    got = default_runs.speculative["logprobs"].outputs[0].logprobs
    want = default_runs.plain["logprobs"].outputs[0].logprobs
    assert got is not None and want is not None and len(got) == len(want) == 40
    for g, w in zip(got, want, strict=True):
        assert list(g) == list(w)  # the chosen token, then the same top 3
        for token_id, lp in w.items():
            assert g[token_id].logprob == pytest.approx(lp.logprob, abs=2e-3)
            assert g[token_id].rank == lp.rank


@pytest.mark.slow  # the default model, with and without drafts (shared: one run)
def test_penalties_min_tokens_and_bad_words_count_the_drafts(default_runs: Runs) -> None:
    """Penalties and bans at a draft's position depend on the drafts before it."""
    for name in ("penalties-0", "penalties-1", "bans"):
        assert default_runs.same_tokens(name), name
    assert "lazy dog" not in default_runs.speculative["bans"].outputs[0].text


@pytest.mark.slow  # the default model, with and without drafts (shared: one run)
def test_structured_outputs_are_as_without_drafts(default_runs: Runs) -> None:
    """A constrained request decodes beside unconstrained drafted ones, as without drafts."""
    assert default_runs.same_tokens("regex")
    assert default_runs.speculative["regex"].outputs[0].text == "the lazy dog " * 3


ANIMALS_SCHEMA: dict[str, Any] = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"enum": ["lazy dog", "quick fox", "cat"]},
            "legs": {"enum": [2, 4]},
        },
        "required": ["name", "legs"],
        "additionalProperties": False,
    },
    "minItems": 6,
    "maxItems": 6,
}
REPEATS_REGEX = r"(the lazy dog ){3}(one two three ){2}"


def test_structured_outputs_verify_drafts_under_their_grammar() -> None:
    """Constrained requests verify drafts: row ``j`` of a drafted request's mask is its
    grammar after the drafts before ``j``, so the same tokens come out as without drafts,
    and each output is complete and valid (only constrained requests run: the accepted
    drafts are theirs)."""
    import re

    import jsonschema

    params = [
        SamplingParams(
            max_tokens=120,
            temperature=0.0,
            structured_outputs=StructuredOutputsParams(json=ANIMALS_SCHEMA),
        ),
        SamplingParams(
            max_tokens=60,
            temperature=0.0,
            structured_outputs=StructuredOutputsParams(regex=REPEATS_REGEX),
        ),
    ]
    prompts = [
        'List six animals as JSON, e.g. [{"name": "cat", "legs": 4}, {"name": "lazy dog", '
        '"legs": 4}]:',
        "Repeat: the lazy dog the lazy dog one two three",
    ]
    plain, speculative, counts = compare("toy", prompts, params)
    assert tokens(speculative) == tokens(plain)
    assert counts.accepted >= 20
    json_out, regex_out = (o.outputs[0] for o in speculative)
    assert json_out.finish_reason == regex_out.finish_reason == "stop"  # grammar complete
    jsonschema.validate(json.loads(json_out.text), ANIMALS_SCHEMA)
    assert re.fullmatch(REPEATS_REGEX, regex_out.text)


@pytest.mark.slow
def test_sampled_requests_finish_at_max_tokens_with_drafts() -> None:
    # A low temperature keeps the continuation on the repeated text, so drafts are
    # accepted whatever the random stream (at 0.8 that depended on the draw).
    params = SamplingParams(max_tokens=30, temperature=0.3, seed=3, ignore_eos=True)
    outs, counts = run(None, PROMPTS[:1] * 2, params, NGRAM)
    assert counts.accepted > 0
    assert [len(t) for t in tokens(outs)] == [30, 30]


async def assert_kv_freed_after_aborts(model_dir: Any, spec: dict[str, Any]) -> None:
    """Six requests with ``spec`` cancelled at different lengths (aborts mid-draft):
    the engine goes idle with no KV block in use."""
    async with open_engine(
        str(model_dir), executor="process", speculative_config=spec, **ARGS
    ) as engine:
        got: dict[int, int] = {}

        async def one(i: int) -> None:
            params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
            with trio.CancelScope() as scope:
                async with engine.generate(PROMPTS[i % 3], params, f"a{i}") as stream:
                    async for out in stream:
                        got[i] = len(out.outputs[0].token_ids)
                        if got[i] >= 5 + i:
                            scope.cancel()

        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(one, i)
        assert all(5 + i <= got[i] < 300 for i in range(6))
        with trio.fail_after(30):
            await engine.wait_until_idle()
        assert engine.num_kv_blocks_used == 0


async def test_kv_usage_returns_to_zero_after_aborts(toy_model_dir: Any) -> None:
    await assert_kv_freed_after_aborts(toy_model_dir, NGRAM)


def test_disable_by_batch_size_verifies_no_drafts_while_more_requests_run() -> None:
    """vLLM's ``disable_by_batch_size``: three requests running together verify no drafts
    with a limit of 2 (and the same tokens come out); two of them do."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    limited = {**NGRAM, "disable_by_batch_size": 2}
    plain, _ = run("toy", PROMPTS, params, None)
    outs, counts = run("toy", PROMPTS, params, limited)
    assert counts.drafts == 0
    assert tokens(outs) == tokens(plain)
    _, counts = run("toy", PROMPTS[:2], params, limited)
    assert counts.accepted > 0


def test_drafts_per_batch_size_follow_vllms_table() -> None:
    """vLLM's ``num_speculative_tokens_per_batch_size`` ranges, under ``disable_by_batch_size``."""
    config = EngineConfig(
        speculative_config={  # type: ignore[arg-type]
            "num_speculative_tokens": 4,
            "num_speculative_tokens_per_batch_size": [[1, 2, 4], [3, 6, 1], [7, 64, 0]],
            "disable_by_batch_size": 32,
        }
    )
    spec = config.speculative_config
    assert spec is not None
    assert [spec.drafts_at(n) for n in (1, 2, 3, 6, 7, 32, 33, 100)] == [4, 4, 1, 1, 0, 0, 0, 0]
    assert EngineConfig(**config.to_dict()) == config  # the worker's round trip
    plain = EngineConfig(speculative_config={"num_speculative_tokens": 3})  # type: ignore[arg-type]
    assert plain.speculative_config is not None and plain.speculative_config.drafts_at(500) == 3
    for bad in ([[0, 2, 1]], [[3, 2, 1]], [[1, 2]], [[1, 2, True]], "1-2:3"):
        with pytest.raises(ValueError, match="num_speculative_tokens_per_batch_size"):
            EngineConfig(
                speculative_config={  # type: ignore[arg-type]
                    "num_speculative_tokens": 4,
                    "num_speculative_tokens_per_batch_size": bad,
                }
            )


def test_bad_speculative_configs_are_refused_naming_the_field() -> None:
    cases = {
        "num_speculative_tokens": {"method": "ngram"},
        "method": {"method": "eagle3", "num_speculative_tokens": 2},
        "prompt_lookup_min": {
            "num_speculative_tokens": 2,
            "prompt_lookup_min": 4,
            "prompt_lookup_max": 2,
        },
        "prompt_lookup_max": {"num_speculative_tokens": 2, "prompt_lookup_max": 0},
        "model": {"method": "draft_model", "num_speculative_tokens": 2},
        "bogus": {"num_speculative_tokens": 2, "bogus": 1},
        "disable_by_batch_size": {"num_speculative_tokens": 2, "disable_by_batch_size": 1},
        "num_speculative_tokens_per_batch_size": {
            "num_speculative_tokens": 2,
            "num_speculative_tokens_per_batch_size": [[1, 4, 3]],  # K above k
        },
    }
    for name, spec in cases.items():
        with pytest.raises(ValueError, match=rf"^speculative_config\.{name}: "):
            EngineConfig(speculative_config=spec)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^speculative_config: "):
        EngineConfig(speculative_config="ngram")  # type: ignore[arg-type]
    config = EngineConfig(
        speculative_config={  # type: ignore[arg-type]
            "num_speculative_tokens": 2,
            "prompt_lookup_max": 3,
            "disable_by_batch_size": 4,
        }
    )
    assert config.speculative_config is not None
    assert (
        config.speculative_config.prompt_lookup_min,
        config.speculative_config.prompt_lookup_max,
        config.speculative_config.disable_by_batch_size,
    ) == (3, 3, 4)
    # the worker rebuilds its config from the dict form
    assert EngineConfig(**config.to_dict()) == config


def test_serve_takes_speculative_config_as_json() -> None:
    from legato.cli import build_parser, engine_kwargs

    parser = build_parser()
    args = parser.parse_args(
        ["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    )
    config = EngineConfig(**engine_kwargs(args))
    assert config.speculative_config is not None
    assert config.speculative_config.num_speculative_tokens == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--speculative-config", "{not json"])


@pytest.mark.parametrize("fault", ["sigkill", "raise_on_step"])
async def test_a_dead_worker_mid_verification_ends_every_stream(
    toy_model_dir: Any, fault: str
) -> None:
    await assert_chaos_ends_every_stream(toy_model_dir, NGRAM, fault)


async def assert_chaos_ends_every_stream(model_dir: Any, spec: dict[str, Any], fault: str) -> None:
    """The chaos harness with ``spec`` on: every stream ends with EngineDeadError,
    nothing hangs or leaks (``run_chaos`` raises otherwise)."""
    from legato.testing.chaos import ChaosConfig, check_round, run_chaos

    config = ChaosConfig(
        model=str(model_dir),
        num_streams=8,
        max_tokens=(8, 40),
        engine_args={**ARGS, "speculative_config": spec},
    )
    results = await run_chaos(1, seed=5, faults=[fault], config=config, log=lambda _: None)
    for result in results:
        assert check_round(result) == []
        assert result.dead_error is not None and result.count("hung") == 0
