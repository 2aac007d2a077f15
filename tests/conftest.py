"""Shared fixtures. Environment set here before anything imports transformers or triton."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run under the numpy interpreter on CPU-only machines.
    os.environ.setdefault("TRITON_INTERPRET", "1")


# -- the toy model (legato.toy_model) ------------------------------------------

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

import pytest  # noqa: E402

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@pytest.fixture(scope="session", autouse=True)
def legato_home_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """`$LEGATO_HOME` for the whole session: a fresh temp dir, never the user's cache.

    Child processes (engine workers) inherit it, so they find the same toy model.
    """
    home = tmp_path_factory.mktemp("legato-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LEGATO_HOME", str(home))
        yield home


@pytest.fixture(scope="session")
def toy_model_dir(legato_home_dir: Path) -> Path:
    """The embedded default toy model (seed 0), built once per session into `legato_home_dir`."""
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
