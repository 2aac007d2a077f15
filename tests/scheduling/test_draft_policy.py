"""A request's adaptive draft length (speculative decoding): it shrinks while drafts miss,
backs off to none, probes again, and grows back while they are accepted."""

from __future__ import annotations

from typing import Any

from legato.scheduling.draft_policy import (
    FIRST_BACKOFF,
    MAX_BACKOFF,
    MAX_PROBE_EVERY,
    PROBE_DECISIONS,
    PROBE_EVERY,
    DraftLength,
    StepCost,
)

PROPOSAL = [11, 12, 13, 14]


def verify(policy: DraftLength, accepted: int | None = None) -> int:
    """One sample with a full proposal; verify what the policy admits (``accepted`` of them,
    default all). Returns how many drafts were admitted."""
    drafts = policy.admit(PROPOSAL)
    if drafts:
        policy.settle(len(drafts), len(drafts) if accepted is None else min(accepted, len(drafts)))
    return len(drafts)


def test_full_acceptance_keeps_every_draft() -> None:
    policy = DraftLength(4)
    assert [verify(policy) for _ in range(5)] == [4, 4, 4, 4, 4]


def test_missing_drafts_back_off_to_none_then_probe_with_one() -> None:
    policy = DraftLength(4)
    # The first miss keeps the length; each further miss in a row takes one off.
    assert [verify(policy, 0) for _ in range(5)] == [4, 4, 3, 2, 1]
    # Down to zero: the next FIRST_BACKOFF samples verify nothing, then one draft probes.
    assert [verify(policy, 0) for _ in range(FIRST_BACKOFF + 1)] == [0] * FIRST_BACKOFF + [1]
    # That probe missed too: the back-off doubles, and keeps doubling up to MAX_BACKOFF.
    backoff = 2 * FIRST_BACKOFF
    while backoff <= MAX_BACKOFF:
        assert [verify(policy, 0) for _ in range(backoff + 1)] == [0] * backoff + [1]
        backoff *= 2
    assert [verify(policy, 0) for _ in range(MAX_BACKOFF + 1)] == [0] * MAX_BACKOFF + [1]


def test_an_accepted_probe_grows_back_and_resets_the_backoff() -> None:
    policy = DraftLength(4)
    for _ in range(5 + FIRST_BACKOFF + 1 + 2 * FIRST_BACKOFF):  # two back-offs deep
        verify(policy, 0)
    assert [verify(policy) for _ in range(5)] == [1, 2, 3, 4, 4]  # probe accepted: grows
    assert [verify(policy, 0) for _ in range(5)] == [4, 4, 3, 2, 1]
    # The back-off starts over at FIRST_BACKOFF, not where it had doubled to.
    assert [verify(policy, 0) for _ in range(FIRST_BACKOFF + 1)] == [0] * FIRST_BACKOFF + [1]


def test_partial_acceptance_keeps_the_length() -> None:
    policy = DraftLength(4)
    assert [verify(policy, 0) for _ in range(4)] == [4, 4, 3, 2]  # misses in a row shrink it
    assert [verify(policy, 1) for _ in range(3)] == [1, 2, 2]  # 1 of 1 grows, 1 of 2 keeps
    assert [verify(policy, 0), verify(policy, 1), verify(policy, 0)] == [2, 2, 2]  # not in a row
    assert policy.admit([]) == []  # no proposal: nothing to verify, nothing learned
    assert policy.limit == 2


# Step times measured on this project's CPU (AMD EPYC Zen 4, 2 threads) with the default
# model's decode stack, per number of computed rows (in-process forwards of the
# runner: one sequence with 0/1/2/4 drafts; eight sequences with 0/1/2/4 drafts each), and
# the acceptance rates benchmarks/spec_decode.py measured (edit at 1 stream, chat at 8).
MEASURED_SECONDS = {
    1: 0.00747, 2: 0.00973, 3: 0.01248, 5: 0.01995,
    8: 0.03469, 16: 0.05173, 24: 0.07459, 40: 0.13093,
}  # fmt: skip
EDIT_ACCEPTANCE, CHAT_ACCEPTANCE = 0.895, 0.495


def _expected(p: float, drafts: int) -> float:
    return p * drafts  # as the scheduler estimates it


