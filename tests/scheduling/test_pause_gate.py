"""The pause gate: which requests a pause holds, and its count of them."""

from __future__ import annotations

from legato.protocol.messages import EngineRequest
from legato.protocol.params import SamplingParams
from legato.scheduling.pause_gate import PauseGate, PauseMode
from legato.scheduling.request_state import Request


def request(seq: int) -> Request:
    return Request(EngineRequest(f"r{seq}", [1, 2], SamplingParams(max_tokens=2), 0.0), seq)


def test_requests_after_the_boundary_are_held_until_resume() -> None:
    gate = PauseGate()
    before, after = request(3), request(4)
    gate.arrived()  # not paused: nothing is held
    assert not gate.is_paused and gate.num_held == 0 and not gate.is_held(after)
    gate.pause(PauseMode.WAIT, last_seq=3)
    gate.arrived()  # ``after`` arrives during the pause
    assert gate.is_held(after) and not gate.is_held(before) and gate.num_held == 1
    gate.left(before)  # a request from before the pause finishing changes nothing
    assert gate.num_held == 1
    gate.left(after)  # the held one is aborted before it ever started
    assert gate.num_held == 0
    gate.resume()
    assert not gate.is_paused and not gate.is_held(after)


def test_pausing_again_changes_the_mode_and_keeps_the_first_boundary() -> None:
    gate = PauseGate()
    gate.pause(PauseMode.WAIT, last_seq=5)
    gate.pause(PauseMode.KEEP, last_seq=9)
    assert gate.mode is PauseMode.KEEP
    assert gate.is_held(request(6))  # still the first pause's boundary
