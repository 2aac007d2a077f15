"""The deterministic toy model: fast and tiny, for tests (``model="toy"``, ``legato serve toy``).

`build_toy_model` makes a complete Hugging Face checkpoint directory from a seed
alone: a byte-level BPE tokenizer trained on the corpus shipped in
`legato/data/corpus.txt`, and a random-weight Llama-architecture model (a few
million parameters, fp32 safetensors). The same seed gives byte-identical files.
`default_toy_model_dir` builds it once into `$LEGATO_HOME` and reuses it;
`describe` summarises a checkpoint directory for humans.

Nothing here downloads anything: the tokenizer is trained from text in the
package and the weights come from torch's seeded generator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import struct
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .model_cache import build_atomically, legato_home

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TOY_MODEL_VERSION = 1
"""Bump when the recipe (corpus, tokenizer, model) changes, so old cached builds are not reused."""

MARKER_FILE = "legato-toy-model.json"
"""Written last into a build: its presence (with matching contents) means the build is complete."""

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
"""In id order: `<|bos|>` is 0, `<|eos|>` 1, `<|pad|>` 2, `<|im_start|>` 3, `<|im_end|>` 4."""

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, led by BOS as Llama 3's template is: render it, then tokenize without special tokens."""


@dataclasses.dataclass(frozen=True)
class ToyModelSpec:
    """Sizes of the toy model; the defaults are the model ``"toy"`` names."""

    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    # Larger than transformers' 0.02 so that attention and the MLPs move the
    # logits enough for greedy decoding to depend on more than the last token.
    initializer_range: float = 0.05


DEFAULT_SPEC = ToyModelSpec()


def build_toy_model(
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    spec: ToyModelSpec = DEFAULT_SPEC,
) -> Path:
    """Build the toy checkpoint for `seed` into `out_dir` and return its path.

    The directory is built in a temporary sibling and renamed into place, so a
    concurrent reader never sees a half-built model. If `out_dir` already holds
    a complete build of the same seed and spec (another process won the race),
    that build is returned untouched. Raises FileExistsError if `out_dir` holds
    anything else (an empty directory is replaced). Blocks: a fraction of a
    second once torch and transformers are imported (importing them takes seconds).
    """
    return build_atomically(
        Path(out_dir),
        MARKER_FILE,
        _marker(seed, spec),
        lambda tmp: _build_into(tmp, seed, spec),
        _not_a_build(Path(out_dir).absolute(), seed),
    )


def default_toy_model_dir() -> Path:
    """The toy model's directory (``model="toy"``), built on first use (blocks a few seconds then).

    Safe to call from several processes at once: each may build, one wins the
    rename, and all return the same complete directory.
    """
    return build_toy_model(legato_home() / f"toy-model-v{TOY_MODEL_VERSION}-seed0", seed=0)


def describe(model_dir: str | os.PathLike[str]) -> str:
    """A short human summary of a checkpoint directory: architecture, sizes, files.

    Reads only the JSON files and the safetensors headers (no torch, no weights).
    """
    root = Path(model_dir)
    config = json.loads((root / "config.json").read_text())
    n_params = 0
    dtypes: set[str] = set()
    for path in sorted(root.glob("*.safetensors")):
        for name, info in _safetensors_header(path).items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in info["shape"]:
                count *= dim
            n_params += count
            dtypes.add(info["dtype"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    files = ", ".join(
        f"{p.name} ({_human_bytes(p.stat().st_size)})"
        for p in sorted(root.iterdir())
        if p.is_file()
    )
    lines = [
        f"{root}",
        f"  architecture  {', '.join(config.get('architectures', [config.get('model_type', '?')]))}",
        f"  parameters    {n_params:,} ({n_params / 1e6:.2f} M), dtype {', '.join(sorted(dtypes))}",
        f"  layers        {config['num_hidden_layers']}, hidden {config['hidden_size']},"
        f" intermediate {config['intermediate_size']}",
        f"  heads         {config['num_attention_heads']} query,"
        f" {config.get('num_key_value_heads', config['num_attention_heads'])} key/value,"
        f" head_dim {head_dim}",
        f"  vocab         {config['vocab_size']} (bos {config.get('bos_token_id')},"
        f" eos {config.get('eos_token_id')}, pad {config.get('pad_token_id')}),"
        f" max positions {config.get('max_position_embeddings')}",
        f"  files         {files}",
    ]
    return "\n".join(lines)


# -- building ---------------------------------------------------------------


def _build_into(out: Path, seed: int, spec: ToyModelSpec) -> None:
    tokenizer = _train_tokenizer(spec)
    tokenizer.save_pretrained(out)
    _build_weights(out, seed, spec, tokenizer)


def _corpus_lines() -> list[str]:
    text = resources.files("legato").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    return text.splitlines(keepends=True)


def _train_tokenizer(spec: ToyModelSpec) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (transformers fast tokenizer) trained on the shipped corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Deterministic whatever the thread count: merge ties are broken by token
    # ids and the initial alphabet is sorted (tests/test_toy_model.py checks).
    backend.train_from_iterator(_corpus_lines(), trainer=trainer)
    # Prepend BOS to every encoded prompt, as Llama does; never append EOS.
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, SPECIAL_TOKENS.index(BOS_TOKEN))],
    )
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        clean_up_tokenization_spaces=False,
        model_max_length=spec.max_position_embeddings,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _build_weights(
    out: Path, seed: int, spec: ToyModelSpec, tokenizer: PreTrainedTokenizerFast
) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        rms_norm_eps=spec.rms_norm_eps,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=torch.float32,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).float()  # type: ignore[no-untyped-call]
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with _quiet_transformers():
        model.save_pretrained(out, safe_serialization=True)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No progress bars on stderr while saving."""
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()  # type: ignore[no-untyped-call]


# -- reading ----------------------------------------------------------------


def _marker(seed: int, spec: ToyModelSpec) -> dict[str, Any]:
    return {
        "format": "legato-toy-model",
        "version": TOY_MODEL_VERSION,
        "seed": seed,
        "spec": dataclasses.asdict(spec),
    }


def _not_a_build(out: Path, seed: int) -> str:
    return (
        f"{out} exists but is not a complete toy model build (version {TOY_MODEL_VERSION},"
        f" seed {seed}); remove it to rebuild"
    )


def _safetensors_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header: dict[str, Any] = json.loads(f.read(length))
    return header


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"
