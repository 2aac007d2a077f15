"""Triton KV-cache write against the reference."""

from __future__ import annotations

import pytest
import torch

from legato.kernels import kv_write, reference


@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "block_size", "src_dtype", "cache_dtype"),
    [
        (2, 64, 16, torch.float32, torch.float32),
        (3, 80, 32, torch.float32, torch.float16),
        (2, 128, 16, torch.bfloat16, torch.bfloat16),
        (8, 64, 16, torch.float16, torch.float16),
    ],
)
def test_write_kv_matches_reference(
    device: str,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    src_dtype: torch.dtype,
    cache_dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(0)
    num_blocks, num_tokens = 9, 40
    # K and V as strided views of a fused projection output.
    fused = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen).to(src_dtype)
    key, value = fused[:, 1].to(device), fused[:, 2].to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::7] = -1  # padding
    slots = slots.to(device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype).to(device)
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype).to(device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    kv_write.write_kv(key, value, k_cache, v_cache, slots)
    reference.write_kv(key, value, k_ref, v_ref, slots)
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0)


def test_write_kv_empty_batch(device: str) -> None:
    cache = torch.zeros(2, 16, 1, 64, device=device)
    empty = torch.zeros(0, 1, 64, device=device)
    kv_write.write_kv(empty, empty, cache, cache, torch.zeros(0, dtype=torch.int64, device=device))
    assert not cache.any()
