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

Whether drafts pay at all at the current batch size is decided from measured step
times (:class:`StepCost`, the default when neither ``disable_by_batch_size`` nor
``num_speculative_tokens_per_batch_size`` is set): the runner reports each step's
compute time, the scheduler keeps a running mean per number of sequences and of
computed rows (a row count not measured yet is the plain step's time plus the
measured cost of a draft row at that number of sequences), and a step verifies drafts
only when the tokens they are expected to add (each request's recent share of drafts
accepted, times its drafts) pay for the rows they add: ``(S + expected) / t(S, S + D)
> S / t(S, S)``; and only those of the requests likeliest to be accepted, the set with
the most tokens a second (:meth:`StepCost.acceptance_floor`: a few streams that copy
their prompt verify their drafts while the rest of a free-chat batch does not). On one
CPU core pair a step of 8 sequences is compute-bound (40 rows took 3.8x the time of 8),
so free chat at 8 streams (about half the drafts accepted) stops
drafting, while one stream of an edit (about 90% accepted; 5 rows cost about 2.7x one)
keeps it. A number of sequences never measured with drafts is tried (that is how it
gets measured), and every ``PROBE_EVERY`` decisions that leave requests out, the
likeliest of them verify anyway (a probe of a few rows, not the whole batch), to follow a
change in the workload.

Pure Python; never imports torch or trio.
"""

from __future__ import annotations

import math

FIRST_BACKOFF = 4  # samples without drafts after the first fall to zero
MAX_BACKOFF = 64  # the longest back-off, after repeated failed probes


class DraftLength:
    """One request's adaptive draft length: ``admit`` trims each new proposal, ``settle``
    learns from each verification."""

    __slots__ = ("k", "limit", "skip", "backoff", "misses", "drafted", "accepted")

    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = num_speculative_tokens
        self.limit = num_speculative_tokens  # drafts the next verification may take (>= 1)
        self.skip = 0  # samples left in the current back-off
        self.backoff = FIRST_BACKOFF  # the next back-off's length
        self.misses = 0  # verifications in a row that accepted no draft
        self.drafted = 0.0  # decayed counts of drafts verified and accepted (acceptance rate)
        self.accepted = 0.0

    def acceptance(self) -> float:
        """The request's recent share of drafts accepted (1 before any verification: a
        request's drafts are tried, which is how its rate gets measured)."""
        return self.accepted / self.drafted if self.drafted else 1.0

    def admit(self, proposal: list[int]) -> list[int]:
        """The drafts to verify out of ``proposal``, the runner's proposal with the request's
        latest sample (``[]`` when it had none). Call once per sample: a back-off counts them."""
        if self.skip:
            self.skip -= 1
            return []
        return proposal[: self.limit]

    def settle(self, num_drafts: int, num_accepted: int) -> None:
        """Learn from a verification of ``num_drafts`` drafts (> 0), ``num_accepted`` accepted."""
        self.drafted = 0.8 * self.drafted + num_drafts
        self.accepted = 0.8 * self.accepted + num_accepted
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


PROBE_EVERY = 64  # steps that leave a request's drafts out between two probes
_MEAN_WEIGHT = 0.2  # weight of a new measurement in a row count's running mean


class StepCost:
    """Measured step times by number of computed rows, and the drafting decision."""

    __slots__ = ("seconds", "declined")

    def __init__(self) -> None:
        # (sequences, rows) -> running mean of the step time: a row of a one-sequence step
        # costs other than one of an eight-sequence step (the activation path follows the
        # number of sequences)
        self.seconds: dict[tuple[int, int], float] = {}
        self.declined = 0  # decisions that left a request out since the last probe

    def observe(self, sequences: int, rows: int, seconds: float) -> None:
        """A decode step of ``sequences`` sequences that computed ``rows`` rows (theirs and
        their drafts) took ``seconds`` (the runner's own time)."""
        if sequences <= 0 or rows < sequences or seconds <= 0:
            return
        key = (sequences, rows)
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else old + _MEAN_WEIGHT * (seconds - old)

    def drafts_pay(self, sequences: int, drafts: int, expected_accepted: float) -> bool:
        """Whether ``sequences`` decode rows plus ``drafts`` drafts, of which
        ``expected_accepted`` are expected to be accepted, give more tokens a second than
        the ``sequences`` rows alone (:meth:`acceptance_floor` with one request's drafts)."""
        if drafts <= 0:
            return False
        return self.acceptance_floor(sequences, [(drafts, expected_accepted / drafts)]) < math.inf

    def acceptance_floor(self, sequences: int, drafts: list[tuple[int, float]]) -> float:
        """Which requests verify their drafts in a step of ``sequences`` sequences, of which
        those holding drafts hold ``drafts``: one ``(number of drafts, share expected
        accepted)`` each. Returns the lowest share that verifies (``inf``: none does).

        Each draft costs a row whether accepted or not, so the drafts worth verifying are
        the likeliest: requests are taken by falling share, and the floor is the share of
        the last one in the set with the most tokens a second, ``(S + expected) / t(S, S +
        D)``, if that beats the plain step's ``S / t(S, S)`` (a few requests whose drafts
        are usually accepted pay where a whole batch of free chat does not). 0 (every
        request verifies) while ``sequences`` has no plain or no drafted step measured yet.
        Once every ``PROBE_EVERY`` decisions that leave a request out, the floor is the
        share of the likeliest ones left out instead (a probe, cheap: not the whole batch)."""
        plain = self.seconds.get((sequences, sequences))
        if not drafts:
            return math.inf
        if plain is None:
            return 0.0
        best_rate, floor = sequences / plain, math.inf
        num_drafts, expected = 0, 0.0
        ranked = sorted(drafts, key=lambda d: -d[1])
        for i, (n, share) in enumerate(ranked):
            num_drafts += n
            expected += n * share
            if i + 1 < len(ranked) and ranked[i + 1][1] == share:
                continue  # equal shares go together: the floor cannot split them
            seconds = self._drafted_seconds(sequences, num_drafts, plain)
            if seconds is None:
                return 0.0
            if (sequences + expected) / seconds > best_rate:
                best_rate, floor = (sequences + expected) / seconds, share
        below = [share for _, share in ranked if share < floor]
        if not below:
            self.declined = 0
            return floor
        self.declined += 1
        if self.declined >= PROBE_EVERY:
            # measure the likeliest of the requests left out again now and then (their
            # shares are stale otherwise): one group, not the whole batch, whose drafts
            # would cost a row each
            self.declined = 0
            return below[0]
        return floor

    def _drafted_seconds(self, sequences: int, drafts: int, plain: float | None) -> float | None:
        """The time of a step of ``sequences`` sequences and ``drafts`` drafts: measured, or
        else the plain step's plus ``drafts`` times the mean cost of a draft row in the
        drafted steps of ``sequences`` measured so far (row counts in between are not each
        tried: at 8 sequences of up to 4 drafts there are 33 of them). None: none measured."""
        measured = self.seconds.get((sequences, sequences + drafts))
        if measured is not None or plain is None:
            return measured
        per_row = [
            (seconds - plain) / (rows - sequences)
            for (seqs, rows), seconds in self.seconds.items()
            if seqs == sequences and rows > sequences
        ]
        if not per_row:
            return None
        return plain + drafts * max(0.0, sum(per_row) / len(per_row))
