"""Fixtures for the model tests: tiny random checkpoints and a mini scheduler.

Each checkpoint is made with transformers' own config and model classes and
``save_pretrained`` into a session temp dir; the transformers model (fp32,
eval) is kept beside it as the fidelity reference.

:class:`MiniScheduler` is a tiny test-only scheduler that drives a ModelRunner
with SchedulerOutput messages: blocks are handed out sequentially and never
reused (one new block when one fills), every request runs each step (prefill
in ``chunk``-token pieces when set), and a request finishes after
``max_tokens`` outputs. A request may start from a cached prefix (it shares
the first blocks of an earlier request and is admitted with
``num_computed_tokens > 0``) and may be preempted and recomputed.

:class:`Greedy` (fixture ``greedy``) holds the comparisons the model-family tests
share: random prompts, legato's greedy tokens for a batch (whole or chunked
prefill, from a cached prefix, from a model file), transformers' for the same.
``decode_stack_calls`` records the one-call decode stack's kernel calls.

Helpers are served as fixtures because pytest runs with
``--import-mode=importlib``, where test modules cannot import from beside them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from legato.models import cpu_kernels
from legato.models.runner import ModelRunner
from legato.protocol.messages import (
    CachedRequestData,
    NewRequestData,
    RunnerSamplingParams,
    SchedulerOutput,
    TokenLogprobs,
)
from legato.protocol.params import LoRARequest, PoolingParams, SamplingParams

SMALL: dict[str, Any] = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.08,  # decisive logits: few near-ties in greedy decoding
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

KINDS = ("llama", "llama3", "mistral", "qwen2", "qwen3")
MOE = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe"}  # test kinds

# Where the Triton kernels run: the GPU when there is one; else the CPU, under the
# interpreter that the root conftest switches on (Triton cannot take CPU tensors otherwise).
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class Checkpoint:
    """A saved tiny checkpoint and the transformers model it came from."""

    kind: str
    path: Path
    hf_model: Any


def _make(kind: str, path: Path, max_shard_size: str | None = None, **overrides: Any) -> Checkpoint:
    import transformers as tf

    kwargs = {**SMALL, **overrides}
    if kind == "llama":
        config = tf.LlamaConfig(**kwargs)
        cls = tf.LlamaForCausalLM
    elif kind == "llama3":
        kwargs.setdefault(
            "rope_scaling",
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        kwargs.setdefault("rope_theta", 500000.0)
        config = tf.LlamaConfig(**kwargs)
        cls = tf.LlamaForCausalLM
    elif kind == "mistral":
        config = tf.MistralConfig(**{"sliding_window": None, **kwargs})
        cls = tf.MistralForCausalLM
    elif kind == "qwen2":
        config = tf.Qwen2Config(**kwargs)
        cls = tf.Qwen2ForCausalLM
    elif kind == "qwen3":
        config = tf.Qwen3Config(**{"head_dim": 16, "tie_word_embeddings": True, **kwargs})
        cls = tf.Qwen3ForCausalLM
    elif kind == "phi3":
        config = tf.Phi3Config(**kwargs)
        cls = tf.Phi3ForCausalLM
    elif kind in MOE:
        config_class = getattr(tf, MOE[kind] + "Config")
        cls = getattr(tf, MOE[kind] + "ForCausalLM")
        experts = {"num_local_experts" if kind == "mixtral" else "num_experts": 8}
        sizes = {} if kind == "mixtral" else {"moe_intermediate_size": 48}
        config = config_class(**{"num_experts_per_tok": 2, **experts, **sizes, **kwargs})
    elif kind in ("gemma2", "gemma3"):
        # eager attention: transformers' SDPA path takes no soft cap
        config_class = tf.Gemma2Config if kind == "gemma2" else tf.Gemma3TextConfig
        config = config_class(
            **{"head_dim": 16, "query_pre_attn_scalar": 24, "attn_implementation": "eager",
               **kwargs}
        )  # fmt: skip
        cls = tf.Gemma2ForCausalLM if kind == "gemma2" else tf.Gemma3ForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(1234 + KINDS.index(kind) if kind in KINDS else 99)
    model = cls(config).eval()
    if kind in ("gemma2", "gemma3"):  # random norm weights, so (1 + w) is exercised
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 0.3)
    if kind == "qwen2":  # random biases, so the bias path is exercised
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0.0, 0.1)
    if max_shard_size is None:
        model.save_pretrained(path)
    else:
        model.save_pretrained(path, max_shard_size=max_shard_size)
    return Checkpoint(kind, path, model)


@pytest.fixture(scope="session")
def make_checkpoint(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[..., Checkpoint]:
    """``make_checkpoint(kind, **config_overrides)``: built once per distinct call."""
    cache: dict[tuple[str, tuple[tuple[str, Any], ...]], Checkpoint] = {}

    def make(kind: str, **overrides: Any) -> Checkpoint:
        key = (kind, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            cache[key] = _make(kind, tmp_path_factory.mktemp(kind), **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session", params=KINDS)
def checkpoint(
    request: pytest.FixtureRequest, make_checkpoint: Callable[..., Checkpoint]
) -> Checkpoint:
    """Each supported family in turn."""
    return make_checkpoint(request.param)


@pytest.fixture(scope="session")
def llama(make_checkpoint: Callable[..., Checkpoint]) -> Checkpoint:
    return make_checkpoint("llama")


# ------------------------------------------------------------ mini scheduler


@dataclass
class _Req:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    outputs: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    pending_tokens: list[int] = field(default_factory=list)  # sampled, not yet sent back
    pending_blocks: list[int] = field(default_factory=list)
    sent: bool = False  # the runner has seen it
    lora: LoRARequest | None = None
    pooling: PoolingParams | None = None
    pooled: list[float] | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs


class MiniScheduler:
    """Drives ``runner`` until every added request has produced its tokens."""

    def __init__(self, runner: ModelRunner, chunk: int | None = None) -> None:
        self.runner = runner
        self.chunk = chunk
        self.block_size = runner.block_size
        self.next_block = 0
        self.running: dict[str, _Req] = {}
        self.done: dict[str, _Req] = {}
        self.finished_ids: list[str] = []
        self.preempted_ids: list[str] = []
        self.step_id = 0

    def _alloc(self) -> int:
        block = self.next_block
        self.next_block += 1
        if block >= self.runner.num_kv_blocks:
            raise RuntimeError("test scheduler ran out of KV blocks")
        return block

    def add(
        self,
        req_id: str,
        prompt: list[int],
        params: SamplingParams | None = None,
        max_tokens: int = 16,
        prefix_of: str | None = None,
        prefix_blocks: int = 0,
        lora: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
    ) -> None:
        """Queue a request; ``prefix_of`` shares that request's first ``prefix_blocks`` blocks.

        ``lora`` runs it through an adapter; ``pooling`` makes it a pooling request,
        finished when its pooled vector comes back.
        """
        req = _Req(req_id, list(prompt), params or SamplingParams(temperature=0.0), max_tokens)
        req.lora, req.pooling = lora, pooling
        if prefix_of is not None:
            donor = self.done.get(prefix_of) or self.running[prefix_of]
            req.block_ids = donor.block_ids[:prefix_blocks]
            req.pending_blocks = list(req.block_ids)
            req.num_computed = prefix_blocks * self.block_size
            assert req.tokens[: req.num_computed] == donor.tokens[: req.num_computed]
        self.running[req_id] = req

    def preempt(self, req_id: str) -> None:
        """Drop the request's KV; it is recomputed (prompt + outputs) from the next step."""
        req = self.running[req_id]
        req.sent, req.num_computed = False, 0
        req.block_ids, req.pending_blocks, req.pending_tokens = [], [], []
        self.preempted_ids.append(req_id)

    def step(self) -> None:
        new: list[NewRequestData] = []
        params: dict[str, RunnerSamplingParams] = {}
        cached = CachedRequestData()
        scheduled: dict[str, int] = {}
        for req in self.running.values():
            n = len(req.tokens) - req.num_computed
            if self.chunk is not None:
                n = min(n, self.chunk)
            while len(req.block_ids) * self.block_size < req.num_computed + n:
                block = self._alloc()
                req.block_ids.append(block)
                req.pending_blocks.append(block)
            if not req.sent:
                new.append(
                    NewRequestData(
                        req.req_id, list(req.prompt), req.req_id, list(req.block_ids),
                        req.num_computed, list(req.outputs), req.lora, req.pooling,
                        req.params.seed,
                    )
                )  # fmt: skip
                params[req.req_id] = RunnerSamplingParams.of(req.params)
                req.sent = True
            else:
                cached.req_ids.append(req.req_id)
                cached.num_computed_tokens.append(req.num_computed)
                if req.pending_tokens:
                    cached.new_token_ids[req.req_id] = req.pending_tokens
                if req.pending_blocks:
                    cached.new_block_ids[req.req_id] = req.pending_blocks
            req.pending_tokens, req.pending_blocks = [], []
            scheduled[req.req_id] = n
        out = self.runner.execute(
            SchedulerOutput(
                step_id=self.step_id,
                new_requests=new,
                cached_requests=cached,
                num_scheduled_tokens=scheduled,
                total_num_scheduled_tokens=sum(scheduled.values()),
                finished_req_ids=self.finished_ids,
                preempted_req_ids=self.preempted_ids,
                sampling_params=params,
            )
        )
        self.step_id += 1
        self.finished_ids, self.preempted_ids = [], []
        assert out.req_ids == list(scheduled)
        for req_id, sampled in zip(out.req_ids, out.sampled_lists()):
            req = self.running[req_id]
            req.num_computed += scheduled[req_id]
            req.prompt_logprobs.extend(out.prompt_logprobs.get(req_id, []))
            if req_id in out.pooled:
                assert not sampled and req.num_computed == len(req.tokens)
                req.pooled = out.pooled[req_id]
                self.done[req_id] = self.running.pop(req_id)
                self.finished_ids.append(req_id)
                continue
            if not sampled:
                assert req.num_computed < len(req.tokens)
                continue
            assert req.num_computed == len(req.tokens)
            req.outputs.extend(sampled)  # the runner appends its own samples: nothing to send
            req.logprobs.extend(out.logprobs.get(req_id, []))
            if len(req.outputs) >= req.max_tokens:
                self.done[req_id] = self.running.pop(req_id)
                self.finished_ids.append(req_id)

    def run(self) -> dict[str, list[int]]:
        """Step until nothing runs; the outputs of every finished request."""
        while self.running:
            self.step()
        return {rid: req.outputs for rid, req in self.done.items()}


