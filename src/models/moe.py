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
they are copied into their slice of the stacked weight as they stream in. A GGUF
file's experts of a kept type stay quantized instead (:class:`QuantizedExperts`,
one 2-D weight per expert and projection). On the Triton backend the routed
experts run as :func:`legato.kernels.fused_moe.fused_moe` (one grouped GEMM per
projection, no host sync); the other backends group on the host.

Tensor parallelism shards within each expert (each rank holds its slice of every
expert's intermediate dimension, like the dense MLP; the router is whole): see
:mod:`legato.models.sharding`.

Never imports trio or transformers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention_backend import Backend
from .config import ModelConfig
from .layers import MLP, Linear
from .llama import DecoderLayer, LlamaForCausalLM
from .quantized import QuantizedWeight, stack_rows

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
    quantized: QuantizedExperts | None = None,
) -> torch.Tensor:
    """``sum_k weights[t, k] * expert_{experts[t, k]}(x[t])`` for every token ``t``, one
    pair of matmuls per expert that has tokens (its tokens gathered, in expert order).

    ``x`` ``[T, H]``, ``w13`` ``[E, 2I, H]``, ``w2`` ``[E, H, I]``.
    The Triton backend runs :func:`legato.kernels.fused_moe.fused_moe` (two grouped-GEMM
    launches over the pairs sorted by expert, no host sync); the others group on the
    host, reading the per-expert counts back (one sync on a GPU). ``quantized``: each
    expert's weights kept quantized (``w13`` / ``w2`` are then unused), run by
    :meth:`~.quantized.QuantizedWeight.matmul` on fp32 activations (one rank).
    """
    if backend.name == "triton" and quantized is None:
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
        picked = x.index_select(0, rows)
        if quantized is None:
            hidden = backend.silu_and_mul(F.linear(picked, w13[expert]))
            hidden = F.linear(hidden, w2[expert])
        else:
            gate_up = quantized.w13[expert].matmul(picked.float().contiguous())
            hidden = backend.silu_and_mul(gate_up)
            hidden = quantized.w2[expert].matmul(hidden.contiguous()).to(x.dtype)
        hidden = hidden * pair_weights[start : start + count]
        out.index_add_(0, rows, hidden)
        start += count
    return out