def _measured(without: int | None = None, probes_back_off: bool = False) -> StepCost:
    """The step times above observed once each (``without`` one row count)."""
    cost = StepCost(probes_back_off)
    for rows, seconds in MEASURED_SECONDS.items():
        if rows != without:
            cost.observe(1 if rows <= 5 else 8, rows, seconds)
    return cost


def test_step_cost_drafts_for_one_edit_stream_and_not_for_eight_chat_streams() -> None:
    cost = _measured()
    assert cost.drafts_pay(1, 4, _expected(EDIT_ACCEPTANCE, 4))  # 4.4 tokens for 2.7x
    assert not cost.drafts_pay(8, 32, 8 * _expected(CHAT_ACCEPTANCE, 4))  # 15 for 3.8x
    assert not cost.drafts_pay(8, 8, 8 * _expected(0.1, 1))  # misses cost a row each
    assert not cost.drafts_pay(1, 4, _expected(0.2, 4))


def test_step_cost_tries_unmeasured_row_counts_and_probes_after_declining() -> None:
    cost = StepCost()
    assert cost.drafts_pay(8, 32, 0.0)  # nothing measured: drafting is how it gets measured
    cost = _measured()
    # 3 sequences never measured: judged by eight's plain step and draft rows, not tried
    assert not cost.drafts_pay(3, 6, 0.0)
    # 8 sequences with 2 drafts each (24 rows) measured, 8 with 1 each (16 rows) not: the
    # plain step plus the measured cost of a draft row, not tried
    del cost.seconds[(8, 16)]
    assert not cost.drafts_pay(8, 8, 8 * _expected(0.1, 1))
    assert cost.drafts_pay(8, 8, 8 * _expected(0.9, 1))
    decisions = [
        cost.drafts_pay(8, 32, 8 * _expected(CHAT_ACCEPTANCE, 4))
        for _ in range(PROBE_EVERY - 1 + PROBE_DECISIONS)
    ]
    # one probe (held for PROBE_DECISIONS decisions), then declines again
    assert decisions == [False] * (PROBE_EVERY - 1) + [True] * PROBE_DECISIONS
    assert not cost.drafts_pay(8, 32, 8 * _expected(CHAT_ACCEPTANCE, 4))
    assert not cost.drafts_pay(1, 0, 0.0)  # no drafts: nothing to verify


def test_a_new_number_of_sequences_borrows_the_costs_measured_beside_others() -> None:
    """Seven sequences, their plain step measured and no drafted one: judged by the cost of
    a draft row measured at eight (not tried with every request's drafts, as with nothing
    measured beside two or more sequences); five, with no step measured at all, by the
    plain step the measured counts' line gives; one sequence never borrows either."""
    cost = _measured()
    per_row_8 = MEASURED_SECONDS[8] / 8
    cost.observe(7, 7, 7 * per_row_8)
    assert not cost.drafts_pay(7, 28, 7 * _expected(CHAT_ACCEPTANCE, 4))
    # a draft row costs about 2.5 ms at eight, a token 4.3 ms at seven: drafts accepted at
    # 99% pay, at 49.5% (chat) they do not
    assert cost.drafts_pay(7, 4, _expected(0.99, 4))
    # five sequences, not even their plain step measured: the line through seven's and
    # eight's plain steps
    assert not cost.drafts_pay(5, 20, 5 * _expected(CHAT_ACCEPTANCE, 4))
    assert cost.drafts_pay(5, 4, _expected(0.99, 4))
    fresh = StepCost()
    fresh.observe(7, 7, 7 * per_row_8)
    assert fresh.drafts_pay(7, 28, 7 * _expected(CHAT_ACCEPTANCE, 4))  # nothing to borrow: try
    fresh.observe(1, 1, MEASURED_SECONDS[1])
    fresh.observe(1, 5, MEASURED_SECONDS[5])
    fresh.observe(2, 2, MEASURED_SECONDS[1] * 1.5)
    assert fresh.drafts_pay(2, 4, 0.0)  # one sequence's verification is not the batched path


def test_step_cost_follows_new_measurements() -> None:
    cost = _measured()
    for _ in range(30):  # drafted 40-row steps become as cheap as 8-row ones
        cost.observe(8, 40, MEASURED_SECONDS[8])
    assert cost.drafts_pay(8, 32, 8 * _expected(CHAT_ACCEPTANCE, 4))


