"""Incremental detokenization, stop strings, output kinds and n>1 merging.

The stage after the scheduler: ``OutputProcessor.process_outputs`` takes one
step's ``EngineCoreOutputs`` and turns them into ``RequestOutput``s, put into
each request's ``OutputSlot``. ``make_detokenizer`` picks how one
completion's token ids become text as they arrive: ``StreamDetokenizer`` (on
tokenizers' ``DecodeStream``, in Rust) for a fast tokenizer, else
``IncrementalDetokenizer`` (the same algorithm in Python, any tokenizer);
``find_stop_string`` and ``partial_stop_length`` are the stop-string rules.

Plain synchronous classes: the actor loop that feeds them lives elsewhere.
Never imports trio or torch (the slot type is only named for type checking).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from tokenizers import Tokenizer, decoders
from tokenizers.decoders import DecodeStream

from ..protocol.errors import ConstraintFailedError, EngineGenerateError
from ..protocol.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason, TokenLogprobs
from ..protocol.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from ..protocol.params import RequestOutputKind, SamplingParams
from .request_ids import child_id
from .stats import FinishedRequest, StepStats

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from .output_slot import OutputSlot

AnyTokenizer = Union["PreTrainedTokenizerBase", Tokenizer]
"""A transformers tokenizer, or a bare ``tokenizers.Tokenizer``."""

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5  # prompt tokens decoded with the output, for correct spacing
_MAX_UNSETTLED_TOKENS = 16  # then text is emitted as decoded, U+FFFD and all


def _make_decode(
    tokenizer: AnyTokenizer, *, skip_special_tokens: bool, spaces_between_special_tokens: bool
) -> Callable[[list[int]], str]:
    """``ids -> text``: the fast backend when there is one, else ``tokenizer.decode``.

    The fast backend is what ``tokenizer.decode`` calls too, minus
    ``clean_up_tokenization_spaces`` (which is not incremental) and the
    slow-tokenizer-only ``spaces_between_special_tokens``.
    """
    backend = _backend(tokenizer)
    if backend is not None:
        fast = backend

        def decode_fast(ids: list[int]) -> str:
            return fast.decode(ids, skip_special_tokens=skip_special_tokens)

        return decode_fast
    slow: Any = tokenizer

    def decode_slow(ids: list[int]) -> str:
        text: str = slow.decode(
            ids,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        return text

    return decode_slow


def _backend(tokenizer: AnyTokenizer) -> Tokenizer | None:
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


def _special_token_ids(tokenizer: AnyTokenizer) -> frozenset[int]:
    """The ids that ``decode(..., skip_special_tokens=True)`` drops."""
    backend = _backend(tokenizer)
    if backend is not None:
        added = backend.get_added_tokens_decoder()
        return frozenset(i for i, token in added.items() if token.special)
    return frozenset(getattr(tokenizer, "all_special_ids", ()))


class IncrementalDetokenizer:
    """Turns one completion's token ids into text as they arrive.

    ``update(ids)`` returns the text those tokens completed. A character split
    across tokens appears once, in the update that completes it: an update
    never returns a partial character (U+FFFD standing for bytes still to
    come). ``flush()``, at the end, returns what is still held back except a
    trailing incomplete character. For context-free decoders (byte-level BPE)
    ``"".join(updates) + flush()`` equals ``decode(all_ids)`` with one
    trailing U+FFFD removed, if it ends with one.

    A few prompt tokens are decoded along with the output so that decoders
    that depend on position (SentencePiece's leading space) space the first
    output token correctly. Each token costs one or two decodes of a short
    window (the tokens since the last complete character, and those before
    it up to the previous one): O(1) per token, never a re-decode of the
    whole output. Skipped special tokens never enter the window. After
    ``_MAX_UNSETTLED_TOKENS`` tokens in a row that do not end on a complete
    character (garbage bytes), the text is emitted as decoded, U+FFFD and all.
    """

    def __init__(
        self,
        tokenizer: AnyTokenizer,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._decode = _make_decode(
            tokenizer,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )
        # Skipped special tokens never enter the window: they decode to nothing.
        self._skipped = _special_token_ids(tokenizer) if skip_special_tokens else frozenset()
        # The window: tokens [0, _prefix_len) decode to _prefix_text, text already
        # emitted (or prompt context); the rest await a complete character.
        self._window = _context(self._decode, prompt_token_ids)
        self._prefix_len = len(self._window)
        self._prefix_text = self._decode(self._window) if self._window else ""

    @classmethod
    def _resume(
        cls,
        decode: Callable[[list[int]], str],
        skipped: frozenset[int],
        prefix: list[int],
        pending: list[int],
    ) -> IncrementalDetokenizer:
        """One that goes on where a ``StreamDetokenizer`` stopped: ``prefix`` is the
        text already emitted (its tokens), ``pending`` the tokens read since."""
        self = cls.__new__(cls)
        self._decode, self._skipped = decode, skipped
        self._window = [*prefix, *pending]
        self._prefix_len = len(prefix)
        self._prefix_text = decode(prefix) if prefix else ""
        return self

    def update(self, new_token_ids: Iterable[int]) -> str:
        """Append tokens; return the text they completed (possibly "")."""
        pieces: list[str] = []
        for token_id in new_token_ids:
            if token_id in self._skipped:
                continue
            self._window.append(token_id)
            text = self._decode(self._window)
            settled = len(text) > len(self._prefix_text) and not text.endswith(_REPLACEMENT)
            if settled or len(self._window) - self._prefix_len > _MAX_UNSETTLED_TOKENS:
                pieces.append(text[len(self._prefix_text) :])
                # The tokens just read become the next prefix.
                self._window = self._window[self._prefix_len :]
                self._prefix_len = len(self._window)
                self._prefix_text = self._decode(self._window)
        return "".join(pieces)

    def flush(self) -> str:
        """At the end: the text still held back, minus a trailing incomplete character.

        Tokens given to ``update`` afterwards are decoded without context.
        """
        text = self._decode(self._window)
        if text.endswith(_REPLACEMENT):
            text = text[:-1]
        delta = text[len(self._prefix_text) :]
        self._window, self._prefix_len, self._prefix_text = [], 0, ""
        return delta


def _context(decode: Callable[[list[int]], str], prompt_token_ids: Sequence[int]) -> list[int]:
    """The shortest prompt suffix of at least a few tokens that decodes cleanly, or []."""
    n = len(prompt_token_ids)
    for k in range(min(n, _CONTEXT_TOKENS), min(n, _CONTEXT_TOKENS + 20) + 1):
        suffix = list(prompt_token_ids[n - k :])
        if _REPLACEMENT not in decode(suffix):
            return suffix
    return []


class DetokenizationError(ValueError):
    """The tokenizer could not decode a completion's tokens (an odd token id, a
    decoder that panics on it): that request fails, the engine goes on."""


def _is_tokenizers_panic(exc: BaseException) -> bool:
    """A Rust panic inside tokenizers: pyo3's PanicException, a BaseException."""
    return type(exc).__name__ == "PanicException"