@dataclass(frozen=True, slots=True)
class QuantizedExperts:
    """One block's experts kept quantized: ``w13[e]`` (gate rows, then up rows) and ``w2[e]``."""

    w13: tuple[QuantizedWeight, ...]
    w2: tuple[QuantizedWeight, ...]

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in (*self.w13, *self.w2))


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
        # a GGUF file's experts kept quantized (w13 / w2 storage then released)
        self.quantized: QuantizedExperts | None = None
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: Linear | None = None
        if cfg.shared_expert_intermediate_size:
            shared = cfg.shared_expert_intermediate_size
            self.shared_expert = MLP(hidden, shared, False, backend, dtype, device)
            self.shared_expert_gate = Linear(hidden, 1, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.top_k, self.renormalize)
        out = grouped_experts(x, self.w13, self.w2, weights, experts, self.backend, self.quantized)
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
        slice of the stacked weights, or, quantized (a GGUF file on one CPU rank), are kept so
        when every expert of the block came quantized (see :meth:`_keep_experts_quantized`)."""
        params = dict(self.named_parameters())
        expected: dict[str, int] = {}  # stacked parameter -> rows or slices to fill
        for name in params:
            if name.endswith((".w13", ".w2")):
                experts = self._full_shapes[name][0]  # (its storage may be released)
                expected[name] = experts * (2 if name.endswith(".w13") else 1)
            elif ".shared_expert.gate_up_proj." in name:
                expected[name] = 2
        filled = dict.fromkeys(expected, 0)
        kept: dict[tuple[str, int, str], QuantizedWeight] = {}  # (block, expert, proj)
        super().load_weights(
            self._experts_copied(weights, params, filled, kept), {*filled_elsewhere, *expected}
        )
        missing = [name for name, count in filled.items() if count != expected[name]]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(sorted(missing))}")
        self._keep_experts_quantized(kept)

    def _keep_experts_quantized(self, kept: dict[tuple[str, int, str], QuantizedWeight]) -> None:
        """A block whose every expert came quantized computes from those weights (its
        stacked storage released); in a block that also got dense expert tensors the
        quantized ones are dequantized into place."""
        experts = self.config.num_experts
        for prefix in dict.fromkeys(block for block, _, _ in kept):
            block = self.get_submodule(prefix)
            assert isinstance(block, SparseMoeBlock)
            projs = [
                [kept.get((prefix, e, p)) for p in ("gate", "up", "down")] for e in range(experts)
            ]
            device = block.w13.device
            whole = [[w.to(device) for w in part if w is not None] for part in projs]
            if all(len(part) == 3 for part in whole):
                block.quantized = QuantizedExperts(
                    tuple(stack_rows(part[:2]) for part in whole),
                    tuple(part[2] for part in whole),
                )
                for param in (block.w13, block.w2):
                    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
                continue
            for name in (f"{prefix}.w13", f"{prefix}.w2"):  # storage back if it was released
                param = dict(self.named_parameters())[name]
                if not param.numel():
                    param.data = torch.empty(
                        self._full_shapes[name], dtype=param.dtype, device=param.device
                    )
            block.quantized = None
            for (owner, expert, proj), weight in kept.items():
                if owner != prefix:
                    continue
                dest = _expert_slice(block.w2 if proj == "down" else block.w13, expert, proj)
                dest.copy_(weight.dequantize())

    def quantized_bytes(self) -> int:
        """As :meth:`LlamaForCausalLM.quantized_bytes`, the experts kept quantized included."""
        return super().quantized_bytes() + sum(
            m.quantized.nbytes
            for m in self.modules()
            if isinstance(m, SparseMoeBlock) and m.quantized is not None
        )

    def drop_quantized(self) -> None:
        """As :meth:`LlamaForCausalLM.drop_quantized`, the experts kept quantized included."""
        super().drop_quantized()
        for module in self.modules():
            if isinstance(module, SparseMoeBlock):
                module.quantized = None

    def _experts_copied(
        self,
        weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
        params: dict[str, nn.Parameter],
        filled: dict[str, int],
        kept: dict[tuple[str, int, str], QuantizedWeight],
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """Copy expert tensors into place (counting them in ``filled``), routed experts'
        quantized tensors into ``kept`` by ``(block, expert, proj)``; yield the rest."""
        for name, tensor in weights:
            match = _EXPERT_RE.match(name)
            if match is None or ".shared_expert." in name and match.group(4) == "down":
                yield name, tensor  # a shared expert's down_proj is an ordinary Linear
                continue
            prefix, which, expert, proj = match.groups()
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
            rows, cols = self._full_shapes[target][-2:] if param.numel() == 0 else param.shape[-2:]
            if proj != "down":
                rows //= 2
            if isinstance(tensor, QuantizedWeight):
                shape: tuple[int, ...] = (tensor.out_features, tensor.in_features)
            else:
                shape = tuple(tensor.shape)
            if shape != (rows, cols):
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {shape}, expected {(rows, cols)}"
                )
            filled[target] += 1
            if index is not None and isinstance(tensor, QuantizedWeight):
                kept[(prefix, index, proj)] = tensor
                continue
            if isinstance(tensor, QuantizedWeight):
                tensor = tensor.dequantize()
            if param.numel() == 0:  # released by an earlier quantized load
                param.data = torch.empty(
                    self._full_shapes[target], dtype=param.dtype, device=param.device
                )
            _expert_slice(param, index, proj).copy_(tensor)


def _expert_slice(param: torch.Tensor, expert: int | None, proj: str) -> torch.Tensor:
    """The rows of ``param`` (stacked ``w13`` / ``w2``, or a shared ``gate_up``) that
    ``expert``'s ``proj`` fills."""
    dest = param.data if expert is None else param.data[expert]
    if proj != "down":
        half = dest.shape[0] // 2
        dest = dest[:half] if proj == "gate" else dest[half:]
    return dest
