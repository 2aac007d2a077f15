"""Tensor-parallel layers and loading: one rank's share of a Llama-family model.

:class:`TensorParallel` is what a rank's :class:`~legato.models.runner.ModelRunner`
is given. It builds the rank's model from the plan
(:mod:`legato.models.sharding`): the ordinary layers at the rank's
sizes (its query and KV heads, its share of the MLP), with four modules
swapped for their parallel forms:

- ``o_proj`` and ``down_proj`` become :class:`RowParallelLinear`: the rank's
  partial product, summed over the ranks with an all-reduce;
- ``embed_tokens`` becomes :class:`VocabParallelEmbedding`: the rank looks
  up the ids it owns, zeros for the others, and the ranks sum;
- ``lm_head`` becomes :class:`VocabParallelHead`: the rank's logit columns,
  gathered from every rank (an all-gather), so every rank holds the whole
  logits and samples the same tokens from them.

Weights are read slice by slice: from safetensors only the rank's slice of
each tensor is read (``safe_open(...).get_slice``); a GGUF file is
dequantized tensor by tensor and sliced; a random-weights directory draws
every tensor at full size exactly as a single-device load would, then keeps
the rank's slice, so tensor-parallel and single-device runs of it match.

Never imports trio.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from .attention_backend import Backend
from .config import ModelConfig, read_json
from .gguf_checkpoint import gguf_weights_file, iter_gguf_weights, open_gguf
from .layers import MLP, Attention, Embedding, Linear, RMSNorm
from .llama import _FUSED, LlamaForCausalLM
from .loader import RANDOM_WEIGHTS_FILE, build_model, safetensors_files
from .moe import SparseMoeBlock
from .process_group import TensorParallelGroup
from .sharding import Shard, TensorParallelPlan


class RowParallelLinear(Linear):
    """``o_proj`` / ``down_proj`` on one rank: its input columns, then the sum over ranks.

    Off rank 0 the bias holds zeros, so the sum adds it once.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        group: TensorParallelGroup,
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype, device)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x))


class VocabParallelEmbedding(Embedding):
    """The rank's rows ``[start, start + rows)`` of the table; other ids look up zeros."""

    def __init__(
        self,
        rows: int,
        hidden: int,
        start: int,
        dtype: torch.dtype,
        device: torch.device,
        group: TensorParallelGroup,
    ) -> None:
        super().__init__(rows, hidden, dtype, device)
        self.start = start
        self.rows = rows
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(hidden)


class VocabParallelHead(Linear):
    """The LM head on one rank: its logit columns, gathered from every rank and cut
    to the real vocabulary."""

    def __init__(
        self,
        hidden: int,
        rows: int,
        vocab_size: int,
        dtype: torch.dtype,
        device: torch.device,
        group: TensorParallelGroup,
    ) -> None:
        super().__init__(hidden, rows, False, dtype, device)
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.group.all_gather_columns(super().forward(x))
        return logits[:, : self.vocab_size]


class TensorParallel:
    """One rank's view of tensor parallelism: its group, and how it builds and fills
    its share of the model. See the module docstring."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def plan(self, cfg: ModelConfig) -> TensorParallelPlan:
        return TensorParallelPlan.for_model(cfg, self.world_size, self.rank)

    def rank_config(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` at this rank's sizes (heads, KV heads, intermediate)."""
        return self.plan(cfg).rank_config(cfg)

    def build_model(
        self,
        cfg: ModelConfig,
        backend: Backend,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
    ) -> LlamaForCausalLM:
        """This rank's model of the whole-model config ``cfg``, weights uninitialised."""
        plan = self.plan(cfg)
        model = build_model(plan.rank_config(cfg), backend, dtype, device, max_positions)
        group = self.group
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp  # every family's layer has these
            assert isinstance(attn, Attention)
            attn.o_proj = RowParallelLinear(
                plan.heads_per_rank * plan.head_dim, cfg.hidden_size, cfg.o_bias, dtype, device,
                group,
            )  # fmt: skip
            if isinstance(mlp, SparseMoeBlock):  # sharded within each expert
                mlp.all_reduce = group.all_reduce
                if mlp.shared_expert is not None:
                    mlp.shared_expert.down_proj = RowParallelLinear(
                        plan.shared_expert_intermediate_size // plan.world_size, cfg.hidden_size,
                        False, dtype, device, group,
                    )  # fmt: skip
                continue
            assert isinstance(mlp, MLP)
            mlp.down_proj = RowParallelLinear(
                plan.intermediate_per_rank, cfg.hidden_size, cfg.mlp_bias, dtype, device, group
            )
        rows = plan.vocab_per_rank
        model.model.embed_tokens = VocabParallelEmbedding(
            rows, cfg.hidden_size, plan.vocab_start, dtype, device, group
        )
        model.lm_head = VocabParallelHead(
            cfg.hidden_size, 0 if cfg.tie_word_embeddings else rows, cfg.vocab_size, dtype,
            device, group,
        )  # fmt: skip
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model

    def load_model(
        self,
        model_dir: str | Path,
        cfg: ModelConfig,
        backend: Backend,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
    ) -> LlamaForCausalLM:
        """Build this rank's model and fill it from ``model_dir`` (see :meth:`fill_weights`)."""
        model = self.build_model(cfg, backend, dtype, device, max_positions)
        self.fill_weights(model, model_dir, cfg)
        return model

    def fill_weights(
        self, model: LlamaForCausalLM, model_dir: str | Path, cfg: ModelConfig
    ) -> None:
        """Fill this rank's ``model`` (of whole-model config ``cfg``) from ``model_dir``."""
        plan = self.plan(cfg)
        marker = Path(model_dir) / RANDOM_WEIGHTS_FILE
        weights: Iterable[tuple[str, torch.Tensor]]
        if marker.exists():
            spec = read_json(marker)
            full = random_checkpoint(
                cfg,
                model.dtype,
                next(model.parameters()).device,
                seed=int(spec.get("seed", 0)),
                std=float(spec.get("std", 0.02)),
            )
            weights = shard_weights(full, plan)
        elif (gguf := gguf_weights_file(model_dir)) is not None:
            weights = shard_weights(iter_gguf_weights(open_gguf(gguf)), plan)
        else:
            weights = iter_sharded_safetensors(model_dir, plan)
        with torch.no_grad():
            model.load_weights(weights)


