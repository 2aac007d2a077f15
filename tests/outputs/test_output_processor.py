"""The output processor: stop strings, output kinds, n>1, logprobs, errors, the plain path."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from legato.actors.output_slot import OutputSlot
from legato.outputs.detokenizer import (
    IncrementalDetokenizer,
    StreamDetokenizer,
    TokenTexts,
    make_detokenizer,
)
from legato.outputs.output_processor import OutputProcessor, ProcessedStep
from legato.protocol.errors import EngineGenerateError
from legato.protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    TokenLogprobs,
)
from legato.protocol.outputs import RequestOutput
from legato.protocol.params import LoRARequest, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DELTA = RequestOutputKind.DELTA
CUMULATIVE = RequestOutputKind.CUMULATIVE
FINAL_ONLY = RequestOutputKind.FINAL_ONLY
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


def core(
    request_id: str,
    ids: Sequence[int] = (),
    *,
    finish: FinishReason | None = None,
    stop_reason: int | str | None = None,
    logprobs: list[TokenLogprobs] | None = None,
    prompt_logprobs: list[TokenLogprobs | None] | None = None,
    cached: int = 0,
    error: str | None = None,
) -> EngineCoreOutput:
    return EngineCoreOutput(
        request_id, list(ids), logprobs, prompt_logprobs, finish, stop_reason, cached, error
    )


class Engine:
    """An OutputProcessor with a slot per request and a clock, stepped by hand."""

    def __init__(self, tok: PreTrainedTokenizerBase | None) -> None:
        self.tok = tok
        self.proc = OutputProcessor(tok)
        self.slots: dict[str, OutputSlot] = {}
        self.now = ARRIVAL

    def add(self, request_id: str, params: SamplingParams, prompt: str = "Hi") -> list[str]:
        slot = self.slots[request_id] = OutputSlot(params.output_kind)
        prompt_ids = [0, *encode(self.tok, prompt)] if self.tok is not None else [0, 5, 6]
        return self.proc.add_request(request_id, prompt, prompt_ids, params, ARRIVAL, slot=slot)

    def step(self, *outputs: EngineCoreOutput) -> ProcessedStep:
        self.now += 1.0
        return self.proc.process_outputs(EngineCoreOutputs(list(outputs), self.now))

    def take(self, request_id: str) -> RequestOutput | None:
        return self.slots[request_id].get_nowait()

    def stream(
        self, request_id: str, ids: Sequence[int], finish: FinishReason = FinishReason.LENGTH
    ) -> tuple[list[RequestOutput | None], list[str]]:
        """One token per step, ``finish`` on the last; stop early if the detokenizer finishes it."""
        taken: list[RequestOutput | None] = []
        aborted: list[str] = []
        for i, token_id in enumerate(ids):
            last = i == len(ids) - 1
            step = self.step(core(request_id, [token_id], finish=finish if last else None))
            aborted += step.requests_to_stop + step.requests_to_abort
            taken.append(self.take(request_id))
            if aborted:
                break
        return taken, aborted


def texts(outputs: Sequence[RequestOutput | None], index: int = 0) -> list[str | None]:
    return [None if o is None else o.outputs[index].text for o in outputs]


def last_output(outputs: Sequence[RequestOutput | None]) -> RequestOutput:
    final = outputs[-1]
    assert final is not None and final.finished
    assert all(o is None or not o.finished for o in outputs[:-1])
    return final


def test_a_token_the_decoder_panics_on_fails_only_that_request(strip_tokenizer: Tokenizer) -> None:
    engine = Engine(None)
    engine.proc = OutputProcessor(strip_tokenizer)
    for rid in ("odd", "fine"):
        engine.slots[rid] = OutputSlot(DELTA)
        params = SamplingParams(n=2 if rid == "odd" else 1, output_kind=DELTA)
        engine.proc.add_request(rid, "a", [0], params, ARRIVAL, slot=engine.slots[rid])
    step = engine.step(core("0_odd", [2]), core("1_odd", [0]), core("fine", [0]))
    assert sorted(step.requests_to_abort) == ["0_odd", "1_odd"]  # the scheduler frees them
    with pytest.raises(EngineGenerateError, match="the tokenizer failed to decode") as info:
        engine.take("odd")
    assert info.value.request_id == "odd"
    fine = engine.take("fine")
    assert fine is not None and fine.outputs[0].token_ids == [0]
    engine.step(core("fine", [1], finish=FinishReason.LENGTH), core("0_odd", [0]))
    fine = engine.take("fine")
    assert fine is not None and fine.finished
    assert engine.proc.get_num_unfinished_requests() == 0


def test_smollm2_text_is_the_same_through_both_detokenizers(
    smollm2_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real default model's tokenizer: emoji and accents split across tokens, stop
    strings, skipped special tokens; the OutputProcessor gives the same outputs with
    DecodeStream as with the Python detokenizer."""
    from transformers import AutoTokenizer

    import legato.outputs.output_processor as output_processor

    smol = AutoTokenizer.from_pretrained(str(smollm2_dir))
    texts = [
        "Hello world! 🎉🙂 café naïve 世界 — done.",
        "Emoji family 👨‍👩‍👧 and flags 🇫🇷🇯🇵, then Ελληνικά and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢.",
        "Stop here: END and more text after END",
    ]
    prompt = smol.encode("Say something:", add_special_tokens=False)
    im_end = smol.convert_tokens_to_ids("<|im_end|>")
    for text in texts:
        ids = [*smol.encode(text, add_special_tokens=False), im_end]
        assert any("\ufffd" in smol.decode([i]) for i in ids[:-1]) or "END" in text
        stream, python = StreamDetokenizer(smol, prompt), IncrementalDetokenizer(smol, prompt)
        whole = StreamDetokenizer(smol, prompt, token_texts=TokenTexts(smol))
        assert isinstance(make_detokenizer(smol, prompt), StreamDetokenizer)
        expected = [python.update([i]) for i in ids]
        assert [stream.update([i]) for i in ids] == expected
        assert [whole.update([i]) for i in ids] == expected
        assert stream.flush() == whole.flush() == python.flush()

    def run() -> list[tuple[str, list[int], str | None]]:
        proc = OutputProcessor(smol)
        got: list[tuple[str, list[int], str | None]] = []
        for k, text in enumerate(texts):
            params = SamplingParams(output_kind=DELTA, stop=["END", "🙂"])
            slot = OutputSlot(DELTA)
            proc.add_request(f"r{k}", None, prompt, params, ARRIVAL, slot=slot)
            for i in smol.encode(text, add_special_tokens=False):
                proc.process_outputs(EngineCoreOutputs([core(f"r{k}", [i])], ARRIVAL + 1))
                out = slot.get_nowait()
                if out is not None:
                    c = out.outputs[0]
                    got.append((c.text, list(c.token_ids), c.finish_reason))
                    if out.finished:
                        break
        return got

    with_stream = run()
    monkeypatch.setattr(output_processor, "make_detokenizer", lambda tok, ids, token_texts, **kw: (
        IncrementalDetokenizer(tok, ids, **kw)))  # fmt: skip
    assert with_stream == run()
    text = "".join(t for t, _, _ in with_stream)
    assert text.startswith("Hello world! 🎉Emoji family 👨‍👩‍👧") and text.endswith("Stop here: ")
    assert [f for _, _, f in with_stream].count("stop") == 2


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(
    tok: PreTrainedTokenizerBase, kind: RequestOutputKind, include: bool
) -> None:
    ids = encode(tok, "Hello world. Bye now")
    assert [tok.decode([i]) for i in ids[:4]] == ["H", "el", "lo", " wor"]
    engine = Engine(tok)
    params = SamplingParams(stop=["o wor"], include_stop_str_in_output=include, output_kind=kind)
    engine.add("r", params)
    outputs, aborted = engine.stream("r", ids)
    assert aborted == ["r"]  # finished here, still live in the scheduler
    assert len(outputs) == 4
    final = last_output(outputs)
    expected = "Hello wor" if include else "Hell"
    c = final.outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", "o wor")
    assert c.token_ids == (ids[3:4] if kind == DELTA else ids[:4])
    if kind == DELTA:
        # The "o" that might start the stop string was held back, never leaked.
        held = ["H", "el", "l", ""] if not include else ["H", "el", "lo", " wor"]
        assert texts(outputs) == held
        assert "".join(t or "" for t in texts(outputs)) == expected
    else:
        assert texts(outputs) == (
            ["H", "Hel", "Hell", expected] if not include else ["H", "Hel", "Hello", expected]
        )
    assert not engine.proc.has_unfinished_requests()
    # The scheduler's late answer for the request is ignored.
    assert engine.step(core("r", [ids[4]], finish=FinishReason.ABORT)).finished == []


