"""Fixtures for the kernel tests: random paged batches with shuffled block tables, tolerances.

Served as fixtures because pytest runs with ``--import-mode=importlib``, where
test modules cannot import helpers from beside them. The root conftest sets
``TRITON_INTERPRET=1`` on machines without CUDA before anything imports
triton; kernels then run on CPU tensors. Shapes are kept small because the
interpreter pays per program instance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class PagedBatch:
    """One flat batch on a paged KV cache, in the reference's argument order."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float

    def args(self) -> tuple[torch.Tensor, ...]:
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
        )


def build_paged_batch(
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> PagedBatch:
    """A batch whose sequence ``i`` has ``seq_lens[i]`` tokens, the last ``query_lens[i]`` new.

    Every block of the cache holds random data (so reading a wrong block shows),
    block ids are a random permutation spread over a pool twice the size needed,
    and unused block-table entries hold an out-of-range id.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    max_blocks = max(blocks_per_seq) + 1
    num_blocks = 2 * sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(seq_lens), max_blocks), num_blocks + 1000, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = ids[used : used + n].to(torch.int32)
        used += n
    total = sum(query_lens)
    query = torch.randn((total, num_heads, head_dim), generator=gen).to(dtype)
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    return PagedBatch(
        query=query.to(DEVICE),
        key_cache=key_cache.to(DEVICE),
        value_cache=value_cache.to(DEVICE),
        block_tables=block_tables.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=starts.to(DEVICE),
        scale=head_dim**-0.5,
    )


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    """assert_close tolerances for kernel-vs-reference comparisons."""
    if dtype == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-5}
    if dtype == torch.bfloat16:  # one bf16 ulp of difference in the final rounding
        return {"rtol": 1.6e-2, "atol": 1e-2}
    return {"rtol": 1e-3, "atol": 1e-3}


@pytest.fixture
def device() -> str:
    """The device kernel tests run on: cuda when present, else cpu under the interpreter."""
    return DEVICE


@pytest.fixture
def paged_batch() -> Callable[..., PagedBatch]:
    """The :func:`build_paged_batch` factory."""
    return build_paged_batch


@pytest.fixture
def tol() -> Callable[[torch.dtype], dict[str, float]]:
    """The :func:`tolerances` lookup."""
    return tolerances
