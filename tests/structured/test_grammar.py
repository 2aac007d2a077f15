"""Grammar states on llguidance with the toy model's real tokenizer.

Outputs sampled from random logits under the masks must match their
constraint every time; every hostile schema or grammar must cost exactly its
own request (a ValidationError naming the field, or a GrammarError), and the
compiler must keep serving the next one.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import llguidance
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from legato.protocol.errors import ValidationError
from legato.protocol.structured import StructuredOutputsParams
from legato.structured import (
    GrammarCompiler,
    GrammarError,
    allocate_bitmask,
    bitmask_allows,
)
from legato.structured import grammar as grammar_module
from legato.structured.grammar import is_lark


@pytest.fixture
def person_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }


def _params(**kwargs: Any) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kwargs)


# ------------------------------------------------------------------ outputs match


def test_json_schema_outputs_validate(
    grammar_compiler: GrammarCompiler, constrained_generate: Any, person_schema: dict[str, Any]
) -> None:
    for seed in range(8):
        state = grammar_compiler.compile(_params(json=person_schema))
        text, _ = constrained_generate(state, seed)
        jsonschema.validate(json.loads(text), person_schema)
        assert " " not in text.replace(json.loads(text)["name"], "")  # compact by default


def test_json_schema_given_as_text(
    grammar_compiler: GrammarCompiler, constrained_generate: Any, person_schema: dict[str, Any]
) -> None:
    state = grammar_compiler.compile(_params(json=json.dumps(person_schema)))
    text, _ = constrained_generate(state, 1)
    jsonschema.validate(json.loads(text), person_schema)


def test_json_object_outputs_parse(
    grammar_compiler: GrammarCompiler, constrained_generate: Any
) -> None:
    for seed in range(4):
        state = grammar_compiler.compile(_params(json_object=True))
        text, _ = constrained_generate(state, seed, eos_bias=8.0, prefer='"}]')
        assert isinstance(json.loads(text), dict)


def test_disable_additional_properties_closes_open_objects(
    grammar_compiler: GrammarCompiler,
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    closed = grammar_compiler.compile(_params(json=schema, disable_additional_properties=True))
    opened = grammar_compiler.compile(_params(json=schema))
    tokens = grammar_compiler.tokenizer.tokenize_str('{"a":1,')
    assert opened.matcher.validate_tokens(tokens) == len(tokens)
    assert closed.matcher.validate_tokens(tokens) < len(tokens)


def test_regex_outputs_match(grammar_compiler: GrammarCompiler, constrained_generate: Any) -> None:
    pattern = r"[A-Z][a-z]{2,5}-\d{3}"
    for seed in range(8):
        text, _ = constrained_generate(grammar_compiler.compile(_params(regex=pattern)), seed)
        assert re.fullmatch(pattern, text), text


def test_choice_outputs_are_one_of_the_choices(
    grammar_compiler: GrammarCompiler, constrained_generate: Any
) -> None:
    choices = ["positive", "negative", 'say "neutral"', "héllo wörld"]
    seen = set()
    for seed in range(12):
        text, _ = constrained_generate(grammar_compiler.compile(_params(choice=choices)), seed)
        assert text in choices
        seen.add(text)
    assert len(seen) > 1  # the mask constrains; it does not force one answer


@pytest.mark.parametrize(
    ("grammar", "pattern"),
    [
        ('start: "(" item ("," item)* ")"\nitem: /[0-9]{1,3}/', r"\(\d{1,3}(,\d{1,3})*\)"),
        ('root ::= "yes" | "no" | "maybe " [a-c]', r"yes|no|maybe [a-c]"),  # GBNF
    ],
)
def test_grammar_outputs_match(
    grammar_compiler: GrammarCompiler, constrained_generate: Any, grammar: str, pattern: str
) -> None:
    for seed in range(6):
        state = grammar_compiler.compile(_params(grammar=grammar))
        text, _ = constrained_generate(state, seed, eos_bias=4.0)
        assert re.fullmatch(pattern, text), text


# ------------------------------------------------------------------ the state machine


def test_mask_allows_only_eos_once_complete(grammar_compiler: GrammarCompiler) -> None:
    state = grammar_compiler.compile(_params(choice=["yes"]))
    state.accept(grammar_compiler.tokenizer.tokenize_str("yes"))
    assert state.is_terminated and state.is_accepting
    row = allocate_bitmask(1, grammar_compiler.vocab_size)[0]
    state.fill_bitmask(row)
    allowed = [t for t in range(grammar_compiler.vocab_size) if bitmask_allows(row, t)]
    assert set(allowed) == set(grammar_compiler.eos_token_ids)
    eos = next(iter(grammar_compiler.eos_token_ids))
    state.accept([eos, eos])  # EOS after the end is fine ...
    with pytest.raises(GrammarError, match="after the end"):
        state.accept([5])  # ... anything else is not


def test_padded_vocabulary_is_never_allowed(grammar_compiler: GrammarCompiler) -> None:
    state = grammar_compiler.compile(_params(regex=".*"))
    row = allocate_bitmask(1, grammar_compiler.vocab_size)[0]
    state.fill_bitmask(row)
    real = 2048  # the toy tokenizer; the compiler's vocabulary is padded past it
    assert grammar_compiler.vocab_size > real
    assert not any(bitmask_allows(row, t) for t in range(real, grammar_compiler.vocab_size))


def test_rejected_token_fails_the_state_for_good(grammar_compiler: GrammarCompiler) -> None:
    state = grammar_compiler.compile(_params(regex="[0-9]+"))
    letter = grammar_compiler.tokenizer.tokenize_str("x")
    with pytest.raises(GrammarError, match="doesn.t satisfy the grammar"):
        state.accept(letter)
    assert state.error is not None
    with pytest.raises(GrammarError):
        state.fill_bitmask(allocate_bitmask(1, grammar_compiler.vocab_size)[0])
    with pytest.raises(GrammarError, match="outside the vocabulary"):
        grammar_compiler.compile(_params(regex="a")).accept([10**9])


def test_rollback_and_fork(grammar_compiler: GrammarCompiler) -> None:
    tok = grammar_compiler.tokenizer
    state = grammar_compiler.compile(_params(choice=["abc", "abd"]))
    state.accept(tok.tokenize_str("abc"))
    assert state.is_accepting
    state.rollback(state.num_accepted)
    twin = state.fork()
    state.accept(tok.tokenize_str("abd"))
    assert state.is_accepting and not twin.is_accepting  # the fork did not move
    twin.accept(tok.tokenize_str("abc"))
    assert twin.is_accepting
    with pytest.raises(ValueError):
        state.rollback(state.num_accepted + 1)


def test_compiles_are_cached_and_states_independent(grammar_compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {"q": {"type": "boolean"}}, "required": ["q"]}
    first = grammar_compiler.compile(_params(json=schema))
    second = grammar_compiler.compile(_params(json=json.dumps(schema)))
    assert first.matcher is not second.matcher
    first.accept(grammar_compiler.tokenizer.tokenize_str('{"q":'))
    assert second.num_accepted == 0
    rows = allocate_bitmask(2, grammar_compiler.vocab_size)
    second.fill_bitmask(rows[0])
    grammar_compiler.compile(_params(json=schema)).fill_bitmask(rows[1])
    assert (rows[0] == rows[1]).all()  # still at the start


def test_fill_bitmasks_reports_failed_rows_and_fills_the_rest(
    grammar_compiler: GrammarCompiler,
) -> None:
    good = grammar_compiler.compile(_params(regex="[0-9]+"))
    bad = grammar_compiler.compile(_params(regex="[0-9]+"))
    with pytest.raises(GrammarError):
        bad.accept(grammar_compiler.tokenizer.tokenize_str("x"))
    mask = allocate_bitmask(3, grammar_compiler.vocab_size)
    mask[:] = 0
    failed = grammar_compiler.fill_bitmasks([(good, 2), (bad, 0)], mask)
    assert list(failed) == [0]
    digit = grammar_compiler.tokenizer.tokenize_str("7")[0]
    letter = grammar_compiler.tokenizer.tokenize_str("x")[0]
    assert bitmask_allows(mask[2], digit) and not bitmask_allows(mask[2], letter)
    assert (mask[0] == -1).all()  # a failed row allows everything: no all -inf row
    assert (mask[1] == 0).all()  # rows not named are left alone


# ------------------------------------------------------------------ hostile input


HOSTILE: list[tuple[dict[str, Any], str]] = [
    ({"json": {"type": "nope"}}, "Invalid type"),
    ({"json": {"$ref": "#/definitions/missing"}}, "does not exist"),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "Unsatisfiable"),
    ({"json": {"type": "string", "pattern": "[a-"}}, "unclosed"),
    ({"json": {"type": "string", "minLength": 10**12}}, ""),
    ({"json": {"enum": []}}, "Unsatisfiable"),
    ({"json": {"type": "string", "format": "not-a-format"}}, "Unknown format"),
    ({"json": {"x-guidance": {"item_separator": 5}, "type": "array"}}, "invalid type"),
    ({"json": {"x-guidance": {"whitespace_pattern": "["}, "type": "object"}}, "unclosed"),
    ({"json": '{"type": "object", "properties": {"a": ' * 300 + "{}" + "}}" * 300}, "recursion"),
    ({"json": {"$ref": "#"}}, "matches no output"),
    ({"regex": "[a-z"}, "unclosed character class"),
    ({"regex": r"\p{NotAProperty}"}, "property not found"),
    ({"regex": "\ud800"}, "surrogates"),
    ({"grammar": "start: foo"}, "unknown name"),
    ({"grammar": "start: start"}, "matches no output"),
    ({"grammar": "start: <[99999999]>"}, "Token range"),
    ({"grammar": "::=::="}, "GBNF"),
    ({"grammar": ""}, "root"),
    ({"grammar": 'start: "\x00"'}, ""),
    ({"grammar": '%llguidance {}\nstart: %json {"$ref": 7}'}, ""),
]


@pytest.mark.parametrize(("spec", "needle"), HOSTILE, ids=[repr(h[0])[:40] for h in HOSTILE])
def test_hostile_constraints_fail_alone(
    grammar_compiler: GrammarCompiler,
    constrained_generate: Any,
    spec: dict[str, Any],
    needle: str,
) -> None:
    kind = next(iter(spec))
    with pytest.raises(ValidationError) as caught:
        grammar_compiler.compile(_params(**spec, field="response_format"))
    assert caught.value.field == f"response_format.{kind}"
    assert needle in str(caught.value)
    assert "<state>" not in str(caught.value) and len(str(caught.value)) < 700
    # the compiler (and its tokenizer, its cache) serves the next request
    text, _ = constrained_generate(grammar_compiler.compile(_params(regex="ok[0-9]")), 0)
    assert re.fullmatch("ok[0-9]", text)


def test_expensive_regex_compiles_within_limits(grammar_compiler: GrammarCompiler) -> None:
    state = grammar_compiler.compile(_params(regex="a{1,20000}"))
    row = allocate_bitmask(1, grammar_compiler.vocab_size)[0]
    state.fill_bitmask(row)
    assert bitmask_allows(row, grammar_compiler.tokenizer.tokenize_str("a")[0])


def _real_panic() -> BaseException:
    """A genuine ``pyo3_runtime.PanicException`` from llguidance (a tokenizer callback that raises)."""

    class Raising:
        eos_token_id, bos_token_id, tokens = 1, None, [b"a", b"b"]

        def __call__(self, text: bytes) -> list[int]:
            raise RuntimeError("boom")

    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Raising()))
    try:
        tokenizer.tokenize_str("ab")
    except BaseException as exc:  # noqa: B036 - the point: it is not an Exception
        assert not isinstance(exc, Exception)
        return exc
    raise AssertionError("no panic")


class _PanickingMatcher:
    """Test double for an injected fault: an llguidance matcher whose every call panics."""

    def __init__(self, panic: BaseException) -> None:
        self.panic = panic

    def __getattr__(self, name: str) -> Any:
        def raise_panic(*args: Any, **kwargs: Any) -> Any:
            raise self.panic

        return raise_panic


def test_rust_panic_mid_request_fails_that_state_only(
    grammar_compiler: GrammarCompiler, constrained_generate: Any
) -> None:
    panic = _real_panic()
    victim = grammar_compiler.compile(_params(regex="[0-9]+"))
    bystander = grammar_compiler.compile(_params(regex="[0-9]+"))
    victim.matcher = _PanickingMatcher(panic)  # type: ignore[assignment]
    with pytest.raises(GrammarError, match="panic"):
        victim.accept([5])
    assert victim.error is not None and "panic" in victim.error
    mask = allocate_bitmask(2, grammar_compiler.vocab_size)
    failed = grammar_compiler.fill_bitmasks([(bystander, 0), (victim, 1)], mask)
    assert list(failed) == [1]
    text, _ = constrained_generate(bystander, 3, eos_bias=3.0)
    assert re.fullmatch("[0-9]+", text)


def test_rust_panic_in_a_batch_fill_is_traced_to_its_row(
    grammar_compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    panic = _real_panic()
    victim = grammar_compiler.compile(_params(regex="[0-9]+"))
    bystander = grammar_compiler.compile(_params(regex="[a-z]+"))
    victim.matcher = _PanickingMatcher(panic)  # type: ignore[assignment]

    class PanickingExecutor:
        def unsafe_compute_mask_ptr(self, *args: Any) -> None:
            raise panic

    monkeypatch.setattr(grammar_compiler, "_executor", PanickingExecutor())
    mask = allocate_bitmask(2, grammar_compiler.vocab_size)
    failed = grammar_compiler.fill_bitmasks([(bystander, 0), (victim, 1)], mask)
    assert list(failed) == [1] and "panic" in failed[1]
    assert bitmask_allows(mask[0], grammar_compiler.tokenizer.tokenize_str("q")[0])
    assert not bitmask_allows(mask[0], grammar_compiler.tokenizer.tokenize_str("7")[0])


def test_rust_panic_at_compile_is_a_validation_error(
    grammar_compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    panic = _real_panic()

    real = llguidance.LLMatcher

    class PanickingMatcher:
        grammar_from_regex = staticmethod(real.grammar_from_regex)

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            raise panic

    monkeypatch.setattr(grammar_module.llguidance, "LLMatcher", PanickingMatcher)
    with pytest.raises(ValidationError, match="panic") as caught:
        grammar_compiler.compile(_params(regex="never-compiled-before"))
    assert caught.value.field == "structured_outputs.regex"


def test_keyboard_interrupt_is_not_swallowed(
    grammar_compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = grammar_compiler.compile(_params(regex="[0-9]+"))
    state.matcher = _PanickingMatcher(KeyboardInterrupt())  # type: ignore[assignment]
    with pytest.raises(KeyboardInterrupt):
        state.accept([5])


def test_fill_bitmasks_checks_its_buffer(grammar_compiler: GrammarCompiler) -> None:
    state = grammar_compiler.compile(_params(regex="a"))
    with pytest.raises(ValueError, match="words"):
        grammar_compiler.fill_bitmasks([(state, 0)], np.zeros((1, 3), dtype=np.int32))
    with pytest.raises(ValueError, match="outside"):
        grammar_compiler.fill_bitmasks(
            [(state, 4)], allocate_bitmask(1, grammar_compiler.vocab_size)
        )


_LLGUIDANCE_SNIFF = re.compile(r"(?m)^\s*(%llguidance\b|start\s*:)")


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                "start: x",
                "start :",
                "  start:",
                "startx:",
                "%llguidance {}",
                "%llguidancex",
                "%llguidance_",
                "root ::= x",
                "",
                " ",
                "\t",
                "x start:",
                "start",
                ":",
            ]
        ),
        max_size=6,
    ).map("\n".join)
)
def test_is_lark_agrees_with_llguidance_in_one_linear_pass(text: str) -> None:
    """Same verdict as llguidance's sniffing regex (quadratic on blank lines: F2)."""
    assert is_lark(text) == (_LLGUIDANCE_SNIFF.search(text) is not None)