def test_one_slow_first_drafted_step_does_not_decline_drafts_for_long() -> None:
    """The first verification of a row count may pay one-off costs (on a GPU a first
    call's set-up took many plain steps' time): the next, normal measurement of it
    counts in full, so one edit stream verifies its drafts again at once."""
    cost = _measured(without=5)
    cost.observe(1, 5, 10 * MEASURED_SECONDS[5])  # its first measurement, an outlier
    assert not cost.drafts_pay(1, 4, _expected(EDIT_ACCEPTANCE, 4))
    cost.observe(1, 5, MEASURED_SECONDS[5])  # one normal step (a probe)
    assert cost.drafts_pay(1, 4, _expected(EDIT_ACCEPTANCE, 4))


def test_a_probe_holds_for_the_decision_after_it() -> None:
    """With async scheduling the next step is often planned before a decision: the probe
    must still be there at the decision after, or it is never used (on an H100 a row count
    measured once in a slow first step then kept one stream's drafts out for good)."""
    assert PROBE_DECISIONS == 2  # one step in flight beside the one planned
    cost = _measured(without=5)
    cost.observe(1, 5, 10 * MEASURED_SECONDS[5])
    for _ in range(PROBE_EVERY - 1):
        assert not cost.drafts_pay(1, 4, _expected(EDIT_ACCEPTANCE, 4))
    assert cost.drafts_pay(1, 4, _expected(EDIT_ACCEPTANCE, 4))  # the probe
    cost.observe(1, 1, MEASURED_SECONDS[1])  # a plain step planned before it
    assert cost.drafts_pay(1, 4, _expected(EDIT_ACCEPTANCE, 4))  # still granted
    cost.observe(1, 5, MEASURED_SECONDS[5])  # the probe runs, and measures a normal step
    for _ in range(PROBE_EVERY):
        assert cost.drafts_pay(1, 4, _expected(EDIT_ACCEPTANCE, 4))  # now on its merits


def test_a_costly_proposers_failed_probes_back_off_until_drafts_pay() -> None:
    """With ``probes_back_off`` (a draft model: a probe costs a proposal, the draft's
    catch-up and a verification), each probe after which eight chat streams' drafts still
    do not pay doubles the decisions before the next, up to MAX_PROBE_EVERY; a decision
    that verifies every draft held puts it back to PROBE_EVERY. n-gram probes (lookups
    cost nothing) stay PROBE_EVERY apart."""
    chat = 8 * _expected(CHAT_ACCEPTANCE, 4)
    for back_off in (True, False):
        cost = _measured(probes_back_off=back_off)
        gaps, gap = [], PROBE_EVERY
        while len(gaps) < 5:
            gaps.append(gap)
            gap = min(MAX_PROBE_EVERY, 2 * gap) if back_off else gap
        want = [d for g in gaps for d in [False] * (g - 1) + [True] * PROBE_DECISIONS]
        assert [cost.drafts_pay(8, 32, chat) for _ in want] == want
        assert gaps[-1] == (MAX_PROBE_EVERY if back_off else PROBE_EVERY)
        assert cost.drafts_pay(1, 4, _expected(EDIT_ACCEPTANCE, 4))  # drafts pay: reset
        again = [False] * (PROBE_EVERY - 1) + [True] * PROBE_DECISIONS
        assert [cost.drafts_pay(8, 32, chat) for _ in again] == again


def test_step_cost_lets_only_the_requests_whose_drafts_pay_verify_them() -> None:
    cost = _measured()
    # Two of eight chat streams copy (95% of their drafts accepted), six do not (20%): the
    # whole batch's 32 drafts do not pay (20.4 tokens for 3.8x the time), the copiers'
    # 8 drafts do (15.6 tokens for 1.5x), and no more than theirs.
    held = [(4, 0.2)] * 3 + [(4, 0.95)] * 2 + [(4, 0.2)] * 3
    assert not cost.drafts_pay(8, 32, sum(n * p for n, p in held))
    assert cost.allowances(8, held) == [0, 0, 0, 4, 4, 0, 0, 0]
    assert cost.allowances(1, [(4, EDIT_ACCEPTANCE)]) == [4]
    assert cost.allowances(8, []) == []


