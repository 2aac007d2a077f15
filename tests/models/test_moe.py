"""Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): greedy tokens identical to
transformers in fp32, and the routing and grouping on their own.

Tiny random checkpoints with 8 experts, top-2: Mixtral (always renormalised, every
layer windowed), Qwen2-MoE (shared expert, not renormalised), Qwen3-MoE as
configured by default (not renormalised) and renormalised with a dense first layer
(``mlp_only_layers``). Whole prefill, chunked prefill and a prefix-cache hit;
TP=2 is in ``test_tensor_parallel.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from legato.models.attention_backend import select_backend
from legato.models.config import load_model_config
from legato.models.moe import SparseMoeBlock, grouped_experts, route
from legato.models.registry import resolve_architecture

NEW_TOKENS = 32
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("mixtral", dict(sliding_window=16)),
    "qwen2_moe": ("qwen2_moe", dict(shared_expert_intermediate_size=40)),
    "qwen3_moe": ("qwen3_moe", dict(head_dim=16)),
    "qwen3_moe_renorm_dense0": (
        "qwen3_moe",
        dict(head_dim=16, norm_topk_prob=True, mlp_only_layers=[0]),
    ),
}


def _checkpoint(make_checkpoint: Callable[..., Any], case: str) -> Any:
    kind, overrides = CASES[case]
    return make_checkpoint(kind, **overrides)


def test_route_renormalises_only_when_asked() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 3.5, 0.0]])
    weights, experts = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, dim=-1)
    assert experts.tolist() == [[0, 1], [2, 1]]
    assert torch.allclose(weights, probs.gather(1, experts))
    weights, _ = route(logits, 2, renormalize=True)
    assert torch.allclose(weights.sum(-1), torch.ones(2))
    assert torch.allclose(weights[0], torch.softmax(torch.tensor([2.0, 1.0]), 0))


def test_grouped_experts_equal_a_per_token_loop() -> None:
    """Grouping tokens by expert computes what each token's own experts would."""
    g = torch.Generator().manual_seed(7)
    tokens, hidden, inter, experts, top_k = 13, 8, 6, 5, 2
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g)
    w2 = torch.randn(experts, hidden, inter, generator=g)
    weights, chosen = route(torch.randn(tokens, experts, generator=g), top_k, True)
    got = grouped_experts(x, w13, w2, weights, chosen, select_backend("torch", x.device))
    for t in range(tokens):
        want = torch.zeros(hidden)
        for k in range(top_k):
            e = int(chosen[t, k])
            gate, up = (w13[e] @ x[t]).chunk(2)
            want += weights[t, k] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
        assert torch.allclose(got[t], want, atol=1e-4), t


@pytest.mark.parametrize("case", list(CASES))
def test_registry_and_layers(case: str, make_checkpoint: Callable[..., Any]) -> None:
    ck = _checkpoint(make_checkpoint, case)
    model_class, cfg = resolve_architecture(load_model_config(ck.path))
    assert cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    assert cfg.norm_topk_prob == (case in ("mixtral", "qwen3_moe_renorm_dense0"))
    runner_layers = [cfg.is_moe_layer(i) for i in range(2)]
    assert runner_layers == ([False, True] if case.endswith("dense0") else [True, True])
    model = model_class(cfg, select_backend("torch", torch.device("cpu")), torch.float32,
                        torch.device("cpu"), 64)  # fmt: skip
    blocks = [layer.mlp for layer in model.model.layers]
    assert [isinstance(b, SparseMoeBlock) for b in blocks] == runner_layers


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("chunk", [None, 5])
def test_batch_matches_transformers(
    case: str,
    chunk: int | None,
    make_checkpoint: Callable[..., Any],
    make_runner: Callable[..., Any],
    greedy: Any,
) -> None:
    ck = _checkpoint(make_checkpoint, case)
    prompts = greedy.prompts([4, 19, 37], seed=61)
    greedy.assert_matches_transformers(
        ck, make_runner(ck), prompts, NEW_TOKENS, chunk=chunk, logprobs_abs=1e-4
    )


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_prefix_cache_hit_matches_transformers(
    case: str,
    make_checkpoint: Callable[..., Any],
    make_runner: Callable[..., Any],
    greedy: Any,
) -> None:
    ck = _checkpoint(make_checkpoint, case)
    donor, tail = greedy.prompts([40, 11], seed=62)
    greedy.assert_prefix_hit_matches_transformers(
        ck, make_runner(ck), donor, donor[:32] + tail, 2, NEW_TOKENS
    )


