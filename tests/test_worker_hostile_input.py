"""Hostile bytes on the worker's pipes: refused loudly, never hung on, never executed.

The codec's own fuzzing (random and mutated frames) is in
tests/protocol/test_wire.py. Here: the framing on a byte stream (the 4-byte
length before each frame) on both ends of the worker's pipes, and the worker
process itself fed hostile stdin. It must exit non-zero with a clear message
on stderr, at once, without running anything a frame asks for beyond the
public runner methods; a pickle is never unpickled.
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from legato.actors.process_executor import _FrameReader
from legato.protocol import messages as m
from legato.protocol import wire
from legato.protocol.wire import HEADER_SIZE, MAX_FRAME_SIZE, WireError, frame_header
from legato.testing.worker_frames import NULL_INIT, framed
from legato.workers.worker import read_frame, serve


def raw_frame(payload: bytes) -> bytes:
    return frame_header(len(payload), 1) + payload


def run_worker(stdin: bytes) -> subprocess.CompletedProcess[bytes]:
    """``python -m legato.workers.worker`` fed ``stdin`` then end of input; must exit within 30 s."""
    env = dict(os.environ)
    env.pop("LEGATO_WORKER_THREADS", None)
    return subprocess.run(
        [sys.executable, "-m", "legato.workers.worker"],
        input=stdin,
        capture_output=True,
        timeout=30,
        env=env,
    )


def frames_in(data: bytes, *, check_ids: bool = True) -> list[object]:
    """The worker's answers, in order; each carries the id of the frame it answers."""
    stream = io.BytesIO(data)
    frames = []
    while (frame := read_frame(stream)) is not None:
        frame_id, message = frame
        assert frame_id == len(frames) + 1 or not check_ids, (frame_id, message)
        frames.append(message)
    return frames


