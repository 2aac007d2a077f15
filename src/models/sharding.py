"""The tensor-parallel sharding plan (Megatron-style) of a Llama-family checkpoint.

For ``world_size`` ranks, rank ``r`` holds:

- **column-parallel** slices (rows of the ``[out, in]`` weight, and of the
  bias): its query heads of ``q_proj``, its KV heads of ``k_proj`` and
  ``v_proj``, its rows of ``gate_proj`` and ``up_proj``. Each checkpoint
  tensor is sliced on its own, so fusing q/k/v and gate/up after sharding
  gives the rank's own fused projection;
- **row-parallel** slices (columns of the weight) of ``o_proj`` and
  ``down_proj``, whose partial products the ranks add with an all-reduce.
  Their bias is added once: rank 0 holds it, the others hold zeros;
- **vocab-parallel** rows of the embedding and the LM head: rank ``r`` owns
  token ids ``[r * per_rank, (r + 1) * per_rank)``, the vocabulary padded with
  zero rows to a multiple of ``world_size``;
- everything else (norms, per-head q/k norms) whole.

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
_VOCAB_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class Shard:
    """What one rank holds of one checkpoint tensor.

    ``dim`` 0 (rows) or 1 (columns): the rank reads ``[start, stop)`` along it
    and pads with zeros to ``length``. ``dim`` None with ``zeros`` True: the
    rank holds zeros of the tensor's shape (a row-parallel bias off rank 0).
    """

    dim: Literal[0, 1] | None
    start: int = 0
    stop: int = 0
    length: int = 0
    zeros: bool = False


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
        return cls(
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
        )

    # ------------------------------------------------------- checkpoint

    def shard(self, name: str) -> Shard | None:
        """This rank's part of checkpoint tensor ``name`` (HF naming); None: the whole tensor."""
        if name in _VOCAB_NAMES:
            per = self.vocab_per_rank
            return Shard(0, self.vocab_start, self.vocab_stop, per)
        match = _COLUMN_RE.match(name)
        if match:
            proj = match.group(1).rsplit(".", 1)[1]
            if proj in ("k_proj", "v_proj"):
                rows = self.kv_heads_per_rank * self.head_dim
                start = self.kv_head_start * self.head_dim
            elif proj == "q_proj":
                rows = self.heads_per_rank * self.head_dim
                start = self.rank * rows
            else:
                rows = self.intermediate_per_rank
                start = self.rank * rows
            return Shard(0, start, start + rows, rows)
        match = _ROW_RE.match(name)
        if match:
            if match.group(2) == "bias":
                return None if self.rank == 0 else Shard(None, zeros=True)
            if match.group(1) == "self_attn.o_proj":
                cols = self.heads_per_rank * self.head_dim
            else:
                cols = self.intermediate_per_rank
            start = self.rank * cols
            return Shard(1, start, start + cols, cols)
        return None