def test_held_back_text_is_released_when_it_is_no_stop(tok: PreTrainedTokenizerBase) -> None:
    ids = encode(tok, "Hello world. Bye now")
    engine = Engine(tok)
    engine.add("r", SamplingParams(stop=["o wow"], output_kind=DELTA))
    outputs, aborted = engine.stream("r", ids)
    assert aborted == []
    assert texts(outputs)[:5] == ["H", "el", "l", "o wor", "ld"]
    assert "".join(t or "" for t in texts(outputs)) == "Hello world. Bye now"
    assert last_output(outputs).outputs[0].finish_reason == "length"


def test_held_back_text_is_released_on_finish(tok: PreTrainedTokenizerBase) -> None:
    ids = encode(tok, "Hello")
    engine = Engine(tok)
    engine.add("r", SamplingParams(stop=["lo!"], output_kind=DELTA))
    outputs, _ = engine.stream("r", ids)
    assert texts(outputs) == ["H", "e", "llo"]  # "l", then "lo", might have become "lo!"


def test_min_tokens_ignores_stop_strings_before_it(tok: PreTrainedTokenizerBase) -> None:
    ids = encode(tok, "a b. c d. e f.")  # a, " b", ".", " c", " d", ".", ...
    engine = Engine(tok)
    engine.add("r", SamplingParams(stop=["."], min_tokens=3, output_kind=CUMULATIVE))
    outputs, aborted = engine.stream("r", ids)
    # The "." at token 3 comes within min_tokens (as for stop token ids, min_tokens
    # tokens precede the one that may stop); the one at token 6 stops.
    assert aborted == ["r"]
    final = last_output(outputs)
    assert final.outputs[0].text == "a b. c d"
    assert len(final.outputs[0].token_ids) == 6


