"""Phi-3 and Phi-4(-mini): the Llama decoder with its projections stored fused.

What differs from :mod:`legato.models.llama`, all of it in the checkpoint and the
config, none in the forward pass:

- ``self_attn.qkv_proj`` and ``mlp.gate_up_proj`` are single tensors (query, key,
  value rows; gate rows, then up rows), split here into the q/k/v and gate/up
  pieces the Llama loader takes;
- LongRoPE scaling (``rope_scaling`` type "longrope", Phi-3's 128k models) and a
  sliding window on every layer (Phi-3-mini-4k), both read by the shared config
  code (:mod:`legato.models.rotary`, :mod:`legato.models.config`);
- a partial rotary (``partial_rotary_factor``, Phi-4-mini: 0.75): each head's
  query and key rows are reordered at load so that the shared full-width rotary
  rotates exactly the dims transformers rotates
  (:func:`legato.models.rotary.partial_rotary_order`);
- ``resid_pdrop`` / ``attention_dropout``: training only.

transformers' Phi-3 ``generate`` drops its KV cache and recomputes the whole
sequence at the step where the sequence first passes the original window, so
every key is then rotated with the long factors; legato keeps the keys it has
(rotated with the short factors, see :mod:`legato.models.rotary`), so a
generation that crosses the original window departs from transformers there.
Prompts already past it, and sequences that stay within it, match.

Tensor parallelism: the sharding plan (:mod:`legato.models.sharding`) hands each
rank its own query, key and value rows of ``qkv_proj`` (its gate and up rows of
``gate_up_proj``), joined in that order, so the split below, at the rank's sizes,
gives the rank's own heads and columns.

Never imports trio or transformers.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator

import torch

from .llama import LlamaForCausalLM
from .quantized import QuantizedWeight
from .rotary import partial_rotary_order

_QKV = "self_attn.qkv_proj.weight"
_GATE_UP = "mlp.gate_up_proj.weight"


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-4 causal LM on the paged KV cache (the Llama forward, fused weights).

    Its config may be one tensor-parallel rank's (its heads, its intermediate size):
    the fused tensors it is given are then that rank's (see the module docstring).
    """

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
        filled_elsewhere: Collection[str] = (),
    ) -> None:
        """As :meth:`LlamaForCausalLM.load_weights`, after splitting the fused tensors
        (rows checked against this model's own, possibly one rank's, sizes)."""
        super().load_weights(self._split_fused(weights), filled_elsewhere)

    def _split_fused(
        self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        cfg = self.config
        qkv_rows = [cfg.q_size, cfg.kv_size, cfg.kv_size]
        rotary_dim = cfg.rope.rotary_dim(cfg.head_dim)
        order = partial_rotary_order(cfg.head_dim, rotary_dim)
        for name, tensor in weights:
            if isinstance(tensor, QuantizedWeight):  # GGUF knows no Phi-3: never fused here
                yield name, tensor
            elif name.endswith(_QKV):
                prefix = name[: -len(_QKV)]
                self._check_rows(name, tensor, sum(qkv_rows))
                q, k, v = torch.split(tensor, qkv_rows)
                if rotary_dim != cfg.head_dim:  # partial rotary (Phi-4-mini): see rotary.py
                    q, k = (x.view(-1, cfg.head_dim, x.shape[-1])[:, order].flatten(0, 1)
                            for x in (q, k))  # fmt: skip
                yield f"{prefix}self_attn.q_proj.weight", q
                yield f"{prefix}self_attn.k_proj.weight", k
                yield f"{prefix}self_attn.v_proj.weight", v
            elif name.endswith(_GATE_UP):
                prefix = name[: -len(_GATE_UP)]
                self._check_rows(name, tensor, 2 * cfg.intermediate_size)
                gate, up = tensor.chunk(2)
                yield f"{prefix}mlp.gate_proj.weight", gate
                yield f"{prefix}mlp.up_proj.weight", up
            else:
                yield name, tensor

    @staticmethod
    def _check_rows(name: str, tensor: torch.Tensor, rows: int) -> None:
        if tensor.shape[0] != rows:
            raise ValueError(
                f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, expected {rows}"
            )
