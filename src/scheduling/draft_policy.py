"""How many of the runner's drafts a request verifies next (speculative decoding).

Every draft costs a verified position whether or not it is accepted: once a CPU
step is compute-bound (a few streams), a rejected draft costs nearly what a
token does, and a step that verifies drafts cannot overlap the next one (async
scheduling). So each request sizes its drafts from its own recent acceptance,
after transformers' ``"heuristic"`` assistant-token schedule:

* every draft accepted: one more draft next time (up to ``num_speculative_tokens``);
* some accepted: as many (a lookup that hit, then diverged, says little about the
  next one); none accepted twice or more in a row: one fewer for each such miss
  (a single miss is a divergence, which the next lookup often recovers from: an
  edit keeps its full length through it);
* down to zero drafts: the request backs off, verifying no drafts for its next
  ``backoff`` samples (4 at first, doubling after each failed probe, at most 64),
  then probes again with one draft; a probe that is accepted ends the back-off.

A request on text the proposer predicts well (an edit, a copy) keeps its full
draft length; one whose drafts keep missing (free chat) soon verifies none, so
its steps cost what they would without speculation.

Pure Python; never imports torch or trio.
"""

from __future__ import annotations

FIRST_BACKOFF = 4  # samples without drafts after the first fall to zero
MAX_BACKOFF = 64  # the longest back-off, after repeated failed probes


class DraftLength:
    """One request's adaptive draft length: ``admit`` trims each new proposal, ``settle``
    learns from each verification."""

    __slots__ = ("k", "limit", "skip", "backoff", "misses")

    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = num_speculative_tokens
        self.limit = num_speculative_tokens  # drafts the next verification may take (>= 1)
        self.skip = 0  # samples left in the current back-off
        self.backoff = FIRST_BACKOFF  # the next back-off's length
        self.misses = 0  # verifications in a row that accepted no draft

    def admit(self, proposal: list[int]) -> list[int]:
        """The drafts to verify out of ``proposal``, the runner's proposal with the request's
        latest sample (``[]`` when it had none). Call once per sample: a back-off counts them."""
        if self.skip:
            self.skip -= 1
            return []
        return proposal[: self.limit]

    def settle(self, num_drafts: int, num_accepted: int) -> None:
        """Learn from a verification of ``num_drafts`` drafts (> 0), ``num_accepted`` accepted."""
        if num_accepted:
            self.misses = 0
            self.backoff = FIRST_BACKOFF
            if num_accepted == num_drafts:
                self.limit = min(self.k, self.limit + 1)
            return  # some accepted: the lookup hit, then diverged; the next one may not
        self.misses += 1
        if self.misses < 2:  # one miss is a divergence the next lookup often recovers from
            return
        self.limit -= 1
        if not self.limit:  # back off, then probe with one draft
            self.skip = self.backoff
            self.backoff = min(MAX_BACKOFF, 2 * self.backoff)
            self.limit = 1