@HYPOTHESIS
@given(
    text=st.text(alphabet="ab .", min_size=1, max_size=24),
    stops=st.lists(st.text(alphabet="ab .", min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_stop_strings_never_leak_into_a_delta_stream(
    tok: PreTrainedTokenizerBase, text: str, stops: list[str], include: bool
) -> None:
    ids = encode(tok, text)
    engine = Engine(tok)
    engine.add(
        "r", SamplingParams(stop=stops, include_stop_str_in_output=include, output_kind=DELTA)
    )
    outputs, _ = engine.stream("r", ids)
    final = last_output(outputs)
    # Brute force: the first position where some stop string has just been completed.
    expected = text
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            expected = text[:end] if include else text[: end - len(stop)]
            assert (final.outputs[0].finish_reason, final.outputs[0].stop_reason) == ("stop", stop)
            break
    assert "".join(t or "" for t in texts(outputs)) == expected


# --------------------------------------------------------------- output kinds


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE, FINAL_ONLY])
def test_output_kinds(tok: PreTrainedTokenizerBase, kind: RequestOutputKind) -> None:
    ids = encode(tok, "The cat sat")
    assert len(ids) == 3
    engine = Engine(tok)
    engine.add("r", SamplingParams(output_kind=kind, max_tokens=3), prompt="Once")
    outputs, _ = engine.stream("r", ids)
    final = last_output(outputs)
    if kind == DELTA:
        assert texts(outputs) == ["The", " cat", " sat"]
        assert [o.outputs[0].token_ids for o in outputs if o] == [[i] for i in ids]
    elif kind == CUMULATIVE:
        assert texts(outputs) == ["The", "The cat", "The cat sat"]
        assert [o.outputs[0].token_ids for o in outputs if o] == [ids[:1], ids[:2], ids]
    else:
        assert outputs[:2] == [None, None]
        assert (final.outputs[0].text, final.outputs[0].token_ids) == ("The cat sat", ids)
    assert [o.outputs[0].finish_reason for o in outputs if o][-1] == "length"
    assert all(o.outputs[0].finish_reason is None for o in outputs[:-1] if o)
    assert final.outputs[0].stop_reason is None
    assert (final.request_id, final.prompt) == ("r", "Once")
    assert final.prompt_token_ids == [0, *encode(tok, "Once")]
    assert final.outputs[0].logprobs is None and final.outputs[0].cumulative_logprob is None


def test_a_slow_consumer_gets_merged_deltas(tok: PreTrainedTokenizerBase) -> None:
    ids = encode(tok, "héllo 世界 🙂")
    engine = Engine(tok)
    engine.add("r", SamplingParams(output_kind=DELTA))
    for i, token_id in enumerate(ids):
        last = i == len(ids) - 1
        engine.step(core("r", [token_id], finish=FinishReason.LENGTH if last else None))
    merged = engine.take("r")
    assert merged is not None and merged.finished
    assert (merged.outputs[0].text, merged.outputs[0].token_ids) == ("héllo 世界 🙂", ids)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("skip", [True, False])
def test_stop_token_text_is_left_out(
    tok: PreTrainedTokenizerBase, include: bool, skip: bool
) -> None:
    # The scheduler finished the request on a stop token: EOS, or a stop token id.
    dot = encode(tok, ".")[0]
    ids = encode(tok, "The cat")
    for stop_token, stop_reason in ((EOS, None), (dot, dot)):
        engine = Engine(tok)
        params = SamplingParams(
            output_kind=CUMULATIVE,
            skip_special_tokens=skip,
            include_stop_str_in_output=include,
            stop_token_ids=[dot],
        )
        engine.add("r", params)
        engine.step(core("r", ids))
        engine.step(core("r", [stop_token], finish=FinishReason.STOP, stop_reason=stop_reason))
        final = engine.take("r")
        assert final is not None and final.finished
        c = final.outputs[0]
        stop_text = tok.decode([stop_token], skip_special_tokens=skip)
        assert c.text == "The cat" + (stop_text if include else "")
        assert (c.token_ids, c.finish_reason, c.stop_reason) == (
            [*ids, stop_token],
            "stop",
            stop_reason,
        )


def test_detokenize_false_keeps_text_empty(tok: PreTrainedTokenizerBase) -> None:
    engine = Engine(tok)
    engine.add("r", SamplingParams(detokenize=False, logprobs=0, output_kind=CUMULATIVE))
    ids = encode(tok, "The cat")
    lps = [TokenLogprobs([i], [-1.0], [1]) for i in ids]
    engine.step(core("r", ids, logprobs=lps, finish=FinishReason.LENGTH))
    final = engine.take("r")
    assert final is not None
    c = final.outputs[0]
    assert (c.text, c.token_ids) == ("", ids)
    assert c.logprobs is not None
    assert all(lp.decoded_token is None for d in c.logprobs for lp in d.values())


# ----------------------------------------------------------------------- n > 1


def test_n3_delta_merges_children_under_the_parent_id(tok: PreTrainedTokenizerBase) -> None:
    engine = Engine(tok)
    params = SamplingParams(n=3, output_kind=DELTA, stop=["sat"])
    children = engine.add("r", params)
    assert children == ["0_r", "1_r", "2_r"]
    the, cat, sat = encode(tok, "The cat sat")
    engine.step(core("0_r", [the]), core("2_r", [cat]))
    first = engine.take("r")
    assert first is not None and not first.finished
    assert first.request_id == "r"
    assert [(c.index, c.text) for c in first.outputs] == [(0, "The"), (2, " cat")]
    # Child 1 stops on a stop string: finish it in the scheduler (as STOP, not abort).
    step = engine.step(core("1_r", [cat, sat]), core("0_r", [the], finish=FinishReason.LENGTH))
    assert step.requests_to_stop == ["1_r"] and step.requests_to_abort == []
    second = engine.take("r")
    assert second is not None and not second.finished
    assert [(c.index, c.text, c.finish_reason) for c in second.outputs] == [
        (0, "The", "length"),
        (1, " cat ", "stop"),
    ]
    assert engine.proc.has_unfinished_requests()
    engine.step(core("2_r", [EOS], finish=FinishReason.STOP))
    last = engine.take("r")
    assert last is not None and last.finished
    assert [(c.index, c.text, c.finish_reason) for c in last.outputs] == [(2, "", "stop")]
    assert not engine.proc.has_unfinished_requests()


@pytest.mark.parametrize("kind", [CUMULATIVE, FINAL_ONLY])
def test_n3_cumulative_and_final_only_carry_all_completions(
    tok: PreTrainedTokenizerBase, kind: RequestOutputKind
) -> None:
    engine = Engine(tok)
    engine.add("r", SamplingParams(n=3, output_kind=kind))
    the, cat, sat = encode(tok, "The cat sat")
    engine.step(core("1_r", [the]))
    first = engine.take("r")
    if kind == CUMULATIVE:
        assert first is not None
        assert [(c.index, c.text) for c in first.outputs] == [(0, ""), (1, "The"), (2, "")]
    else:
        assert first is None
    engine.step(core("0_r", [cat], finish=FinishReason.LENGTH), core("2_r", [sat]))
    engine.step(core("1_r", [cat], finish=FinishReason.LENGTH))
    assert engine.take("r") is None or kind == CUMULATIVE
    engine.step(core("2_r", [EOS], finish=FinishReason.STOP))
    final = engine.take("r")
    assert final is not None and final.finished
    assert [(c.index, c.text, c.finish_reason) for c in final.outputs] == [
        (0, " cat", "length"),
        (1, "The cat", "length"),
        (2, " sat", "stop"),
    ]


# ------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE])
def test_logprobs_are_decoded_and_summed(
    tok: PreTrainedTokenizerBase, kind: RequestOutputKind
) -> None:
    engine = Engine(tok)
    engine.add("r", SamplingParams(logprobs=2, prompt_logprobs=1, output_kind=kind))
    the, cat = encode(tok, "The cat")
    other = encode(tok, " dog")[0]
    prompt = [None, TokenLogprobs([44, 77], [-2.0, -0.1], [3, 1])]
    engine.step(
        core("r", [the], logprobs=[TokenLogprobs([the, cat, other], [-0.5, -0.5, -1.5], [1, 2, 3])],
             prompt_logprobs=prompt)
    )  # fmt: skip
    first = engine.take("r")
    engine.step(core("r", [cat], logprobs=[TokenLogprobs([cat, the], [-0.25, -0.1], [2, 1])]))
    second = engine.take("r")
    assert first is not None and second is not None
    assert first.prompt_logprobs is not None
    assert first.prompt_logprobs[0] is None
    (pl,) = first.prompt_logprobs[1:]
    assert pl is not None and list(pl) == [44, 77]
    assert (pl[44].logprob, pl[44].rank, pl[44].decoded_token) == (-2.0, 3, tok.decode([44]))
    entry = first.outputs[0].logprobs
    assert entry is not None and len(entry) == 1
    assert list(entry[0]) == [the, cat, other]  # the sampled token first
    assert entry[0][cat].decoded_token == " cat" and entry[0][cat].rank == 2
    assert first.outputs[0].cumulative_logprob == -0.5
    assert second.outputs[0].cumulative_logprob == -0.75
    second_lps = second.outputs[0].logprobs
    assert second_lps is not None
    if kind == DELTA:
        assert second.prompt_logprobs is None  # only on the first output
        assert len(second_lps) == 1 and list(second_lps[0]) == [cat, the]
    else:
        assert second.prompt_logprobs == first.prompt_logprobs
        assert [list(d) for d in second_lps] == [[the, cat, other], [cat, the]]


# ---------------------------------------------------- errors, aborts, metrics


def test_an_error_fails_only_that_request(tok: PreTrainedTokenizerBase) -> None:
    engine = Engine(tok)
    engine.add("bad", SamplingParams(n=2, output_kind=DELTA))
    engine.add("good", SamplingParams(output_kind=DELTA))
    the, cat = encode(tok, "The cat")
    engine.step(core("0_bad", [the]), core("1_bad", [the]), core("good", [the]))
    assert engine.take("bad") is not None
    step = engine.step(
        core("0_bad", [cat]),
        core("1_bad", [], finish=FinishReason.ERROR, error="NaN in logits"),
        core("good", [cat]),
    )
    assert step.requests_to_abort == ["0_bad"]  # the sibling still runs in the scheduler
    assert {f.request_id: f.finish_reason for f in step.finished} == {
        "0_bad": FinishReason.ERROR,
        "1_bad": FinishReason.ERROR,
    }
    with pytest.raises(EngineGenerateError, match="NaN in logits") as info:
        engine.take("bad")
    assert info.value.request_id == "bad"
    good = engine.take("good")
    assert good is not None and good.outputs[0].text == "The cat"  # two deltas, merged
    assert engine.proc.get_num_unfinished_requests() == 1
    # Later news for the failed request is ignored.
    engine.step(core("0_bad", [the]))


def test_fail_request_and_fail_all(tok: PreTrainedTokenizerBase) -> None:
    engine = Engine(tok)
    engine.add("a", SamplingParams(n=2))
    engine.add("b", SamplingParams())
    step = engine.proc.fail_request("a", ValueError("bad LoRA"))
    assert step.requests_to_abort == ["0_a", "1_a"]
    with pytest.raises(ValueError, match="bad LoRA"):
        engine.take("a")
    assert engine.proc.fail_request("a", ValueError("again")).requests_to_abort == []
    dead = RuntimeError("engine died")
    assert engine.proc.fail_all(dead).requests_to_abort == ["b"]
    with pytest.raises(RuntimeError, match="engine died"):
        engine.take("b")
    assert not engine.proc.has_unfinished_requests()


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE, FINAL_ONLY])
def test_abort_ends_the_stream_with_reason_abort(
    tok: PreTrainedTokenizerBase, kind: RequestOutputKind
) -> None:
    engine = Engine(tok)
    engine.add("r", SamplingParams(n=2, output_kind=kind, stop=["cat!"]))
    the, cat = encode(tok, "The cat")
    engine.step(core("0_r", [the, cat]), core("1_r", [the], finish=FinishReason.LENGTH))
    engine.take("r")
    step = engine.proc.abort_requests(["r", "unknown"], now=ARRIVAL + 9)
    assert step.requests_to_abort == ["0_r"]
    assert [(f.request_id, f.finish_reason) for f in step.finished] == [("0_r", FinishReason.ABORT)]
    final = engine.take("r")
    assert final is not None and final.finished
    texts_by_index = {c.index: (c.text, c.finish_reason) for c in final.outputs}
    if kind == DELTA:
        assert texts_by_index == {0: ("cat", "abort")}  # the held-back text, released
    else:
        assert texts_by_index == {0: ("The cat", "abort"), 1: ("The", "length")}
    assert not engine.proc.has_unfinished_requests()


