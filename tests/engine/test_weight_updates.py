"""vLLM's weight-update calls (its "disk" backend) on a running engine.

Two toy checkpoints of one architecture and tokenizer, seeds 0 and 1, give
different greedy tokens; an engine started on seed 0 and updated to seed 1's
directory gives seed 1's tokens, with the KV cache and the engine kept.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from legato import (
    EngineArgs,
    SamplingParams,
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)
from legato.engine import AsyncEngine, open_engine
from legato.toy_model import build_toy_model

ARGS: dict[str, Any] = dict(
    executor="inproc", max_model_len=128, num_kv_blocks=32, disable_log_stats=True
)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy model's architecture and tokenizer with seed 1's weights."""
    return build_toy_model(tmp_path_factory.mktemp("weights") / "seed1", seed=1).absolute()


async def greedy(engine: AsyncEngine, request_id: str) -> list[int]:
    outputs = [out async for out in engine.generate(PROMPT, GREEDY, request_id)]
    return list(outputs[-1].outputs[0].token_ids)


async def test_an_update_from_a_checkpoint_gives_its_greedy_tokens(
    toy_model_dir: Path, other_weights: Path
) -> None:
    async with open_engine(str(other_weights), **ARGS) as engine:
        want = await greedy(engine, "reference")
    async with open_engine(str(toy_model_dir), **ARGS) as engine:
        before = await greedy(engine, "before")
        assert before != want  # the two checkpoints differ where the test looks
        await engine.init_weight_transfer_engine(WeightTransferInitRequest())
        await engine.start_weight_update(is_checkpoint_format=True)
        await engine.update_weights(WeightTransferUpdateRequest({"path": str(other_weights)}))
        await engine.finish_weight_update(weight_version="step-1")
        await engine.reset_prefix_cache()  # its blocks hold the old weights' KV
        assert await greedy(engine, "after") == want
        assert await engine.get_weight_version() == "step-1"
        await engine.check_health()


@pytest.fixture
async def engine(toy_model_dir: Path) -> AsyncIterator[AsyncEngine]:
    async with open_engine(str(toy_model_dir), **ARGS) as eng:
        yield eng


async def test_the_sessions_order_and_bad_paths_fail_the_call_not_the_engine(
    engine: AsyncEngine, other_weights: Path
) -> None:
    before = await greedy(engine, "before")
    update = WeightTransferUpdateRequest({"path": str(other_weights)})
    with pytest.raises(RuntimeError, match="Worker failed .*init_weight_transfer_engine must"):
        await engine.start_weight_update()
    with pytest.raises(RuntimeError, match="init_info: the disk weight transfer takes no"):
        await engine.init_weight_transfer_engine(WeightTransferInitRequest({"master_port": 1}))
    await engine.init_weight_transfer_engine(WeightTransferInitRequest())
    with pytest.raises(RuntimeError, match="start_weight_update must be called before"):
        await engine.update_weights(update)
    await engine.start_weight_update()
    with pytest.raises(RuntimeError, match="update_info.path: must be an absolute"):
        await engine.update_weights(WeightTransferUpdateRequest({"path": "relative/dir"}))
    await engine.start_weight_update()  # the failed update ended the session
    with pytest.raises(RuntimeError, match="update_info.path: no safetensors or GGUF file"):
        await engine.update_weights(WeightTransferUpdateRequest({"path": str(other_weights.parent)}))
    with pytest.raises(RuntimeError, match="No shared-disk weight update is active"):
        await engine.finish_weight_update()
    await engine.check_health()
    assert await greedy(engine, "unchanged") == before  # nothing was loaded


def test_engine_args_take_vllms_disk_backend_and_refuse_the_others() -> None:
    assert EngineArgs(weight_transfer_config={"backend": "disk"}).weight_transfer_config
    with pytest.raises(ValueError, match="weight_transfer_config: .*got backend 'nccl'"):
        EngineArgs(weight_transfer_config={"backend": "nccl"})