# ------------------------------------------------------------------ speculative drafts


def test_drafts_are_cut_where_the_grammar_refuses_and_masked_per_position(
    toy_tokenizer: Any, grammar_compiler: GrammarCompiler
) -> None:
    """``validate`` counts the drafts the grammar accepts without consuming them; a drafted
    request's rows are the masks after each prefix of its drafts, rows past a refused draft
    repeat the row that refuses it, and the state ends where it started."""
    from legato.structured.engine import EngineGrammars

    grammars = EngineGrammars(
        toy_tokenizer, grammar_compiler.vocab_size, list(grammar_compiler.eos_token_ids)
    )
    compiler = grammars.compiler
    tok = compiler.tokenizer
    state = compiler.compile(_params(regex="ab(cd)+"))
    state.accept(tok.tokenize_str("a"))
    good, bad = tok.tokenize_str("bcd"), tok.tokenize_str("x")
    assert state.validate(good) == len(good)
    assert state.validate([*good[:1], *bad, *good[1:]]) == 1
    assert state.validate([10**9, *good]) == 0  # outside the vocabulary: refused
    assert state.num_accepted == 1  # nothing consumed

    drafts = [*good[:1], *bad, *good[1:]]
    rows = np.frombuffer(grammars.draft_rows(state, drafts), dtype=np.int32)
    rows = rows.reshape(len(drafts) + 1, -1)
    assert state.num_accepted == 1 and state.error is None  # rolled back
    want = allocate_bitmask(2, compiler.vocab_size)
    walker = state.fork()
    walker.fill_bitmask(want[0])
    walker.accept(good[:1])
    walker.fill_bitmask(want[1])
    assert (rows[0] == want[0]).all() and (rows[1] == want[1]).all()
    assert bitmask_allows(rows[0], good[0]) and not bitmask_allows(rows[1], bad[0])
    assert all((rows[j] == rows[1]).all() for j in range(2, len(drafts) + 1))