def test_step_cost_verifies_the_drafts_that_fill_the_last_row_tile() -> None:
    # Eight sequences measured with up to 4 drafts (one 6-row fp32 tile holds rows 7-12,
    # nearly free) and with 5 (a third tile): every draft of one request verifies, and of
    # two requests only as many as fill the tile, the likelier request's first.
    cost = _measured()
    for rows, seconds in ((12, 0.0355), (13, 0.0520)):
        cost.observe(8, rows, seconds)
    assert cost.allowances(8, [(4, 0.3)]) == [4]
    assert cost.allowances(8, [(4, 0.3), (4, 0.6)]) == [0, 4]
    assert cost.allowances(8, [(3, 0.6), (4, 0.3)]) == [3, 1]
    # Row counts in between: interpolated between the nearest measured (not one mean
    # cost a row): 10 rows lie between 8 and 12, both about 35 ms.
    assert cost.allowances(8, [(2, 0.2)]) == [2]


def _eight_decoding(draft_model: str | None = None, max_tokens: int = 64, **settings: Any) -> Any:
    """A harness whose real scheduler (n-gram, k=4; with ``draft_model``, a draft model's;
    ``settings``: more speculative_config keys) runs eight requests past their prompts and
    one plain decode step."""
    from legato.config import SpeculativeConfig

    from .harness import Harness, make_config, make_request

    spec = SpeculativeConfig.of(
        {"num_speculative_tokens": 4, **settings}
        | ({"model": draft_model} if draft_model else {"method": "ngram"})
    )
    h = Harness(make_config(speculative_config=spec, max_num_seqs=9))
    h.add(*(make_request(f"r{i}", 5, max_tokens=max_tokens) for i in range(8)))
    for _ in range(2):  # the prompts, then one plain decode step
        h.step()
    return h


def test_the_scheduler_verifies_only_the_drafts_its_step_cost_allows() -> None:
    """Driven through the scheduler: eight decoding requests all hold four drafts, two of
    them with a history of accepted drafts; the next step verifies only those two's."""
    h = _eight_decoding()
    sched = h.sched
    assert sched.step_cost is not None
    for rows, seconds in MEASURED_SECONDS.items():
        sched.step_cost.observe(1 if rows <= 5 else 8, rows, seconds)
    copiers = {"r3", "r6"}
    for rid, req in sched.requests.items():
        req.draft_length = DraftLength(4)
        req.draft_length.drafted, req.draft_length.accepted = 10.0, (9.5 if rid in copiers else 2.0)
    plan = sched.schedule()
    runner_output = h.runner.execute(plan)
    runner_output.spec_token_ids = {rid: list(PROPOSAL) for rid in runner_output.req_ids}
    runner_output.step_seconds = MEASURED_SECONDS[8]
    sched.update_from_output(plan, runner_output)
    assert sched.has_drafts_to_verify()
    plan = sched.schedule()
    assert set(plan.scheduled_spec_decode_tokens) == copiers
    assert all(d == PROPOSAL for d in plan.scheduled_spec_decode_tokens.values())
    assert len(plan.num_scheduled_tokens) == 8


def test_a_backed_off_request_asks_the_runner_for_no_proposal() -> None:
    """The step tells the runner how many drafts each request's draft length can admit of
    the proposal made after its sample: none while it backs off, its limit (one more if the
    step verifies its drafts: all accepted raises it) once shortened, and a request at full
    length is not listed (the runner proposes up to num_speculative_tokens)."""
    h = _eight_decoding(disable_by_batch_size=9)  # no step cost: the draft lengths decide
    sched = h.sched
    lengths = {f"r{i}": DraftLength(4) for i in range(8)}
    lengths["r0"].skip = 2  # backing off for two more samples
    lengths["r1"].skip = 1  # for one more: the one this step takes
    lengths["r2"].limit = 2
    lengths["r3"].limit = 3
    for rid, req in sched.requests.items():
        req.draft_length = lengths[rid]
    plan = sched.schedule()
    # r0's and r1's proposals fall in their back-offs; r2 and r3 admit 2 and 3 drafts.
    assert plan.draft_limits == {"r0": 0, "r1": 0, "r2": 2, "r3": 3}
    runner_output = h.runner.execute(plan)
    runner_output.spec_token_ids = {rid: list(PROPOSAL) for rid in runner_output.req_ids}
    sched.update_from_output(plan, runner_output)
    assert (lengths["r0"].skip, lengths["r1"].skip) == (1, 0)
    assert sched.requests["r1"].spec_token_ids == []  # proposed anyway: still discarded
    plan = sched.schedule()
    # r2 and r3 verify 2 and 3 drafts: all accepted would raise their limits by one.
    assert plan.draft_limits == {"r0": 0, "r2": 3}


