"""Mixtral (``MixtralForCausalLM``): the mixture-of-experts decoder under Mixtral's names.

The model is :class:`legato.models.moe.MoeForCausalLM` (Mistral's attention, sliding
window included, and a routed SwiGLU block in every layer); what differs is in
the checkpoint and the config only:

- the block is ``block_sparse_moe`` and each expert's projections are ``w1``
  (gate), ``w3`` (up) and ``w2`` (down), renamed here to the Qwen-MoE names the
  shared loader takes;
- the experts' size is ``intermediate_size``, their count ``num_local_experts``,
  and the top-k routing weights are always renormalised (the registry sets
  ``norm_topk_prob``).

Never imports trio or transformers.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator

import torch

from .moe import MoeForCausalLM
from .quantized import QuantizedWeight

_NAME_RE = re.compile(
    r"^(model\.layers\.\d+\.)block_sparse_moe\.(gate\.weight|experts\.\d+\.w[123]\.weight)$"
)
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral causal LM: :class:`MoeForCausalLM` loading Mixtral's tensor names."""

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
        filled_elsewhere: Collection[str] = (),
    ) -> None:
        """As :meth:`MoeForCausalLM.load_weights`, after renaming Mixtral's tensors."""
        super().load_weights(_renamed(weights), filled_elsewhere)


def _renamed(
    weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    for name, tensor in weights:
        match = _NAME_RE.match(name)
        if match is not None:
            prefix, rest = match.groups()
            for old, new in _PROJ.items():
                rest = rest.replace(f".{old}.", f".{new}.")
            name = f"{prefix}mlp.{rest}"
        yield name, tensor
