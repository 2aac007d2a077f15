"""LoRA through the model runner: token-identical to transformers + peft.

Adapters are random PEFT adapters made on the tiny checkpoints (conftest's
``make_adapter``); the reference is the peft model itself (unmerged), greedy
in fp32. Also: two adapters and the base model in one batch each equal their
own single runs, eviction from host memory reloads from the path, and every
adapter the engine cannot serve is refused with an error naming why.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from legato.models.lora_adapter import LoRAError, load_peft_adapter
from legato.protocol.params import LoRARequest

NEW_TOKENS = 24


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 384, (n,), generator=g).tolist() for n in lengths]


def _peft_greedy(adapter: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = adapter.peft_model.generate(
            input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=n
        )
    tokens: list[int] = out[0, len(prompt) :].tolist()
    return tokens


def test_adapter_matches_peft(
    checkpoint: Any,
    make_adapter: Callable[..., Any],
    make_runner: Callable[..., Any],
    mini_scheduler: Any,
    hf_greedy: Any,
) -> None:
    """An adapter on all seven projections: greedy tokens equal peft's, and differ from the base."""
    adapter = make_adapter(checkpoint, r=8)
    runner = make_runner(checkpoint, enable_lora=True, max_lora_rank=8)
    prompts = _prompts([5, 19])
    sched = mini_scheduler(runner, chunk=7)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt, max_tokens=NEW_TOKENS, lora=adapter.request("a", 1))
    outputs = sched.run()
    for i, prompt in enumerate(prompts):
        expected = _peft_greedy(adapter, prompt, NEW_TOKENS)
        assert outputs[f"r{i}"] == expected, f"{checkpoint.kind} prompt {i}"
        assert expected != hf_greedy(checkpoint, prompt, NEW_TOKENS)[0]  # the adapter matters


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_two_adapters_and_base_in_one_batch(
    backend: str,
    make_checkpoint: Callable[..., Any],
    make_adapter: Callable[..., Any],
    make_runner: Callable[..., Any],
    mini_scheduler: Any,
    hf_greedy: Any,
) -> None:
    """Adapters of different ranks and targets share batches with the base model;
    each request equals its own single run (and peft / transformers). The Triton
    kernels run on a GPU where there is one, else under the interpreter."""
    device = "cpu"
    if backend == "triton":
        from legato.kernels import triton_available

        if not triton_available():
            pytest.skip("triton cannot run here (no CUDA device and no TRITON_INTERPRET)")
        device = "cuda" if torch.cuda.is_available() else "cpu"
    interpreted = backend == "triton" and device == "cpu"
    n = 6 if interpreted else NEW_TOKENS
    ck = make_checkpoint("qwen2")
    first = make_adapter(ck, r=4, targets=("q_proj", "v_proj"), seed=1)
    second = make_adapter(ck, r=8, seed=2, use_rslora=True)
    loras = [first.request("first", 1), None, second.request("second", 2)]
    prompts = _prompts([9, 14, 6] if interpreted else [9, 14, 6, 21, 3, 11], seed=3)

    def run(pairs: list[tuple[int, LoRARequest | None]]) -> dict[str, list[int]]:
        runner = make_runner(
            ck,
            enable_lora=True,
            max_loras=2,
            max_lora_rank=8,
            attention_backend=backend,
            device=device,
        )
        sched = mini_scheduler(runner, chunk=5)
        for i, lora in pairs:
            sched.add(f"r{i}", prompts[i], max_tokens=n, lora=lora)
        result: dict[str, list[int]] = sched.run()
        return result

    together = run([(i, loras[i % 3]) for i in range(len(prompts))])
    for i, prompt in enumerate(prompts):
        alone = run([(i, loras[i % 3])])
        assert together[f"r{i}"] == alone[f"r{i}"], f"prompt {i}"
        reference = {0: first, 2: second}.get(i % 3)
        if reference is None:
            assert alone[f"r{i}"] == hf_greedy(ck, prompt, n)[0]
        else:
            assert alone[f"r{i}"] == _peft_greedy(reference, prompt, n)


