"""The vectorised plain-torch hot paths agree with legato.kernels.reference."""

from __future__ import annotations

import pytest
import torch

from legato.kernels import reference
from legato.models import torch_ops
from legato.models.attention_backend import select_backend
from legato.models.config import RopeConfig
from legato.models.rotary import rope_cos_sin_cache

H, HKV, D, BS = 4, 2, 16, 4


def _batch(
    q_lens: list[int], ctx_lens: list[int], dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Random cache + flat batch; blocks of each sequence are shuffled over the pool."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // BS) for c in ctx_lens) + 3
    key_cache = torch.randn(num_blocks, BS, HKV, D, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, BS, HKV, D, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(-(-c // BS) for c in ctx_lens) + 1
    tables = torch.full((len(ctx_lens), max_blocks), 10_000, dtype=torch.int32)  # junk padding
    used = 0
    for i, c in enumerate(ctx_lens):
        n = -(-c // BS)
        tables[i, :n] = perm[used : used + n].int()
        used += n
    query = torch.randn(sum(q_lens), H, D, generator=g).to(dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return query, key_cache, value_cache, tables, torch.tensor(ctx_lens, dtype=torch.int32), starts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("q_lens", "ctx_lens"),
    [
        ([1, 1, 1], [5, 9, 16]),  # decodes only
        ([1, 1, 6, 3], [7, 12, 6, 11]),  # decodes + a prefill + a prefill after a prefix hit
        ([4, 1, 5], [4, 3, 13]),  # a decode between two prefills
        ([1, 0, 2], [3, 5, 2]),  # an empty sequence
    ],
)
def test_paged_attention_matches_reference(
    dtype: torch.dtype, q_lens: list[int], ctx_lens: list[int]
) -> None:
    args = _batch(q_lens, ctx_lens, dtype)
    tables = args[3].clone()
    tables[tables == 10_000] = 0  # the reference indexes only what it needs, but be safe
    expected = reference.paged_attention(*args[:3], tables, *args[4:], 0.25)
    got = torch_ops.paged_attention(*args, 0.25)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("q_lens", "ctx_lens", "num_decodes"),
    [
        ([1, 1, 5, 3], [6, 9, 5, 10], 2),
        # a run of three fresh 4-token prompts (one batched call), a fresh 3, a prefix hit
        ([1, 4, 4, 4, 3, 4], [7, 4, 4, 4, 3, 9], 1),
    ],
)
def test_attend_writes_then_attends(
    dtype: torch.dtype, q_lens: list[int], ctx_lens: list[int], num_decodes: int
) -> None:
    """The per-step plan path: new K/V written at the slots, then attention, as the reference."""
    query, key_cache, value_cache, tables, seq_lens, starts = _batch(q_lens, ctx_lens, dtype, 1)
    tables[tables == 10_000] = 0
    g = torch.Generator().manual_seed(2)
    kv = torch.randn(sum(q_lens), 2, HKV, D, generator=g).to(dtype)
    key, value = kv[:, 0], kv[:, 1]  # strided, as split off a fused projection
    slots = []
    for i, (q, c) in enumerate(zip(q_lens, ctx_lens)):
        for pos in range(c - q, c):
            slots.append(int(tables[i, pos // BS]) * BS + pos % BS)
    slot_mapping = torch.tensor(slots)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    reference.write_kv(key, value, ref_k, ref_v, slot_mapping)
    expected = reference.paged_attention(query, ref_k, ref_v, tables, seq_lens, starts, 0.25)
    plan = torch_ops.plan_attention(
        tables, ctx_lens, starts.tolist(), slot_mapping, BS, dtype, num_decodes=num_decodes
    )
    got = torch_ops.attend(query, key, value, key_cache, value_cache, plan, 0.25)
    assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_and_activation_match_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 32, generator=g).to(dtype)
    res = torch.randn(5, 32, generator=g).to(dtype)
    w = torch.randn(32, generator=g).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(
        torch_ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), atol=tol, rtol=tol
    )
    got = torch_ops.fused_add_rms_norm(x, res, w, 1e-6)
    expected = reference.fused_add_rms_norm(x, res, w, 1e-6)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    torch.testing.assert_close(
        torch_ops.silu_and_mul(x), reference.silu_and_mul(x), atol=tol, rtol=tol
    )


@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3"])
def test_rotary_matches_reference(rope_type: str) -> None:
    rope = RopeConfig(
        theta=10000.0, rope_type=rope_type, factor=4.0, original_max_position_embeddings=32
    )
    cache = rope_cos_sin_cache(D, rope, 128, torch.device("cpu"))
    g = torch.Generator().manual_seed(4)
    qk = torch.randn(6, H + HKV, D, generator=g)
    positions = torch.tensor([0, 3, 17, 64, 100, 127])
    q_ref, k_ref = reference.apply_rotary(qk[:, :H], qk[:, H:], positions, cache, True)
    cos, sin = torch_ops.rotary_tables(cache, positions, torch.float32)
    out = torch_ops.rotate_neox(qk, cos, sin)
    torch.testing.assert_close(out[:, :H], q_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out[:, H:], k_ref, atol=1e-6, rtol=1e-6)


def test_select_backend() -> None:
    cpu = torch.device("cpu")
    assert select_backend("auto", cpu).name == "torch"
    assert select_backend("torch", cpu).name == "torch"
    assert select_backend("reference", cpu).name == "reference"
    with pytest.raises(ValueError, match="unknown backend"):
        select_backend("cudnn", cpu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("q_lens", "ctx_lens"),
    [
        ([1, 1, 1], [5, 9, 16]),  # decodes, two past the window (off the native kernel)
        ([1, 1], [3, 6]),  # decodes within the window (the native kernel where it builds)
        ([1, 9, 3], [12, 9, 11]),  # a fresh prompt past the window, a chunk after a prefix
    ],
)
def test_sliding_window_matches_reference(
    dtype: torch.dtype, q_lens: list[int], ctx_lens: list[int]
) -> None:
    args = _batch(q_lens, ctx_lens, dtype, seed=7)
    tables = args[3].clone()
    tables[tables == 10_000] = 0
    expected = reference.paged_attention(*args[:3], tables, *args[4:], 0.25, sliding_window=6)
    got = torch_ops.paged_attention(*args, 0.25, sliding_window=6)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