@pytest.fixture(scope="session")
def mini_scheduler() -> type[MiniScheduler]:
    """The :class:`MiniScheduler` class."""
    return MiniScheduler


@pytest.fixture(scope="session")
def hf_greedy() -> Callable[..., tuple[list[int], list[float]]]:
    """``hf_greedy(checkpoint, prompt, n)``: transformers' greedy tokens and their logprobs.

    ``generate(do_sample=False)`` on the fp32 reference model (cached per call).
    """
    cache: dict[tuple[str, tuple[int, ...], int], tuple[list[int], list[float]]] = {}

    def run(ck: Checkpoint, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        key = (str(ck.path), tuple(prompt), n)
        if key not in cache:
            with torch.no_grad():
                out = ck.hf_model.generate(
                    torch.tensor([prompt]),
                    do_sample=False,
                    max_new_tokens=n,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
            tokens = out.sequences[0, len(prompt) :].tolist()
            logprobs = [
                torch.log_softmax(step[0].float(), dim=-1)[tok].item()
                for step, tok in zip(out.logits, tokens)
            ]
            cache[key] = (tokens, logprobs)
        return cache[key]

    return run


class Greedy:
    """Greedy generations to compare, legato's (each call drives a fresh
    :class:`MiniScheduler`) against transformers' (``hf_greedy``), shared by the
    model-family tests. The assertions fail on a degenerate reference too: a
    repeated token proves little."""

    def __init__(self, hf_greedy: Callable[..., tuple[list[int], list[float]]]) -> None:
        self.hf_greedy = hf_greedy

    @staticmethod
    def prompts(lengths: list[int], seed: int, vocab: int = 384) -> list[list[int]]:
        """Random prompts of ``lengths`` tokens (ids below ``vocab``), drawn from ``seed``."""
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]

    @staticmethod
    def run(
        runner: ModelRunner, prompts: list[list[int]], max_tokens: int, chunk: int | None = None
    ) -> list[list[int]]:
        """legato's greedy tokens for ``prompts`` in one batch (prefill in ``chunk``s)."""
        sched = MiniScheduler(runner, chunk=chunk)
        for i, prompt in enumerate(prompts):
            sched.add(f"r{i}", prompt, max_tokens=max_tokens)
        outputs = sched.run()
        return [outputs[f"r{i}"] for i in range(len(prompts))]

    def run_file(
        self, model: str | Path, prompts: list[list[int]], max_tokens: int, **engine: Any
    ) -> tuple[list[list[int]], ModelRunner]:
        """:meth:`run` on a fresh fp32 CPU runner of ``model`` (a directory or a GGUF file;
        ``engine``: more EngineConfig fields); the tokens and the runner."""
        from legato.config import EngineConfig

        engine = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 64, **engine}
        runner = ModelRunner(EngineConfig(model=str(model), **engine))
        return self.run(runner, prompts, max_tokens), runner

    def transformers(
        self, ck: Checkpoint, prompts: list[list[int]], max_tokens: int
    ) -> list[list[int]]:
        """transformers' greedy tokens for each prompt, on the checkpoint's fp32 model."""
        return [self.hf_greedy(ck, prompt, max_tokens)[0] for prompt in prompts]

    def assert_matches_transformers(
        self,
        ck: Checkpoint,
        runner: ModelRunner,
        prompts: list[list[int]],
        max_tokens: int,
        *,
        chunk: int | None = None,
        logprobs_abs: float | None = None,
    ) -> None:
        """legato's greedy tokens for ``prompts`` (one batch, prefill in ``chunk``s) are
        transformers'; with ``logprobs_abs`` the sampled tokens' logprobs are too, within it."""
        params = SamplingParams(temperature=0.0, logprobs=0 if logprobs_abs else None)
        sched = MiniScheduler(runner, chunk=chunk)
        for i, prompt in enumerate(prompts):
            sched.add(f"r{i}", prompt, params, max_tokens)
        outputs = sched.run()
        for i, prompt in enumerate(prompts):
            expected, expected_lp = self.hf_greedy(ck, prompt, max_tokens)
            assert len(set(expected)) > 2, f"prompt {i}: a degenerate reference proves little"
            assert outputs[f"r{i}"] == expected, f"{ck.kind} chunk={chunk} prompt {i}"
            if logprobs_abs is not None:
                got_lp = [entry.logprobs[0] for entry in sched.done[f"r{i}"].logprobs]
                assert got_lp == pytest.approx(expected_lp, abs=logprobs_abs), f"prompt {i}"

    def assert_prefix_hit_matches_transformers(
        self,
        ck: Checkpoint,
        runner: ModelRunner,
        donor: list[int],
        prompt: list[int],
        blocks: int,
        max_tokens: int,
    ) -> None:
        """``prompt``, started from the first ``blocks`` blocks ``donor`` wrote (admitted
        with those tokens computed), gives transformers' greedy tokens."""
        sched = MiniScheduler(runner)
        sched.add("donor", donor, max_tokens=2)
        sched.run()
        sched.add("hit", prompt, max_tokens=max_tokens, prefix_of="donor", prefix_blocks=blocks)
        assert sched.running["hit"].num_computed == blocks * runner.block_size
        expected = self.hf_greedy(ck, prompt, max_tokens)[0]
        assert len(set(expected)) > 2, "a degenerate reference proves little"
        assert sched.run()["hit"] == expected


