"""CUDA graphs for pure-decode and verification steps: capture at a ladder of batch sizes,
pad, replay.

A decode step (every scheduled request computes one token) launches a few
hundred small kernels whose Python launch cost dominates at small batches.
:class:`DecodeGraphRunner` captures the model forward once per batch size of
:func:`capture_sizes` (1, 2, 4, 8, 16, 24, ... as in vLLM) into
``torch.cuda.CUDAGraph`` objects that share one memory pool, each reading the
first ``B`` rows of one set of static input buffers. At run time a batch of
``n`` requests is padded up to the next captured size, its inputs are copied
into the static buffers and the graph is replayed; the caller slices the real
rows out of the static output. Padded rows write no KV (slot -1) and read one
token of the null block 0 (seq_len 1, block table row 0), so they touch only
valid memory and never change the cache.

A speculative verification step (each request computes its last token and up
to ``k`` drafts) is as launch-bound, and eager it cost several plain steps.
A runner built with ``query_len=q`` (``k + 1``) captures steps whose every
sequence has ``q`` query rows: a request verifying fewer drafts is padded to
``q`` rows. Its ``seq_len`` is ``start + q``, so each real row ``j`` attends to
positions up to ``start + j`` exactly as in the eager step (causal from the
end); padded rows write no KV (slot -1) and their outputs are dropped. They
may read K/V slots past the request's own (stale or null blocks, always
valid block ids), which no real row sees.

The captured forward must be graph-safe: no host syncs and no shapes or
launch plans taken from the step's data. The Triton backend is, given the
hints the graph metadata fixes: ``max_query_len`` (1: the decode kernels;
``q``: the varlen kernel, whose grid follows the token count) and
``max_seq_len=max_model_len`` (a static split plan).

Tests have no GPU, so a runner built with ``mode="emulate"`` "captures" by
recording the same forward over the same static buffers and metadata and
"replays" by calling it eagerly: the padding and buffer logic is exercised
unchanged on CPU.

Never imports trio.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from .attention_backend import AttentionMetadata, Backend
from .llama import KVCache, LlamaForCausalLM

logger = logging.getLogger(__name__)

CaptureMode = Literal["cuda", "emulate"]

MAX_CAPTURE_SIZE = 256  # no graph above this batch size (vLLM's default ceiling)
_WARMUP_RUNS = 2  # eager forwards before each capture: compile kernels, settle the allocator


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """The batch sizes to capture: 1, 2, 4, then multiples of 8, up to ``min(max_num_seqs, limit)``.

    The ceiling itself is always included, so every batch up to it has a graph.
    """
    cap = max(1, min(max_num_seqs, limit))
    sizes = [s for s in (1, 2, 4, *range(8, limit + 1, 8)) if s <= cap]
    if sizes[-1] != cap:
        sizes.append(cap)
    return sizes


def wants_decode_graphs(device: torch.device, enforce_eager: bool, backend: Backend) -> bool:
    """Whether a runner should capture decode graphs: on CUDA, not eager, a graph-safe backend."""
    return device.type == "cuda" and not enforce_eager and backend.graph_safe


@dataclass(slots=True)
class _Captured:
    """One batch size's graph (None when emulated), its metadata and static output."""

    size: int
    meta: AttentionMetadata
    graph: torch.cuda.CUDAGraph | None
    output: torch.Tensor | None  # [size, hidden]; set at capture on CUDA