class _Boom:
    """Unpickling this would create ``path``: proof that nothing was unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


# ------------------------------------------------------------------ the worker process


@pytest.mark.parametrize(
    ("case", "stdin", "message"),
    [
        ("truncated frame", frame_header(100) + b"\x94" * 10, "truncated frame"),
        ("truncated header", b"\x00\x00", "truncated frame header"),
        ("oversized header", b"\xff\xff\xff\xff" + bytes(8) + b"x" * 64, "over the limit of"),
        ("length past the limit", frame_header(MAX_FRAME_SIZE) + b"x", "truncated frame"),
        ("garbage", raw_frame(b"\xc1 not msgpack at all"), "malformed frame"),
        ("not a legato frame", raw_frame(b"\x93\x01\x02\x03"), "not a legato frame"),
        ("unknown tag", raw_frame(b"\x94\xa6legato\x01\xcd\x03\xe7\x90"), "unknown type tag"),
    ],
)
def test_hostile_first_frames_make_the_worker_exit_with_a_clear_message(
    case: str, stdin: bytes, message: str
) -> None:
    done = run_worker(stdin)
    assert done.returncode == 2, (case, done.stderr)
    stderr = done.stderr.decode()
    assert "legato worker: bad frame from the engine:" in stderr, stderr
    assert message in stderr, stderr
    assert done.stdout == b""


def test_a_pickle_is_never_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    done = run_worker(raw_frame(pickle.dumps(_Boom(marker))))
    assert done.returncode == 2 and b"bad frame from the engine" in done.stderr
    assert not marker.exists()


def test_a_first_frame_other_than_init_is_refused() -> None:
    done = run_worker(framed(m.HealthPing(1, 0.0)))
    assert done.returncode == 2
    (error,) = frames_in(done.stdout)
    assert error == m.WorkerError("first frame must be WorkerInit", "WireError", fatal=True)


def test_hostile_frames_after_start_up(tmp_path: Path) -> None:
    """With a runner loaded: private methods and pickles are refused, the worker serves
    on; an unexpected frame type or garbage makes it exit non-zero."""
    marker = tmp_path / "unpickled"
    calls = [
        m.UtilityCall(1, "_build", [], {}),
        m.UtilityCall(2, "__init__", [], {}),
        m.UtilityCall(3, "no_such_method", [], {}),
        m.UtilityCall(4, "sleep", [], {"level": "not a level", "extra": 1}),
        m.HealthPing(5, 1.5),
    ]
    done = run_worker(framed(NULL_INIT, *calls) + raw_frame(pickle.dumps(_Boom(marker))))
    assert done.returncode == 2 and b"bad frame from the engine: not a legato frame" in done.stderr
    ready, *answers = frames_in(done.stdout)
    assert isinstance(ready, m.WorkerReady)
    assert [a.error for a in answers[:3]] == [  # type: ignore[attr-defined]
        "unknown worker method '_build'",
        "unknown worker method '__init__'",
        "unknown worker method 'no_such_method'",
    ]
    assert "TypeError" in answers[3].error  # type: ignore[attr-defined]
    assert answers[4] == m.HealthPong(5, 1.5)
    assert not marker.exists()

    done = run_worker(framed(NULL_INIT, m.HealthPong(1, 0.0)))
    assert done.returncode == 2
    assert frames_in(done.stdout)[-1] == m.WorkerError(
        "unexpected frame HealthPong", "WireError", fatal=True
    )


def test_a_step_naming_unknown_requests_is_a_fatal_worker_error() -> None:
    step = m.SchedulerOutput(1, [], m.CachedRequestData(), {"nobody": 3}, 3)
    done = run_worker(framed(NULL_INIT, step))
    assert done.returncode == 1
    error = frames_in(done.stdout)[-1]
    assert isinstance(error, m.WorkerError) and error.fatal


def test_end_of_input_is_a_clean_exit() -> None:
    done = run_worker(framed(NULL_INIT))
    assert done.returncode == 0
    assert isinstance(frames_in(done.stdout)[0], m.WorkerReady)


# ------------------------------------------------------------------ a step whose bitmask follows


def _step(step_id: int, *, follows: bool) -> m.SchedulerOutput:
    new = [m.NewRequestData("r", [1, 2], "r", [1], 0)] if step_id == 1 else []
    params = {"r": m.RunnerSamplingParams()} if step_id == 1 else {}
    cached = m.CachedRequestData() if step_id == 1 else m.CachedRequestData(["r"], [2])
    tokens = {"r": 2 if step_id == 1 else 1}
    return m.SchedulerOutput(
        step_id,
        new,
        cached,
        tokens,
        sum(tokens.values()),
        grammar_bitmask_follows=follows,
        sampling_params=params,
    )


def _serve(*messages: object) -> tuple[int, list[tuple[int, object]]]:
    """``serve`` in this process on ``messages`` (frame ids 1, 2, ...): its exit code and
    its answers with the ids they answer."""
    out = io.BytesIO()
    code = serve(io.BytesIO(framed(NULL_INIT, *messages)), out)
    stream, answers = io.BytesIO(out.getvalue()), []
    while (frame := read_frame(stream)) is not None:
        answers.append(frame)
    return code, answers


def test_a_step_whose_bitmask_follows_is_answered_through_its_bitmask() -> None:
    code, answers = _serve(
        _step(1, follows=True),
        m.HealthPing(7, 1.0),
        m.GrammarBitmask(1, {}),
        _step(2, follows=False),
    )
    assert code == 0
    ids = [frame_id for frame_id, _ in answers]
    assert ids == [1, 3, 4, 5]  # nothing answers the step frame itself; the ping is served
    assert answers[1][1] == m.HealthPong(7, 1.0)
    first, second = answers[2][1], answers[3][1]
    assert isinstance(first, m.ModelRunnerOutput) and first.step_id == 1
    assert first.req_ids == ["r"] and first.num_sampled == [1]
    assert isinstance(second, m.ModelRunnerOutput) and second.step_id == 2


def test_a_worker_that_never_gets_the_bitmask_exits_at_end_of_input() -> None:
    code, answers = _serve(_step(1, follows=True))
    assert code == 0 and [frame_id for frame_id, _ in answers] == [1]


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([m.GrammarBitmask(1, {})], "GrammarBitmask for step 1 while no step waits for one"),
        (
            [_step(1, follows=True), m.GrammarBitmask(9, {})],
            "GrammarBitmask for step 9 while step 1 waits for one",
        ),
        (
            [_step(1, follows=True), _step(2, follows=False)],
            "step 2 arrived before step 1's GrammarBitmask",
        ),
    ],
)
def test_bitmask_frames_out_of_turn_are_fatal(messages: list[object], message: str) -> None:
    code, answers = _serve(*messages)
    assert code == 2
    assert answers[-1][1] == m.WorkerError(message, "WireError", fatal=True)


# ------------------------------------------------------------------ framing, fuzzed in-process

frames_strategy = st.lists(
    st.sampled_from(
        [
            NULL_INIT,
            m.HealthPing(1, 2.0),
            m.UtilityCall(7, "sleep", [1], {}),
            m.UtilityCall(8, "_private", [], {}),
            m.HealthPong(2, 3.0),
            m.SchedulerOutput(1, [], m.CachedRequestData(), {}, 0),
            m.SchedulerOutput(1, [], m.CachedRequestData(), {}, 0, grammar_bitmask_follows=True),
            m.GrammarBitmask(1, {"r": b"\xff" * 8}),
        ]
    ),
    max_size=4,
)


def _mutate(data: bytes, draw: st.DataObject) -> bytes:
    if not data:
        return draw.draw(st.binary(max_size=16))
    buf = bytearray(data)
    for _ in range(draw.draw(st.integers(1, 3))):
        where = draw.draw(st.integers(0, max(0, len(buf) - 1)))
        how = draw.draw(st.sampled_from(["flip", "truncate", "insert", "delete", "header"]))
        if not buf:
            break
        if how == "flip":
            buf[where] ^= 1 << draw.draw(st.integers(0, 7))
        elif how == "truncate":
            del buf[where:]
        elif how == "insert":
            buf[where:where] = draw.draw(st.binary(min_size=1, max_size=6))
        elif how == "delete":
            del buf[where]
        else:  # a hostile length header in the middle of the stream
            buf[where:where] = draw.draw(st.integers(0, 2**96 - 1)).to_bytes(HEADER_SIZE, "big")
    return bytes(buf)


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(frames_strategy, st.data())
def test_worker_read_frame_on_mutated_streams_raises_only_wire_error(
    messages: list[object], data: st.DataObject
) -> None:
    stream = io.BytesIO(_mutate(framed(*messages), data))
    try:
        while read_frame(stream) is not None:
            pass
    except WireError:
        pass


@FUZZ
@given(frames_strategy, st.data())
def test_worker_serve_on_mutated_input_ends_with_an_exit_code_or_wire_error(
    messages: list[object], data: st.DataObject
) -> None:
    out = io.BytesIO()
    try:
        code = serve(io.BytesIO(_mutate(framed(NULL_INIT, *messages), data)), out)
    except WireError:
        return
    assert code in (0, 1, 2)
    out.seek(0)
    for answer in frames_in(out.getvalue(), check_ids=False):
        if isinstance(answer, m.UtilityResult) and answer.call_id == 8:
            # the method name itself may be mutated: any name is refused, none is called
            assert answer.error is not None and answer.error.startswith("unknown worker method")


class _Chunks(trio.abc.ReceiveStream):
    """A receive stream that hands out ``data`` in the given chunk sizes."""

    def __init__(self, data: bytes, sizes: list[int]) -> None:
        self._data = data
        self._sizes = sizes

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        size = self._sizes.pop(0) if self._sizes else len(self._data)
        chunk, self._data = self._data[: max(1, size)], self._data[max(1, size) :]
        return chunk

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


@FUZZ
@given(frames_strategy, st.data())
def test_executor_frame_reader_on_mutated_streams_raises_only_wire_error(
    messages: list[object], data: st.DataObject
) -> None:
    """The engine's side: a worker writing garbage is refused with WireError (engine death)."""
    payload = _mutate(framed(*messages), data)
    sizes = data.draw(st.lists(st.integers(1, 64), max_size=8))

    async def read_all() -> None:
        reader = _FrameReader(_Chunks(payload, sizes))
        try:
            while await reader.read() is not None:
                pass
        except WireError:
            pass

    trio.run(read_all)