class TokenTexts:
    """One tokenizer's texts of single tokens, each decoded once.

    ``text(token_id)``: the token decoded alone (special tokens included), as
    logprobs show it. ``whole(token_id)``: that text where a token read right
    after a complete piece adds exactly it, so ``StreamDetokenizer`` takes it
    from here instead of decoding; else None. That holds for a context-free
    decoder (byte-level BPE: each token stands for fixed bytes) and a token of
    the vocabulary (not an added one) whose text is whole characters (not
    empty, no U+FFFD). Filled as tokens are met; share one per tokenizer.
    """

    def __init__(self, tokenizer: AnyTokenizer) -> None:
        backend = _backend(tokenizer)
        self.byte_level = backend is not None and _is_byte_level(backend)
        self._added = frozenset(backend.get_added_tokens_decoder()) if backend else frozenset()
        self._decode = _make_decode(
            tokenizer, skip_special_tokens=False, spaces_between_special_tokens=True
        )
        self._texts: dict[int, str] = {}
        self._whole: dict[int, str | None] = {}

    def text(self, token_id: int) -> str:
        """The token decoded alone; raises what the tokenizer raises."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._decode([token_id])
        return text

    def whole(self, token_id: int) -> str | None:
        whole = self._whole
        if token_id in whole:
            return whole[token_id]
        text = None
        if self.byte_level and token_id not in self._added:
            try:
                decoded = self.text(token_id)
            except BaseException as exc:
                if not (isinstance(exc, Exception) or _is_tokenizers_panic(exc)):
                    raise
                decoded = ""  # the decoding path reports it, for this request alone
            if decoded and _REPLACEMENT not in decoded:
                text = decoded
        whole[token_id] = text
        return text


def _is_byte_level(backend: Tokenizer) -> bool:
    """Whether the tokenizer's decoder is byte-level alone (no strip, no replace)."""
    return isinstance(backend.decoder, decoders.ByteLevel)


