"""Per-request grammar states on llguidance: compile, token bitmask per step, advance, roll back.

:class:`GrammarCompiler` wraps one tokenizer (built once per engine; ~0.1-1 s
for a large vocabulary) and compiles a request's
:class:`~legato.protocol.structured.StructuredOutputsParams` into a
:class:`GrammarState`, the matcher that request owns. Each step the engine
asks every constrained request for its row of the token bitmask
(:func:`fill_bitmasks`, in parallel on llguidance's own threads, the GIL
released), samples under it, then feeds the sampled tokens back
(:meth:`GrammarState.accept`).

The bitmask is ``int32[rows, ceil(vocab / 32)]``: bit ``t % 32`` of word
``t // 32`` set means token ``t`` is allowed. A stopped grammar (the output
is complete) allows only the EOS tokens.

Failure contract (one bad schema costs one request, never the engine):

- compiling raises ``ValidationError`` naming the request's field
  (``structured_outputs.json``, ``response_format`` ...) with the grammar
  engine's message, for every error llguidance reports *and* for anything it
  raises, Rust panics included (pyo3's ``PanicException`` derives from
  ``BaseException``, not ``Exception``; it is caught here and nowhere else);
- during generation, a matcher that errors (a sampled token it rejects, a
  resource limit, a panic) raises :class:`GrammarError` from ``accept`` or is
  reported per row by :func:`fill_bitmasks`; the engine fails that request
  alone.

Thread safety: a compiler may be used from several threads at once (the
cache is locked); one GrammarState is used by one thread at a time. Every
call here may block for the grammar's compute time (microseconds per mask,
up to about a second for a pathological grammar at compile time): run
compiles off the event loop.

Imports numpy and llguidance; never torch or trio.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import llguidance
import numpy as np
import numpy.typing as npt
from llguidance.gbnf_to_lark import gbnf_to_lark

from ..protocol.errors import LegatoError, ValidationError
from ..protocol.structured import StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

T = TypeVar("T")

Bitmask = npt.NDArray[np.int32]
"""``int32[rows, words]``: one bit per token, set = allowed."""

MAX_ERROR_CHARS = 600
"""Grammar-engine messages are cut to this length (they can carry whole parser dumps)."""


class GrammarError(LegatoError):
    """A request's grammar failed while generating; only that request fails."""


