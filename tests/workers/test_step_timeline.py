"""The worker's env-gated step timeline (benchmarks/serve_timeline.py reads it)."""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

import pytest

from legato.protocol import messages as m
from legato.testing.worker_frames import NULL_INIT, framed
from legato.workers.step_timeline import COLUMNS, ENV
from legato.workers.worker import read_frame, serve


def _steps() -> list[m.SchedulerOutput]:
    """Step 1 prefills two prompts (3 and 2 tokens); step 2 decodes both; step 3 decodes
    "a" verifying two drafts beside "b"'s plain row."""
    new = [
        m.NewRequestData("a", [1, 2, 3], "p", [1], 0),
        m.NewRequestData("b", [4, 5], "p", [2], 0),
    ]
    first = m.SchedulerOutput(
        1, new, m.CachedRequestData(), {"a": 3, "b": 2}, 5,
        sampling_params={"p": m.RunnerSamplingParams()},
    )  # fmt: skip
    second = m.SchedulerOutput(2, [], m.CachedRequestData(["a", "b"], [3, 2]), {"a": 1, "b": 1}, 2)
    third = m.SchedulerOutput(
        3, [], m.CachedRequestData(["a", "b"], [4, 3]), {"a": 3, "b": 1}, 4,
        scheduled_spec_decode_tokens={"a": [7, 8]},
    )  # fmt: skip
    return [first, second, third]


def test_each_step_frame_logs_its_kind_and_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "timeline.tsv"
    monkeypatch.setenv(ENV, str(path))
    first, second, third = _steps()
    out = io.BytesIO()
    frames = framed(NULL_INIT, first, m.HealthPing(1, 0.0), second, third)
    assert serve(io.BytesIO(frames), out) == 0
    answers = []
    stream = io.BytesIO(out.getvalue())
    while (frame := read_frame(stream)) is not None:
        answers.append(frame[1])
    assert [type(a) for a in answers[1:]] == [
        m.ModelRunnerOutput,
        m.HealthPong,
        m.ModelRunnerOutput,
        m.ModelRunnerOutput,
    ]
    with open(path) as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    assert list(rows[0]) == list(COLUMNS)
    # the ping is not a step: one line per step frame, with its prefill tokens, decode rows
    # and drafts (a row verifying drafts is a decode row, not a prefill chunk)
    assert [
        (r["step"], r["prefill_tokens"], r["decode_rows"], r["draft_tokens"]) for r in rows
    ] == [
        ("1", "5", "0", "0"),
        ("2", "0", "2", "0"),
        ("3", "0", "2", "2"),
    ]
    for r in rows:
        assert all(float(r[c]) >= 0.0 for c in COLUMNS[4:])
        assert float(r["compute_s"]) > 0.0


def test_a_pid_in_the_path_names_each_workers_own_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, str(tmp_path / "timeline-{pid}.tsv"))
    assert serve(io.BytesIO(framed(NULL_INIT, *_steps())), io.BytesIO()) == 0
    assert [p.name for p in tmp_path.iterdir()] == [f"timeline-{os.getpid()}.tsv"]


def test_without_the_variable_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert serve(io.BytesIO(framed(NULL_INIT, *_steps())), io.BytesIO()) == 0
    assert list(tmp_path.iterdir()) == []