def test_metrics_and_stats(tok: PreTrainedTokenizerBase) -> None:
    engine = Engine(tok)
    engine.add("r", SamplingParams(output_kind=CUMULATIVE))
    the, cat, sat = encode(tok, "The cat sat")
    first = engine.step(core("r", [the], cached=16))  # at ARRIVAL + 1
    assert first.time_to_first_token == [1.0] and first.num_generation_tokens == 1
    second = engine.step(core("r", [cat, sat]))
    assert second.inter_token_latency == [1.0] and second.num_generation_tokens == 2
    last = engine.step(core("r", [EOS], finish=FinishReason.STOP))
    (done,) = last.finished
    assert (done.request_id, done.parent_id, done.finish_reason) == ("r", "r", FinishReason.STOP)
    assert (done.num_prompt_tokens, done.num_generation_tokens, done.num_cached_tokens) == (
        len(encode(tok, "Hi")) + 1,
        4,
        16,
    )
    assert (done.first_token_time, done.last_token_time, done.e2e_latency) == (
        ARRIVAL + 1,
        ARRIVAL + 3,
        3.0,
    )
    output = engine.take("r")
    assert output is not None and output.num_cached_tokens == 16
    assert output.metrics is not None
    m = output.metrics
    assert (m.arrival_time, m.first_token_time, m.finished_time) == (
        ARRIVAL,
        ARRIVAL + 1,
        ARRIVAL + 3,
    )