def bitmask_words(vocab_size: int) -> int:
    """How many int32 words hold one row of a bitmask for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> Bitmask:
    """A bitmask with every token allowed in every row."""
    return np.full((rows, bitmask_words(vocab_size)), -1, dtype=np.int32)


def bitmask_allows(row: Bitmask, token_id: int) -> bool:
    """Whether one bitmask row allows ``token_id``."""
    return bool((int(row[token_id // 32]) >> (token_id % 32)) & 1)


def short_message(message: str) -> str:
    """The first part of a grammar-engine message: no parser state dump, bounded length."""
    text = message.split("\n<state>", 1)[0].strip()
    if len(text) > MAX_ERROR_CHARS:
        text = text[: MAX_ERROR_CHARS - 3] + "..."
    return text or "grammar engine error"


def _is_panic(exc: BaseException) -> bool:
    """A Rust panic surfacing through pyo3 (``pyo3_runtime.PanicException``)."""
    return type(exc).__name__ == "PanicException"


@contextmanager
def _engine_errors(wrap: Callable[[str], Exception]) -> Iterator[None]:
    """Turn whatever the grammar engine raises (Rust panics too) into ``wrap(message)``.

    KeyboardInterrupt, SystemExit and the like pass through untouched.
    """
    try:
        yield
    except (GrammarError, ValidationError):
        raise
    except Exception as exc:
        raise wrap(short_message(f"{type(exc).__name__}: {exc}")) from exc
    except BaseException as exc:
        if not _is_panic(exc):
            raise
        raise wrap(short_message(f"grammar engine panic: {exc}")) from exc


# ------------------------------------------------------------------ specs


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = (
    "additionalProperties",
    "items",
    "prefixItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "allOf",
    "anyOf",
    "oneOf",
)


def _close_objects(schema: Any) -> None:
    """Set ``additionalProperties: false`` wherever an object schema leaves it open, in place."""
    if isinstance(schema, list):
        for item in schema:
            _close_objects(item)
        return
    if not isinstance(schema, dict):
        return
    for key in _SCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, dict):
            for sub in value.values():
                _close_objects(sub)
    for key in _SUBSCHEMAS:
        value = schema.get(key)
        if isinstance(value, dict | list):
            _close_objects(value)
    if "additionalProperties" not in schema and isinstance(schema.get("properties"), dict):
        schema["additionalProperties"] = False


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for ``params`` (not yet checked: :meth:`GrammarCompiler.compile` does).

    Raises ValidationError for what can be told without the grammar engine.
    """
    kind = params.kind
    field = params.spec_name
    with _engine_errors(lambda m: ValidationError(field, m)):
        if kind in ("json", "json_object"):
            schema: Any = {"type": "object"} if kind == "json_object" else params.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if params.disable_additional_properties:
                schema = copy.deepcopy(schema)
                _close_objects(schema)
            options: JsonCompileOptions = {"whitespace_flexible": not params.disable_any_whitespace}
            if params.whitespace_pattern is not None:
                options["whitespace_pattern"] = params.whitespace_pattern
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options))
        if kind == "regex":
            assert params.regex is not None
            params.regex.encode("utf-8")  # lone surrogates: a clear error, not a Rust one
            return str(llguidance.LLMatcher.grammar_from_regex(params.regex))
        if kind == "choice":
            assert params.choice is not None
            lark = "start: " + " | ".join(json.dumps(c) for c in params.choice)
            return str(llguidance.LLMatcher.grammar_from_lark(lark))
        assert params.grammar is not None
        params.grammar.encode("utf-8")
        # Lark as is; GBNF (``root ::= ...``) is converted to Lark by llguidance.
        if is_lark(params.grammar):
            return str(llguidance.LLMatcher.grammar_from_lark(params.grammar))
        try:
            lark = gbnf_to_lark(params.grammar)
        except Exception as exc:  # as llguidance.grammar_from words it
            raise ValueError(f"Failed to convert the grammar from GBNF to Lark: {exc}") from exc
        return str(llguidance.LLMatcher.grammar_from_lark(lark))


def is_lark(text: str) -> bool:
    r"""Whether a grammar is Lark (a line starting ``start:`` or ``%llguidance``), else GBNF.

    llguidance's own test, ``re.search(r"(?m)^\s*(%llguidance\b|start\s*:)")``, is
    quadratic on blank lines and holds the GIL (200k newlines: minutes); this is one
    linear pass with the same verdict.
    """
    pos = 0
    for line in text.split("\n"):  # (?m)^: after each newline
        stripped = line.lstrip()
        if stripped.startswith("%llguidance"):
            after = stripped[11:12]
            if not (after.isalnum() or after == "_"):
                return True
        if stripped.startswith("start"):
            # ``start\s*:`` may span lines; each blank run is scanned once (it ends at or
            # before the next line that starts a rule), so the pass stays linear.
            j = pos + len(line) - len(stripped) + 5
            while j < len(text) and text[j].isspace():
                j += 1
            if text.startswith(":", j):
                return True
        pos += len(line) + 1
    return False


# ------------------------------------------------------------------ compiler


@dataclass(frozen=True)
class TokenizerInfo:
    """What the grammar engine needs to know about the model's tokenizer."""

    tokenizer_json: str  # the Hugging Face ``tokenizer.json`` text
    vocab_size: int  # the model's logits width (>= the tokenizer's vocabulary)
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(
        cls, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int] = ()
    ) -> TokenizerInfo:
        """From a transformers fast tokenizer or a bare ``tokenizers.Tokenizer``."""
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        eos = list(eos_token_ids)
        own_eos = getattr(tokenizer, "eos_token_id", None)
        if isinstance(own_eos, int) and own_eos not in eos:
            eos.append(own_eos)
        if not eos:
            raise ValueError("the tokenizer has no EOS token; pass eos_token_ids")
        return cls(backend.to_str(), vocab_size, tuple(eos))


