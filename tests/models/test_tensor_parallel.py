"""Tensor-parallel ranks against one device: token-identical greedy output in fp32.

Both ranks run in threads of this process, each with a ModelRunner on its
share of the model, joined by a real gloo group over loopback (the engine
runs them as processes; that path is tested in tests/distributed). The
greedy tokens of every rank must equal a single-device runner's, and
transformers', for each architecture, in prefill chunks and from a cached
prefix, with KV heads split (2 of them on 2 ranks) and replicated (1 KV head
on 2 ranks), and with a vocabulary the ranks cannot split evenly; Phi-3's
fused projections are split per part.
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

_DONOR = [int(t) for t in torch.randint(0, 383, (20,), generator=torch.Generator().manual_seed(9))]
PROMPTS = {
    "a": [5, 17, 99, 3, 250, 8, 41],
    "b": [300, 2, 2, 77, 160, 19, 7, 201, 33, 90, 12],
    "donor": _DONOR,  # a whole first block of 16 tokens
}
HIT = _DONOR[:16] + [61, 4, 200, 18, 93]  # starts from the donor's first block, cached
NEW_TOKENS = 10


def _run(
    runner: ModelRunner,
    mini_scheduler: Any,
    prompts: dict[str, list[int]] = PROMPTS,
    chunk: int | None = 8,  # chunked prefill: partial steps too
) -> dict[str, list[int]]:
    """Greedy outputs of ``prompts``; with the default prompts, then also of :data:`HIT`
    started from the donor's cached first block (``"hit"``)."""
    sched = mini_scheduler(runner, chunk=chunk)
    for rid, prompt in prompts.items():
        sched.add(rid, prompt, SamplingParams(temperature=0.0), max_tokens=NEW_TOKENS)
    outputs = dict(sched.run())
    if prompts is PROMPTS:
        sched.add("hit", HIT, max_tokens=NEW_TOKENS, prefix_of="donor", prefix_blocks=1)
        assert sched.running["hit"].num_computed == 16
        outputs.update(sched.run())
    return outputs


def _transformers(ck: Any, hf_greedy: Any) -> dict[str, list[int]]:
    """transformers' greedy outputs for :data:`PROMPTS` and :data:`HIT`, as :func:`_run`'s."""
    prompts = {**PROMPTS, "hit": HIT}
    return {rid: hf_greedy(ck, prompt, NEW_TOKENS)[0] for rid, prompt in prompts.items()}


def _tensor_parallel_outputs(
    path: str, world_size: int, mini_scheduler: Any, **run: Any
) -> list[Any]:
    """Every rank's outputs for the same steps (``run``: :func:`_run`'s prompts and chunk),
    then every rank's runner, ranks as threads of one gloo group."""
    store = dist.HashStore()
    results: list[Any] = [None] * world_size

    def rank_main(rank: int) -> None:
        try:
            group = gloo_group(store, rank=rank, world_size=world_size, timeout=60)
            config = EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=64)
            runner = ModelRunner(config, parallel=TensorParallel(group))
            results[rank] = (_run(runner, mini_scheduler, **run), runner)
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
    # fused qkv_proj / gate_up_proj: each rank its own q, k, v heads and gate, up rows
    ("phi3", {}),
    ("phi3", {"num_key_value_heads": 1}),  # the one KV head's rows replicated in the fused rows
    ("phi3", {"partial_rotary_factor": 0.5}),  # Phi-4-mini's partial rotary, per rank's heads
]


@pytest.mark.parametrize(("kind", "overrides"), CASES, ids=[f"{k}{o or ''}" for k, o in CASES])
def test_two_ranks_match_one_device(
    kind: str,
    overrides: dict[str, Any],
    make_checkpoint: Callable[..., Any],
    mini_scheduler: Any,
    hf_greedy: Any,
) -> None:
    ck = make_checkpoint(kind, **overrides)
    single = ModelRunner(
        EngineConfig(model=str(ck.path), device="cpu", dtype="float32", num_kv_blocks=64)
    )
    want = _run(single, mini_scheduler)
    assert want == _transformers(ck, hf_greedy)
    rank0, rank1, runner0, runner1 = _tensor_parallel_outputs(str(ck.path), 2, mini_scheduler)
    assert rank0 == want
    assert rank1 == want  # every rank samples the same tokens from the gathered logits
    # each rank's KV cache holds its own KV heads only
    kv_heads = load_model_config(ck.path).num_kv_heads
    per_rank = max(1, kv_heads // 2)
    for runner in (runner0, runner1):
        assert runner.kv_caches[0][0].shape[2] == per_rank
    assert single.kv_caches[0][0].shape[2] == kv_heads


def test_phi3_longrope_two_ranks_match_transformers(
    make_checkpoint: Callable[..., Any], mini_scheduler: Any, hf_greedy: Any
) -> None:
    """Phi-3-128k's LongRoPE (long factors: prompts past the original window of 16, in
    whole prefill, where transformers defines it) on two ranks: transformers' tokens."""
    ck = make_checkpoint(
        "phi3",
        max_position_embeddings=64,
        original_max_position_embeddings=16,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.05 * i for i in range(8)],
            "long_factor": [1.0 + 0.7 * i for i in range(8)],
        },
    )
    g = torch.Generator().manual_seed(71)
    prompts = {f"r{n}": torch.randint(0, 384, (n,), generator=g).tolist() for n in (20, 33)}
    rank0, rank1, *_ = _tensor_parallel_outputs(
        str(ck.path), 2, mini_scheduler, prompts=prompts, chunk=None
    )
    want = {rid: hf_greedy(ck, prompt, NEW_TOKENS)[0] for rid, prompt in prompts.items()}
    assert all(len(set(tokens)) > 2 for tokens in want.values())
    assert rank0 == want and rank1 == want


def test_phi3_gguf_two_ranks_match_transformers(
    make_checkpoint: Callable[..., Any], mini_scheduler: Any, hf_greedy: Any, tmp_path: Any
) -> None:
    """A Phi-3 GGUF file (fused ``attn_qkv`` / ``ffn_up``, dequantized, then each part sliced
    in memory rather than read slice by slice from safetensors) on two ranks."""
    from legato.testing.gguf_files import write_gguf

    ck = make_checkpoint("phi3")
    gguf_file = write_gguf(ck.path, tmp_path / "phi3.gguf", tensor_type="F32")
    rank0, rank1, *_ = _tensor_parallel_outputs(str(gguf_file), 2, mini_scheduler)
    want = _transformers(ck, hf_greedy)
    assert rank0 == want and rank1 == want


def test_fused_projections_are_split_per_part() -> None:
    """Rank 1's rows of Phi-3's fused tensors: its query head rows, then its KV head rows
    of the keys and of the values (its gate rows, then its up rows)."""
    from legato.models.config import model_config_from_dict

    raw = dict(architectures=["Phi3ForCausalLM"], vocab_size=384, hidden_size=64,
               intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2)  # fmt: skip
    plan = TensorParallelPlan.for_model(model_config_from_dict(raw, {}), 2, 1)
    qkv = plan.shard("model.layers.0.self_attn.qkv_proj.weight")
    assert qkv is not None and qkv.dim == 0 and qkv.length == 32 + 16 + 16
    assert qkv.ranges == ((32, 64), (64 + 16, 64 + 32), (96 + 16, 96 + 32))
    gate_up = plan.shard("model.layers.1.mlp.gate_up_proj.weight")
    assert gate_up is not None and gate_up.ranges == ((64, 128), (128 + 64, 256))


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