class StreamDetokenizer:
    """``IncrementalDetokenizer``'s contract, computed by tokenizers' ``DecodeStream``.

    Same text, same pieces: ``DecodeStream`` runs the same algorithm in Rust
    (a window of the tokens since the last complete character, decoded
    against the previous piece), with the same prompt context; this class
    adds what it lacks: skipped special tokens never enter the window, and
    ``flush`` returns the text still held back. It keeps the ids of the last
    piece and of the tokens read since, so where the stream would differ it
    hands over to ``IncrementalDetokenizer`` with the same state: after
    ``_MAX_UNSETTLED_TOKENS`` tokens that complete no character, or a decode
    that does not extend the text before it (tokenizers' "invalid prefix").
    Both are rare (invalid bytes).

    With ``token_texts`` (the tokenizer's ``TokenTexts``), a token read
    right after a complete piece whose text is in the table is taken from there
    (the common case for byte-level BPE: no decode at all); the stream is
    rebuilt from the last piece's ids before the next token it must decode.

    Needs a fast tokenizer (a ``tokenizers.Tokenizer`` backend); ValueError
    otherwise. ``update`` and ``flush`` raise ``DetokenizationError`` if the
    tokenizer fails on a token, a Rust panic included.
    """

    def __init__(
        self,
        tokenizer: AnyTokenizer,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        token_texts: TokenTexts | None = None,
    ) -> None:
        backend = _backend(tokenizer)
        if backend is None:
            raise ValueError("tokenizer: DecodeStream needs a fast (tokenizers) tokenizer")
        self._tokenizer = backend
        self._skip_special_tokens = skip_special_tokens
        self._decode = _make_decode(
            backend, skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=True
        )
        self._skipped = _special_token_ids(backend) if skip_special_tokens else frozenset()
        self._fallback: IncrementalDetokenizer | None = None
        try:
            self._prefix = _context(self._decode, prompt_token_ids)  # the last piece's ids
            self._stream = DecodeStream(self._prefix, skip_special_tokens)
        except BaseException as exc:
            raise self._error(exc) from None
        self._pending: list[int] = []  # read since the last piece, no complete character yet
        self._whole = token_texts if token_texts is not None and token_texts.byte_level else None
        self._stream_behind = False  # pieces were taken from the table since it last stepped

    def _error(self, exc: BaseException) -> BaseException:
        if isinstance(exc, Exception) or _is_tokenizers_panic(exc):
            return DetokenizationError(f"the tokenizer failed to decode: {exc}")
        return exc  # KeyboardInterrupt and the like pass through

    def update(self, new_token_ids: Iterable[int]) -> str:
        """Append tokens; return the text they completed (possibly "")."""
        fallback = self._fallback
        if fallback is not None:
            return self._guarded(functools.partial(fallback.update, new_token_ids))
        ids = new_token_ids if isinstance(new_token_ids, list) else list(new_token_ids)
        tokenizer, skipped, whole = self._tokenizer, self._skipped, self._whole
        if len(ids) == 1 and whole is not None and not self._pending:  # a decode step's
            token_id = ids[0]
            text = None if token_id in skipped else self._from_table(whole, token_id)
            if text is not None:
                return text
        pieces: list[str] = []
        for i, token_id in enumerate(ids):
            if token_id in skipped:
                continue
            if whole is not None and not self._pending:
                text = self._from_table(whole, token_id)
                if text is not None:
                    pieces.append(text)
                    continue
            try:
                if self._stream_behind:
                    self._stream = DecodeStream(self._prefix, self._skip_special_tokens)
                    self._stream_behind = False
                text = self._stream.step(tokenizer, token_id)
            except BaseException as exc:
                if type(exc) is not Exception or "prefix" not in str(exc).lower():
                    raise self._error(exc) from None
                text = None  # not an extension of the text before it: Python goes on
                stuck = True
            else:
                stuck = text is None and len(self._pending) >= _MAX_UNSETTLED_TOKENS
            if stuck:  # (or garbage bytes, emitted as decoded): from the same state
                self._fallback = IncrementalDetokenizer._resume(
                    self._decode, self._skipped, self._prefix, self._pending
                )
                pieces.append(self._guarded(functools.partial(self._fallback.update, ids[i:])))
                break
            self._pending.append(token_id)
            if text is not None:
                pieces.append(text)
                self._prefix, self._pending = self._pending, []
        return pieces[0] if len(pieces) == 1 else "".join(pieces)

    def _from_table(self, whole: TokenTexts, token_id: int) -> str | None:
        """``token_id``'s text from the table, read right after a complete piece: a piece
        of its own, as the stream would have found (the stream is then behind); None if
        the stream must decode it."""
        text = whole.whole(token_id)
        if text is not None:
            self._prefix = [token_id]
            self._stream_behind = True
        return text

    def _guarded(self, call: Callable[[], str]) -> str:
        """``call()``, its tokenizer failures (panics included) as DetokenizationError."""
        try:
            return call()
        except BaseException as exc:
            raise self._error(exc) from None

    def _held_back_text(self) -> str:
        """The text of the tokens read since the last piece, as decoded (unguarded)."""
        prefix_text = self._decode(self._prefix) if self._prefix else ""
        return self._decode([*self._prefix, *self._pending])[len(prefix_text) :]

    def flush(self) -> str:
        """At the end: the text still held back, minus a trailing incomplete character.

        Tokens given to ``update`` afterwards are decoded without context.
        """
        if self._fallback is not None:
            return self._guarded(self._fallback.flush)
        delta = self._guarded(self._held_back_text) if self._pending else ""
        if delta.endswith(_REPLACEMENT):
            delta = delta[:-1]
        self._prefix, self._pending = [], []
        self._stream = DecodeStream(None, self._skip_special_tokens)
        self._stream_behind = False
        return delta


