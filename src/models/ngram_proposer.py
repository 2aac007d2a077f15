"""Prompt-lookup (n-gram) proposals for speculative decoding.

:class:`NgramProposer` proposes a request's next tokens from its own tokens:
the continuation of the latest earlier occurrence of its last ``n`` tokens,
for the largest ``n`` in ``[prompt_lookup_min, prompt_lookup_max]`` that
occurs. It needs no model, so it shines where the output repeats the input
(editing, summarising, code).

A proposer's contract, which a draft model or EAGLE heads would keep: after
a step's verification the runner asks it for each sampling request's drafts,
given the request's tokens so far (``propose``), and sends them to the
scheduler; it holds no per-request state here (a draft model would hold its
own KV cache per request and drop it on ``finished`` / ``preempted``).

NumPy only; never imports torch or trio.
"""

from __future__ import annotations

import numpy as np

from ..config import SpeculativeConfig


class NgramProposer:
    """Up to ``num_speculative_tokens`` drafts per request by prompt lookup."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, tokens: np.ndarray, limit: int | None = None) -> list[int]:
        """Drafts following ``tokens`` (a 1-D int array, prompt then output): the tokens
        after the latest earlier match of its longest matching suffix (``[]`` if none
        matches). At most ``limit`` (default ``num_speculative_tokens``) tokens.

        One vectorised pass finds the earlier positions holding the last token; each
        longer suffix then only filters those candidates, so a call costs O(len) plus
        O(candidates * max_n) (a few microseconds, where comparing every window cost
        tens: it runs for every sampling request at every step)."""
        k = self.k if limit is None else min(limit, self.k)
        length = len(tokens)
        if k <= 0 or length < self.min_n + 1:
            return []
        # ends: positions i < length - 1 where tokens[i - n + 1 : i + 1] equals the last n
        # tokens, for growing n; the drafts would start at i + 1.
        ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
        best = ends if self.min_n <= 1 else ends[:0]
        for n in range(2, min(self.max_n, length - 1) + 1):
            ends = ends[ends >= n - 1]
            ends = ends[tokens[ends - (n - 1)] == tokens[length - n]]
            if not len(ends):
                break
            if n >= self.min_n:
                best = ends
        if not len(best):
            return []
        start = int(best[-1]) + 1
        return [int(t) for t in tokens[start : start + k]]
