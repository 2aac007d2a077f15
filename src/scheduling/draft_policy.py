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
compute time, the scheduler keeps the lower median of the latest few per number of
sequences and of computed rows (a row count not measured yet is interpolated between
those measured; a median, not a mean: another process's burst that stretches one plain
step must not make drafts look cheap for the steps after it),
and a step verifies the drafts of the requests likeliest to be accepted first (by each
request's recent share of drafts accepted; before its first verification, the engine's
recent share over all requests, :meth:`StepCost.prior`), as many as give the most tokens a second,
``(S + expected) / (t(S, S + D) + overlap)``, none unless that beats ``S / t(S, S)``
(:meth:`StepCost.allowances`; ``overlap``: the worker's idle time a step with drafts
costs under async scheduling, which plans no step ahead of it, measured by the engine
core). A step's time is not linear in its rows: a CPU matmul
computes rows in tiles (of 4 in the fp32 tile, 3 in the int8 one), so a few drafts can
fill the last tile nearly free while one more opens a new one. So a few streams that
copy their prompt verify their drafts while the rest of a free-chat batch does not, and
one stream of an edit (about 90% accepted) keeps all of its. A number of sequences never
measured is judged by the steps measured at other numbers (two or more sequences: the
batched path), and tried only while there are none (that is how it gets measured; one
sequence's verification is a path of its own), and every ``PROBE_EVERY`` decisions that
leave requests out, the next of them verifies anyway (a probe of a few rows, not the
whole batch), to follow a change in the workload.

Pure Python; never imports torch or trio.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Callable

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

    def acceptance(self, prior: float = 1.0) -> float:
        """The request's recent share of drafts accepted; ``prior`` before any verification
        (the engine's recent share, :meth:`StepCost.prior`)."""
        return self.accepted / self.drafted if self.drafted else prior

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
MAX_PROBE_EVERY = 512  # the longest such interval, where failed probes back off
PROBE_DECISIONS = 2  # a probe holds this many decisions: one more than steps in flight
_RECENT = 9  # measurements per row count the step time is the lower median of
_PRIOR_DECAY = 0.9  # weight of the past in the engine's share of drafts accepted, a verification


class StepCost:
    """Measured step times by number of computed rows, and the drafting decision."""

    __slots__ = (
        "seconds", "recent", "declined", "probing", "drafted", "accepted", "overlap", "gaps",
        "probe_every", "probes_back_off",
    )  # fmt: skip

    def __init__(self, probes_back_off: bool = False) -> None:
        """``probes_back_off``: each probe after which drafts still do not pay doubles the
        decisions until the next one (up to ``MAX_PROBE_EVERY``), for a proposer whose
        proposals cost (a draft model: a probe's proposal, the draft's catch-up over the
        tokens it skipped and the verification cost about 40 ms beside 6 ms steps of the
        default model); a decision that verifies every draft held resets it."""
        # (sequences, rows) -> the step time, the lower median of the latest measurements:
        # a row of a one-sequence step costs other than one of an eight-sequence step (the
        # activation path follows the number of sequences)
        self.seconds: dict[tuple[int, int], float] = {}
        self.recent: dict[tuple[int, int], collections.deque[float]] = {}
        self.declined = 0  # decisions that left a request out since the last probe
        self.probing = 0  # decisions the current probe has held
        self.drafted = 0.0  # decayed counts of drafts verified and accepted, all requests
        self.accepted = 0.0
        # What a drafted step costs beyond its compute under async scheduling: the worker's
        # idle time while the engine applies it and plans the next (observe_overlap); 0
        # until measured, and never measured without async scheduling (every step pays it).
        self.overlap = 0.0
        self.gaps: collections.deque[float] = collections.deque(maxlen=_RECENT)
        self.probe_every = PROBE_EVERY
        self.probes_back_off = probes_back_off

    def observe_overlap(self, seconds: float) -> None:
        """A step planned with no step ahead (it had drafts to verify) left the worker idle
        ``seconds`` between finishing it and receiving the next: the overlap that async
        scheduling gives a plain step and a drafted step gives up. Kept as the lower median
        of the latest few, as step times are (:meth:`observe`)."""
        if seconds < 0:
            return
        self.gaps.append(seconds)
        self.overlap = statistics.median_low(self.gaps)

    def settle(self, num_drafts: int, num_accepted: int) -> None:
        """Learn from any request's verification of ``num_drafts`` drafts (> 0),
        ``num_accepted`` accepted: the engine's recent share (:meth:`prior`)."""
        self.drafted = _PRIOR_DECAY * self.drafted + num_drafts
        self.accepted = _PRIOR_DECAY * self.accepted + num_accepted

    def prior(self) -> float:
        """The share of its drafts a request never verified yet is expected to have accepted:
        the engine's recent share over every request's verifications (1 before the first).
        Not 1 for everyone: free chat holds a few drafts in most requests, most of them
        missed, and a fresh request's first proposal verified in full at 8 streams cost
        more rows than its accepted drafts saved (benchmarks/spec_decode.py, chat x8)."""
        return self.accepted / self.drafted if self.drafted else 1.0

    def observe(self, sequences: int, rows: int, seconds: float) -> None:
        """A decode step of ``sequences`` sequences that computed ``rows`` rows (theirs and
        their drafts) took ``seconds`` (the runner's own time). The row count's time becomes
        the lower median of its latest ``_RECENT`` measurements: it follows a lasting change
        (longer contexts) within a few steps, and ignores a burst of the machine's other
        work, which only ever adds time (a running mean took a fifth of every such spike:
        one 110 ms plain step among 23 ms ones let a chat request at 41% accepted verify
        four drafts at 8 streams, where about 80% pays for them)."""
        if sequences <= 0 or rows < sequences or seconds <= 0:
            return
        key = (sequences, rows)
        recent = self.recent.get(key)
        if recent is None:
            recent = self.recent[key] = collections.deque(maxlen=_RECENT)
        recent.append(seconds)
        self.seconds[key] = statistics.median_low(recent)

    def drafts_pay(self, sequences: int, drafts: int, expected_accepted: float) -> bool:
        """Whether all of ``drafts`` drafts, of which ``expected_accepted`` are expected to
        be accepted, verified beside ``sequences`` decode rows give the most tokens a second
        (:meth:`allowances` for one request's drafts)."""
        if drafts <= 0:
            return False
        allowed = self.allowances(sequences, [(drafts, expected_accepted / drafts)])
        return allowed is None or allowed[0] == drafts

    def allowances(self, sequences: int, drafts: list[tuple[int, float]]) -> list[int] | None:
        """How many of their drafts the requests holding ``drafts`` (one ``(number of
        drafts, share expected accepted)`` each) verify in a step of ``sequences``
        sequences: one count per entry. None: all of them, while ``sequences`` has no plain
        or no drafted step measured yet (trying is how it gets measured).

        Each draft costs a row whether accepted or not, and a step's time is not linear in
        its rows (a CPU matmul computes rows in tiles: at 8 sequences a few drafts fill the
        last tile nearly free, one more opens a new one). So the drafts are ranked by their
        request's share, and the step verifies the best ``D`` of them, for the ``D`` (0
        included) with the most tokens a second, ``(S + expected) / t(S, S + D)``, with
        ``t`` measured where it was, interpolated where not, plus the overlap a drafted step
        gives up under async scheduling (:meth:`observe_overlap`). Once every ``probe_every``
        decisions that leave a request's drafts out, the next request's drafts verify too
        (a probe: its share went stale while it was left out), for ``PROBE_DECISIONS``
        decisions in a row: with async scheduling the step after a decision is often
        planned before it, and a probe granted for one decision was taken back unused."""
        counts = [0] * len(drafts)
        total = sum(n for n, _ in drafts)
        if not total:
            return counts
        plain = self._plain_seconds(sequences)
        if plain is None:
            return None
        drafted_seconds = self._drafted_seconds(sequences, plain)
        if drafted_seconds is None:
            return None
        ranked = sorted(range(len(drafts)), key=lambda i: -drafts[i][1])
        best_rate, best, expected, num = sequences / plain, 0, 0.0, 0
        for i in ranked:
            n, share = drafts[i]
            for _ in range(n):
                num += 1
                expected += share
                # plus the step ahead it gives up (async scheduling)
                seconds = drafted_seconds(num) + self.overlap
                if (sequences + expected) / seconds > best_rate:
                    best_rate, best = (sequences + expected) / seconds, num
        if best == total:
            self.declined = self.probing = 0
            self.probe_every = PROBE_EVERY
        else:
            self.declined += 1
            if self.declined >= self.probe_every:
                self.declined -= 1  # held for PROBE_DECISIONS decisions in a row
                self.probing += 1
                if self.probing >= PROBE_DECISIONS:
                    self.declined = self.probing = 0
                    if self.probes_back_off:
                        self.probe_every = min(MAX_PROBE_EVERY, 2 * self.probe_every)
                reach = 0
                for i in ranked:  # up to the end of the first request not fully in
                    reach += drafts[i][0]
                    if reach > best:
                        best = reach
                        break
        for i in ranked:
            counts[i] = min(drafts[i][0], best)
            best -= counts[i]
        return counts

    def _plain_seconds(self, sequences: int) -> float | None:
        """The time of a plain step of ``sequences`` sequences: measured; else, for two or
        more, the line through the plain steps of the two nearest numbers (two or more)
        measured, or the one measured times ``sequences`` over its number. None: none
        measured. A batch whose count changed (a request finished) is so judged at once,
        where an unmeasured count verified every request's drafts, step after step while
        it stayed unmeasured (each drafted step measured its drafted rows, never its plain
        ones: chat at 8 streams verified every proposal at 5, 4, 3 sequences)."""
        measured = self.seconds.get((sequences, sequences))
        if measured is not None or sequences < 2:
            return measured
        plains = sorted(
            ((abs(s - sequences), s, t) for (s, r), t in self.seconds.items() if s == r > 1)
        )
        if not plains:
            return None
        (_, s1, t1), *rest = plains
        if not rest:
            return t1 * sequences / s1
        _, s2, t2 = rest[0]
        line = t1 + (t2 - t1) * (sequences - s1) / (s2 - s1)
        return line if line > 0 else t1 * sequences / s1

    def _drafted_seconds(self, sequences: int, plain: float) -> Callable[[int], float] | None:
        """The time of a step of ``sequences`` sequences, as a function of its number of
        drafts: measured; else interpolated between the nearest row counts measured below
        and above; past the largest, that one's plus the mean cost of a draft row in the
        drafted steps of ``sequences`` measured so far. With none of ``sequences`` measured
        (two or more), the plain step plus the mean cost of a draft row measured beside
        another number of sequences, two or more (:meth:`_draft_row_elsewhere`). None: none
        measured. The measurements are read once here, not once for each number of drafts
        a decision weighs."""
        known = sorted((r, t) for (s, r), t in self.seconds.items() if s == sequences and r > s)
        if not known:
            elsewhere = self._draft_row_elsewhere() if sequences > 1 else None
            if elsewhere is None:
                return None
            return lambda drafts: plain + drafts * elsewhere
        per_row = max(0.0, sum((t - plain) / (r - sequences) for r, t in known) / len(known))

        def seconds(drafts: int) -> float:
            rows = sequences + drafts
            low_rows, low = sequences, plain
            for r, t in known:
                if r == rows:  # measured
                    return t
                if r > rows:  # the nearest above: interpolate
                    return low + (t - low) * (rows - low_rows) / (r - low_rows)
                low_rows, low = r, t
            return low + (rows - low_rows) * per_row

        return seconds

    def _draft_row_elsewhere(self) -> float | None:
        """The mean cost of a draft row over the drafted steps measured beside two or more
        sequences (each against its own plain step), or None. Several sequences' steps run
        the batched path, whose time grows with its rows about alike whatever their number
        of sequences; one sequence's verification is a path of its own."""
        costs = [
            (t - plain) / (r - s)
            for (s, r), t in self.seconds.items()
            if s > 1 and r > s and (plain := self.seconds.get((s, s))) is not None
        ]
        return max(0.0, sum(costs) / len(costs)) if costs else None
