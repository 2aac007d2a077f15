"""Stop strings: where one ends a completion's text, and how much text to hold back.

A stream never shows a stop string: text that could still become one is held
back (``partial_stop_length``) until it is known not to be, and the first stop
string a reader would meet ends the text (``find_stop_string``). Pure
functions of strings; never imports trio or torch.
"""

from __future__ import annotations

from collections.abc import Sequence


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
