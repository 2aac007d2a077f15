"""Multi-LoRA on the model's projections: stacked adapter weights, per-step token slots.

:class:`LoRALayers` attaches to a loaded :class:`~legato.models.llama.LlamaForCausalLM`
without changing its modules or parameter names: it keeps, for each layer's
four fused projections (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj``), the stacked weights of ``max_loras`` adapter slots plus slot 0
(the base model, all zeros), and registers a forward hook on each projection
that adds every token's LoRA update to the projection's output in place.

A step announces which slot each of its tokens uses with :meth:`LoRALayers.begin_step`
(per-token slots, punica's "token -> adapter" mapping). Then:

- on CUDA with Triton, the SGMV kernels of :mod:`legato.kernels.lora` group the
  tokens by slot on the device and apply every adapter in one launch per
  shrink and per slice;
- elsewhere (the CPU path), plain torch: a gather of each adapter's tokens into
  a padded ``[adapters, rows, in]`` block and one batched matmul per shrink and
  per slice, whatever the number of adapters (one adapter: plain matmuls).

A step whose tokens all use slot 0 costs nothing beyond a flag test per hook.
The slot contents are written by :meth:`LoRALayers.write_slot`, which the
registry calls (:mod:`legato.models.lora_registry`).

Never imports trio.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from .config import ModelConfig
from .lora_adapter import LoRAAdapter, LoRAWeights, projection_shapes


@dataclass(frozen=True)
class ProjectionSpec:
    """One fused projection of a decoder layer and the PEFT modules it holds, in order."""

    attr: str  # path inside a decoder layer, e.g. "self_attn.qkv_proj"
    modules: tuple[str, ...]  # PEFT names of its slices, e.g. ("q_proj", "k_proj", "v_proj")
    in_features: int
    out_features: tuple[int, ...]  # per slice

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.cumsum((0, *self.out_features[:-1])))


def projection_specs(cfg: ModelConfig) -> list[ProjectionSpec]:
    """The four fused projections of a decoder layer of ``cfg``."""
    shapes = projection_shapes(cfg)

    def spec(attr: str, modules: tuple[str, ...]) -> ProjectionSpec:
        return ProjectionSpec(
            attr, modules, shapes[modules[0]][0], tuple(shapes[m][1] for m in modules)
        )

    return [
        spec("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
        spec("self_attn.o_proj", ("o_proj",)),
        spec("mlp.gate_up_proj", ("gate_proj", "up_proj")),
        spec("mlp.down_proj", ("down_proj",)),
    ]


class LoRAStack:
    """One projection's weights for every slot: ``a`` ``[L, S * R, in]``, ``b`` ``[L, out, R]``.

    Slice ``s`` sits in rows ``s*R .. s*R+R`` of ``a`` and in the rows of its own
    output columns of ``b``. Slot 0 stays zero (the base model); adapters of
    rank below ``R`` are zero-padded.
    """

    def __init__(
        self,
        spec: ProjectionSpec,
        num_slots: int,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.spec = spec
        self.rank = rank
        self.slices = [
            slice(off, off + out) for off, out in zip(spec.offsets, spec.out_features, strict=True)
        ]
        rows = len(spec.modules) * rank
        self.a = torch.zeros((num_slots, rows, spec.in_features), dtype=dtype, device=device)
        self.b = torch.zeros((num_slots, sum(spec.out_features), rank), dtype=dtype, device=device)

    def write(self, slot: int, weights: list[LoRAWeights | None]) -> None:
        """Fill ``slot`` with one adapter's slices (None: that slice has no update)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for s, (w, cols) in enumerate(zip(weights, self.slices, strict=True)):
            if w is not None:
                self.a[slot, s * self.rank : s * self.rank + w.rank].copy_(w.a)
                self.b[slot, cols, : w.rank].copy_(w.b)


@dataclass(frozen=True)
class _TorchPlan:
    """Host-side grouping of one step's LoRA tokens for the plain-torch path.

    The groups are the slots ``first .. first + groups - 1`` (a view of the
    stacks, no copy; a slot in that range that no token uses is an empty group).
    ``rows``: the tokens that use an adapter (None: every token, in order);
    ``dest``: where each of them sits in the padded ``[groups * padded_rows]``
    block (None: one group, no padding).
    """

    first: int
    groups: int
    padded_rows: int
    rows: torch.Tensor | None
    dest: torch.Tensor | None