GGUF_CASES = {
    "mixtral": ("mixtral", {}),  # llama.cpp's ``llama`` architecture with experts
    # Q8_0 rows are whole 32-blocks: every intermediate size a multiple of 32
    "qwen2_moe": ("qwen2_moe", dict(moe_intermediate_size=64, shared_expert_intermediate_size=32)),
    "qwen3_moe": (  # renormalised, as llama.cpp routes Qwen3-MoE
        "qwen3_moe",
        dict(head_dim=16, moe_intermediate_size=64, norm_topk_prob=True),
    ),
}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_gguf_file_matches_transformers(
    case: str, make_checkpoint: Callable[..., Any], greedy: Any, tmp_path: Any
) -> None:
    """The checkpoint written as GGUF (experts stacked per layer, as llama.cpp stores them):
    from an F32 file legato gives transformers' tokens on the checkpoint; from a Q8_0 file
    its 2-D matrices and every expert (2-D slices of the 3-D tensors) stay quantized and
    the tokens equal the dequantized path's, also after a level-2 sleep and wake-up."""
    from legato.testing.gguf_files import write_gguf

    kind, overrides = GGUF_CASES[case]
    ck = make_checkpoint(kind, **overrides)
    prompts = greedy.prompts([6, 21], seed=63)
    f32 = write_gguf(ck.path, tmp_path / f"{case}-f32.gguf", tensor_type="F32")
    tokens, _ = greedy.run_file(f32, prompts, NEW_TOKENS)
    assert tokens == greedy.transformers(ck, prompts, NEW_TOKENS)
    q8 = write_gguf(ck.path, tmp_path / f"{case}-q8.gguf", tensor_type="Q8_0")
    kept, runner = greedy.run_file(q8, prompts, NEW_TOKENS)
    assert runner.model.quantized_bytes() > 0
    blocks = [m for m in runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(b.quantized is not None and not b.w13.numel() for b in blocks)
    assert kept == greedy.run_file(q8, prompts, NEW_TOKENS, gguf_dequantize=True)[0]
    runner.sleep(2)  # weights dropped, then read again from the file: the experts too
    assert runner.model.quantized_bytes() == 0
    runner.wake_up()
    assert all(b.quantized is not None for b in blocks)
    assert greedy.run(runner, prompts, NEW_TOKENS) == kept
    assert all(len(set(t)) > 2 for t in kept)


def test_partly_quantized_experts_are_dequantized_into_place(
    make_checkpoint: Callable[..., Any], tmp_path: Any
) -> None:
    """A block whose experts came partly dense (one expert's up_proj) computes from its
    stacked weights, the quantized experts dequantized into them; a block whose experts
    all came quantized keeps them so; both blocks give the same outputs."""
    from legato.models.gguf_checkpoint import iter_gguf_quantized, open_gguf
    from legato.models.quantized import QuantizedWeight
    from legato.testing.gguf_files import write_gguf

    kind, overrides = GGUF_CASES["qwen3_moe"]
    ck = make_checkpoint(kind, **overrides)
    q8 = write_gguf(ck.path, tmp_path / "q8.gguf", tensor_type="Q8_0")
    model_class, cfg = resolve_architecture(load_model_config(ck.path))
    weights = list(iter_gguf_quantized(open_gguf(q8)))
    dense_name = "model.layers.1.mlp.experts.3.up_proj.weight"
    mixed_weights = [
        (n, w.dequantize() if n == dense_name and isinstance(w, QuantizedWeight) else w)
        for n, w in weights
    ]
    assert any(n == dense_name for n, _ in weights)
    models = []
    for source in (weights, mixed_weights):
        model = model_class(cfg, select_backend("torch", torch.device("cpu")), torch.float32,
                            torch.device("cpu"), 64)  # fmt: skip
        model.load_weights(source)
        models.append(model)
    kept, mixed = (m.model.layers[1].mlp for m in models)
    assert kept.quantized is not None and not kept.w13.numel()
    assert mixed.quantized is None and mixed.w13.numel()
    assert models[1].model.layers[0].mlp.quantized is not None  # the other block: all quantized
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(mixed(x), kept(x), rtol=1e-4, atol=1e-4)
