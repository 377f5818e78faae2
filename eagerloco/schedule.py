"""When each fragment's exchange is launched and when it is applied, shared by the outer algorithm and the
simulator so that the two cannot drift apart.

Step s is the point right after the s-th inner optimizer step (s = 1, 2, ...); fragment p syncs at every s > 0
with s mod H == round(p * H / P) (round half up).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from eagerloco.errors import ConfigError


def fragment_offsets(inner_steps: int, fragments: int) -> list[int]:
    """Staggered offsets round(p*H/P); distinct whenever P <= H."""
    return [int(p * inner_steps / fragments + 0.5) for p in range(fragments)]


def apply_delay(method: str, inner_steps: int, overlap_steps: int, eager_rounds: int) -> int:
    """Inner steps between launching an exchange and applying it: 0 for dp and blocking DiLoCo/Streaming, tau with
    overlap, k * H for naive delayed and eager."""
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
    due: dict[int, list[int]] = {}  # step mod H -> the fragments due then, as fragments_due lists them
    for p, off in enumerate(offsets):
        due.setdefault(off, []).append(p)
    count = [0] * fragments
    for step in range(1, total_steps + 1):
        for p in due.get(step % inner_steps, ()):
            count[p] += 1
            yield SyncEvent(p, step, step + delay, count[p])


#: How blocks map to fragments (Streaming DiLoCo): contiguous runs, or fragment p holds p, p+P, ...
PATTERNS = ("sequential", "strided")


def block_groups(num_blocks: int, fragments: int, pattern: str) -> list[list[int]]:
    """Block indices of each fragment, every block in exactly one: "strided" (fragment p holds p, p+P, ...) or
    "sequential" (contiguous, the first ones a block longer); ConfigError naming the flag for another pattern."""
    if pattern == "strided":
        return [list(range(p, num_blocks, fragments)) for p in range(fragments)]
    if pattern == "sequential":
        base, extra = divmod(num_blocks, fragments)
        starts = [p * base + min(p, extra) for p in range(fragments + 1)]  # the first ones a block longer
        return [list(range(a, b)) for a, b in zip(starts, starts[1:], strict=False)]
    raise ConfigError(f"--fragment-pattern must be one of {', '.join(PATTERNS)}; got {pattern!r}")


def short_run_note(steps: int, inner_steps: int) -> str | None:
    """What to tell a user whose run is shorter than one round (no outer step, so the outer parameters stay the
    initial ones), or None."""
    if steps >= inner_steps:
        return None
    return (f"{steps} inner step(s) is less than one round (--inner-steps {inner_steps}): no outer step happens, "
            "so the outer parameters, which are evaluated, stay the initial ones; run at least "
            f"{inner_steps} steps or lower --inner-steps")


# ---------------------------------------------------------------- workers of unequal speed (adaptive steps)
#
# A round is counted in ticks, the inner steps of the fastest worker: round r is ticks (r-1)H+1 .. rH, and
# every exchange keeps the tick the schedule above gives it, so every worker launches and applies the same
# exchanges at the same ticks as without adaptive steps. Worker m runs H_m of its own inner steps over a
# round's H ticks (0, 1 or more at a tick).


def round_lengths(inner_steps: int, speeds: list[float]) -> list[int]:
    """Each worker's inner steps in a round: H_m = max(1, round(H * r_m / r_max)) (round half up); the fastest
    runs H. Equal speeds give H for every worker."""
    fastest = max(speeds)
    return [max(1, int(inner_steps * r / fastest + 0.5)) for r in speeds]


def steps_by_tick(inner_steps: int, fragments: int, own: int) -> list[int]:
    """A worker's own inner steps completed by each tick t = 0..H of a round in which it runs ``own`` of them: its own
    fragment offset at each sync tick, as early as they can come in between."""
    knots = list(zip(fragment_offsets(inner_steps, fragments) + [inner_steps],
                     fragment_offsets(own, fragments) + [own], strict=True))
    done = [0]
    for (a, na), (b, nb) in zip(knots, knots[1:], strict=False):
        done.extend(na + -(-(t - a) * (nb - na) // (b - a)) for t in range(a + 1, b + 1))
    return done


class Rounds:
    """Every worker's inner steps, tick by tick, as all workers see them (each worker keeps the same one).

    ``lengths``: each worker's H_m this round; ``done``: its steps completed by ``tick``; ``synced``: ``done`` at each
    fragment's last launch."""

    def __init__(self, inner_steps: int, fragments: int, lengths: list[int]) -> None:
        self.inner_steps, self.fragments = inner_steps, fragments
        self.tick = 0
        self.done = [0] * len(lengths)
        self.synced = [[0] * len(lengths) for _ in range(fragments)]
        self.lengths: list[int] = []
        self._by_tick: list[list[int]] = []
        self.set_lengths(lengths)

    def set_lengths(self, lengths: list[int]) -> None:
        """Each worker's H_m from the next round on (call at a round's end, every worker with the same)."""
        self.lengths = list(lengths)
        self._by_tick = [steps_by_tick(self.inner_steps, self.fragments, n) for n in self.lengths]

    def due(self, worker: int) -> int:
        """The worker's inner steps at the next tick (0, 1, or more where its steps outnumber the ticks)."""
        t = self.tick % self.inner_steps + 1
        by_tick = self._by_tick[worker]
        return by_tick[t] - by_tick[t - 1]

    def advance(self) -> None:
        """Count the next tick: every worker's steps due at it are done."""
        for m in range(len(self.done)):
            self.done[m] += self.due(m)
        self.tick += 1

    def window(self, fragment: int) -> list[int]:
        """Each worker's inner steps since the fragment's last launch (what its outer gradient is made of);
        marks the fragment launched now."""
        steps = [d - s for d, s in zip(self.done, self.synced[fragment], strict=True)]
        self.synced[fragment] = list(self.done)
        return steps

    def state(self) -> dict[str, object]:
        return {"tick": self.tick, "lengths": list(self.lengths), "done": list(self.done),
                "synced": [list(s) for s in self.synced]}

    def load(self, state: Mapping[str, Any]) -> None:
        self.tick = int(state["tick"])
        self.set_lengths([int(n) for n in state["lengths"]])
        self.done = [int(n) for n in state["done"]]
        self.synced = [[int(n) for n in s] for s in state["synced"]]