def _torch_plan(token_slots: np.ndarray, device: torch.device) -> _TorchPlan:
    used = np.flatnonzero(token_slots)
    slots = token_slots[used]
    first, last = int(slots.min()), int(slots.max())
    rows = None if len(used) == len(token_slots) else torch.from_numpy(used).to(device)
    if first == last:
        return _TorchPlan(first, 1, len(used), rows, None)
    group = slots - first
    order = np.argsort(group, kind="stable")
    counts = np.bincount(group, minlength=last - first + 1)
    pos = np.empty(len(used), dtype=np.int64)
    pos[order] = np.arange(len(used)) - np.repeat(np.cumsum(counts) - counts, counts)
    padded = int(counts.max())
    dest = torch.from_numpy((group * padded + pos).astype(np.int64)).to(device)
    return _TorchPlan(first, last - first + 1, padded, rows, dest)


def add_lora_torch(y: torch.Tensor, x: torch.Tensor, stack: LoRAStack, plan: _TorchPlan) -> None:
    """``y += `` each LoRA token's update (plain torch: gather, batched matmul, scatter-add)."""
    rank, rows, dest = stack.rank, plan.rows, plan.dest
    xs = x if rows is None else x.index_select(0, rows)
    if dest is None:  # one adapter: plain matmuls
        h = xs @ stack.a[plan.first].T
    else:
        groups, padded = plan.groups, plan.padded_rows
        slots = slice(plan.first, plan.first + groups)
        block = x.new_zeros((groups * padded, x.shape[1])).index_copy_(0, dest, xs)
        h = torch.bmm(block.view(groups, padded, -1), stack.a[slots].transpose(1, 2))
    for s, cols in enumerate(stack.slices):
        hs = h[..., s * rank : (s + 1) * rank]
        if dest is None:
            delta = hs @ stack.b[plan.first, cols].T
        else:
            delta = torch.bmm(hs, stack.b[slots, cols].transpose(1, 2))
            delta = delta.view(groups * padded, -1).index_select(0, dest)
        out = y[:, cols]
        if rows is None:
            out += delta
        else:
            out.index_add_(0, rows, delta)


class LoRALayers:
    """The stacked adapter weights of a model and the hooks that apply them.

    ``max_loras`` adapter slots (1..max_loras) plus the base slot 0, each of
    rank ``max_lora_rank``. ``use_triton`` picks the SGMV kernels (CUDA, or the
    interpreter in tests); otherwise the plain-torch path runs.
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: ModelConfig,
        *,
        max_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        use_triton: bool = False,
    ) -> None:
        self.num_slots = max_loras + 1
        self.max_lora_rank = max_lora_rank
        self.device = device
        self.use_triton = use_triton
        self.specs = projection_specs(cfg)
        self.stacks: dict[tuple[int, str], LoRAStack] = {}
        self._handles: list[Any] = []
        self._active = False
        self._plan: _TorchPlan | None = None
        self._token_slots: torch.Tensor | None = None
        self._meta: Any = None
        layers: Any = model.model.layers  # type: ignore[union-attr]
        for index, layer in enumerate(layers):
            for spec in self.specs:
                stack = LoRAStack(spec, self.num_slots, max_lora_rank, dtype, device)
                self.stacks[(index, spec.attr)] = stack
                module = layer.get_submodule(spec.attr)
                self._handles.append(module.register_forward_hook(self._hook(stack)))

    # ------------------------------------------------------------ weights

    def write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy ``adapter`` into ``slot`` (1..max_loras) of every stack."""
        if not 1 <= slot < self.num_slots:
            raise ValueError(f"slot: must be in 1..{self.num_slots - 1}, got {slot}")
        for (layer, _), stack in self.stacks.items():
            stack.write(slot, [adapter.weights.get((layer, m)) for m in stack.spec.modules])

    @property
    def num_bytes(self) -> int:
        return sum(s.a.nbytes + s.b.nbytes for s in self.stacks.values())

    # -------------------------------------------------------------- steps

    def begin_step(self, token_slots: np.ndarray | None) -> None:
        """Announce the slot of every token of the next forward (``[T]`` ints, 0 = base).

        None, or all zeros, turns the hooks off for that forward.
        """
        if token_slots is None or not token_slots.any():
            self._active = False
            return
        self._active = True
        if self.use_triton:
            from ..kernels.lora import lora_meta

            self._token_slots = torch.from_numpy(token_slots.astype(np.int64)).to(self.device)
            self._meta = lora_meta(self._token_slots, self.num_slots)
        else:
            self._plan = _torch_plan(token_slots, self.device)

    def _hook(self, stack: LoRAStack) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
            if self._active:
                self._apply(stack, args[0], output)
            return output

        return hook

    def _apply(self, stack: LoRAStack, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.use_triton:
            from ..kernels.lora import add_lora

            assert self._token_slots is not None
            sizes = stack.spec.out_features
            add_lora(y, x, stack.a, stack.b, self._token_slots, sizes, meta=self._meta)
        else:
            assert self._plan is not None
            add_lora_torch(y, x, stack, self._plan)

    def detach(self) -> None:
        """Remove the hooks; the model runs as the base model again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
