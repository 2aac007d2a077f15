"""Mixture of experts: the routed feed-forward block and the Qwen2-MoE / Qwen3-MoE models.

:class:`SparseMoeBlock` replaces the dense MLP of a sparse layer:

- the router (``gate``, a linear layer to one logit per expert) gives each token
  a softmax over the experts (fp32), keeps the ``top_k`` largest and, where the
  config says so (``norm_topk_prob``; Mixtral always), renormalises them to sum
  to 1, as transformers does;
- the experts' weights are stacked, ``w13`` ``[E, 2 * I, H]`` (gate rows, then
  up rows) and ``w2`` ``[E, H, I]``; the (token, expert) pairs are sorted by
  expert, and each expert that has tokens runs its SwiGLU once on all of them
  (two matmuls), never token by token; the weighted results are added back per
  token in expert order;
- Qwen2-MoE adds an always-on shared expert, gated by ``sigmoid(shared_expert_gate)``.

:class:`MoeForCausalLM` is the Llama decoder with that block in its sparse layers
(``decoder_sparse_step``, ``mlp_only_layers``); the registry serves Qwen3-MoE (q/k
norms) and Qwen2-MoE (q/k/v bias, shared expert) with it, and Mixtral through
:mod:`legato.models.mixtral`, which only renames its tensors. Checkpoints store
one tensor per expert and projection (``mlp.experts.<e>.gate_proj.weight``);
they are copied into their slice of the stacked weight as they stream in.

Tensor parallelism shards within each expert (each rank holds its slice of every
expert's intermediate dimension, like the dense MLP; the router is whole): see
:mod:`legato.models.sharding`.

Never imports trio or transformers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .attention_backend import Backend
from .config import ModelConfig
from .layers import MLP, Linear
from .llama import DecoderLayer, LlamaForCausalLM
from .quantized import QuantizedWeight

_EXPERT_RE = re.compile(
    r"^(model\.layers\.\d+\.mlp)\.(experts\.(\d+)|shared_expert)\.(gate|up|down)_proj\.weight$"
)


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] in the logits' dtype, experts [T, k] int64)`` for ``[T, E]`` logits:
    the top-k of the fp32 softmax, renormalised to sum to 1 when ``renormalize``."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


def grouped_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    backend: Backend,
) -> torch.Tensor:
    """``sum_k weights[t, k] * expert_{experts[t, k]}(x[t])`` for every token ``t``, one
    pair of matmuls per expert that has tokens (its tokens gathered, in expert order).

    ``x`` ``[T, H]``, ``w13`` ``[E, 2I, H]``, ``w2`` ``[E, H, I]``.
    The Triton backend runs :func:`legato.kernels.fused_moe.fused_moe` (two grouped-GEMM
    launches over the pairs sorted by expert, no host sync); the others group on the
    host, reading the per-expert counts back (one sync on a GPU).
    """
    if backend.name == "triton":
        from ..kernels.fused_moe import fused_moe  # imports triton: only on this path

        return fused_moe(x, w13, w2, weights, experts)
    top_k = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tokens = order // top_k
    pair_weights = weights.reshape(-1)[order].unsqueeze(-1)
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        rows = tokens[start : start + count]
        hidden = backend.silu_and_mul(F.linear(x.index_select(0, rows), w13[expert]))
        hidden = F.linear(hidden, w2[expert]) * pair_weights[start : start + count]
        out.index_add_(0, rows, hidden)
        start += count
    return out


def _stacked(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class SparseMoeBlock(nn.Module):
    """Router, routed experts (stacked weights), and Qwen2-MoE's optional shared expert."""

    def __init__(
        self, cfg: ModelConfig, backend: Backend, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        experts, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.backend = backend
        self.gate = Linear(hidden, experts, False, dtype, device)
        self.w13 = _stacked(experts, 2 * inter, hidden, dtype=dtype, device=device)
        self.w2 = _stacked(experts, hidden, inter, dtype=dtype, device=device)
        # tensor parallelism: sums the ranks' partial expert outputs (None: one rank)
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: Linear | None = None
        if cfg.shared_expert_intermediate_size:
            shared = cfg.shared_expert_intermediate_size
            self.shared_expert = MLP(hidden, shared, False, backend, dtype, device)
            self.shared_expert_gate = Linear(hidden, 1, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.top_k, self.renormalize)
        out = grouped_experts(x, self.w13, self.w2, weights, experts, self.backend)
        if self.all_reduce is not None:
            out = self.all_reduce(out)  # the shared expert's down_proj reduces its own
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out = out + gate * self.shared_expert(x)
        return out


class MoeDecoderLayer(DecoderLayer):
    """The Llama layer, with a :class:`SparseMoeBlock` as the MLP of sparse layers."""

    def build_mlp(
        self, cfg: ModelConfig, backend: Backend, dtype: torch.dtype, device: torch.device,
        layer: int,
    ) -> nn.Module:  # fmt: skip
        if cfg.is_moe_layer(layer):
            return SparseMoeBlock(cfg, backend, dtype, device)
        return super().build_mlp(cfg, backend, dtype, device, layer)


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder with mixture-of-experts layers (Qwen2-MoE, Qwen3-MoE)."""

    layer_class = MoeDecoderLayer
    graph_capturable = False  # grouping tokens by expert reads the counts on the host

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
        filled_elsewhere: Collection[str] = (),
    ) -> None:
        """As :meth:`LlamaForCausalLM.load_weights`; each expert's tensors go into their
        slice of the stacked weights (quantized ones dequantized)."""
        params = dict(self.named_parameters())
        expected: dict[str, int] = {}  # stacked parameter -> rows or slices to fill
        for name, param in params.items():
            if name.endswith((".w13", ".w2")):
                expected[name] = param.shape[0] * (2 if name.endswith(".w13") else 1)
            elif ".shared_expert.gate_up_proj." in name:
                expected[name] = 2
        filled = dict.fromkeys(expected, 0)
        super().load_weights(
            self._experts_copied(weights, params, filled), {*filled_elsewhere, *expected}
        )
        missing = [name for name, count in filled.items() if count != expected[name]]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(sorted(missing))}")

    def _experts_copied(
        self,
        weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
        params: dict[str, nn.Parameter],
        filled: dict[str, int],
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """Copy expert tensors into place (counting them in ``filled``); yield the rest."""
        for name, tensor in weights:
            match = _EXPERT_RE.match(name)
            if match is None or ".shared_expert." in name and match.group(4) == "down":
                yield name, tensor  # a shared expert's down_proj is an ordinary Linear
                continue
            prefix, which, expert, proj = match.groups()
            if isinstance(tensor, QuantizedWeight):
                tensor = tensor.dequantize()
            if which == "shared_expert":
                target, index = f"{prefix}.shared_expert.gate_up_proj.weight", None
            else:
                target = f"{prefix}.{'w2' if proj == 'down' else 'w13'}"
                index = int(expert)
            param = params.get(target)
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}"
                )
            dest = param.data if index is None else param.data[index]
            if proj != "down":
                half = dest.shape[0] // 2
                dest = dest[:half] if proj == "gate" else dest[half:]
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            filled[target] += 1
