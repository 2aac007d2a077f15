"""Reading JSON that is still being generated: where a value ends, and what is safe to stream.

Tool-call parsers stream a call's ``arguments`` while the model is still
writing them. The rule that keeps streamed deltas consistent with the final
answer: only ever send a *prefix of the final raw text* of the value. While a
value is incomplete, everything written so far belongs to it; once
:func:`value_end` finds its end, the rest up to that end is sent and the call
is closed.

Pure functions; never imports trio or torch.
"""

from __future__ import annotations

import json
import re

_DECODER = json.JSONDecoder()
_WS = " \t\r\n"


def skip_ws(text: str, pos: int) -> int:
    """The first index at or after ``pos`` that is not JSON whitespace."""
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def value_end(text: str, start: int) -> int | None:
    """The end index of the complete JSON value starting at ``start``, or None if it is unfinished.

    A bare number at the very end of ``text`` counts as unfinished (more digits may follow).
    """
    try:
        _, end = _DECODER.raw_decode(text, start)
    except json.JSONDecodeError:
        return None
    if end == len(text) and text[start] not in '{["tfn':
        return None
    return end


def string_field(text: str, key: str) -> str | None:
    """The value of a complete ``"key": "..."`` string member found in ``text``, if any."""
    match = re.search(r'"' + re.escape(key) + r'"\s*:\s*"((?:[^"\\]|\\.)*)"', text)
    if match is None:
        return None
    try:
        value: str = json.loads('"' + match.group(1) + '"')
    except json.JSONDecodeError:
        return None
    return value


def member_value_start(text: str, keys: tuple[str, ...]) -> int | None:
    """Where the value of the first member named one of ``keys`` starts (its first character)."""
    for key in keys:
        match = re.search(r'"' + re.escape(key) + r'"\s*:\s*', text)
        if match is not None and match.end() < len(text):
            return match.end()
    return None


def split_top_level(text: str, open_char: str = "{") -> list[tuple[int, int | None]]:
    """``(start, end)`` of each top-level JSON object in ``text`` (end None: still open).

    Objects may be separated by anything outside them (commas, ``;``, whitespace).
    Strings are honoured, so braces inside them do not count.
    """
    close_char = {"{": "}", "[": "]"}[open_char]
    spans: list[tuple[int, int | None]] = []
    depth = 0
    in_string = escaped = False
    start = 0
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch == '"':
            in_string = depth > 0
        elif ch == open_char:
            if depth == 0:
                start = i
            depth += 1
        elif ch == close_char and depth > 0:
            depth -= 1
            if depth == 0:
                spans.append((start, i + 1))
    if depth > 0:
        spans.append((start, None))
    return spans