@pytest.fixture(scope="session")
def greedy(hf_greedy: Callable[..., tuple[list[int], list[float]]]) -> Greedy:
    """The :class:`Greedy` comparisons."""
    return Greedy(hf_greedy)


@pytest.fixture(scope="session")
def triton_device() -> str:
    """The device runners on the Triton kernels use: cuda where present, else cpu."""
    return TRITON_DEVICE


@pytest.fixture(scope="session")
def make_runner() -> Callable[..., ModelRunner]:
    """``make_runner(checkpoint, **engine_config)``: a CPU runner with a small KV cache."""
    from legato.config import EngineConfig

    def make(ck: Checkpoint, *, attention_backend: str | None = None, **kwargs: Any) -> ModelRunner:
        kwargs = {"num_kv_blocks": 128, "max_num_seqs": 8, "device": "cpu", **kwargs}
        config = EngineConfig(model=str(ck.path), **kwargs)
        return ModelRunner(config, attention_backend=attention_backend)

    return make


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """Tiny models gain nothing from a second thread, and on a shared 2-core machine
    every parallel region can stall on a busy core; restored after each test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------ LoRA


@dataclass
class Adapter:
    """A random PEFT adapter saved to ``path`` and the peft model it came from."""

    path: Path
    peft_model: Any

    def request(self, name: str, int_id: int) -> LoRARequest:
        return LoRARequest(name, int_id, str(self.path))


ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="session")
def make_adapter(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Adapter]:
    """``make_adapter(checkpoint, r=8, targets=ALL_TARGETS, seed=0, **lora_config)``.

    peft's ``get_peft_model`` on a copy of the checkpoint's transformers model,
    with every LoRA weight drawn at random (peft's default zero ``B`` would make
    the adapter a no-op), saved with ``save_pretrained``. Built once per call.
    """
    import copy

    from peft import LoraConfig, get_peft_model

    cache: dict[tuple[Any, ...], Adapter] = {}

    def make(
        ck: Checkpoint,
        *,
        r: int = 8,
        targets: tuple[str, ...] = ALL_TARGETS,
        seed: int = 0,
        std: float = 0.08,
        **overrides: Any,
    ) -> Adapter:
        key = (str(ck.path), r, targets, seed, std, tuple(sorted(overrides.items())))
        if key not in cache:
            config = LoraConfig(
                r=r,
                lora_alpha=overrides.pop("lora_alpha", 2 * r),
                target_modules=list(targets),
                lora_dropout=0.0,
                init_lora_weights=False,
                **overrides,
            )
            model = get_peft_model(copy.deepcopy(ck.hf_model), config).eval()
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if "lora_" in name:
                        param.copy_(torch.randn(param.shape, generator=g) * std)
            path = tmp_path_factory.mktemp(f"lora-{ck.kind}-r{r}-s{seed}")
            model.save_pretrained(path)
            cache[key] = Adapter(path, model)
        return cache[key]

    return make


@pytest.fixture
def decode_stack_calls() -> Callable[[], contextlib.AbstractContextManager[list[tuple[int, int]]]]:
    """A context manager under which each call of the one-call decode stack's kernel
    (:mod:`legato.models.decode_stack`) still runs and is recorded as ``(rows, sequences)``
    in the list it yields."""

    @contextlib.contextmanager
    def recording() -> Iterator[list[tuple[int, int]]]:
        calls: list[tuple[int, int]] = []
        kernel = cpu_kernels.decode_layers_kernel()

        def counted(*args: Any) -> int:
            calls.append((int(args[4]), int(args[-1])))  # rows, sequences
            return int(kernel(*args))

        original = cpu_kernels.decode_layers_kernel
        cpu_kernels.decode_layers_kernel = lambda: counted  # type: ignore[assignment]
        try:
            yield calls
        finally:
            cpu_kernels.decode_layers_kernel = original  # type: ignore[assignment]

    return recording
