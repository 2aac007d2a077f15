"""Decode CUDA graphs: the padding and static-buffer path, on CPU and (where one is) a GPU.

Without a GPU the graphs are emulated (``mode="emulate"``): the runner records
the forward over the same static buffers and metadata and replays it eagerly,
on the Triton kernels under the interpreter, which are the ones a GPU
captures. With a GPU the same tests also run real captures (``mode="cuda"``).
Greedy outputs must equal the eager runner's at batch sizes on and between
the captured sizes and above the largest (eager fallback); mixed prefill +
decode steps must bypass the graphs; CPU and ``enforce_eager`` must never
build real ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from legato.models.attention_backend import select_backend
from legato.models.cuda_graphs import DecodeGraphRunner, capture_sizes, wants_decode_graphs
from legato.models.runner import ModelRunner
from legato.protocol.params import SamplingParams

CAPTURED = [1, 2, 4]
MODES = [
    "emulate",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]


@pytest.fixture(autouse=True)
def _needs_triton() -> None:
    from legato.kernels import triton_available

    if not triton_available():
        pytest.skip("triton cannot run here (no CUDA device and no TRITON_INTERPRET)")


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _runners(
    make_runner: Callable[..., ModelRunner], ck: Any, mode: str
) -> tuple[ModelRunner, ModelRunner]:
    """``(eager, graphed)`` runners on the Triton kernels; graphs captured at ``CAPTURED``.

    Emulated graphs run where the Triton kernels do: on the GPU when there is one.
    """
    device = "cuda" if mode == "cuda" or torch.cuda.is_available() else "cpu"
    eager = make_runner(ck, attention_backend="triton", device=device, enforce_eager=True)
    assert eager.decode_graphs is None
    graphed = make_runner(ck, attention_backend="triton", device=device)
    assert (graphed.decode_graphs is None) == (device != "cuda")  # CUDA captures at start-up
    graphed.capture_decode_graphs(CAPTURED, mode=mode)  # type: ignore[arg-type]
    assert graphed.decode_graphs is not None and graphed.decode_graphs.sizes == CAPTURED
    return eager, graphed


def _pure_decode(sched: Any) -> int | None:
    """The batch size of the step ``sched`` will run next if every request computes one token."""
    counts = [len(r.tokens) - r.num_computed for r in sched.running.values()]
    if sched.chunk is not None:
        counts = [min(c, sched.chunk) for c in counts]
    return len(counts) if counts and all(c == 1 for c in counts) else None


def test_capture_sizes() -> None:
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(1000)[-1] == 256
    assert capture_sizes(13) == [1, 2, 4, 8, 13]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]


def test_graphs_only_on_cuda_with_a_graph_safe_backend() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    triton = select_backend("triton", cpu)
    assert triton.graph_safe and not select_backend("torch", cpu).graph_safe
    assert not select_backend("reference", cpu).graph_safe
    assert wants_decode_graphs(cuda, False, triton)
    assert not wants_decode_graphs(cuda, True, triton)  # enforce_eager
    assert not wants_decode_graphs(cpu, False, triton)
    assert not wants_decode_graphs(cuda, False, select_backend("torch", cpu))


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_cpu_runner_never_builds_graphs(
    enforce_eager: bool,
    llama: Any,
    make_runner: Callable[..., ModelRunner],
    mini_scheduler: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from legato.kernels import triton_interpreting

    if not triton_interpreting():
        pytest.skip("Triton kernels run on CPU tensors only under the interpreter")

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a CUDA graph was built on CPU")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", refuse)
    monkeypatch.setattr(torch.cuda, "graph", refuse)
    runner = make_runner(llama, attention_backend="triton", enforce_eager=enforce_eager)
    assert runner.decode_graphs is None
    sched = mini_scheduler(runner)
    sched.add("a", _prompt(5, 0), max_tokens=3)
    sched.run()
    assert runner.decode_graphs is None


def test_refuses_what_cannot_be_captured(
    llama: Any, make_runner: Callable[..., ModelRunner]
) -> None:
    torch_runner = make_runner(llama)  # auto on CPU: the torch backend
    with pytest.raises(ValueError, match="not graph-safe"):
        torch_runner.capture_decode_graphs(mode="emulate")
    runner = make_runner(llama, attention_backend="triton")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        DecodeGraphRunner(
            runner.model,
            runner.kv_caches,
            sizes=[1],
            max_model_len=runner.max_model_len,
            block_size=runner.block_size,
            device=runner.device,
            mode="cuda",
        )


@pytest.mark.parametrize("mode", MODES)
def test_padded_replay_matches_eager(
    mode: str,
    llama: Any,
    make_runner: Callable[..., ModelRunner],
    mini_scheduler: Any,
    hf_greedy: Any,
) -> None:
    """Six requests finishing one after another: decode batches of 6 and 5 run eagerly
    (above the largest graph), 4, 2 and 1 replay exactly, 3 is padded to 4; a late
    arrival makes a mixed prefill + decode step, which bypasses the graphs."""
    lengths = [(5, 14), (23, 13), (40, 12), (9, 10), (17, 9), (31, 7)]
    prompts = [_prompt(n, i) for i, (n, _) in enumerate(lengths)]
    late = _prompt(12, 99)
    params = SamplingParams(temperature=0.0, logprobs=1)
    results = []
    for graphs, runner in zip((False, True), _runners(make_runner, llama, mode)):
        sched = mini_scheduler(runner)
        for i, (prompt, (_, max_tokens)) in enumerate(zip(prompts, lengths)):
            sched.add(f"r{i}", prompt, params, max_tokens=max_tokens)
        expected_replays: list[int] = []
        while sched.running:
            if sched.step_id == 3:
                sched.add("late", late, params, max_tokens=4)  # its prefill joins decodes
            batch = _pure_decode(sched)
            before = sum(runner.decode_graphs.replays.values()) if graphs else 0
            sched.step()
            if graphs:
                assert runner.decode_graphs is not None
                replayed = sum(runner.decode_graphs.replays.values()) - before
                assert replayed == (batch is not None and batch <= CAPTURED[-1])
                if replayed:
                    expected_replays.append(batch or 0)
        outputs = {rid: req.outputs for rid, req in sched.done.items()}
        logprobs = {rid: [e.logprobs[0] for e in req.logprobs] for rid, req in sched.done.items()}
        results.append((outputs, logprobs))
        if graphs:
            assert runner.decode_graphs is not None
            replays = runner.decode_graphs.replays
            assert set(expected_replays) >= {1, 2, 3, 4}  # 3 padded to 4
            assert replays[4] == sum(1 for b in expected_replays if b in (3, 4))
            assert replays[2] == expected_replays.count(2)
            assert replays[1] == expected_replays.count(1)
    (eager, eager_lp), (graphed, graphed_lp) = results
    assert graphed == eager
    for rid, values in eager_lp.items():
        torch.testing.assert_close(graphed_lp[rid], values, rtol=0, atol=1e-4)
    for i, (prompt, (_, max_tokens)) in enumerate(zip(prompts, lengths)):
        assert graphed[f"r{i}"] == hf_greedy(llama, prompt, max_tokens)[0]


@pytest.mark.parametrize("mode", MODES)
def test_one_token_chunks_replay_with_prompt_logprobs(
    mode: str,
    make_checkpoint: Callable[..., Any],
    make_runner: Callable[..., ModelRunner],
    mini_scheduler: Any,
) -> None:
    """Prefill one token per step: every step is decode-shaped and replays, including
    steps that sample nothing and steps that produce prompt logprobs (qwen3: tied
    head, q/k norm)."""
    ck = make_checkpoint("qwen3")
    runs = []
    for graphs, runner in zip((False, True), _runners(make_runner, ck, mode)):
        sched = mini_scheduler(runner, chunk=1)
        sched.add("a", _prompt(6, 1), SamplingParams(temperature=0.0, prompt_logprobs=1), 4)
        sched.add("b", _prompt(9, 2), max_tokens=3)
        sched.add("c", _prompt(3, 3), max_tokens=5)
        sched.run()
        if graphs:
            assert runner.decode_graphs is not None
            assert sum(runner.decode_graphs.replays.values()) == sched.step_id
        runs.append(sched.done)
    eager, graphed = runs
    assert {r: q.outputs for r, q in graphed.items()} == {r: q.outputs for r, q in eager.items()}
    lp_eager = [e.logprobs if e else None for e in eager["a"].prompt_logprobs]
    lp_graphed = [e.logprobs if e else None for e in graphed["a"].prompt_logprobs]
    assert len(lp_graphed) == 6 and lp_graphed[0] is None
    for got, want in zip(lp_graphed[1:], lp_eager[1:]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_sleep_drops_and_wake_up_recaptures(
    mode: str, llama: Any, make_runner: Callable[..., ModelRunner], mini_scheduler: Any
) -> None:
    eager_runner, runner = _runners(make_runner, llama, mode)
    before = runner.decode_graphs
    runner.sleep(1)
    assert runner.decode_graphs is None
    runner.wake_up()
    graphs = runner.decode_graphs
    assert graphs is not None and graphs is not before and graphs.sizes == CAPTURED
    assert graphs.kv_caches is runner.kv_caches
    sched = mini_scheduler(runner)
    sched.add("a", _prompt(7, 4), max_tokens=4)
    sched.add("b", _prompt(11, 5), max_tokens=4)
    out = sched.run()
    eager = mini_scheduler(eager_runner)
    eager.add("a", _prompt(7, 4), max_tokens=4)
    eager.add("b", _prompt(11, 5), max_tokens=4)
    assert out == eager.run()
    assert graphs.replays[2] == 3


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}  # fmt: skip


def _speculative_run(mode: str | None) -> tuple[list[list[int]], Any]:
    """Greedy outputs of repetitive prompts through ``LLMEngine`` on the toy model with
    n-gram drafts, on the Triton kernels; ``mode`` None runs every step eagerly, else
    the graphs are captured at ``CAPTURED`` (verification: 4 rows a sequence). Returns
    the outputs and the runner."""
    from legato.config import EngineConfig
    from legato.llm import LLMEngine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = LLMEngine(
        EngineConfig(
            model="toy",
            device=device,
            attention_backend="triton",
            speculative_config=NGRAM,
            enforce_eager=mode is None,
            max_model_len=256,
            num_kv_blocks=96,
            max_num_seqs=4,
            disable_log_stats=True,
        )
    )
    runner = engine.worker.runner
    if mode is not None:
        runner.capture_decode_graphs(CAPTURED, mode=mode)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [_prompt(n, seed) * 3 for n, seed in ((5, 1), (7, 2), (4, 3))]  # repeats: drafts
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    finals: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = list(out.outputs[0].token_ids)
    assert engine.scheduler.kv.num_used_blocks == 0
    return [finals[f"r{i}"] for i in range(len(prompts))], runner


@pytest.mark.parametrize("mode", MODES)
def test_verification_steps_replay_and_match_eager(mode: str) -> None:
    """With n-gram drafts, steps that verify drafts replay the verification graphs (each
    sequence padded to k + 1 rows, the batch to a captured size) and give the eager
    run's greedy tokens; steps without drafts replay the decode graphs."""
    eager, eager_runner = _speculative_run(None)
    assert eager_runner.verify_graphs is None
    graphed, runner = _speculative_run(mode)
    verify = runner.verify_graphs
    assert verify is not None and verify.query_len == NGRAM["num_speculative_tokens"] + 1
    assert sum(verify.replays.values()) > 0, "no verification step replayed"
    assert verify.replays[4] > 0  # three sequences padded to the captured 4
    assert graphed == eager
