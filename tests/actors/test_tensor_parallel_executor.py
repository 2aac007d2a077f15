"""A tensor-parallel engine (two rank processes on gloo) from the outside.

Correctness: LLM with ``tensor_parallel_size=2`` gives the same greedy tokens
as one worker. Supervision, through the chaos harness (legato.testing.chaos),
which checks that every stream ends with EngineDeadError within its deadline,
``errored`` is set and no process is left: SIGKILL of rank 1 mid-stream,
SIGSTOP of rank 1, a start-up failure on rank 1 (open_engine fails with rank
1's own error), and the restart supervisor bringing a TP=2 engine back.
Each test starts two-rank engines, a few seconds each on two cores.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import trio

from legato import WeightTransferInitRequest, WeightTransferUpdateRequest
from legato.actors.tensor_parallel_executor import TensorParallelExecutor
from legato.engine import open_engine
from legato.llm import LLM
from legato.protocol.errors import EngineDeadError
from legato.protocol.params import SamplingParams
from legato.supervise import open_supervised_engine
from legato.testing.chaos import (
    AfterTokens,
    AtStartup,
    ChaosConfig,
    Fault,
    FaultKind,
    StreamSpec,
    check_round,
    find_cause,
    run_round,
)
from legato.toy_model import build_toy_model

TP2: dict[str, Any] = dict(
    tensor_parallel_size=2, max_model_len=256, num_kv_blocks=64, disable_log_stats=True
)
PROMPTS = ["Once upon a time", "The capital of France is", "1, 2, 3,"]


def test_llm_two_ranks_match_one_worker(toy_model_dir: Path) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    # Structured outputs: every rank samples once the GrammarBitmask frame reaches it.
    constrained = SamplingParams(
        max_tokens=24, temperature=1.0, seed=2, structured_outputs={"regex": r"[a-d]{1,30}"}
    )
    with LLM(str(toy_model_dir), executor="inproc", max_model_len=256, num_kv_blocks=64) as one:
        want = [out.outputs[0].token_ids for out in one.generate(PROMPTS, params)]
        want_constrained = [out.outputs[0].text for out in one.generate(PROMPTS, constrained)]
    with LLM(str(toy_model_dir), **TP2) as llm:
        two = llm.generate(PROMPTS, params)
        two_constrained = [out.outputs[0].text for out in llm.generate(PROMPTS, constrained)]
    assert [len(t) for t in want] == [16, 16, 16]
    assert [out.outputs[0].token_ids for out in two] == want
    assert two_constrained == want_constrained
    assert all(re.fullmatch(r"[a-d]{1,30}", text) for text in want_constrained)


def _config(model: Path) -> ChaosConfig:
    return ChaosConfig(
        model=str(model),
        num_streams=4,
        max_tokens=(1, 24),
        engine_args={**TP2, "heartbeat_interval": 0.5, "heartbeat_timeout": 10.0},
    )


def _streams() -> list[StreamSpec]:
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    return [StreamSpec(f"chaos-{i}", "Tell me a story", long) for i in range(4)]


@pytest.mark.parametrize("kind", [FaultKind.SIGKILL, FaultKind.SIGSTOP])
async def test_rank_one_killed_or_stopped_ends_every_stream(
    toy_model_dir: Path, kind: FaultKind
) -> None:
    fault = Fault(kind, when=AfterTokens(0, 3), rank=1)
    result = await run_round(fault, _streams(), config=_config(toy_model_dir))
    assert check_round(result) == []  # every stream ended dead in time; no process left
    assert result.dead_error is not None and isinstance(result.dead_error, EngineDeadError)
    assert all(record.outcome == "dead" for record in result.streams)
    cause = find_cause(result.dead_error, fault)
    assert cause is not None
    if kind is FaultKind.SIGKILL:
        assert "rank" in str(cause)  # a rank's exit or rank 0's failed collective


async def test_a_rank_that_fails_to_load_fails_open_engine_with_its_error(
    toy_model_dir: Path,
) -> None:
    fault = Fault(FaultKind.FAIL_LOAD, when=AtStartup(), rank=1)
    result = await run_round(fault, [], config=_config(toy_model_dir))
    assert check_round(result) == []
    assert "tensor-parallel rank 1 failed to start" in str(result.startup_error)
    assert "weight loading failed" in str(result.startup_error)


async def test_restart_supervisor_brings_a_two_rank_engine_back(toy_model_dir: Path) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0)
    async with open_supervised_engine(str(toy_model_dir), max_restarts=1, window=600, **TP2) as h:
        first = h.engine
        executor = first.executor
        assert isinstance(executor, TensorParallelExecutor) and len(executor.rank_pids) == 2
        executor.kill_rank(1)
        with trio.fail_after(30):
            await first.supervisor.dead.wait()
        with pytest.raises(EngineDeadError):
            await first.check_health()
        with trio.fail_after(60):
            engine = await h.wait_running()
        assert engine is not first and isinstance(engine.executor, TensorParallelExecutor)
        outputs = [out async for out in engine.generate("Hello", params, "after")]
        assert len(outputs[-1].outputs[0].token_ids) == 4


async def test_collective_rpc_answers_from_every_rank_in_rank_order(
    toy_model_dir: Path, tmp_path: Path
) -> None:
    """As vLLM's: one result per rank, rank 0's first (each rank's profiler trace is
    named by its own pid); a method that fails on rank 1 only (an injected fault)
    raises vLLM's RuntimeError naming rank 1, and the engine keeps serving; no answer
    in time is vLLM's TimeoutError. A weight update from a checkpoint reaches every
    rank: the two ranks then give that checkpoint's greedy tokens."""
    other = build_toy_model(tmp_path / "seed1", seed=1).absolute()
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    async with open_engine(str(other), executor="inproc", **TP2 | {"tensor_parallel_size": 1}) as one:
        want = [out async for out in one.generate("Once upon", greedy, "ref")][-1].outputs[0]
    faults = {"worker": {"fail_utility": "held_requests", "rank": 1}}
    async with open_engine(str(toy_model_dir), faults=faults, **TP2) as engine:
        executor = engine.executor
        assert isinstance(executor, TensorParallelExecutor)
        assert await engine.collective_rpc("start_profile", args=(str(tmp_path),)) == [None, None]
        paths = await engine.collective_rpc("stop_profile")
        assert [Path(p).name.split("-")[2] for p in paths] == [str(p) for p in executor.rank_pids]
        with pytest.raises(RuntimeError, match="Worker failed with error 'rank 1: .*injected"):
            await engine.collective_rpc("held_requests")
        with pytest.raises(TimeoutError, match="RPC call to stop_profile timed out"):
            await engine.collective_rpc("stop_profile", timeout=0)
        await engine.check_health()
        await engine.init_weight_transfer_engine(WeightTransferInitRequest())
        await engine.start_weight_update()
        await engine.update_weights(WeightTransferUpdateRequest({"path": str(other)}))
        await engine.finish_weight_update()
        got = [out async for out in engine.generate("Once upon", greedy, "after")][-1].outputs[0]
        assert got.token_ids == want.token_ids