def _decide(h: Any, steps: int) -> list[dict[str, int]]:
    """``steps`` steps of ``h`` whose runner proposes what each step's draft limits allow
    (all rejected) in MEASURED_SECONDS' time for its rows; each step's draft limits."""
    sched, limits = h.sched, []
    for _ in range(steps):
        plan = sched.schedule()
        limits.append(plan.draft_limits)
        runner_output = h.runner.execute(plan)
        runner_output.spec_token_ids = {
            rid: PROPOSAL[: plan.draft_limits.get(rid, 4)]
            for rid in runner_output.req_ids
            if plan.draft_limits.get(rid, 4)
        }
        # eight rows as measured, each draft row as the 16-row step's rows on average
        per_row = (MEASURED_SECONDS[16] - MEASURED_SECONDS[8]) / 8
        rows = plan.total_num_scheduled_tokens
        runner_output.step_seconds = MEASURED_SECONDS[8] + per_row * max(0, rows - 8)
        sched.update_from_output(plan, runner_output)
    return limits


def test_a_draft_models_proposals_follow_the_step_cost_decision(tmp_path: Any) -> None:
    """With a draft model (a forward per draft), a request whose drafts the step cost leaves
    out gets none proposed; it still counts in the next decision as holding its draft
    length's drafts, so that a probe brings its proposals back. An n-gram lookup costs
    next to nothing: its proposals are always made."""
    from .harness import make_request

    for draft_model in (str(tmp_path), None):
        h = _eight_decoding(draft_model, max_tokens=2 * PROBE_EVERY)
        sched = h.sched
        ids = set(sched.requests)
        assert sched.step_cost is not None
        for rows, seconds in MEASURED_SECONDS.items():
            sched.step_cost.observe(1 if rows <= 5 else 8, rows, seconds)
        for req in sched.requests.values():
            req.draft_length = DraftLength(4)
            req.draft_length.drafted, req.draft_length.accepted = 10.0, 1.0  # 10% accepted
        limits = _decide(h, 2 + PROBE_EVERY + PROBE_DECISIONS)
        if draft_model is None:
            assert limits == [{}] * len(limits)
            continue
        assert limits[0] == {}  # no decision yet: every request proposes
        left_out = [{rid for rid, n in lim.items() if n == 0} for lim in limits[1:]]
        assert left_out[0] == ids  # none of them pays at 8 streams
        # A probe lets one of them propose again, one draft; never more than one at a time.
        assert min(len(out) for out in left_out) == len(ids) - 1
        # The step verifying that draft lets it propose two, not its old draft length: every
        # request stays listed (a request not listed proposes k).
        assert all(ids <= set(lim) for lim in limits[1:])
        assert {n for lim in limits[1:] for rid, n in lim.items() if rid in ids} == {0, 1, 2}
        # A new request proposes nothing either while none verifies (added after a probe).
        last_probe = max(i for i, out in enumerate(left_out) if len(out) < len(ids))
        assert len(left_out[-1]) == len(ids) and last_probe < len(left_out) - 1
        h.add(make_request("late", 5, max_tokens=8))
        assert _decide(h, 1)[0].get("late") == 0


def test_step_cost_probes_the_next_request_left_out_not_the_whole_batch() -> None:
    cost = _measured()
    held = [(4, 0.2)] * 3 + [(4, 0.5)] * 3 + [(4, 0.95)] * 2
    cycle = PROBE_EVERY - 1 + PROBE_DECISIONS
    decisions = [cost.allowances(8, held) for _ in range(2 * cycle)]
    # The copiers' 8 drafts pay, no more: once every PROBE_EVERY decisions the next request
    # (the likeliest left out) verifies too, for PROBE_DECISIONS decisions, never all eight.
    allowed = [0] * 6 + [4, 4]
    probe = [0] * 3 + [4, 0, 0] + [4, 4]
    assert decisions == ([allowed] * (PROBE_EVERY - 1) + [probe] * PROBE_DECISIONS) * 2
    declined = [(4, 0.1)] * 8
    decisions = [cost.allowances(8, declined) for _ in range(cycle)]
    assert decisions == [[0] * 8] * (PROBE_EVERY - 1) + [[4] + [0] * 7] * PROBE_DECISIONS