class GrammarCompiler:
    """Compiles requests' constraints against one tokenizer; keeps recent compiles.

    A compiled grammar is kept pristine in a small LRU cache keyed by its text
    and options; each request gets a deep copy (cheap), so twenty requests
    with the same schema compile it once.
    """

    def __init__(
        self,
        info: TokenizerInfo,
        *,
        cache_size: int = 64,
        limits: llguidance.LLParserLimits | None = None,
        threads: int | None = None,
    ) -> None:
        with _engine_errors(lambda m: ValueError(f"tokenizer: {m}")):
            self.tokenizer = llguidance.LLTokenizer(
                info.tokenizer_json,
                n_vocab=info.vocab_size,
                eos_token=list(info.eos_token_ids),
            )
        self.vocab_size = int(self.tokenizer.vocab_size)
        self.eos_token_ids = frozenset(info.eos_token_ids)
        self.limits = limits
        self._executor = llguidance.LLExecutor(num_threads=threads)
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @property
    def bitmask_words(self) -> int:
        return bitmask_words(self.vocab_size)

    def compile(self, params: StructuredOutputsParams) -> GrammarState:
        """A fresh grammar state for one request (one sequence). May block; see the module doc.

        Raises ValidationError naming ``params``' field when the constraint does
        not compile or can produce no output at all.
        """
        options = {
            k: v
            for k, v in params.to_dict().items()
            if k not in ("field", "spec_field", params.kind)
        }
        key = f"{params.kind}\x00{params.spec_text()}\x00{sorted(options.items())!r}"
        with self._lock:
            pristine = self._cache.get(key)
            if pristine is not None:
                self._cache.move_to_end(key)
        if pristine is None:
            pristine = self._compile(params)
            with self._lock:
                self._cache[key] = pristine
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        field = params.spec_name
        with _engine_errors(lambda m: ValidationError(field, m)):
            return GrammarState(pristine.deep_copy(), self, field)

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        text = grammar_text(params)
        field = params.spec_name
        with _engine_errors(lambda m: ValidationError(field, m)):
            matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0, limits=self.limits)
            if matcher.is_error():
                raise ValidationError(field, short_message(matcher.get_error()))
            # A grammar whose language is empty compiles, then stops at its first mask.
            probe = matcher.deep_copy()
            scratch = allocate_bitmask(1, self.vocab_size)
            probe.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
            if probe.is_error():
                raise ValidationError(
                    field, "matches no output at all: " + short_message(probe.get_error())
                )
        return matcher

    def fill_bitmasks(
        self, states: Sequence[tuple[GrammarState, int]], bitmask: Bitmask
    ) -> dict[int, str]:
        """Write each state's next-token mask into its row of ``bitmask``, in parallel.

        Returns ``{row: message}`` for the states whose grammar failed (their rows
        are left allowing every token; the caller fails those requests). Blocks
        for the slowest grammar's compute time, the GIL released.
        """
        if bitmask.dtype != np.int32 or not bitmask.flags["C_CONTIGUOUS"]:
            raise ValueError("bitmask must be a C-contiguous int32 array")
        if bitmask.shape[1] != self.bitmask_words:
            raise ValueError(f"bitmask rows must have {self.bitmask_words} words")
        failed: dict[int, str] = {}
        live = []
        for state, row in states:
            if not 0 <= row < bitmask.shape[0]:
                raise ValueError(f"row {row} is outside the bitmask")
            if state.error is not None:
                failed[row] = state.error
            else:
                live.append((state, row))
        if live:
            try:
                with _engine_errors(GrammarError):
                    self._executor.unsafe_compute_mask_ptr(
                        [(s.matcher, row) for s, row in live],
                        bitmask.ctypes.data,
                        bitmask.shape[1] * 4,
                        bitmask.shape[0],
                    )
            except GrammarError:
                # The batch call failed as a whole: find the culprit(s) one by one.
                for state, row in live:
                    try:
                        state.fill_bitmask(bitmask[row])
                    except GrammarError as exc:
                        failed[row] = str(exc)
                live = [(s, r) for s, r in live if r not in failed]
        for state, row in live:
            message = state.check()
            if message is not None:
                failed[row] = message
        for row in failed:
            bitmask[row] = -1
        return failed


