"""One scheduling step in the making, and a step planned but not answered yet.

``StepPlan`` is what one ``Scheduler.schedule()`` call has decided so far;
``InFlightStep`` what the scheduler remembers of a planned step until the
runner's answer is applied. Pure Python; never imports torch or trio.
"""

from __future__ import annotations

from .request_state import Request


class StepPlan:
    """What one ``schedule()`` call has decided so far.

    Running requests are advanced as they are planned (``_schedule_running``):
    ``running[i]`` resumes at ``computed[i]`` and samples if ``samples[i]``;
    ``new_token_ids`` holds the tokens the runner does not know yet. A request
    planned and then preempted in the same step is taken back with :meth:`drop`.
    ``num_scheduled`` holds the running requests first, in ``running``'s order,
    then the ones admitted (``new``).
    """

    __slots__ = (
        "budget",
        "frame_bytes",
        "new",
        "running",
        "computed",
        "samples",
        "num_decode",
        "num_scheduled",
        "new_block_ids",
        "new_token_ids",
        "spec_tokens",
        "draft_limits",
    )

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.frame_bytes = 0  # an upper bound on what the admitted requests add to the frame
        self.new: list[Request] = []
        self.running: list[Request] = []
        self.computed: list[int] = []
        self.samples: list[bool] = []
        self.num_decode = 0  # running requests' one-token steps past their prefill
        self.num_scheduled: dict[str, int] = {}
        self.new_block_ids: dict[str, list[int]] = {}
        self.new_token_ids: dict[str, list[int]] = {}
        self.spec_tokens: dict[str, list[int]] = {}  # drafts verified (in num_scheduled)
        self.draft_limits: dict[str, int] = {}  # SchedulerOutput.draft_limits

    def drop(self, req: Request) -> int:
        """Take back a running request planned earlier this step (it is being preempted,
        its state not reset yet); returns its tokens, for the budget."""
        request_id = req.request_id
        k = self.running.index(req)
        n = self.num_scheduled.pop(request_id)
        drafts = self.spec_tokens.pop(request_id, ())
        self.draft_limits.pop(request_id, None)
        # As counted when planned: a placeholder was added if it samples.
        if (
            n - len(drafts) == 1
            and self.samples[k]
            and (req.num_output_placeholders > 1 or req.output_token_ids)
        ):
            self.num_decode -= n
        del self.running[k], self.computed[k], self.samples[k]
        self.new_block_ids.pop(request_id, None)
        self.new_token_ids.pop(request_id, None)
        return n


class InFlightStep:
    """A planned step the runner has not answered yet: its requests, in the runner's
    order, whether each one's scheduled tokens end in a sample, and how many drafts
    each drafted request verifies (speculative decoding)."""

    __slots__ = ("requests", "samples", "num_drafts")

    def __init__(
        self, requests: list[Request], samples: list[bool], num_drafts: dict[str, int]
    ) -> None:
        self.requests = requests
        self.samples = samples
        self.num_drafts = num_drafts
