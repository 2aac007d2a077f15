"""The draft-model proposer: a smaller checkpoint with the target's tokenizer proposes
each step's drafts (``speculative_config={"model": path, ...}``).

**Its KV cache**: its own cache tensors (its own layers, heads and head size) over the
target's block ids: block ``b`` of the draft cache holds the draft's KV of the tokens
whose target KV block ``b`` holds. The draft runs on the target's forwards, over the
same tokens at the same slots (:meth:`DraftModelProposer.observe`), so its KV is
valid where the target's is. Everything the scheduler does to blocks then holds for
both caches without a second block manager or a scheduler change: allocation,
prefix-cache hits, preemption, freeing, and the rollback of rejected drafts (their
slots are rewritten by the next step). The price: the draft cache has as many blocks
as the target's (the runner sizes both together, adding
:meth:`~DraftModelProposer.kv_block_bytes` to the target's per-block bytes).

**Skipped forwards**: the runner skips the draft on a step of decode rows none of
which proposes after it (each request's ``SchedulerOutput.draft_limits`` entry 0: it
backs off, or the step cost leaves its drafts out), so a draft that does not pay
costs next to nothing. The proposer keeps, per request, how many of its leading
positions its KV holds (``_valid``: a span observed right after them extends it; a
request's first span counts its prefix-cache hit as held); :meth:`propose` first
computes the draft over the positions after that (one forward, the rows as a chunk
of a prompt), then proposes. A block filled while its request skipped the draft and
then shared as a prefix-cache hit holds stale draft KV for its new reader: only its
drafts' acceptance suffers, never an output (verification decides every token).

**Proposing** ``k`` tokens computes the draft at the ``k`` positions from the
request's last token on, which its blocks may not cover yet (the scheduler
allocates them when it schedules the drafts). Positions past a request's blocks go
to scratch blocks of its batch row, past the shared ones; the next verification's
forward rewrites those positions in the request's own blocks.

**Sampling**: a greedy request takes the draft's argmax (the draft distribution
``q`` is a point mass, as an n-gram draft's). Others draw from the draft's softmax
at the request's temperature, and the verification uses that ``q``
(:func:`~.rejection_sampler.verify`'s ``draft_probs``): the output keeps the
target's distribution whatever ``q`` is. A seeded request's draws use a generator
seeded per output position, so they do not depend on what shares its batch.

A proposer reading the target's hidden states (EAGLE heads) takes the same seam:
:meth:`~DraftModelProposer.observe` hands it the target's hidden rows of the step.

Never imports trio.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ..config import SpeculativeConfig
from ..tokenizer_loading import load_tokenizer
from .attention_backend import AttentionMetadata, Backend
from .config import ModelConfig, load_model_config
from .cpu_linear import pack_linears
from .input_batch import InputBatch, step_seed
from .llama import KVCache, LlamaForCausalLM
from .loader import load_model
from .registry import resolve_architecture
from .step_metadata import build_metadata

_GREEDY_EPS = 1e-5  # InputBatch's temperature below which a request is greedy
_DRAFT_SEED_SALT = 0x5EED_D2AF  # a seeded request's draft draws: not its own stream


class ModelProposer(Protocol):
    """A proposer that computes with a model beside the target (a draft model; EAGLE
    heads would read ``target_hidden``). The runner calls :meth:`observe` after each
    target forward, :meth:`propose` after each sampling, :meth:`draft_probs` when
    verifying and :meth:`forget` when a request leaves the batch."""

    def observe(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        target_hidden: torch.Tensor,
        spans: list[tuple[str, int, int]],
    ) -> None: ...

    def propose(
        self, batch: InputBatch, rows: np.ndarray, limits: np.ndarray
    ) -> dict[int, list[int]]: ...

    def draft_probs(
        self, req_ids: list[str], drafts: list[list[int]], vocab_size: int
    ) -> torch.Tensor | None: ...

    def forget(self, req_id: str) -> None: ...


@dataclass(slots=True)
class _Proposal:
    tokens: list[int]
    probs: torch.Tensor | None  # [len(tokens), V] q of each draft; None: point masses


def check_same_vocabulary(
    target: ModelConfig, draft: ModelConfig, target_tokenizer: str, draft_dir: Path
) -> None:
    """ValueError naming ``speculative_config.model`` unless the draft's vocabulary is the
    target's: the same ``vocab_size`` and, when the draft directory has a tokenizer, the
    same token -> id map. Blocks while loading the tokenizers (about a second)."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft's vocab_size is {draft.vocab_size}, the "
            f"target's {target.vocab_size}; a draft model must share the target's tokenizer"
        )
    if not any((draft_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return
    want = load_tokenizer(target_tokenizer).get_vocab()
    got = load_tokenizer(str(draft_dir)).get_vocab()
    if want != got:
        token = next((t for t in sorted(set(want) | set(got)) if want.get(t) != got.get(t)), "?")
        raise ValueError(
            "speculative_config.model: the draft's tokenizer differs from the target's "
            f"(token {token!r} is id {want.get(token)} in the target, {got.get(token)} in "
            "the draft); a draft model must share the target's tokenizer"
        )


class DraftModelProposer:
    """Up to ``num_speculative_tokens`` drafts per request from a draft model.

    Construction loads the draft (blocks) and checks its vocabulary against the
    target's (:func:`check_same_vocabulary`); :meth:`allocate` then makes its KV cache
    once the target's block count is known.
    """

    def __init__(
        self,
        spec: SpeculativeConfig,
        target: ModelConfig,
        target_tokenizer: str,
        *,
        backend: Backend,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        seed: int,
    ) -> None:
        assert spec.model is not None
        draft_dir = Path(spec.model)
        if not (draft_dir / "config.json").is_file():
            raise ValueError(
                f"speculative_config.model: {spec.model} is not a model directory (no config.json)"
            )
        _, mcfg = resolve_architecture(load_model_config(draft_dir))
        check_same_vocabulary(target, mcfg, target_tokenizer, draft_dir)
        if target.uniform_window is not None and mcfg.uniform_window != target.uniform_window:
            # the scheduler frees the blocks out of the target's window: the draft's too
            raise ValueError(
                "speculative_config.model: the target attends through a sliding window of "
                f"{target.uniform_window} tokens (its older KV blocks are freed); the draft "
                f"must too, and its window is {mcfg.uniform_window}"
            )
        self.model_config = mcfg
        self.k = spec.num_speculative_tokens
        self.dtype, self.device = dtype, device
        self.model: LlamaForCausalLM = load_model(
            draft_dir, mcfg, backend, dtype, device, max_positions
        )
        pack_linears(self.model)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed ^ _DRAFT_SEED_SALT)
        self.kv_caches: list[KVCache] = []
        self.block_size = 0
        self.scratch_base = 0  # the first scratch block (past the shared ones)
        self.scratch_per_row = 0
        self.num_rows = 0
        self._proposals: dict[str, _Proposal] = {}
        self._valid: dict[str, int] = {}  # per request: its leading positions the KV holds

    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes of one block of the draft's KV cache."""
        m = self.model_config
        return 2 * m.num_layers * block_size * m.num_kv_heads * m.head_dim * self.dtype.itemsize

    def allocate(self, num_blocks: int, num_rows: int, block_size: int) -> None:
        """The draft's KV cache: ``num_blocks`` blocks shared by id with the target's, then
        scratch blocks for proposals past a request's blocks (``num_rows`` batch rows)."""
        m = self.model_config
        self.block_size = block_size
        self.scratch_per_row = self.k // block_size + 2
        self.scratch_base = num_blocks
        self.num_rows = num_rows
        total = num_blocks + num_rows * self.scratch_per_row
        shape = (total, block_size, m.num_kv_heads, m.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(m.num_layers)
        ]

    def observe(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        target_hidden: torch.Tensor,
        spans: list[tuple[str, int, int]],
    ) -> None:
        """Compute the draft over a target forward's tokens (``meta``: its slots), so the
        draft's KV is valid where the target's is; ``spans``: each request's positions
        ``[start, end)`` in the forward. The draft reads no target state."""
        del target_hidden
        self.model(input_ids, self.kv_caches, meta)
        valid = self._valid
        for req_id, start, end in spans:
            if valid.get(req_id, start) >= start:  # no gap before it
                valid[req_id] = end

    @torch.inference_mode()
    def propose(
        self, batch: InputBatch, rows: np.ndarray, limits: np.ndarray
    ) -> dict[int, list[int]]:
        """Drafts for the requests at batch ``rows`` (each one's tokens so far; its last
        token not computed yet), at most ``limits[i]`` (and ``num_speculative_tokens``)
        each: ``{row: drafts}``, rows with none left out. Runs the draft
        ``max(limits)`` times, over all the rows still drafting."""
        limits = np.minimum(limits, self.k)
        keep = (limits > 0) & (rows < self.num_rows)
        rows, limits = rows[keep], limits[keep]
        n = len(rows)
        if n == 0:
            return {}
        positions = batch.num_tokens[rows] - 1
        ids = batch.token_ids[rows, positions].astype(np.int64)
        table = self._block_table(batch, rows)
        self._catch_up(batch, rows, positions, table)
        temperature = batch.temperature[rows]
        n_out = batch.num_tokens[rows] - batch.num_prompt[rows]
        tokens = np.zeros((n, int(limits.max())), dtype=np.int64)
        probs: list[list[torch.Tensor]] = [[] for _ in range(n)]
        for j in range(tokens.shape[1]):
            live = np.flatnonzero(limits > j)
            meta, _, _ = build_metadata(
                positions[live], np.ones(len(live), dtype=np.int64), table[live],
                self.block_size, self.device,
            )  # fmt: skip
            hidden = self.model(torch.from_numpy(ids[live]).to(self.device), self.kv_caches, meta)
            logits = self.model.compute_logits(hidden).float()
            chosen = logits.argmax(-1)
            live_sampled = np.flatnonzero(temperature[live] >= _GREEDY_EPS)
            if len(live_sampled):
                idx = torch.from_numpy(live_sampled).to(self.device)
                temp = torch.from_numpy(temperature[live][live_sampled]).to(self.device)
                q = torch.softmax(logits.index_select(0, idx) / temp[:, None], dim=-1)
                draws = self._draw(
                    q, batch, rows[live][live_sampled], n_out[live][live_sampled] + j
                )
                chosen[idx] = draws
                for a, i in enumerate(live[live_sampled].tolist()):
                    probs[i].append(q[a])
            got = chosen.cpu().numpy()
            tokens[live, j] = got
            ids[live] = got
            positions[live] += 1
        out: dict[int, list[int]] = {}
        for i, row in enumerate(rows.tolist()):
            drafts = tokens[i, : int(limits[i])].tolist()
            q_rows = torch.stack(probs[i]) if probs[i] else None
            self._proposals[batch.state(row).req_id] = _Proposal(drafts, q_rows)
            out[row] = drafts
        return out

    def draft_probs(
        self, req_ids: list[str], drafts: list[list[int]], vocab_size: int
    ) -> torch.Tensor | None:
        """``[R, V]`` draft distributions in :func:`~.rejection_sampler.verify`'s row order
        (each request's drafts, then a zero row for its bonus token): ``q`` of the drafts
        this proposer drew, a point mass for others (greedy, or not its proposal). None
        when every row is a point mass (verify's default)."""
        held = [self._proposals.get(r) for r in req_ids]
        drawn = [
            h is not None and h.probs is not None and bool(d) and h.tokens[: len(d)] == d
            for h, d in zip(held, drafts, strict=True)
        ]
        if not any(drawn):
            return None
        pieces: list[torch.Tensor] = []
        for h, d, q in zip(held, drafts, drawn, strict=True):
            rows = torch.zeros(len(d) + 1, vocab_size, device=self.device)
            if q:
                assert h is not None and h.probs is not None
                rows[: len(d)] = h.probs[: len(d)]
            elif d:
                rows[torch.arange(len(d)), torch.tensor(d)] = 1.0
            pieces.append(rows)
        return torch.cat(pieces)

    def forget(self, req_id: str) -> None:
        """Drop a request's last proposal and KV extent (it finished or was preempted)."""
        self._proposals.pop(req_id, None)
        self._valid.pop(req_id, None)

    def _catch_up(
        self, batch: InputBatch, rows: np.ndarray, positions: np.ndarray, table: np.ndarray
    ) -> None:
        """Compute the draft's KV of each row's positions from what it holds up to
        ``positions`` (each row's last token, computed by the proposal), all rows behind in
        one forward; a rejected draft's position is not held (the extent stops at the last
        token)."""
        req_ids = [batch.state(row).req_id for row in rows.tolist()]
        held = np.minimum([self._valid.get(r, 0) for r in req_ids], positions)
        behind = np.flatnonzero(held < positions)
        # one-token rows first, as build_metadata takes them
        behind = behind[np.argsort(positions[behind] - held[behind] > 1, kind="stable")]
        if len(behind):
            starts, lens = held[behind], positions[behind] - held[behind]
            meta, seq_of_token, at = build_metadata(
                starts, lens, table[behind], self.block_size, self.device
            )
            ids = batch.token_ids[rows[behind][seq_of_token], at].astype(np.int64)
            self.model(torch.from_numpy(ids).to(self.device), self.kv_caches, meta)
        for r, position in zip(req_ids, positions.tolist(), strict=True):
            self._valid[r] = position

    def _block_table(self, batch: InputBatch, rows: np.ndarray) -> np.ndarray:
        """``rows``' block tables with each row's scratch blocks after its own."""
        table: np.ndarray = batch.block_table[rows].copy()
        width, per_row = table.shape[1], self.scratch_per_row
        for i, row in enumerate(rows.tolist()):
            first = int(batch.num_blocks[row])
            stop = min(width, first + per_row)
            table[i, first:stop] = self.scratch_base + row * per_row + np.arange(stop - first)
        return table

    def _draw(
        self, q: torch.Tensor, batch: InputBatch, rows: np.ndarray, n_out: np.ndarray
    ) -> torch.Tensor:
        """One draw per row of ``q``; a seeded request's from its seed and output position."""
        draws = torch.multinomial(q, 1, generator=self.generator)[:, 0]
        for a in np.flatnonzero(batch.has_seed[rows]).tolist():
            seed = batch.state(int(rows[a])).seed
            assert seed is not None
            gen = torch.Generator(device=self.device)
            gen.manual_seed(step_seed(seed ^ _DRAFT_SEED_SALT, int(n_out[a])))
            draws[a] = torch.multinomial(q[a], 1, generator=gen)[0]
        return draws
