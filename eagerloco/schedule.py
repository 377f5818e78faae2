"""When each fragment's exchange is launched and when it must be applied.

One description of the schedule, shared by the outer algorithm (:mod:`eagerloco.outer`) and the
compute-utilization simulator (:mod:`eagerloco.sim`), so the two cannot drift apart.

Steps are counted as inner steps completed: step s is the point right after the s-th inner
optimizer step (s = 1, 2, ...). Fragment p is synchronized at every step s > 0 with
s mod H == offset_p, offset_p = round(p * H / P) (round half up).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


def fragment_offsets(inner_steps: int, fragments: int) -> list[int]:
    """Staggered offsets round(p*H/P); distinct whenever P <= H."""
    return [int(p * inner_steps / fragments + 0.5) for p in range(fragments)]


def apply_delay(method: str, inner_steps: int, overlap_steps: int, eager_rounds: int) -> int:
    """Inner steps between launching an exchange and applying it (its tolerated window).

    dp and blocking DiLoCo/Streaming: 0. Streaming with tau overlap: tau. Naive delayed and
    eager with k rounds: k * H (applied at that fragment's k-th next sync).
    """
    if method in ("delayed", "eager"):
        return eager_rounds * inner_steps
    if method == "dp":
        return 0
    return overlap_steps


@dataclass(frozen=True)
class SyncEvent:
    fragment: int
    launch_step: int
    apply_step: int
    round: int  # 1-based index of this fragment's sync


def fragments_due(step: int, inner_steps: int, offsets: list[int]) -> list[int]:
    """Fragments whose sync is launched at this step (after its inner optimizer step)."""
    if step <= 0:
        return []
    r = step % inner_steps
    return [p for p, off in enumerate(offsets) if off == r]


def sync_events(
    method: str,
    inner_steps: int,
    fragments: int,
    overlap_steps: int,
    eager_rounds: int,
    total_steps: int,
) -> Iterator[SyncEvent]:
    """Every outer exchange of a run of total_steps inner steps, in launch order (not dp)."""
    offsets = fragment_offsets(inner_steps, fragments)
    delay = apply_delay(method, inner_steps, overlap_steps, eager_rounds)
    count = [0] * fragments
    for step in range(1, total_steps + 1):
        for p in fragments_due(step, inner_steps, offsets):
            count[p] += 1
            yield SyncEvent(p, step, step + delay, count[p])


#: How blocks map to fragments (Streaming DiLoCo): contiguous runs, or fragment p holds p, p+P, ...
PATTERNS = ("sequential", "strided")


def block_groups(num_blocks: int, fragments: int, pattern: str) -> list[list[int]]:
    """Block indices of each fragment, shared by the trainer and the simulator.

    Args:
        num_blocks: transformer blocks L.
        fragments: fragments P (at most L).
        pattern: "strided" (fragment p holds blocks p, p+P, ...) or "sequential" (contiguous runs,
            the first fragments one block longer when P does not divide L).

    Returns:
        One list of block indices per fragment; every block is in exactly one.

    Raises:
        ValueError: an unknown pattern.
    """
    if pattern == "strided":
        return [list(range(p, num_blocks, fragments)) for p in range(fragments)]
    if pattern == "sequential":
        base, extra = divmod(num_blocks, fragments)
        groups, start = [], 0
        for p in range(fragments):
            n = base + (1 if p < extra else 0)
            groups.append(list(range(start, start + n)))
            start += n
        return groups
    raise ValueError(f"unknown fragment pattern {pattern!r}; choose one of {', '.join(PATTERNS)}")


def short_run_note(steps: int, inner_steps: int) -> str | None:
    """What to tell a user whose run is shorter than one round: no outer step happens, so the outer
    parameters (what is evaluated, and what a run ends with) stay the initial ones. None otherwise.

    Args:
        steps: inner steps the run takes.
        inner_steps: H, inner steps per round (only for methods that sync once a round).
    """
    if steps >= inner_steps:
        return None
    return (f"{steps} inner step(s) is less than one round (--inner-steps {inner_steps}): no outer step happens, "
            "so the outer parameters, which are evaluated, stay the initial ones; run at least "
            f"{inner_steps} steps or lower --inner-steps")
