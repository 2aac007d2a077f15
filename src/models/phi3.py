"""Phi-3 and Phi-4(-mini): the Llama decoder with its projections stored fused.

What differs from :mod:`legato.models.llama`, all of it in the checkpoint and the
config, none in the forward pass:

- ``self_attn.qkv_proj`` and ``mlp.gate_up_proj`` are single tensors (query, key,
  value rows; gate rows, then up rows), split here into the q/k/v and gate/up
  pieces the Llama loader takes; a GGUF file's (``attn_qkv``, ``ffn_up``) kept
  quantized are split by rows likewise and stay quantized;
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
        rotary_dim = cfg.rope.rotary_dim(cfg.head_dim)
        head_order = partial_rotary_order(cfg.head_dim, rotary_dim)
        for name, tensor in weights:
            if name.endswith(_QKV):
                prefix = name[: -len(_QKV)]
                self._check_rows(name, tensor, cfg.q_size + 2 * cfg.kv_size)
                q_rows = torch.arange(cfg.q_size)
                k_rows = torch.arange(cfg.q_size, cfg.q_size + cfg.kv_size)
                if rotary_dim != cfg.head_dim:  # partial rotary (Phi-4-mini): see rotary.py
                    q_rows, k_rows = (rows.view(-1, cfg.head_dim)[:, head_order].flatten()
                                      for rows in (q_rows, k_rows))  # fmt: skip
                v_rows = torch.arange(cfg.q_size + cfg.kv_size, cfg.q_size + 2 * cfg.kv_size)
                yield f"{prefix}self_attn.q_proj.weight", _take_rows(tensor, q_rows)
                yield f"{prefix}self_attn.k_proj.weight", _take_rows(tensor, k_rows)
                yield f"{prefix}self_attn.v_proj.weight", _take_rows(tensor, v_rows)
            elif name.endswith(_GATE_UP):
                prefix = name[: -len(_GATE_UP)]
                self._check_rows(name, tensor, 2 * cfg.intermediate_size)
                gate_rows, up_rows = torch.arange(2 * cfg.intermediate_size).chunk(2)
                yield f"{prefix}mlp.gate_proj.weight", _take_rows(tensor, gate_rows)
                yield f"{prefix}mlp.up_proj.weight", _take_rows(tensor, up_rows)
            else:
                yield name, tensor

    @staticmethod
    def _check_rows(name: str, tensor: torch.Tensor | QuantizedWeight, rows: int) -> None:
        got = tensor.out_features if isinstance(tensor, QuantizedWeight) else tensor.shape[0]
        if got != rows:
            raise ValueError(f"checkpoint tensor {name!r} has {got} rows, expected {rows}")


def _take_rows(
    tensor: torch.Tensor | QuantizedWeight, rows: torch.Tensor
) -> torch.Tensor | QuantizedWeight:
    """Rows ``rows`` (int64) of a dense or a quantized (GGUF) weight, in that order."""
    if isinstance(tensor, QuantizedWeight):
        return tensor.take_rows(rows)
    return tensor.index_select(0, rows)
