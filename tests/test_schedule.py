"""The schedule shared by the outer algorithm and the simulator: every exchange as its definition says."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from eagerloco.schedule import apply_delay, fragment_offsets, fragments_due, sync_events


@settings(max_examples=100, deadline=None)
@given(
    method=st.sampled_from(["diloco", "streaming", "delayed", "eager"]),
    inner_steps=st.integers(1, 40),
    data=st.data(),
)
def test_sync_events_are_every_step_whose_remainder_is_a_fragments_offset(method: str, inner_steps: int, data) -> None:
    fragments = data.draw(st.integers(1, inner_steps))
    overlap, rounds = data.draw(st.integers(0, 3)), data.draw(st.integers(1, 3))
    total = data.draw(st.integers(0, 5 * inner_steps))
    offsets = fragment_offsets(inner_steps, fragments)
    delay = apply_delay(method, inner_steps, overlap, rounds)
    # Fragment p syncs at every step s > 0 with s mod H == offset_p: in step order, fragments in order.
    want = [(p, s, s + delay) for s in range(1, total + 1) for p in range(fragments) if s % inner_steps == offsets[p]]
    got = list(sync_events(method, inner_steps, fragments, overlap, rounds, total))
    assert [(e.fragment, e.launch_step, e.apply_step) for e in got] == want
    for p in range(fragments):  # each fragment's syncs are numbered 1, 2, ...
        assert [e.round for e in got if e.fragment == p] == list(range(1, sum(w[0] == p for w in want) + 1))
    for s in range(1, total + 1):  # the outer algorithm asks step by step: the same fragments
        assert fragments_due(s, inner_steps, offsets) == [e.fragment for e in got if e.launch_step == s]