def test_add_request_checks(tok: PreTrainedTokenizerBase) -> None:
    engine = Engine(tok)
    engine.add("r", SamplingParams())
    with pytest.raises(ValueError, match="already running"):
        engine.add("r", SamplingParams())
    with pytest.raises(ValueError, match="output_kind"):
        engine.proc.add_request(
            "s", None, [1], SamplingParams(output_kind=DELTA), ARRIVAL, slot=OutputSlot(CUMULATIVE)
        )
    ids = engine.proc.add_request(
        "t", None, [1], SamplingParams(n=2), ARRIVAL, slot=OutputSlot(), child_ids=["x", "y"]
    )
    assert ids == ["x", "y"]
    with pytest.raises(ValueError, match="stop"):
        OutputProcessor(None).add_request(
            "u", None, [1], SamplingParams(stop=["x"]), ARRIVAL, slot=OutputSlot()
        )


def test_without_a_tokenizer_text_stays_empty() -> None:
    engine = Engine(None)
    engine.add("r", SamplingParams(logprobs=0, output_kind=CUMULATIVE))
    engine.step(
        core(
            "r", [5, 6], logprobs=[TokenLogprobs([5], [-1.0], [1])] * 2, finish=FinishReason.LENGTH
        )
    )
    final = engine.take("r")
    assert final is not None
    assert (final.outputs[0].text, final.outputs[0].token_ids) == ("", [5, 6])
    assert final.outputs[0].cumulative_logprob == -2.0