def test_a_fresh_request_expects_the_engines_recent_share_not_every_draft() -> None:
    """A request never verified yet ranks its drafts by the engine's recent share of drafts
    accepted (StepCost.prior), not by 1: driven through the scheduler, eight fresh requests
    each propose four drafts; while the engine's recent verifications accepted a quarter
    (free chat), the next step of eight verifies none of them; with every draft accepted
    recently (an edit), it verifies them."""
    for share, verified in ((0.25, False), (1.0, True)):
        h = _eight_decoding()
        sched = h.sched
        cost = sched.step_cost
        assert cost is not None
        for rows, seconds in MEASURED_SECONDS.items():
            cost.observe(1 if rows <= 5 else 8, rows, seconds)
        assert cost.prior() == 1.0  # nothing verified yet
        for _ in range(20):  # other requests' verifications, now finished
            cost.settle(4, round(4 * share))
        assert abs(cost.prior() - share) < 1e-9
        # none of the eight has verified a draft of its own
        assert all(r.draft_length is None or not r.draft_length.drafted for r in sched.running)
        plan = sched.schedule()
        runner_output = h.runner.execute(plan)
        runner_output.spec_token_ids = {rid: list(PROPOSAL) for rid in runner_output.req_ids}
        runner_output.step_seconds = MEASURED_SECONDS[8]
        sched.update_from_output(plan, runner_output)
        assert sched.has_drafts_to_verify() is verified
        plan = sched.schedule()
        assert bool(plan.scheduled_spec_decode_tokens) is verified
        assert len(plan.num_scheduled_tokens) == 8


def test_step_cost_ignores_a_burst_that_stretches_one_plain_step() -> None:
    """Another process's burst stretched one plain step of eight to three times its time
    (seen on this machine: 110 ms among 23 ms steps): the next decisions still verify no
    draft of a chat request (40% accepted), and follow a lasting change once it lasts."""
    cost = StepCost()
    for _ in range(3):
        for rows, seconds in MEASURED_SECONDS.items():
            cost.observe(1 if rows <= 5 else 8, rows, seconds)
    chat = [(4, 0.4)] * 8
    assert cost.allowances(8, chat) == [0] * 8
    cost.observe(8, 8, 3 * MEASURED_SECONDS[8])
    assert cost.seconds[(8, 8)] == MEASURED_SECONDS[8]
    assert cost.allowances(8, chat) == [0] * 8
    for _ in range(6):  # plain steps of eight now take twice as long, drafted ones not
        cost.observe(8, 8, 2 * MEASURED_SECONDS[8])
    assert cost.seconds[(8, 8)] == 2 * MEASURED_SECONDS[8]
    assert cost.allowances(8, chat) == [4, 4] + [0] * 6  # drafts now pay, up to 16 rows


def test_a_drafted_step_counts_the_overlap_it_gives_up() -> None:
    """Eight streams, one request 35% accepted: four drafts add 5% to the step and pay on
    compute alone. With async scheduling a drafted step plans no step ahead, and the
    worker's measured wait after it (here 3 ms on a 20 ms step) counts into its cost: then
    they do not pay, and the decision leaves them out. A one-off long wait (the lower
    median) does not."""
    cost = StepCost()
    cost.observe(8, 8, 0.020)
    cost.observe(8, 12, 0.021)
    drafts = [(4, 0.35)] + [(0, 0.0)] * 7
    assert cost.allowances(8, drafts) == [4] + [0] * 7  # (8 + 1.4) / 21 ms > 8 / 20 ms
    cost.observe_overlap(0.050)  # one long wait: the median of one
    for _ in range(4):
        cost.observe_overlap(0.003)
    assert cost.overlap == 0.003
    assert cost.allowances(8, drafts) == [0] * 8  # (8 + 1.4) / 24 ms < 8 / 20 ms
