"""A decode step's decoder stack in one native call (``legato_decode_layers_f32``).

The layer-by-layer forward of a 30-layer model makes about 15 kernel calls a layer,
each with Python dispatch and argument checks around it; at batch 1 that overhead is
as large as the math. For a batch of decode rows (one query token per sequence) of an
fp32 Llama-family model whose projections are all kept quantized
(:mod:`legato.models.quantized`) or all held in column panels for the dense fp32 kernel
(:class:`legato.models.cpu_linear.PanelLinear`, an fp32 checkpoint on an AVX-512 CPU),
without biases, q/k norms or sliding windows, this module hands the whole stack to
:mod:`legato.models.cpu_kernels` at once: the same kernels in the same order, so the
numbers are the layer-by-layer path's.

A speculative verification step (``AttentionMetadata.rows_as_decodes``: a sequence's
last token and its drafts) runs here too: each row gets its sequence's block-table row
and attends up to its own position, and the activation path follows the number of
sequences, not of rows (``row_mode`` in the C++), so every verified row is computed
bit for bit as a plain decode step of as many sequences computes it.

:func:`DecodeStack.build` says whether a model qualifies (None if not); the weights'
pointers are gathered once per KV-cache allocation. The model keeps its plain
per-layer forward for prefill and for everything else (``fused_decode = False``
forces it: the fidelity path the tests compare against).

Never imports trio.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from . import cpu_kernels
from .attention_backend import AttentionMetadata
from .cpu_linear import PanelLinear
from .layers import Linear
from .quantized import QuantizedLinear

# The model is a legato.models.llama.LlamaForCausalLM, typed Any here: llama imports this
# module, and the import contract keeps models/ free of circles.
LlamaForCausalLM = Any

_MAX_PARTS = 4  # kMaxParts in native/decoder_layer.h
_DENSE_BITS = 32  # kDenseBits there: a part of fp32 weights in column panels


class _Part(ctypes.Structure):
    _fields_ = [
        ("codes", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("offsets", ctypes.c_void_p),
        ("rows", ctypes.c_int64),
        ("bits", ctypes.c_int32),
        ("group", ctypes.c_int32),
    ]


class NativeProjection(ctypes.Structure):
    """A projection as the native calls read it (``QuantProjection`` in
    native/decoder_layer.h): up to ``_MAX_PARTS`` row blocks of codes, scales, offsets, or
    one part of dense panels (``bits`` 32)."""

    _fields_ = [
        ("num_parts", ctypes.c_int32),
        ("pad", ctypes.c_int32),
        ("parts", _Part * _MAX_PARTS),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("key_cache", ctypes.c_void_p),
        ("value_cache", ctypes.c_void_p),
        ("qkv", NativeProjection),
        ("o", NativeProjection),
        ("gate_up", NativeProjection),
        ("down", NativeProjection),
    ]


def native_projection(linear: QuantizedLinear | PanelLinear) -> NativeProjection:
    """``linear``'s parts as the native calls read them: pointers into its tensors, which
    the caller keeps alive (and unmoved) while the struct is in use. Only for a
    projection :func:`takes_native` (or, dense, :func:`takes_native_dense`) accepts."""
    if isinstance(linear, PanelLinear):
        out = NativeProjection(num_parts=1)
        out.parts[0] = _Part(linear.panels.data_ptr(), None, None, linear.out_features,
                             _DENSE_BITS, 0)  # fmt: skip
        return out
    out = NativeProjection(num_parts=len(linear.parts))
    for i, part in enumerate(linear.parts):
        offsets = part.offsets.data_ptr() if part.offsets is not None else None
        out.parts[i] = _Part(
            part.codes.data_ptr(), part.scales.data_ptr(), offsets, part.out_features,
            part.bits, part.group,
        )  # fmt: skip
    return out


def _native_weight(linear: Any) -> QuantizedLinear | PanelLinear | None:
    """What a projection's product runs on, where the stack can read it: its quantized
    weights, or its column panels. None for anything else: plain or oneDNN weights, a
    subclass (tensor parallelism's row-parallel layers reduce across ranks) or a module with
    hooks (LoRA adds its deltas in forward hooks, which the native stack would skip)."""
    if type(linear) is not Linear or linear._forward_hooks or linear._forward_pre_hooks:
        return None
    if linear.quantized is not None:
        return linear.quantized
    return linear.packed if isinstance(linear.packed, PanelLinear) else None


def _projections(layer: Any) -> tuple[QuantizedLinear | PanelLinear | None, ...]:
    """A decoder layer's (qkv, o, gate_up, down) weights as :func:`_native_weight` finds them."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    return tuple(_native_weight(linear) for linear in linears)


def _int8_max_rows(model: LlamaForCausalLM) -> int:
    """Up to how many sequences a step takes the int8 path (the first qkv's setting; 0 for
    dense panels, which have none)."""
    layer: Any = model.model.layers[0]
    qkv = _native_weight(layer.self_attn.qkv_proj)
    return qkv.int8_max_rows if isinstance(qkv, QuantizedLinear) else 0


def takes_native_dense(linear: PanelLinear) -> bool:
    """Whether the native stack takes these panels: fp32 on the CPU, without a bias."""
    return (
        linear.dtype == torch.float32
        and linear.bias is None
        and linear.panels.dtype == torch.float32
        and linear.panels.device.type == "cpu"
    )


def takes_native(linear: QuantizedLinear | None) -> bool:
    """Whether the native calls take this projection: quantized, on the CPU, in at most
    ``_MAX_PARTS`` parts of layouts the kernels have."""
    return (
        linear is not None
        and len(linear.parts) <= _MAX_PARTS
        and all(
            p.layout()[:2] in cpu_kernels.QUANTIZED_LAYOUTS and p.codes.device.type == "cpu"
            for p in linear.parts
        )
    )


def _rows_of(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row, its sequence's block-table row and the keys it attends (up to its own
    position): a verification step's rows as the decode rows the kernel takes."""
    starts = meta.query_start_loc_host
    counts = torch.tensor([b - a for a, b in zip(starts, starts[1:])], dtype=torch.int64)
    seq_of_row = torch.repeat_interleave(torch.arange(len(counts)), counts)
    table = meta.block_tables.index_select(0, seq_of_row.to(meta.block_tables.device))
    seq_lens = (meta.positions + 1).to(torch.int32)
    return table, seq_lens


class DecodeStack:
    """The pointers of one model's decoder layers and KV caches, laid out for the kernel."""

    def __init__(
        self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Gathers the pointers; only for a model :meth:`eligible` accepted."""
        self.model = model
        self.key = self._key(model, kv_caches)
        decoder: list[Any] = list(model.model.layers)
        self._held = (  # see _key
            [_projections(layer) for layer in decoder],
            [
                (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
                for layer in decoder
            ],
            list(kv_caches),
        )
        layers = (_Layer * len(kv_caches))()
        for i, (layer, (key_cache, value_cache)) in enumerate(zip(decoder, kv_caches, strict=True)):
            qkv, o, gate_up, down = _projections(layer)
            assert qkv is not None and o is not None and gate_up is not None and down is not None
            layers[i] = _Layer(
                layer.input_layernorm.weight.data_ptr(),
                layer.post_attention_layernorm.weight.data_ptr(),
                key_cache.data_ptr(),
                value_cache.data_ptr(),
                native_projection(qkv), native_projection(o), native_projection(gate_up),
                native_projection(down),
            )  # fmt: skip
        self.layers = layers
        self.int8_max_rows = _int8_max_rows(model)
        self.num_blocks, self.block_size = kv_caches[0][0].shape[:2]

    @staticmethod
    def _key(
        model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[int, ...]:
        """What the pointers depend on: the projections' objects (a reload makes new ones),
        the norms' and the caches' storage. The stack holds all of these (``_held``), so no
        other object or allocation can take their ids or addresses while it lives."""
        # Checked before every decode step: read the modules' own dicts rather than through
        # nn.Module.__getattr__ (six lookups a layer that way cost ~0.27 ms a step).
        key: list[int] = []
        for layer in model.model._modules["layers"]._modules.values():
            mods = layer._modules
            attn, mlp = mods["self_attn"]._modules, mods["mlp"]._modules
            for linear in (attn["qkv_proj"], attn["o_proj"], mlp["gate_up_proj"], mlp["down_proj"]):
                key.append(id(_native_weight(linear)))
            for norm in (mods["input_layernorm"], mods["post_attention_layernorm"]):
                weight = norm._parameters.get("weight")
                key.append((weight if weight is not None else norm.weight).data_ptr())
        key.extend(c.data_ptr() for pair in kv_caches for c in pair)
        return tuple(key)

    @staticmethod
    def eligible(
        model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> bool:
        """Whether ``model`` with these caches can run its decode steps here."""
        cfg = model.config
        if not (
            # A model class opts in by its own declaration, never by inheritance: the
            # subclasses of Llama (MoE blocks, Gemma's norms and GeGLU, Phi-3's partial
            # rotary) compute what the native stack does not.
            vars(type(model)).get("native_decode_stack", False)
            and cpu_kernels.available()
            and model.dtype == torch.float32
            and getattr(model.backend, "native", False)
            and not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.qk_norm)
            and all(cfg.window_of(i) is None for i in range(cfg.num_layers))
            and len(kv_caches) == cfg.num_layers
        ):
            return False
        # Every projection quantized, or every one in panels: a model of both kinds (a GGUF
        # file with some matrices stored unquantized) keeps the layer-by-layer path, whose
        # quantized matmuls take the int8 path by their own setting (_int8_max_rows reads it
        # from the first qkv projection only).
        weights = [w for layer in model.model.layers for w in _projections(layer)]
        panels = [w for w in weights if isinstance(w, PanelLinear)]
        if len(panels) == len(weights):
            if not all(takes_native_dense(w) for w in panels):
                return False
        elif not all(isinstance(w, QuantizedLinear) and takes_native(w) for w in weights):
            return False
        for pair in kv_caches:
            if not all(
                c.dtype == torch.float32
                and c.is_contiguous()
                and c.device.type == "cpu"
                and c.shape == kv_caches[0][0].shape
                and c.shape[2:] == (cfg.num_kv_heads, cfg.head_dim)
                for c in pair
            ):
                return False
        return True

    def matches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether these are still the caches (and weights' row limit) it was built for."""
        return (
            _int8_max_rows(self.model) == self.int8_max_rows
            and self._key(self.model, kv_caches) == self.key
        )

    def run(
        self, hidden: torch.Tensor, meta: AttentionMetadata, cos_sin_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stack over ``hidden`` ``[T, H]``: the embeddings of ``T`` decode rows, one per
        sequence (``meta.num_decodes == T``), or with ``meta.rows_as_decodes`` several rows of
        a sequence (a verification step: each row attends up to its own position). Returns
        ``(hidden, residual)`` as the last layer leaves them; writes each layer's K/V at
        ``meta.slot_mapping``. Each row is computed as a plain decode step of as many
        sequences computes it (``native/decode_stack.h``'s ``row_mode``: the activation rounding
        follows the number of sequences, not of rows). Raises ``ValueError`` for a length
        or block id outside the table or the cache (checked before any read)."""
        cfg = self.model.config
        tokens = hidden.shape[0]
        hidden = hidden.contiguous().clone()
        residual = torch.empty_like(hidden)
        table, seq_lens = meta.block_tables, meta.seq_lens
        slots, positions = meta.slot_mapping, meta.positions
        sequences = table.shape[0]
        if meta.rows_as_decodes and meta.num_decodes != tokens:
            table, seq_lens = _rows_of(meta)
        if not (
            table.dtype == torch.int32
            and table.stride(1) == 1
            and table.shape[0] == tokens
            and seq_lens.shape[0] == tokens
            and 1 <= sequences <= tokens
            and meta.block_size == self.block_size
            and seq_lens.dtype == torch.int32
            and seq_lens.is_contiguous()
            and slots.is_contiguous()
            and positions.is_contiguous()
            and cos_sin_cache.is_contiguous()
            and cos_sin_cache.dtype == torch.float32
        ):
            raise ValueError("decode stack: unsupported metadata layout")
        code = cpu_kernels.decode_layers_kernel()(
            self.layers, cfg.num_layers, hidden.data_ptr(), residual.data_ptr(), tokens,
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, table.data_ptr(), table.stride(0), table.shape[1],
            self.num_blocks, self.block_size, seq_lens.data_ptr(), slots.data_ptr(),
            positions.data_ptr(), cos_sin_cache.data_ptr(), cos_sin_cache.shape[0],
            cfg.rms_norm_eps, cfg.head_dim**-0.5, self.int8_max_rows, torch.get_num_threads(),
            sequences,
        )  # fmt: skip
        if code != 0:
            raise ValueError(f"decode stack: the kernel refused its arguments (code {code})")
        return hidden, residual