# ------------------------------------------------------- the plain-stream path

PLAIN_CASES = {
    "plain": SamplingParams(output_kind=DELTA),
    "plain, specials kept": SamplingParams(output_kind=DELTA, skip_special_tokens=False),
    "plain, no text": SamplingParams(output_kind=DELTA, detokenize=False),
    "stop strings": SamplingParams(output_kind=DELTA, stop=[" cat"]),
    "logprobs": SamplingParams(output_kind=DELTA, logprobs=0),
    "n=2": SamplingParams(output_kind=DELTA, n=2),
    "cumulative": SamplingParams(output_kind=CUMULATIVE),
}
PLAIN = ["plain", "plain, specials kept", "plain, no text"]


@HYPOTHESIS
@given(data=st.data())
def test_plain_streams_match_the_general_path(
    tok: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch, data: st.DataObject
) -> None:
    """A plain stream's ordinary steps skip ``_update``/``_emit`` (``_stream_plain``):
    every output, figure and finish must be what the general path gives."""
    token = st.one_of(
        st.integers(0, len(tok) - 1),  # specials, halves of characters, anything
        st.sampled_from(encode(tok, "The cat sat héllo 世界 🙂")),
    )
    steps = data.draw(
        st.lists(st.lists(token, max_size=3), min_size=1, max_size=12), label="tokens per step"
    )
    finish = data.draw(st.sampled_from([FinishReason.LENGTH, FinishReason.STOP]), label="finish")

    def run() -> list[object]:
        engine = Engine(tok)
        ids = {name: engine.add(name, params) for name, params in PLAIN_CASES.items()}
        seen: list[object] = []
        for i, new in enumerate(steps):
            last = i == len(steps) - 1
            lps = [TokenLogprobs([t], [-0.5], [1]) for t in new]
            step = engine.step(
                *(
                    core(
                        child,
                        new,
                        finish=finish if last else None,
                        logprobs=lps if PLAIN_CASES[name].logprobs is not None else None,
                    )
                    for name, children in ids.items()
                    for child in children
                )
            )
            seen.append(
                (step.num_generation_tokens, step.time_to_first_token, step.inter_token_latency)
            )
            seen.append(sorted(map(repr, step.finished)))  # reasons, token counts, times
            seen.append(sorted(step.requests_to_stop))
            seen.append({name: engine.take(name) for name in PLAIN_CASES})
        return seen

    taken = 0
    stream_plain = OutputProcessor._stream_plain

    def counted(self: OutputProcessor, *args: Any) -> bool:
        nonlocal taken
        done = stream_plain(self, *args)
        taken += done
        return done

    with monkeypatch.context() as patch:  # undone before hypothesis's next example
        patch.setattr(OutputProcessor, "_stream_plain", counted)
        fast = run()
        patch.setattr(OutputProcessor, "_stream_plain", lambda *args: False)
        assert fast == run()
    # Each plain stream's steps with tokens take it, but its first such and the last (a finish).
    with_tokens = [i for i, new in enumerate(steps[:-1]) if new]
    assert taken == len(PLAIN) * max(len(with_tokens) - 1, 0)


