"""``build_metadata``: one step's attention metadata (query starts, sequence lengths,
block tables, slot mapping) laid out once for every layer, from the step's rows.

Never imports trio.
"""

from __future__ import annotations

import numpy as np
import torch

from .attention_backend import AttentionMetadata


def build_metadata(
    starts: np.ndarray,
    q_lens: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    device: torch.device,
) -> tuple[AttentionMetadata, np.ndarray, np.ndarray]:
    """Flat-batch metadata for sequences computing ``q_lens`` tokens from ``starts``.

    ``block_table`` ``[S, >= needed]`` holds each sequence's blocks. Sequences
    with ``q_len == 1`` must come first. Returns the metadata plus, per token,
    its sequence index and position (host arrays).
    """
    num_seqs = len(q_lens)
    cu = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    num_tokens = int(cu[-1])
    seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
    positions = np.arange(num_tokens, dtype=np.int64) + (starts - cu[:-1])[seq_of_token]
    ends = starts + q_lens
    max_seq_len = int(ends.max()) if num_seqs else 0
    table = np.ascontiguousarray(block_table[:, : -(-max_seq_len // block_size)], dtype=np.int32)
    slots = table[seq_of_token, positions // block_size].astype(np.int64) * block_size + (
        positions % block_size
    )
    num_decodes = int(np.count_nonzero(q_lens == 1))

    def t(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(x).to(device, non_blocking=True)

    meta = AttentionMetadata(
        positions=t(positions),
        slot_mapping=t(slots),
        block_tables=t(table),
        seq_lens=t(ends.astype(np.int32)),
        query_start_loc=t(cu.astype(np.int32)),
        seq_lens_host=ends.tolist(),
        query_start_loc_host=cu.tolist(),
        num_decodes=num_decodes,
        max_query_len=int(q_lens.max()) if num_seqs else 0,
        max_seq_len=max_seq_len,
        block_size=block_size,
    )
    return meta, seq_of_token, positions
