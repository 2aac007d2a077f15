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
from numpy.lib.stride_tricks import sliding_window_view

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
        matches). At most ``limit`` (default ``num_speculative_tokens``) tokens. O(len *
        max_n) per call, vectorised."""
        k = self.k if limit is None else min(limit, self.k)
        length = len(tokens)
        if k <= 0 or length < self.min_n + 1:
            return []
        # Candidate starts i with tokens[i + n] existing: windows of tokens[:-1].
        head = tokens[:-1]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n :]
            windows = sliding_window_view(head, n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return [int(t) for t in tokens[start : start + k]]
        return []