class GrammarState:
    """One sequence's position in its grammar. Made by :meth:`GrammarCompiler.compile`.

    ``error`` is None while healthy; once set it stays set (llguidance's
    matchers never leave an error state) and every call raises GrammarError.
    """

    def __init__(
        self, matcher: llguidance.LLMatcher, compiler: GrammarCompiler, field: str = ""
    ) -> None:
        self.matcher = matcher
        self.compiler = compiler
        self.field = field  # how errors name the request's constraint (``spec_name``)
        self.error: str | None = None
        self.num_accepted = 0

    def _call(self, fn: Callable[[], T]) -> T:
        if self.error is not None:
            raise GrammarError(self.error)
        try:
            with _engine_errors(GrammarError):
                return fn()
        except GrammarError as exc:
            self.error = str(exc)
            raise

    def check(self) -> str | None:
        """Record and return the matcher's error, if it has one."""
        if self.error is None:
            message = self._call(self.matcher.get_error)
            if message:
                self.error = short_message(message)
        return self.error

    def _raise_if_failed(self) -> None:
        message = self.check()
        if message is not None:
            raise GrammarError(message)

    def fill_bitmask(self, row: Bitmask) -> None:
        """Write the next-token mask into ``row`` (``int32[words]``, contiguous)."""
        if row.dtype != np.int32 or not row.flags["C_CONTIGUOUS"]:
            raise ValueError("a bitmask row must be a C-contiguous int32 array")
        if row.shape != (self.compiler.bitmask_words,):
            raise ValueError(f"a bitmask row must have {self.compiler.bitmask_words} words")
        self._call(lambda: self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes))
        self._raise_if_failed()

    def accept(self, token_ids: Sequence[int]) -> None:
        """Advance over tokens the engine sampled under this state's masks.

        EOS after the grammar is complete is accepted (and nothing else is).
        Raises GrammarError if a token is not allowed here.
        """
        for token_id in token_ids:
            if self.is_terminated:
                if token_id in self.compiler.eos_token_ids:
                    continue
                self.error = f"token {token_id} after the end of the grammar"
                raise GrammarError(self.error)
            if not 0 <= token_id < self.compiler.vocab_size:
                self.error = f"token {token_id} is outside the vocabulary"
                raise GrammarError(self.error)
            ok = self._call(functools.partial(self.matcher.consume_token, token_id))
            if not ok:
                self._raise_if_failed()
                self.error = f"token {token_id} was rejected by the grammar"
                raise GrammarError(self.error)
            self.num_accepted += 1

    def validate(self, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids``, in order, this state would accept (it consumes none):
        speculative drafts are cut there. 0 once the grammar is complete or failed (never
        raises: a failure is reported where the bitmask is computed)."""
        vocab = self.compiler.vocab_size
        tokens = list(itertools.takewhile(lambda t: 0 <= t < vocab, token_ids))
        try:
            if self.error is not None or self.is_terminated or not tokens:
                return 0
            return int(self._call(functools.partial(self.matcher.validate_tokens, tokens)))
        except GrammarError:
            return 0

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding, retries)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted} tokens")
        if num_tokens:
            self._call(lambda: self.matcher.rollback(num_tokens))
            self._raise_if_failed()
            self.num_accepted -= num_tokens

    @property
    def is_terminated(self) -> bool:
        """The output is complete: only EOS may follow."""
        return self.error is None and bool(self._call(self.matcher.is_stopped))

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete match (it could end here)."""
        return self.error is None and bool(self._call(self.matcher.is_accepting))

    def fork(self) -> GrammarState:
        """An independent copy at the same position (n > 1 siblings, preemption snapshots)."""
        state = GrammarState(self._call(self.matcher.deep_copy), self.compiler, self.field)
        state.num_accepted = self.num_accepted
        return state
