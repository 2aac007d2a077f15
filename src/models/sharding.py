"""The tensor-parallel sharding plan (Megatron-style) of a Llama-family checkpoint.

For ``world_size`` ranks, rank ``r`` holds:

- **column-parallel** slices (rows of the ``[out, in]`` weight, and of the
  bias): its query heads of ``q_proj``, its KV heads of ``k_proj`` and
  ``v_proj``, its rows of ``gate_proj`` and ``up_proj``. Each checkpoint
  tensor is sliced on its own, so fusing q/k/v and gate/up after sharding
  gives the rank's own fused projection. A checkpoint that stores them fused
  (Phi-3's ``qkv_proj`` and ``gate_up_proj``) is sliced in each of its parts:
  the rank reads its query rows, its key rows and its value rows (its gate
  rows and its up rows) and joins them in that order, which is the rank's own
  fused tensor; a contiguous split of the fused rows would hand rank 0 every
  query head and rank 1 the keys and values;
- **row-parallel** slices (columns of the weight) of ``o_proj`` and
  ``down_proj``, whose partial products the ranks add with an all-reduce.
  Their bias is added once: rank 0 holds it, the others hold zeros;
- **vocab-parallel** rows of the embedding and the LM head: rank ``r`` owns
  token ids ``[r * per_rank, (r + 1) * per_rank)``, the vocabulary padded with
  zero rows to a multiple of ``world_size``;
- mixture of experts: within each expert, like the dense MLP (its ``gate`` and
  ``up`` rows, its ``down`` columns, of ``moe_intermediate_size / world_size``;
  Qwen2-MoE's shared expert likewise); every rank routes all tokens with the
  whole router and the ranks sum the experts' partial outputs. Chosen over
  placing whole experts on ranks: every rank does an equal share whatever the
  routing picks (a hot expert does not load one rank), any expert count works,
  and the only collective is the dense MLP's all-reduce, where expert placement
  needs an all-to-all of tokens;
- everything else (norms, per-head q/k norms, routers) whole.

Query heads are split evenly. KV heads are split evenly when there are at
least as many as ranks; when there are fewer, each is replicated on
``world_size / num_kv_heads`` consecutive ranks, so every rank's query heads
still read the KV head they belong to. Each rank's KV cache holds its own KV
heads only.

A shape the plan cannot split is a ``ValueError`` naming
``tensor_parallel_size`` and the figure that does not divide.

Never imports trio or torch.distributed.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Literal

from .config import ModelConfig

_LAYER = r"^model\.layers\.\d+\."
_COLUMN_RE = re.compile(_LAYER + r"(self_attn\.(q|k|v)_proj|mlp\.(gate|up)_proj)\.(weight|bias)$")
_ROW_RE = re.compile(_LAYER + r"(self_attn\.o_proj|mlp\.down_proj)\.(weight|bias)$")
# mixture of experts: each expert's projections (Qwen-MoE and Mixtral names), the shared expert's
_EXPERT_RE = re.compile(
    _LAYER + r"(mlp\.experts\.\d+\.(gate|up|down)_proj|block_sparse_moe\.experts\.\d+\.(w1|w3|w2))"
    r"\.weight$"
)
_SHARED_EXPERT_RE = re.compile(_LAYER + r"mlp\.shared_expert\.(gate|up|down)_proj\.weight$")
_VOCAB_NAMES = ("model.embed_tokens.weight", "lm_head.weight")
# projections a checkpoint stores fused (Phi-3): each part is split as its unfused tensor is
_FUSED_RE = re.compile(_LAYER + r"(self_attn\.qkv_proj|mlp\.gate_up_proj)\.(weight|bias)$")


@dataclass(frozen=True)
class Shard:
    """What one rank holds of one checkpoint tensor.

    ``dim`` 0 (rows) or 1 (columns): the rank reads each ``[start, stop)`` of
    ``ranges`` along it, joins them in order (one range, except for the parts
    of a fused tensor) and pads with zeros to ``length``. ``dim`` None with
    ``zeros`` True: the rank holds zeros of the tensor's shape (a row-parallel
    bias off rank 0).
    """

    dim: Literal[0, 1] | None
    ranges: tuple[tuple[int, int], ...] = ()
    length: int = 0
    zeros: bool = False

    @classmethod
    def span(cls, dim: Literal[0, 1], start: int, stop: int, length: int) -> Shard:
        """``[start, stop)`` along ``dim``, padded with zeros to ``length``."""
        return cls(dim, ((start, stop),), length)


@dataclass(frozen=True)
class TensorParallelPlan:
    """How rank ``rank`` of ``world_size`` shards a model of the given figures."""

    world_size: int
    rank: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    @classmethod
    def for_model(cls, cfg: ModelConfig, world_size: int, rank: int) -> TensorParallelPlan:
        """The plan for ``cfg``; ValueError when ``world_size`` does not fit the model."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank: {rank} is not a rank of {world_size}")
        name = "tensor_parallel_size"
        if cfg.num_heads % world_size:
            raise ValueError(
                f"{name}: {world_size} does not divide the model's {cfg.num_heads} attention heads"
            )
        kv = cfg.num_kv_heads
        if kv % world_size and world_size % kv:
            raise ValueError(
                f"{name}: {world_size} and the model's {kv} KV heads must divide one another "
                "(KV heads are split across ranks, or replicated when fewer than the ranks)"
            )
        if cfg.intermediate_size % world_size:
            raise ValueError(
                f"{name}: {world_size} does not divide the model's intermediate size "
                f"{cfg.intermediate_size}"
            )
        for figure, size in (
            ("expert intermediate size", cfg.moe_intermediate_size if cfg.num_experts else 0),
            ("shared expert intermediate size", cfg.shared_expert_intermediate_size),
        ):
            if size % world_size:
                raise ValueError(
                    f"{name}: {world_size} does not divide the model's {figure} {size}"
                )
        return cls(
            moe_intermediate_size=cfg.moe_intermediate_size if cfg.num_experts else 0,
            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
            world_size=world_size,
            rank=rank,
            num_heads=cfg.num_heads,
            num_kv_heads=kv,
            head_dim=cfg.head_dim,
            intermediate_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
        )

    # ------------------------------------------------------------ figures

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.world_size

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.world_size)

    @property
    def kv_head_start(self) -> int:
        """The first KV head this rank holds (a replicated one when KV heads < ranks)."""
        if self.num_kv_heads < self.world_size:
            return self.rank * self.num_kv_heads // self.world_size
        return self.rank * self.kv_heads_per_rank

    @property
    def intermediate_per_rank(self) -> int:
        return self.intermediate_size // self.world_size

    @property
    def vocab_per_rank(self) -> int:
        """Rows of the embedding and LM head per rank (the vocabulary padded up)."""
        return -(-self.vocab_size // self.world_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def vocab_stop(self) -> int:
        """One past this rank's last real token id (a padded tail holds no real token)."""
        return min(self.vocab_size, self.vocab_start + self.vocab_per_rank)

    def rank_config(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` with this rank's head counts and intermediate size (for building the
        rank's layers and sizing its KV cache). The vocabulary stays whole: the
        vocab-parallel layers take their rows from the plan."""
        return dataclasses.replace(
            cfg,
            num_heads=self.heads_per_rank,
            num_kv_heads=self.kv_heads_per_rank,
            intermediate_size=self.intermediate_per_rank,
            moe_intermediate_size=self.moe_intermediate_size // self.world_size,
            shared_expert_intermediate_size=self.shared_expert_intermediate_size // self.world_size,
        )

    # ------------------------------------------------------- checkpoint

    def shard(self, name: str) -> Shard | None:
        """This rank's part of checkpoint tensor ``name`` (HF naming); None: the whole tensor."""
        if name in _VOCAB_NAMES:
            per = self.vocab_per_rank
            return Shard.span(0, self.vocab_start, self.vocab_stop, per)
        expert = _EXPERT_RE.match(name) or _SHARED_EXPERT_RE.match(name)
        if expert:
            per = (
                self.shared_expert_intermediate_size
                if "shared_expert" in name
                else self.moe_intermediate_size
            ) // self.world_size
            start = self.rank * per
            column = name.endswith(("down_proj.weight", "w2.weight"))
            return Shard.span(1 if column else 0, start, start + per, per)
        match = _COLUMN_RE.match(name)
        if match:
            start, stop = self._column_rows(match.group(1).rsplit(".", 1)[1])
            return Shard.span(0, start, stop, stop - start)
        match = _FUSED_RE.match(name)
        if match:
            return self._fused_shard(match.group(1).rsplit(".", 1)[1])
        match = _ROW_RE.match(name)
        if match:
            if match.group(2) == "bias":
                return None if self.rank == 0 else Shard(None, zeros=True)
            if match.group(1) == "self_attn.o_proj":
                cols = self.heads_per_rank * self.head_dim
            else:
                cols = self.intermediate_per_rank
            start = self.rank * cols
            return Shard.span(1, start, start + cols, cols)
        return None

    def _column_rows(self, proj: str) -> tuple[int, int]:
        """This rank's rows ``[start, stop)`` of the column-parallel projection ``proj``."""
        if proj in ("k_proj", "v_proj"):
            rows = self.kv_heads_per_rank * self.head_dim
            start = self.kv_head_start * self.head_dim
        elif proj == "q_proj":
            rows = self.heads_per_rank * self.head_dim
            start = self.rank * rows
        else:
            rows = self.intermediate_per_rank
            start = self.rank * rows
        return start, start + rows

    def _fused_shard(self, fused: str) -> Shard:
        """This rank's rows of each part of a fused projection (``qkv_proj``: query, key,
        value; ``gate_up_proj``: gate, up), in the fused tensor's own row numbers."""
        q_rows, kv_rows = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        parts = (
            (("q_proj", 0), ("k_proj", q_rows), ("v_proj", q_rows + kv_rows))
            if fused == "qkv_proj"
            else (("gate_proj", 0), ("up_proj", self.intermediate_size))
        )
        ranges = []
        for proj, offset in parts:
            start, stop = self._column_rows(proj)
            ranges.append((offset + start, offset + stop))
        return Shard(0, tuple(ranges), sum(stop - start for start, stop in ranges))
