"""Tensor-parallel ranks against one device: token-identical greedy output in fp32.

Both ranks run in threads of this process, each with a ModelRunner on its
share of the model, joined by a real gloo group over loopback (the engine
runs them as processes; that path is tested in tests/distributed). The
greedy tokens of rank 0 must equal a single-device runner's, for each
architecture, with KV heads split (2 of them on 2 ranks) and replicated (1 KV
head on 2 ranks), and with a vocabulary the ranks cannot split evenly.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from legato.config import EngineConfig
from legato.models.config import load_model_config
from legato.models.process_group import gloo_group
from legato.models.runner import ModelRunner
from legato.models.sharding import TensorParallelPlan
from legato.models.tensor_parallel import TensorParallel
from legato.protocol.params import SamplingParams

PROMPTS = {"a": [5, 17, 99, 3, 250, 8, 41], "b": [300, 2, 2, 77, 160, 19, 7, 201, 33, 90, 12]}


def _run(runner: ModelRunner, mini_scheduler: Any) -> dict[str, list[int]]:
    sched = mini_scheduler(runner, chunk=8)  # chunked prefill: partial steps too
    for rid, prompt in PROMPTS.items():
        sched.add(rid, prompt, SamplingParams(temperature=0.0), max_tokens=10)
    return dict(sched.run())


def _tensor_parallel_outputs(
    path: str, world_size: int, mini_scheduler: Any
) -> list[dict[str, list[int]]]:
    """Every rank's outputs for the same steps, ranks as threads of one gloo group."""
    store = dist.HashStore()
    results: list[Any] = [None] * world_size

    def rank_main(rank: int) -> None:
        try:
            group = gloo_group(store, rank=rank, world_size=world_size, timeout=60)
            config = EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=64)
            runner = ModelRunner(config, parallel=TensorParallel(group))
            results[rank] = (_run(runner, mini_scheduler), runner)
        except BaseException as exc:  # reported by the test thread
            results[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return [r[0] for r in results] + [r[1] for r in results]


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
CASES = [
    ("llama", {}),
    ("mistral", {}),
    ("qwen2", {}),  # biases on q, k, v
    ("qwen3", {}),  # q/k norms, tied embeddings
    ("llama", {"num_key_value_heads": 1, "vocab_size": 383}),  # KV heads < ranks; odd vocab
    ("mistral", {"sliding_window": 6}),  # every layer windowed, prompts past the window
    ("llama", {"rope_scaling": YARN}),  # rope scaling past its original window of 8
    # sandwich norms, GeGLU, soft caps, sliding layers between global ones
    ("gemma2", {"sliding_window": 6, "attn_logit_softcapping": 1.0, "tie_word_embeddings": False}),
    ("gemma3", {"sliding_window": 6, "sliding_window_pattern": 2}),  # q/k norms, local rope
    ("mixtral", {}),  # 8 experts, top-2, each sharded across the ranks
    ("qwen2_moe", {"shared_expert_intermediate_size": 40}),  # with a shared expert
    ("qwen3_moe", {"head_dim": 16, "mlp_only_layers": [0]}),  # a dense layer, then experts
]


@pytest.mark.parametrize(("kind", "overrides"), CASES, ids=[f"{k}{o or ''}" for k, o in CASES])
def test_two_ranks_match_one_device(
    kind: str,
    overrides: dict[str, Any],
    make_checkpoint: Callable[..., Any],
    mini_scheduler: Any,
) -> None:
    ck = make_checkpoint(kind, **overrides)
    single = ModelRunner(
        EngineConfig(model=str(ck.path), device="cpu", dtype="float32", num_kv_blocks=64)
    )
    want = _run(single, mini_scheduler)
    rank0, rank1, runner0, runner1 = _tensor_parallel_outputs(str(ck.path), 2, mini_scheduler)
    assert rank0 == want
    assert rank1 == want  # every rank samples the same tokens from the gathered logits
    # each rank's KV cache holds its own KV heads only
    kv_heads = load_model_config(ck.path).num_kv_heads
    per_rank = max(1, kv_heads // 2)
    for runner in (runner0, runner1):
        assert runner.kv_caches[0][0].shape[2] == per_rank
    assert single.kv_caches[0][0].shape[2] == kv_heads


def test_plan_rejects_shapes_it_cannot_split(make_checkpoint: Callable[..., Any]) -> None:
    cfg = load_model_config(make_checkpoint("llama").path)  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide"):
        TensorParallelPlan.for_model(cfg, 3, 0)
    plan = TensorParallelPlan.for_model(cfg, 4, 3)  # 2 KV heads on 4 ranks: replicated
    assert (plan.kv_heads_per_rank, plan.kv_head_start, plan.heads_per_rank) == (1, 1, 1)


def test_broadcast_bytes_and_timeouts() -> None:
    """The control plane carries rank 0's bytes; a rank that never comes is an
    error after the group's timeout, not torch's 30 minutes."""
    store = dist.HashStore()
    got: list[Any] = [None, None]

    def rank_main(rank: int) -> None:
        group = gloo_group(store, rank=rank, world_size=2, timeout=30)
        got[rank] = group.broadcast_bytes(b"step frame" if rank == 0 else None)
        group.barrier()
        got[rank] = (got[rank], group.broadcast_bytes(b"" if rank == 0 else None))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got == [(b"step frame", b""), (b"step frame", b"")]

    lonely = dist.HashStore()
    assert gloo_group(lonely, rank=0, world_size=1, timeout=1).gather_bytes(b"x") == [b"x"]
    group = gloo_group(lonely, rank=0, world_size=1, timeout=1)
    assert group.all_reduce(torch.ones(2)).tolist() == [1.0, 1.0]  # one rank: no collective
    lonely.set_timeout(datetime.timedelta(seconds=1))
    with pytest.raises(Exception, match="(?i)timeout|timed out|wait"):
        gloo_group(lonely, rank=0, world_size=2, timeout=1)


def test_gather_bytes_brings_every_ranks_bytes_in_rank_order() -> None:
    """Rank 0 gathers the ranks' answers to a utility call (msgpack bytes of any
    length, an empty one too) this way: every rank gets all of them, rank 0's first."""
    store = dist.HashStore()
    sent = [b"rank zero's answer", b""]
    got: list[Any] = [None, None]

    def rank_main(rank: int) -> None:
        group = gloo_group(store, rank=rank, world_size=2, timeout=30)
        got[rank] = (group.gather_bytes(sent[rank]), group.gather_bytes(bytes([rank]) * 3))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got[0] == got[1] == (sent, [b"\x00\x00\x00", b"\x01\x01\x01"])
