"""The stop-string rules: the match a reader meets first, and the text to hold back."""

from __future__ import annotations

from legato.outputs.stop_strings import find_stop_string, partial_stop_length


def test_find_stop_string_prefers_the_match_that_ends_first() -> None:
    assert find_stop_string("abcd", 0, ["abcd", "bc"]) == ("bc", 1)
    assert find_stop_string("xabc", 0, ["bc", "abc"]) == ("abc", 1)  # same end: earliest start
    assert find_stop_string("hello world", 6, ["o w"]) == ("o w", 4)  # starts in old text
    assert find_stop_string("hello world", 7, ["o w"]) is None  # ended before the new text
    assert find_stop_string("hello", 0, ["x"]) is None


def test_partial_stop_length() -> None:
    assert partial_stop_length("Hello", ["o wor"]) == 1
    assert partial_stop_length("Hello w", ["o wor", "xyz"]) == 3
    assert partial_stop_length("Hello", ["lo"]) == 0  # a whole stop is not a partial one
    assert partial_stop_length("", ["a"]) == 0
    assert partial_stop_length("aaa", ["aaab"]) == 3
