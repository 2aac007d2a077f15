"""A request's adaptive draft length (speculative decoding): it shrinks while drafts miss,
backs off to none, probes again, and grows back while they are accepted."""

from __future__ import annotations

from legato.scheduling.draft_policy import FIRST_BACKOFF, MAX_BACKOFF, DraftLength

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
