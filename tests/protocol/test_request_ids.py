"""Request ids inside the engine: engine ids never repeat, child ids name one completion."""

from __future__ import annotations

from legato.protocol.request_ids import EngineIds, child_id


def test_engine_ids_tell_reuses_of_a_callers_id_apart() -> None:
    ids = EngineIds()
    first, again, other = ids.next("r"), ids.next("r"), ids.next("s")
    assert len({first, again, other}) == 3
    assert first.startswith("r") and other.startswith("s")  # readable in logs
    assert EngineIds().next("r") == first  # each engine counts on its own


def test_child_ids_differ_per_index_and_from_the_parent() -> None:
    children = [child_id(i, "r-1") for i in range(3)]
    assert len(set(children)) == 3 and "r-1" not in children
    assert all("r-1" in c for c in children)