Detokenizer = IncrementalDetokenizer | StreamDetokenizer


def make_detokenizer(
    tokenizer: AnyTokenizer,
    prompt_token_ids: Sequence[int] = (),
    *,
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
    token_texts: TokenTexts | None = None,
) -> Detokenizer:
    """A ``StreamDetokenizer`` for a fast tokenizer, else an ``IncrementalDetokenizer``.

    (``spaces_between_special_tokens`` matters to slow tokenizers only, as in
    ``IncrementalDetokenizer``; ``token_texts`` to fast ones.) Raises
    ``DetokenizationError`` if the tokenizer fails on the prompt's context tokens.
    """
    if _backend(tokenizer) is not None:
        return StreamDetokenizer(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens=skip_special_tokens,
            token_texts=token_texts,
        )
    return IncrementalDetokenizer(
        tokenizer,
        prompt_token_ids,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
    )


def find_stop_string(text: str, new_from: int, stops: Sequence[str]) -> tuple[str, int] | None:
    """The stop string in ``text`` that a reader would meet first, among matches ending after ``new_from``.

    Returns ``(stop, start)``, or None. "First" is the match that ends
    earliest (ties: the one that starts earliest), as if the text arrived one
    character at a time. Only the new text and the ``len(stop) - 1``
    characters before it are searched, so a stop spanning earlier text is found.
    """
    best: tuple[str, int] | None = None
    best_end = 0
    for stop in stops:
        start = text.find(stop, max(0, new_from - len(stop) + 1))
        if start < 0:
            continue
        end = start + len(stop)
        if best is None or end < best_end or (end == best_end and start < best[1]):
            best, best_end = (stop, start), end
    return best