def test_only_plain_completions_take_the_plain_path(tok: PreTrainedTokenizerBase) -> None:
    engine = Engine(tok)
    for name, params in PLAIN_CASES.items():
        engine.add(name, params)
    plain = {
        c.parent.request_id for c in engine.proc._completions.values() if c.shortcut is not None
    }
    assert plain == set(PLAIN)


@pytest.mark.parametrize(
    ("kind", "n"), [(DELTA, 1), (DELTA, 2), (CUMULATIVE, 1), (FINAL_ONLY, 2)]
)
def test_every_output_names_the_requests_adapter(
    tok: PreTrainedTokenizerBase, kind: RequestOutputKind, n: int
) -> None:
    """vLLM's outputs name the adapter they ran through, each completion too: the plain
    path (DELTA, n=1), the general one and the abort's last output alike."""
    lora = LoRARequest("sql", 7, "/unused")
    engine = Engine(tok)
    params = SamplingParams(n=n, output_kind=kind)
    engine.slots["a"] = OutputSlot(kind)
    ids = engine.proc.add_request(
        "a", "Hi", [0, 5], params, ARRIVAL, slot=engine.slots["a"], lora_request=lora
    )
    engine.add("base", SamplingParams(output_kind=kind))
    seen: list[RequestOutput] = []
    for token in (5, 6, 7):
        engine.step(*(core(i, [token]) for i in [*ids, "base"]))
        seen += [o for o in [engine.take("a")] if o is not None]
        base = engine.take("base")
        assert base is None or base.lora_request is None
    engine.proc.abort_requests(["a"])
    seen += [o for o in [engine.take("a")] if o is not None]
    assert seen and seen[-1].finished
    assert all(o.lora_request is lora for o in seen)
    assert all(c.lora_request is lora for o in seen for c in o.outputs)
