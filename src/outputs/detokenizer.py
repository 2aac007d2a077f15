"""Incremental detokenization: one completion's token ids become text as they arrive.

``make_detokenizer`` picks how: ``StreamDetokenizer`` (on tokenizers'
``DecodeStream``, in Rust) for a fast tokenizer, else ``IncrementalDetokenizer``
(the same algorithm in Python, any tokenizer). ``TokenTexts`` is the table of
single tokens' texts that logprobs show and the stream detokenizer takes whole
tokens from. The output processor (``output_processor``) drives them.

Plain synchronous classes. Never imports trio or torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Union

from tokenizers import Tokenizer, decoders
from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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