async def test_executor_frame_reader_reassembles_split_frames() -> None:
    messages = [m.HealthPong(i, float(i)) for i in range(5)]
    reader = _FrameReader(_Chunks(framed(*messages), [1, 2, 3, 1, 7, 4, 1, 11, 13]))
    got = []
    while (frame := await reader.read()) is not None:
        got.append(frame)
    assert got == list(enumerate(messages, start=1))


def test_a_step_answer_that_cannot_be_encoded_fails_its_requests_not_the_worker() -> None:
    """An answer too large for one frame (the whole vocabulary's logprobs, say; here a
    token id past 64 bits stands in) goes back as that step's requests failing."""
    from legato.workers.worker import write_frame

    out = io.BytesIO()
    answer = m.ModelRunnerOutput(7, ["a", "b"], [1, 1], [3, 2**64])
    write_frame(out, 5, answer)
    stream = io.BytesIO(out.getvalue())
    size, frame_id = wire.read_frame_header(stream.read(wire.HEADER_SIZE))
    sent = wire.decode(stream.read(size), expected=m.ModelRunnerOutput)
    assert frame_id == 5 and sent.step_id == 7 and sent.req_ids == ["a", "b"]
    assert sent.num_sampled == [0, 0] and set(sent.failed) == {"a", "b"}
    with pytest.raises(wire.WireError):  # anything else that cannot be encoded still raises
        write_frame(io.BytesIO(), 6, m.UtilityResult(1, result=2**64))
