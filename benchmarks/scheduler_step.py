"""Scheduler microseconds per step (schedule + update_from_output), no model.

Scenarios:

* ``decode``: ``--num-decode`` requests all past their prefill, one token each per step.
* ``mixed``: a steady state of ``--num-decode`` unfinished requests; finished
  ones are replaced at once by new arrivals, so every step mixes decodes with
  chunked prefills within ``--max-num-batched-tokens``.
* ``mixed+prefix``: as ``mixed``, every prompt starting with the same
  ``--shared-prefix-len`` tokens (prefix-cache hits).

The fake runner's output is built outside the timed region. Prints a table;
sizes are arguments. Example::

    python benchmarks/scheduler_step.py --num-decode 256 --steps 300
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

from legato.config import EngineConfig
from legato.protocol.messages import EngineRequest, ModelRunnerOutput, SchedulerOutput
from legato.protocol.params import SamplingParams
from legato.scheduling.scheduler import Scheduler


@dataclass
class Row:
    scenario: str
    reqs_per_step: float
    tokens_per_step: float
    schedule_us: float
    update_us: float

    @property
    def total_us(self) -> float:
        return self.schedule_us + self.update_us


class Load:
    """Feeds the scheduler requests and plays the model runner."""

    def __init__(self, args: argparse.Namespace, shared_prefix_len: int) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.shared = [self.rng.randrange(3, 30000) for _ in range(shared_prefix_len)]
        self.count = 0
        # Long enough that decode requests outlive their prefill phase and every timed step.
        prefill_steps = -(-args.num_decode * args.prompt_len // args.max_num_batched_tokens)
        decode_len = prefill_steps + args.warmup + args.steps + 2
        max_len = args.prompt_len + max(args.max_tokens * 2, decode_len)
        blocks_per_req = -(-max_len // args.block_size)
        num_blocks = args.num_blocks or args.num_decode * blocks_per_req + 1
        self.sched = Scheduler(
            EngineConfig(
                max_model_len=max_len,
                num_kv_blocks=num_blocks,
                block_size=args.block_size,
                max_num_seqs=max(args.max_num_seqs, args.num_decode),
                max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=not args.no_prefix_caching,
            )
        )

    def add(self, max_tokens: int) -> None:
        self.count += 1
        tail = self.args.prompt_len - len(self.shared)
        prompt = self.shared + [self.rng.randrange(3, 30000) for _ in range(tail)]
        self.sched.add_request(
            EngineRequest(
                request_id=f"r{self.count}",
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                arrival_time=time.time(),
                eos_token_id=2,
            )
        )

    def runner_output(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        requests = self.sched.requests
        req_ids = list(plan.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for request_id in req_ids:
            req = requests[request_id]
            done = req.num_computed_tokens >= req.num_tokens
            sampled.append([self.rng.randrange(3, 30000)] if done else [])
        return ModelRunnerOutput.from_lists(plan.step_id, req_ids, sampled)

    def step(self) -> tuple[int, int, int, int]:
        """One step; returns (schedule ns, update ns, requests, tokens)."""
        t0 = time.perf_counter_ns()
        plan = self.sched.schedule()
        t1 = time.perf_counter_ns()
        runner_out = self.runner_output(plan)
        t2 = time.perf_counter_ns()
        self.sched.update_from_output(plan, runner_out)
        t3 = time.perf_counter_ns()
        return t1 - t0, t3 - t2, len(plan.num_scheduled_tokens), plan.total_num_scheduled_tokens


def measure(name: str, load: Load, steps: int, refill: bool) -> Row:
    sched_ns: list[int] = []
    update_ns: list[int] = []
    reqs = tokens = 0
    for _ in range(steps):
        if refill:
            while load.sched.get_num_unfinished_requests() < load.args.num_decode:
                low = max(1, load.args.max_tokens // 2)
                load.add(load.rng.randint(low, load.args.max_tokens * 3 // 2))
        s, u, r, t = load.step()
        sched_ns.append(s)
        update_ns.append(u)
        reqs += r
        tokens += t
    return Row(
        name,
        reqs / steps,
        tokens / steps,
        statistics.median(sched_ns) / 1000,
        statistics.median(update_ns) / 1000,
    )


def run_decode(args: argparse.Namespace) -> Row:
    load = Load(args, 0)
    for _ in range(args.num_decode):
        load.add(load.sched.max_model_len - args.prompt_len)  # alive through every timed step
    while any(r.num_output_tokens == 0 for r in load.sched.requests.values()):
        load.step()  # prefill everyone first
    for _ in range(args.warmup):
        load.step()
    return measure("decode", load, args.steps, refill=False)


def run_mixed(args: argparse.Namespace, shared_prefix_len: int, name: str) -> Row:
    load = Load(args, shared_prefix_len)
    for _ in range(args.warmup * 4):  # reach a steady state of arrivals and finishes
        while load.sched.get_num_unfinished_requests() < args.num_decode:
            load.add(load.rng.randint(max(1, args.max_tokens // 2), args.max_tokens * 3 // 2))
        load.step()
    return measure(name, load, args.steps, refill=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-decode", type=int, default=256, help="concurrent requests")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128, help="mean output length (mixed)")
    parser.add_argument("--shared-prefix-len", type=int, default=192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=0, help="0: enough for every request")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per scenario")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rows = [
        run_decode(args),
        run_mixed(args, 0, "mixed"),
        run_mixed(args, min(args.shared_prefix_len, args.prompt_len - 1), "mixed+prefix"),
    ]
    header = (
        f"{'scenario':<14}{'reqs/step':>10}{'tokens/step':>13}"
        f"{'schedule us':>13}{'update us':>11}{'total us':>10}{'us/req':>8}"
    )
    print(
        f"block_size={args.block_size} prompt_len={args.prompt_len} "
        f"max_num_batched_tokens={args.max_num_batched_tokens} "
        f"prefix_caching={not args.no_prefix_caching} (median of {args.steps} steps)"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        per_req = row.total_us / row.reqs_per_step if row.reqs_per_step else 0.0
        print(
            f"{row.scenario:<14}{row.reqs_per_step:>10.1f}{row.tokens_per_step:>13.1f}"
            f"{row.schedule_us:>13.1f}{row.update_us:>11.1f}{row.total_us:>10.1f}{per_req:>8.2f}"
        )


if __name__ == "__main__":
    main()