def test_evicted_adapter_reloads_and_slots_rotate(
    llama: Any,
    make_adapter: Callable[..., Any],
    make_runner: Callable[..., Any],
    mini_scheduler: Any,
) -> None:
    """One slot and one host-memory place: each new adapter evicts the previous one,
    and a request naming an evicted adapter reads it again from its path."""
    adapters = [make_adapter(llama, r=4, seed=s) for s in (11, 12)]
    runner = make_runner(llama, enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8)
    prompt = _prompts([7], seed=5)[0]
    outputs = []
    for k in (0, 1, 0):
        request = adapters[k].request(f"a{k}", k + 1)
        runner.add_lora(request)
        assert runner.list_loras() == [k + 1]
        sched = mini_scheduler(runner)
        rid = f"r{len(outputs)}"
        sched.add(rid, prompt, max_tokens=8, lora=request)
        outputs.append(sched.run()[rid])
    assert outputs[0] == outputs[2] == _peft_greedy(adapters[0], prompt, 8)
    assert outputs[1] == _peft_greedy(adapters[1], prompt, 8)
    # a request whose adapter was never added is read from its path at its first step
    runner.remove_lora(1)
    assert runner.list_loras() == []
    sched = mini_scheduler(runner)
    sched.add("late", prompt, max_tokens=8, lora=adapters[1].request("a1", 2))
    assert sched.run()["late"] == outputs[1]
    assert runner.list_loras() == [2]


def test_lora_request_without_enable_lora_is_refused(
    llama: Any,
    make_adapter: Callable[..., Any],
    make_runner: Callable[..., Any],
    mini_scheduler: Any,
) -> None:
    sched = mini_scheduler(make_runner(llama))
    sched.add("r", [1, 2, 3], lora=make_adapter(llama, r=4).request("a", 1))
    with pytest.raises(ValueError, match="enable_lora"):
        sched.step()


# ------------------------------------------------------------------ refusals


def _load(path: Path, ck: Any, max_rank: int = 16) -> Any:
    from legato.models.config import load_model_config

    return load_peft_adapter(
        path, load_model_config(ck.path), name="x", int_id=1, max_lora_rank=max_rank,
        dtype=torch.float32,
    )  # fmt: skip


def test_rank_above_max_lora_rank(llama: Any, make_adapter: Callable[..., Any]) -> None:
    adapter = make_adapter(llama, r=16)
    with pytest.raises(LoRAError, match="rank 16.*max_lora_rank=8") as info:
        _load(adapter.path, llama, max_rank=8)
    assert info.value.field == "max_lora_rank"
    assert _load(adapter.path, llama, max_rank=16).rank == 16


def test_wrong_shapes_are_refused(
    make_checkpoint: Callable[..., Any], make_adapter: Callable[..., Any], llama: Any
) -> None:
    """An adapter trained on a model of another width does not fit."""
    wider = make_checkpoint("llama", hidden_size=96)
    adapter = make_adapter(wider, r=4, targets=("q_proj",))
    with pytest.raises(
        LoRAError, match=r"q_proj\.lora_A has shape \(4, 96\), expected \(rank, 64\)"
    ):
        _load(adapter.path, llama)


def test_unknown_modules_are_refused(llama: Any, make_adapter: Callable[..., Any]) -> None:
    adapter = make_adapter(llama, r=4, targets=("q_proj", "lm_head"))
    with pytest.raises(LoRAError, match="lm_head.*not a LoRA weight of a supported module"):
        _load(adapter.path, llama)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"bias": "all"}, "bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"r": 0}, "r"),
    ],
)
def test_unsupported_configs_are_refused(
    llama: Any, make_adapter: Callable[..., Any], tmp_path: Path, change: dict[str, Any], field: str
) -> None:
    source = make_adapter(llama, r=4).path
    config = json.loads((source / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, **change}))
    (tmp_path / "adapter_model.safetensors").write_bytes(
        (source / "adapter_model.safetensors").read_bytes()
    )
    with pytest.raises(LoRAError) as info:
        _load(tmp_path, llama)
    assert info.value.field == field


def test_missing_files_are_refused(
    llama: Any, make_adapter: Callable[..., Any], tmp_path: Path
) -> None:
    with pytest.raises(LoRAError, match="is not a directory"):
        _load(tmp_path / "nope", llama)
    with pytest.raises(LoRAError, match="has no adapter_config.json"):
        _load(tmp_path, llama)
    source = make_adapter(llama, r=4).path
    (tmp_path / "adapter_config.json").write_bytes((source / "adapter_config.json").read_bytes())
    (tmp_path / "adapter_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(
        LoRAError, match=r"no adapter_model.safetensors \(adapter_model.bin is never"
    ):
        _load(tmp_path, llama)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(LoRAError, match="not a readable safetensors file"):
        _load(tmp_path, llama)