# ------------------------------------------------------------------ weights


def shard_tensor(tensor: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    """This rank's part of a whole checkpoint tensor."""
    if shard is None:
        return tensor
    if shard.zeros:
        return torch.zeros_like(tensor)
    dim = shard.dim or 0
    parts = [tensor.narrow(dim, start, stop - start) for start, stop in shard.ranges]
    return _pad(parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim), shard)


def _pad(part: torch.Tensor, shard: Shard) -> torch.Tensor:
    missing = shard.length - part.shape[shard.dim or 0]
    if missing <= 0:
        return part
    shape = list(part.shape)
    shape[shard.dim or 0] = missing
    return torch.cat((part, part.new_zeros(shape)), dim=shard.dim or 0)


def shard_weights(
    weights: Iterable[tuple[str, torch.Tensor]], plan: TensorParallelPlan
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, this rank's part)`` for each whole checkpoint tensor."""
    for name, tensor in weights:
        yield name, shard_tensor(tensor, plan.shard(name))


def iter_sharded_safetensors(
    model_dir: str | Path, plan: TensorParallelPlan
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, this rank's part)`` for every tensor of a safetensors checkpoint,
    reading only that part from disk."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                shard = plan.shard(name)
                if shard is None:
                    yield name, f.get_tensor(name)
                    continue
                if shard.zeros:  # a row-parallel bias off rank 0: small
                    yield name, torch.zeros_like(f.get_tensor(name))
                    continue
                piece = f.get_slice(name)
                if shard.dim == 0:
                    parts = [piece[start:stop] for start, stop in shard.ranges]
                else:
                    parts = [piece[:, start:stop] for start, stop in shard.ranges]
                joined = parts[0] if len(parts) == 1 else torch.cat(parts, dim=shard.dim or 0)
                yield name, _pad(joined, shard)


def random_checkpoint(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    *,
    seed: int,
    std: float,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole-model tensors (HF names) that :func:`~legato.models.loader.init_random_weights`
    would draw for ``cfg`` on ``device``: same generator, same order, one tensor at a time."""
    from .attention_backend import select_backend

    meta_device = torch.device("meta")
    meta = build_model(cfg, select_backend("torch", meta_device), dtype, meta_device, 1)
    norms = {id(m.weight) for m in meta.modules() if isinstance(m, RMSNorm)}
    generator = torch.Generator(device=device).manual_seed(seed)
    sizes = {
        "self_attn.qkv_proj": [cfg.q_size, cfg.kv_size, cfg.kv_size],
        "mlp.gate_up_proj": [cfg.intermediate_size] * 2,
    }
    parts: dict[str, list[str]] = {fused: [] for fused in sizes}  # fused -> HF names, in order
    for hf, (fused, _) in _FUSED.items():
        parts[fused].append(hf)
    for name, param in meta.named_parameters():
        full = torch.empty(param.shape, dtype=dtype, device=device)
        if id(param) in norms:
            full.fill_(1.0)
        elif name.endswith(".bias"):
            full.zero_()
        else:
            full.normal_(0.0, std, generator=generator)
        prefix, _, kind = name.rpartition(".")
        fused_name = next((f for f in sizes if prefix.endswith(f)), None)
        if fused_name is None:
            yield name, full
            continue
        base = prefix[: -len(fused_name)]
        pieces = torch.split(full, sizes[fused_name])
        for hf, part in zip(parts[fused_name], pieces, strict=True):
            yield f"{base}{hf}.{kind}", part
