"""The detokenizers: incremental text from token ids, the same through all three."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from legato.actors.output_slot import OutputSlot
from legato.outputs.detokenizer import (
    IncrementalDetokenizer,
    StreamDetokenizer,
    TokenTexts,
    make_detokenizer,
)
from legato.outputs.output_processor import OutputProcessor
from legato.protocol.params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DELTA = RequestOutputKind.DELTA
FFFD = "\ufffd"
ARRIVAL = 100.0
EOS = 1  # <|eos|> in the toy tokenizer
HYPOTHESIS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture
def tok(toy_tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    return toy_tokenizer


def encode(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    ids: list[int] = tok.encode(text, add_special_tokens=False)
    return ids


# ------------------------------------- IncrementalDetokenizer, StreamDetokenizer


def stream_with_whole_tokens(tok: Any, *args: Any, **kwargs: Any) -> StreamDetokenizer:
    """A StreamDetokenizer that takes whole tokens from the tokenizer's table (where
    the tokenizer has one: byte-level BPE, as the toy model's and SmolLM2's)."""
    return StreamDetokenizer(tok, *args, token_texts=TokenTexts(tok), **kwargs)


@pytest.fixture(
    params=[IncrementalDetokenizer, StreamDetokenizer, stream_with_whole_tokens],
    ids=["python", "stream", "stream+whole-tokens"],
)
def Detok(request: pytest.FixtureRequest) -> Any:
    """Each test of the detokenizer's contract runs on all three: the Python one, the
    one on tokenizers' DecodeStream, and that one with whole tokens from the table
    must give the same pieces."""
    return request.param


def test_multibyte_characters_appear_once_when_complete(
    Detok: Any, tok: PreTrainedTokenizerBase
) -> None:
    text = "héllo 世界 🙂 naïve"
    ids = encode(tok, text)
    assert any(FFFD in tok.decode([i]) for i in ids), "no character is split across tokens"
    detok = Detok(tok, [0, *encode(tok, "Hi")])
    deltas = [detok.update([i]) for i in ids]
    assert all(FFFD not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text
    # 🙂 is four bytes over several tokens: it shows up whole, in one delta.
    assert sum("🙂" in d for d in deltas) == 1
    assert "" in deltas  # some tokens completed nothing yet


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(Detok: Any, tok: PreTrainedTokenizerBase, skip: bool) -> None:
    ids = [*encode(tok, "a"), EOS, 3, *encode(tok, " b"), 4]
    detok = Detok(tok, [3, 0], skip_special_tokens=skip)
    got = "".join(detok.update([i]) for i in ids) + detok.flush()
    assert got == ("a b" if skip else "a<|eos|><|im_start|> b<|im_end|>")
    assert got == tok.decode(ids, skip_special_tokens=skip)


def test_prompt_context_spaces_the_first_token(Detok: Any) -> None:
    # SentencePiece-style decoders drop the leading space of the first token
    # decoded; with the prompt as context, the first output token keeps it.
    metaspace = Tokenizer(models.WordLevel({"▁Hello": 0, "▁world": 1, "<unk>": 2}, "<unk>"))
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    metaspace.decoder = decoders.Metaspace()
    assert metaspace.decode([1]) == "world"
    assert Detok(metaspace, [0]).update([1, 1]) == " world world"


def test_invalid_byte_runs_are_emitted_as_decoded(Detok: Any, tok: PreTrainedTokenizerBase) -> None:
    # Tokens that never complete a character (lone continuation bytes) must not
    # grow the window forever; their text comes out as U+FFFD, as decode says.
    lone = next(i for i in range(len(tok)) if tok.decode([i, i]) == FFFD * 2)
    ids = [lone] * 40 + encode(tok, " ok")
    detok = Detok(tok)
    deltas = [detok.update([i]) for i in ids]
    assert "".join(deltas) + detok.flush() == tok.decode(ids) == FFFD * 40 + " ok"


@HYPOTHESIS
@given(
    text=st.text(alphabet="ab é世界🙂ŵ\n.", max_size=30),
    prompt=st.text(alphabet="xy 界é", max_size=8),
    chunk=st.integers(1, 3),
)
def test_deltas_concatenate_to_the_decoded_text(
    Detok: Any, tok: PreTrainedTokenizerBase, text: str, prompt: str, chunk: int
) -> None:
    ids = encode(tok, text)
    detok = Detok(tok, encode(tok, prompt))
    deltas = [detok.update(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    assert all(FFFD not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text


@HYPOTHESIS
@given(
    data=st.data(),
    skip=st.booleans(),
    chunk=st.integers(1, 4),
)
def test_random_token_ids_decode_like_the_tokenizer(
    Detok: Any, tok: PreTrainedTokenizerBase, data: st.DataObject, skip: bool, chunk: int
) -> None:
    token = st.integers(0, len(tok) - 1)
    ids = data.draw(st.lists(token, max_size=40), label="ids")
    prompt = data.draw(st.lists(token, max_size=10), label="prompt")
    detok = Detok(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.update(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    full = tok.decode(ids, skip_special_tokens=skip)
    # Only a trailing incomplete character is never emitted.
    expected = full[:-1] if full.endswith(FFFD) else full
    assert "".join(deltas) + detok.flush() == expected
    if FFFD not in full:
        assert all(FFFD not in d for d in deltas)


@HYPOTHESIS
@given(data=st.data(), skip=st.booleans())
def test_decode_stream_gives_the_same_pieces_as_the_python_detokenizer(
    tok: PreTrainedTokenizerBase, data: st.DataObject, skip: bool
) -> None:
    token = st.integers(0, len(tok) - 1)
    ids = data.draw(st.lists(token, max_size=40), label="ids")
    prompt = data.draw(st.lists(token, max_size=10), label="prompt")
    python = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    stream = StreamDetokenizer(tok, prompt, skip_special_tokens=skip)
    whole = stream_with_whole_tokens(tok, prompt, skip_special_tokens=skip)
    expected = [python.update([i]) for i in ids]
    assert [stream.update([i]) for i in ids] == expected
    assert [whole.update([i]) for i in ids] == expected
    assert stream.flush() == whole.flush() == python.flush()


def test_make_detokenizer_uses_decode_stream_for_fast_tokenizers(
    tok: PreTrainedTokenizerBase,
) -> None:
    assert isinstance(make_detokenizer(tok, [0]), StreamDetokenizer)
    slow = SlowTokenizer(tok)
    detok = make_detokenizer(slow, [0], spaces_between_special_tokens=False)
    assert isinstance(detok, IncrementalDetokenizer)
    assert detok.update(encode(tok, "héllo")) == "héllo"


class SlowTokenizer:
    """A tokenizer without a fast backend (only ``decode``), as a slow one is."""

    def __init__(self, tok: PreTrainedTokenizerBase) -> None:
        self._tok = tok
        self.all_special_ids = list(tok.all_special_ids)

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        kwargs.pop("spaces_between_special_tokens", None)
        text: str = self._tok.decode(ids, **kwargs)
        return text


def test_a_run_of_invalid_bytes_hands_over_to_python(tok: PreTrainedTokenizerBase) -> None:
    # 17 tokens that complete no character are emitted as decoded (U+FFFD); DecodeStream
    # would hold them forever, so the rest is decoded in Python, from the same state
    # (the byte after them completes a character with the last one, which the stream,
    # restarted on them, would report as an invalid prefix).
    lone = next(i for i in range(len(tok)) if tok.decode([i, i]) == FFFD * 2)
    two_byte = [encode(tok, ch) for ch in "ŵĳŉŧ"]
    lead, cont = next(ids for ids in two_byte if len(ids) == 2)
    ids = [lone] * 16 + [lead, cont, *encode(tok, "xy z")]
    python, stream = IncrementalDetokenizer(tok), StreamDetokenizer(tok)
    expected = "".join(python.update([i]) for i in ids) + python.flush()
    got = "".join(stream.update([i]) for i in ids) + stream.flush()
    assert got == expected and stream._fallback is not None


def test_whole_token_texts_hold_only_plain_tokens_of_byte_level_tokenizers(
    tok: PreTrainedTokenizerBase, strip_tokenizer: Tokenizer
) -> None:
    texts = TokenTexts(tok)
    assert texts.byte_level  # the toy tokenizer is byte-level BPE
    two_byte = next(ids for ids in (encode(tok, ch) for ch in "ŵĳŉŧ") if len(ids) == 2)
    assert texts.whole(two_byte[0]) is None  # half a character
    special = tok.all_special_ids[0]
    assert texts.whole(special) is None  # an added token: the stream decides
    (space_x,) = encode(tok, " x")
    assert texts.whole(space_x) == " x"  # its leading space is its own
    assert not TokenTexts(strip_tokenizer).byte_level  # Strip depends on position
    # text() is every token decoded alone, as logprobs show it: halves and specials too.
    for token_id in (two_byte[0], special, space_x):
        assert texts.text(token_id) == tok.decode([token_id])
    # The OutputProcessor hands its one table to every request's detokenizer.
    proc = OutputProcessor(tok)
    for rid in ("a", "b"):
        params = SamplingParams(output_kind=DELTA)
        proc.add_request(rid, "Hi", encode(tok, "Hi"), params, ARRIVAL, slot=OutputSlot(DELTA))
    detoks = [c.detokenizer for c in proc._completions.values()]
    assert all(isinstance(d, StreamDetokenizer) and d._whole is proc._token_texts for d in detoks)