def partial_stop_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string.

    Those characters may yet become a stop string, so a stream holds them back.
    """
    if not text:
        return 0
    last = text[-1]
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if stop[k - 1] == last and text.endswith(stop[:k]):
                longest = k
                break
    return longest


# ------------------------------------------------------------- the processor


@dataclass
class FinishedRequestStats:
    """One scheduler-level request (a child, for n>1) that ended, for the metrics."""

    request_id: str
    parent_id: str
    finish_reason: FinishReason
    arrival_time: float
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int

    @property
    def e2e_latency(self) -> float:
        return self.finished_time - self.arrival_time


@dataclass
class ProcessedStep:
    """What the engine must pass on after the detokenizer handled a step (or an abort).

    ``requests_to_stop`` / ``requests_to_abort``: scheduler-level ids
    (children for n>1) that are finished here but still live in the
    scheduler: finish them there as STOP (a stop string) / ABORT (an abort, a
    sibling's error). ``pooled``: the vectors of pooling requests that ended
    in this step. The rest is for the metrics.
    """

    requests_to_stop: list[str] = field(default_factory=list)
    requests_to_abort: list[str] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    pooled: dict[str, list[float]] = field(default_factory=dict)  # by scheduler-level id
    num_generation_tokens: int = 0
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)

    def step_stats(self) -> StepStats:
        """The front end's figures of this step, for the stats collector."""
        return StepStats(
            timestamp=time.monotonic(),
            num_generation_tokens=self.num_generation_tokens,
            time_to_first_token=self.time_to_first_token,
            inter_token_latency=self.inter_token_latency,
            finished=[
                FinishedRequest(
                    str(f.finish_reason),
                    f.e2e_latency,
                    f.num_prompt_tokens,
                    f.num_generation_tokens,
                )
                for f in self.finished
            ],
        )


@dataclass(eq=False)
class _Completion:
    """One completion's state: a child request for n>1, else the request itself."""

    request_id: str
    index: int
    parent: _Request
    detokenizer: Detokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    released: int = 0  # characters of text made visible to the consumer
    logprobs: SampleLogprobs | None = None  # everything so far; unused for DELTA
    cumulative_logprob: float | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # DELTA without stop strings: each piece of text goes straight to ``new_text``;
    # ``text`` stays "" (nothing is held back, and no output needs all of it).
    streams_text: bool = False
    # Besides, n = 1 and no logprobs of either kind: once its first token is out, each
    # step's output is just the new tokens and their text (OutputProcessor._stream_plain).
    plain: bool = False
    # This step's news, set by the processor and consumed when outputs are built.
    has_news: bool = False  # new tokens, or finished, this step
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: SampleLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def release(self) -> None:
        """Make the settled text visible: all of it once finished, else all but a partial stop.

        (Nothing to do where ``streams_text``: its text is visible as it comes.)"""
        params = self.parent.params
        visible = len(self.text)
        if not self.finished and params.stop and not params.include_stop_str_in_output:
            visible -= partial_stop_length(self.text, params.stop)
        visible = max(visible, self.released)
        self.new_text += self.text[self.released : visible]
        self.released = visible

    def clear_news(self) -> None:
        self.has_news, self.new_text, self.new_token_ids, self.new_logprobs = False, "", [], None

    def take_delta(self) -> CompletionOutput:
        """This step's news as a DELTA output; the news is cleared."""
        # Positional arguments: this runs per stream per step, and keywords cost double.
        finish_reason = self.finish_reason
        new_logprobs = self.new_logprobs
        if new_logprobs is None and self.parent.params.logprobs is not None:
            new_logprobs = []
        output = CompletionOutput(
            self.index,
            self.new_text,
            self.new_token_ids,
            self.cumulative_logprob,
            new_logprobs,
            None if finish_reason is None else str(finish_reason),
            self.stop_reason,
        )
        self.clear_news()
        return output

    def cumulative_output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text[: self.released],
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=None if self.finish_reason is None else str(self.finish_reason),
            stop_reason=self.stop_reason,
        )


@dataclass(eq=False)
class _Request:
    """A caller's request: one id, one slot, n completions.

    ``request_id`` is the id the engine runs it under; ``output_id`` the one
    its outputs carry (the caller's).
    """

    request_id: str
    output_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    slot: OutputSlot
    completions: list[_Completion] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        completions = self.completions
        if len(completions) == 1:  # the common case, per output: no generator
            return completions[0].finish_reason is not None
        return all(c.finish_reason is not None for c in completions)

    def metrics(self, finished_time: float | None) -> RequestMetrics:
        if len(self.completions) == 1:  # the common case, once per output: no lists
            (c,) = self.completions
            return RequestMetrics(
                self.arrival_time, None, c.first_token_time, c.last_token_time, finished_time
            )
        first = [c.first_token_time for c in self.completions if c.first_token_time is not None]
        last = [c.last_token_time for c in self.completions if c.last_token_time is not None]
        return RequestMetrics(
            arrival_time=self.arrival_time,
            first_token_time=min(first, default=None),
            last_token_time=max(last, default=None),
            finished_time=finished_time,
        )