class DecodeGraphRunner:
    """The model forward for pure-decode batches (or verification batches of ``query_len``
    rows a sequence), captured at fixed batch sizes.

    Static inputs, sized for the largest captured batch ``M`` and ``q =
    query_len`` rows a sequence: ``input_ids``, ``positions``, ``slot_mapping``
    and ``gather`` (where each real row's output lies) ``[M * q]`` int64;
    ``seq_lens`` ``[M]`` int32; ``query_start_loc`` ``[M + 1]`` int32, the
    constant ``0, q, 2q, ...``; ``block_tables`` ``[M, max_blocks]`` int32 with
    ``max_blocks`` the blocks of ``max_model_len + q`` tokens. The graph of
    size ``B`` reads their first ``B`` sequences and writes its own static
    output ``[B * q, hidden]``. Capture holds on to ``model``'s parameters and
    to the ``kv_caches`` tensors: if either moves (sleep, offload), drop this
    runner and build a new one.

    Not thread-safe; the model runner owns it. :meth:`capture` must run before
    :meth:`run`.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[KVCache],
        *,
        sizes: Sequence[int],
        max_model_len: int,
        block_size: int,
        device: torch.device,
        mode: CaptureMode = "cuda",
        query_len: int = 1,
    ) -> None:
        if mode not in ("cuda", "emulate"):
            raise ValueError(f"mode: expected 'cuda' or 'emulate', got {mode!r}")
        if mode == "cuda" and device.type != "cuda":
            raise ValueError(f"mode 'cuda' needs a CUDA device, got {device}")
        if not model.backend.graph_safe:
            raise ValueError(
                f"attention backend {model.backend.name!r} is not graph-safe "
                "(it plans attention from host-side lengths or syncs); use 'triton'"
            )
        if not sizes or min(sizes) < 1:
            raise ValueError(f"sizes: need positive batch sizes, got {list(sizes)}")
        if query_len < 1:
            raise ValueError(f"query_len: need at least 1 row a sequence, got {query_len}")
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(set(sizes))
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        self.mode: CaptureMode = mode
        self.query_len = query_len
        self.max_blocks = -(-(max_model_len + query_len) // block_size)
        self.replays: Counter[int] = Counter()  # replays per captured size
        self._captured: dict[int, _Captured] = {}
        self._pool = torch.cuda.graph_pool_handle() if mode == "cuda" else None  # shared by all
        self._copied: torch.cuda.Event | None = None  # staging may be rewritten once it fires

        m, q, cols = self.max_batch_size, query_len, self.max_blocks

        def dev(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        def host(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")

        # Two staging areas, each one host-to-device copy per step (API calls cost more
        # host time than these few kilobytes): int64 [ids | positions | slots | gather] and
        # int32 [seq_lens | the step's block-table rows, packed]; the packed rows then go to
        # their places in ``block_tables`` with one device-side copy.
        self._i64 = dev(4, m * q, dtype=torch.int64)
        self.input_ids, self.positions, self.slot_mapping, self.gather = self._i64.unbind(0)
        self.slot_mapping.fill_(-1)
        self._i32 = dev(m + m * cols, dtype=torch.int32)
        self.seq_lens = self._i32[:m].fill_(q)
        self.query_start_loc = torch.arange(0, (m + 1) * q, q, dtype=torch.int32, device=device)
        self.block_tables = dev(m, cols, dtype=torch.int32)
        self._host_i64 = host(4, m * q, dtype=torch.int64)
        self._host_i32 = host(m + m * cols, dtype=torch.int32)

    @property
    def max_batch_size(self) -> int:
        """The largest captured batch size; larger batches run eagerly."""
        return self.sizes[-1]

    @property
    def captured(self) -> bool:
        return bool(self._captured)

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size a batch of ``num_seqs`` is padded to; None above the largest."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def graph(self, num_seqs: int) -> torch.cuda.CUDAGraph | None:
        """The CUDA graph a batch of ``num_seqs`` replays; None when emulated or none fits.

        Only right after :meth:`run` of such a batch does replaying it by hand
        recompute that step (rewriting the same K/V); benchmarks time it so.
        """
        size = self.padded_size(num_seqs)
        entry = self._captured.get(size) if size is not None else None
        return entry.graph if entry is not None else None

    def fits(self, num_seqs: int, max_seq_len: int, max_query_len: int = 1) -> bool:
        """Whether a batch of ``num_seqs`` sequences, each computing at most
        ``max_query_len`` rows and of at most ``max_seq_len`` tokens (its new rows
        included), can be replayed."""
        return (
            self.captured
            and 0 < num_seqs <= self.max_batch_size
            and 0 < max_query_len <= self.query_len
            and max_seq_len <= self.max_blocks * self.block_size - self.query_len + 1
        )

    # ------------------------------------------------------------ capture

    def _metadata(self, size: int) -> AttentionMetadata:
        """Metadata over the first ``size`` sequences of the static buffers, with fixed hints.

        The host-side lengths are upper bounds (every row ``max_model_len``):
        a graph-safe backend never reads them.
        """
        q, rows = self.query_len, size * self.query_len
        return AttentionMetadata(
            positions=self.positions[:rows],
            slot_mapping=self.slot_mapping[:rows],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens_host=[self.max_model_len] * size,
            query_start_loc_host=list(range(0, rows + 1, q)),
            num_decodes=size if q == 1 else 0,
            max_query_len=q,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
        )

    def _forward(self, entry: _Captured) -> torch.Tensor:
        rows = entry.size * self.query_len
        hidden: torch.Tensor = self.model(self.input_ids[:rows], self.kv_caches, entry.meta)
        return hidden

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, so that smaller graphs reuse the shared pool.

        The static buffers hold padding while capturing (slot -1, seq_len
        ``query_len``, block 0), so the warm-up runs and the capture leave the
        KV cache as it was. Blocks while capturing (seconds for a large model).
        """
        began = time.perf_counter()
        for size in reversed(self.sizes):
            entry = _Captured(size, self._metadata(size), None, None)
            if self.mode == "cuda":
                self._capture_cuda(entry)
            self._captured[size] = entry
        if self.mode == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info(
            "%s graphs (%s) captured for batch sizes %s in %.1f s",
            "decode" if self.query_len == 1 else f"verification ({self.query_len} rows)",
            self.mode,
            self.sizes,
            time.perf_counter() - began,
        )

    def _capture_cuda(self, entry: _Captured) -> None:
        for _ in range(_WARMUP_RUNS):
            self._forward(entry)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            entry.output = self._forward(entry)
        entry.graph = graph

    # ---------------------------------------------------------------- run

    def run(
        self,
        token_ids: np.ndarray,
        positions: np.ndarray,
        block_table: np.ndarray,
        query_lens: np.ndarray | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of one step of ``n`` sequences, ``T`` rows.

        Sequence ``i`` computes ``query_lens[i]`` rows (default 1), tokens
        ``token_ids`` flat in sequence order, the first at position
        ``positions[i]`` (its ``positions[i]`` earlier tokens are in the
        cache), with blocks ``block_table[i]`` (valid up to its last row's
        block). Writes each row's K/V into the cache and returns the rows in
        ``token_ids``' order: a view of the static output (decode) or a gather
        from it (verification), valid until the next call. Requires
        :meth:`fits`; never syncs the host with the device except to wait for
        the previous call's input copies.
        """
        n = len(positions)
        q = self.query_len
        size = self.padded_size(n)
        entry = self._captured.get(size) if size is not None else None
        if entry is None or size is None:
            raise ValueError(f"no decode graph for a batch of {n} (captured: {self.sizes})")
        lens = np.ones(n, dtype=np.int64) if query_lens is None else query_lens.astype(np.int64)
        if len(lens) != n or int(lens.min()) < 1 or int(lens.max()) > q:
            raise ValueError(f"query_lens: each sequence computes 1 to {q} rows")
        bs = self.block_size
        cols = -(-(int(positions.max()) + q) // bs)
        if cols > self.max_blocks:
            raise ValueError(f"a sequence of {int(positions.max()) + q} tokens exceeds the graphs")
        if self._copied is not None:
            self._copied.synchronize()
        m = self.max_batch_size
        total = int(lens.sum())
        seq = np.repeat(np.arange(n), lens)  # each real row's sequence
        offsets = np.cumsum(lens) - lens  # each sequence's first real row
        col = np.arange(total) - offsets[seq]  # each real row's place in its sequence
        padded = seq * q + col  # where the row lies in the padded layout
        pos = positions.astype(np.int64)[seq] + col
        i64 = self._host_i64.numpy()
        i64[:2, : size * q] = 0
        i64[2, : size * q] = -1
        i64[0, padded] = token_ids
        i64[1, padded] = pos
        width = min(cols, block_table.shape[1])
        i64[2, padded] = block_table[seq, pos // bs].astype(np.int64) * bs + pos % bs
        i64[3, :total] = padded
        i32 = self._host_i32.numpy()
        i32[:n] = positions + q  # seq_lens: each real row j attends up to positions[i] + j
        i32[n:size] = q
        table = i32[m : m + size * cols].reshape(size, cols)
        table[:n, :width] = block_table[:, :width]
        table[:n, width:] = 0
        table[n:] = 0
        nb = self.device.type == "cuda"
        # Rows past ``size`` are copied too (stale): this graph never reads them.
        self._i64.copy_(self._host_i64, non_blocking=nb)
        self._i32[: m + size * cols].copy_(self._host_i32[: m + size * cols], non_blocking=nb)
        self.block_tables[:size, :cols].copy_(self._i32[m : m + size * cols].view(size, cols))
        if nb:
            self._copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._copied.record()
        self.replays[size] += 1
        if entry.graph is not None:
            entry.graph.replay()
        else:
            entry.output = self._forward(entry)
        assert entry.output is not None
        if q == 1:
            return entry.output[:n]
        return entry.output.index_select(0, self.gather[:total])