class OutputProcessor:
    """Turns each step's ``EngineCoreOutputs`` into ``RequestOutput``s in the requests' slots.

    Per request (caller's id) it keeps n completions, each with its own
    ``IncrementalDetokenizer``, stop-string check and logprobs; for n>1 the
    scheduler runs n children (ids from ``add_request``) whose outputs merge
    under the caller's id. Outputs follow ``params.output_kind``:

    - ``DELTA``: only what is new since the last output, and only the
      completions that have news (new tokens or a finish);
    - ``CUMULATIVE``: all n completions, each with everything so far;
    - ``FINAL_ONLY``: one output, when every completion has finished.

    ``finished=True`` is on the last output only. While a request has stop
    strings (and ``include_stop_str_in_output`` is off), text that could be
    the start of a stop string is held back until it is known not to be one
    (or the request finishes), so no stop string ever reaches a stream.

    Never blocks: slots merge what their consumers have not taken yet.
    """

    def __init__(self, tokenizer: AnyTokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _Request] = {}
        self._completions: dict[str, _Completion] = {}  # by scheduler-level id
        # Single tokens' texts: for logprobs, and whole tokens for the detokenizers.
        self._token_texts = TokenTexts(tokenizer) if tokenizer is not None else None

    # ------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        arrival_time: float,
        *,
        slot: OutputSlot,
        child_ids: Sequence[str] | None = None,
        output_id: str | None = None,
    ) -> list[str]:
        """Register a request; return the ids the scheduler runs it under.

        ``child_ids`` (n of them, in index order) if given; else
        ``[request_id]`` for n == 1 and ``child_id(i, request_id)``
        for n > 1 (the renderer's naming). ``params`` are
        the caller's (n, stop strings, output kind). ``output_id`` is the id
        the outputs and errors carry (default ``request_id``): the caller's,
        when the engine runs the request under an id of its own. Raises
        ValueError for a live duplicate id, a slot of another output kind, or
        stop strings without a tokenizer.
        """
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        if slot.output_kind != params.output_kind:
            raise ValueError(
                f"output_kind: the slot merges as {slot.output_kind.name}, "
                f"the request asks for {params.output_kind.name}"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer")
        if child_ids is not None:
            ids = list(child_ids)
        elif params.n == 1:
            ids = [request_id]
        else:
            ids = [child_id(i, request_id) for i in range(params.n)]
        if len(ids) != params.n:
            raise ValueError(f"child_ids: expected {params.n} ids, got {len(ids)}")
        if clash := [i for i in ids if i in self._completions]:
            raise ValueError(f"request_id: {clash[0]!r} is already running")
        request = _Request(
            request_id,
            request_id if output_id is None else output_id,
            prompt,
            list(prompt_token_ids),
            params,
            arrival_time,
            slot,
        )
        for index, completion_id in enumerate(ids):
            detokenizer = None
            if self.tokenizer is not None and params.detokenize:
                detokenizer = make_detokenizer(
                    self.tokenizer,
                    request.prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                    token_texts=self._token_texts,
                )
            completion = _Completion(completion_id, index, request, detokenizer)
            completion.streams_text = (
                params.output_kind == RequestOutputKind.DELTA and not params.stop
            )
            completion.plain = (
                completion.streams_text
                and params.n == 1
                and params.logprobs is None
                and params.prompt_logprobs is None
            )
            if params.logprobs is not None:
                completion.cumulative_logprob = 0.0
                if params.output_kind != RequestOutputKind.DELTA:
                    completion.logprobs = []
            request.completions.append(completion)
            self._completions[completion_id] = completion
        self._requests[request_id] = request
        return ids

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    # --------------------------------------------------------------- steps

    def process_outputs(self, outputs: EngineCoreOutputs) -> ProcessedStep:
        """Handle one step: detokenize, check stop strings, put outputs into slots.

        Outputs for unknown or already finished ids (e.g. a stop string fired
        before the scheduler's abort took effect) are ignored. A completion
        with ``FinishReason.ERROR``, or whose tokens the tokenizer cannot
        decode (``DetokenizationError``), fails its whole request: the slot
        gets ``EngineGenerateError`` and the siblings are aborted.
        """
        now = outputs.timestamp
        step = ProcessedStep()
        touched: dict[str, _Request] = {}
        completions = self._completions
        for core in outputs.outputs:
            if core.pooled is not None:  # read by encode() when the request ends
                step.pooled[core.request_id] = core.pooled
            completion = completions.get(core.request_id)
            if completion is None or completion.finish_reason is not None:
                continue
            request = completion.parent
            if core.finish_reason == FinishReason.ERROR:
                message = core.error or "the request failed"
                error = (
                    EngineGenerateError(request.output_id, message)
                    if core.error_field is None
                    else ConstraintFailedError(request.output_id, core.error_field, message)
                )
                self._fail(request, error, now, step, failed_id=core.request_id)
                touched.pop(request.request_id, None)
                continue
            try:
                if completion.plain and self._stream_plain(completion, core, now, step):
                    continue
                self._update(completion, core, now, step)
            except DetokenizationError as exc:
                self._fail(request, EngineGenerateError(request.output_id, str(exc)), now, step)
                touched.pop(request.request_id, None)
                continue
            if len(request.completions) == 1:
                self._emit(request, now, step)
            else:  # once all of this step's news of its completions is in
                touched[request.request_id] = request
        for request in touched.values():
            self._emit(request, now, step)
        return step

    def _stream_plain(
        self, completion: _Completion, core: EngineCoreOutput, now: float, step: ProcessedStep
    ) -> bool:
        """A plain completion's ordinary step (new tokens, after its first; no finish, no
        logprobs): record it and put its output, what ``_update`` and ``_emit`` would, built
        directly. Returns False, having done nothing, for any other step.

        Most of a busy engine's outputs are these, once per stream per step; the test
        ``test_plain_streams_match_the_general_path`` holds the two paths to one result.
        """
        new_ids = core.new_token_ids
        last = completion.last_token_time
        if (
            last is None
            or not new_ids
            or core.finish_reason is not None
            or core.new_logprobs
            or core.new_prompt_logprobs is not None
        ):
            return False
        detokenizer = completion.detokenizer
        text = "" if detokenizer is None else detokenizer.update(new_ids)
        step.inter_token_latency.append(now - last)
        step.num_generation_tokens += len(new_ids)
        completion.last_token_time = now
        completion.token_ids += new_ids
        request = completion.parent
        request.slot.put(
            RequestOutput(  # positional: see _Completion.take_delta
                request.output_id,
                request.prompt,
                request.prompt_token_ids,
                None,
                [CompletionOutput(0, text, list(new_ids), None, None, None, None)],
                False,
                completion.num_cached_tokens,
                RequestMetrics(request.arrival_time, None, completion.first_token_time, now, None),
            )
        )
        return True

    def _update(
        self, completion: _Completion, core: EngineCoreOutput, now: float, step: ProcessedStep
    ) -> None:
        request = completion.parent
        params = request.params
        new_ids = core.new_token_ids
        if completion.num_cached_tokens is None:
            completion.num_cached_tokens = core.num_cached_tokens
        if new_ids:
            last = completion.last_token_time
            if last is None:
                completion.first_token_time = now
                step.time_to_first_token.append(now - request.arrival_time)
            else:
                step.inter_token_latency.append(now - last)
            completion.last_token_time = now
            step.num_generation_tokens += len(new_ids)
            completion.token_ids += new_ids
            completion.new_token_ids += new_ids
            completion.has_news = True
        if core.new_logprobs:
            self._add_logprobs(completion, core.new_logprobs)
        if core.new_prompt_logprobs is not None and completion.index == 0:
            self._add_prompt_logprobs(request, core.new_prompt_logprobs)
        finish_reason, stop_reason = core.finish_reason, core.stop_reason

        detokenizer = completion.detokenizer
        if detokenizer is not None:
            text_ids = new_ids
            if (
                finish_reason == FinishReason.STOP
                and new_ids
                and not params.include_stop_str_in_output
            ):
                text_ids = new_ids[:-1]  # the EOS / stop token's own text is not output
            piece = detokenizer.update(text_ids) if text_ids else ""
            if finish_reason is not None:
                piece += detokenizer.flush()
            if completion.streams_text:
                completion.new_text += piece
            else:
                searched_from = len(completion.text)
                completion.text += piece
                # As for stop token ids, min_tokens tokens come before the one that may stop.
                if params.stop and len(completion.token_ids) > params.min_tokens:
                    match = find_stop_string(completion.text, searched_from, params.stop)
                    if match is not None:
                        stop, start = match
                        end = start + len(stop) if params.include_stop_str_in_output else start
                        completion.text = completion.text[:end]
                        if finish_reason is None:
                            step.requests_to_stop.append(completion.request_id)
                        finish_reason, stop_reason = FinishReason.STOP, stop
        if finish_reason is not None:
            self._finish(completion, finish_reason, stop_reason, now, step)
        if not completion.streams_text:
            completion.release()

    def _finish(
        self,
        completion: _Completion,
        reason: FinishReason,
        stop_reason: int | str | None,
        now: float,
        step: ProcessedStep,
    ) -> None:
        completion.finish_reason, completion.stop_reason = reason, stop_reason
        completion.has_news = True
        request = completion.parent
        step.finished.append(
            FinishedRequestStats(
                request_id=completion.request_id,
                parent_id=request.request_id,
                finish_reason=reason,
                arrival_time=request.arrival_time,
                first_token_time=completion.first_token_time,
                last_token_time=completion.last_token_time,
                finished_time=now,
                num_prompt_tokens=len(request.prompt_token_ids),
                num_generation_tokens=len(completion.token_ids),
                num_cached_tokens=completion.num_cached_tokens or 0,
            )
        )

    def _emit(self, request: _Request, now: float, step: ProcessedStep) -> None:
        """Put this step's output for ``request`` into its slot; forget it once finished."""
        every = request.completions
        if len(every) == 1:  # the common case: no generators
            (only,) = every
            finished = only.finish_reason is not None
            news = every if only.has_news else []
        else:
            finished = request.finished
            news = [c for c in every if c.has_news]
        kind = request.params.output_kind
        completions: list[CompletionOutput] = []
        prompt_logprobs: PromptLogprobs | None = None
        # map(), not a comprehension: no function frame per call on Python 3.11.
        if kind == RequestOutputKind.DELTA:
            completions = list(map(_Completion.take_delta, news))
            if news and not request.prompt_logprobs_sent:
                prompt_logprobs, request.prompt_logprobs_sent = request.prompt_logprobs, True
        else:
            if news and (kind == RequestOutputKind.CUMULATIVE or finished):
                completions = list(map(_Completion.cumulative_output, every))
                prompt_logprobs = request.prompt_logprobs
            for c in news:
                c.clear_news()
        if completions:
            request.slot.put(
                RequestOutput(  # positional: see _Completion.take_delta
                    request.output_id,
                    request.prompt,
                    request.prompt_token_ids,
                    None if prompt_logprobs is None else list(prompt_logprobs),
                    completions,
                    finished,
                    request.completions[0].num_cached_tokens,
                    request.metrics(now if finished else None),
                )
            )
        if finished:
            self._forget(request)

    def _forget(self, request: _Request) -> None:
        self._requests.pop(request.request_id, None)
        for c in request.completions:
            self._completions.pop(c.request_id, None)

    # ------------------------------------------------------------ logprobs

    def _token_text(self, token_id: int) -> str | None:
        return None if self._token_texts is None else self._token_texts.text(token_id)

    def _logprob_dict(self, entry: TokenLogprobs, decode: bool) -> dict[int, Logprob]:
        return {
            token_id: Logprob(lp, rank, self._token_text(token_id) if decode else None)
            for token_id, lp, rank in zip(entry.token_ids, entry.logprobs, entry.ranks)
        }

    def _add_logprobs(self, completion: _Completion, entries: list[TokenLogprobs] | None) -> None:
        if completion.cumulative_logprob is None or not entries:
            return
        decode = completion.parent.params.detokenize
        new = [self._logprob_dict(e, decode) for e in entries]
        completion.cumulative_logprob += sum(e.logprobs[0] for e in entries if e.logprobs)
        if completion.new_logprobs is None:
            completion.new_logprobs = []
        completion.new_logprobs.extend(new)
        if completion.logprobs is not None:
            completion.logprobs.extend(new)

    def _add_prompt_logprobs(self, request: _Request, entries: list[TokenLogprobs | None]) -> None:
        if request.params.prompt_logprobs is None:
            return
        decode = request.params.detokenize
        if request.prompt_logprobs is None:
            request.prompt_logprobs = []
        request.prompt_logprobs.extend(
            None if e is None else self._logprob_dict(e, decode) for e in entries
        )

    # ------------------------------------------------------ aborts, errors

    def abort_requests(
        self, request_ids: Iterable[str], *, now: float | None = None
    ) -> ProcessedStep:
        """Finish requests (caller's ids) with reason "abort" and forget them.

        Each slot gets a last output (``finished=True``, finish_reason
        "abort", text held back for stop strings released; a character still
        incomplete is dropped). Unknown or finished ids are ignored.
        ``requests_to_abort`` lists the children still live in the scheduler.
        """
        now = time.monotonic() if now is None else now
        step = ProcessedStep()
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                continue
            for c in request.completions:
                if c.finished:
                    continue
                step.requests_to_abort.append(c.request_id)
                self._finish(c, FinishReason.ABORT, None, now, step)
                c.release()
            self._emit(request, now, step)
        return step

    def fail_request(
        self, request_id: str, error: BaseException, *, now: float | None = None
    ) -> ProcessedStep:
        """Fail a request (caller's id): its slot gets ``error``, and it is forgotten.

        Unknown or finished ids are ignored. ``requests_to_abort`` lists the
        children still live in the scheduler.
        """
        now = time.monotonic() if now is None else now
        step = ProcessedStep()
        request = self._requests.get(request_id)
        if request is not None:
            self._fail(request, error, now, step)
        return step

    def fail_all(self, error: BaseException, *, now: float | None = None) -> ProcessedStep:
        """Fail every open request with ``error`` (e.g. the engine died) and forget them all."""
        now = time.monotonic() if now is None else now
        step = ProcessedStep()
        for request in list(self._requests.values()):
            self._fail(request, error, now, step)
        return step

    def _fail(
        self,
        request: _Request,
        error: BaseException,
        now: float,
        step: ProcessedStep,
        *,
        failed_id: str | None = None,
    ) -> None:
        request.slot.put_error(error)
        for c in request.completions:
            if c.finished:
                continue
            if c.request_id != failed_id:
                step.requests_to_abort.append(c.request_id)
            self._finish(c, FinishReason.ERROR, None, now, step)
        self._forget(request)
