"""The planner: the cheapest settings that reach a compute-utilization target on a given link.

"Cheapest" means giving up the least, in the order the papers' quality results suggest: a
smaller H first (the papers' loss grows with H), then the simpler method (data-parallel,
DiLoCo, Streaming, Streaming with tau overlap, eager), then more bits (FP4 costs little in the
papers, but nothing is cheaper than not quantizing), then a smaller tau. Every candidate is
simulated at the one bandwidth asked for; the table lists each with the utilization it reaches.
Naive delayed updates are left out: the eager paper finds them clearly worse than eager at the
same overlap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagerloco.sim.engine import simulate
from eagerloco.sim.model import CODEC_FOR_BITS, ModelSpec, Variant, fragment_count, traffic
from eagerloco.sim.search import meets

#: Method order of the ranking (simplest first).
METHOD_RANK = {"dp": 0, "diloco": 1, "streaming": 2, "streaming-tau": 3, "eager": 4}


@dataclass(frozen=True)
class Candidate:
    """One setting the planner considers."""

    family: str  # a key of METHOD_RANK
    inner_steps: int
    fragments: int
    tau: int
    bits: int
    variant: Variant

    def rank(self) -> tuple[int, int, int, int]:
        return (self.inner_steps, METHOD_RANK[self.family], -self.bits, self.tau)


def candidates(
    model: ModelSpec,
    fragment_layers: int = 3,
    inner_steps: tuple[int, ...] = (30, 50, 100, 200, 500),
    bits: tuple[int, ...] = (16, 8, 4),
    taus: tuple[int, ...] = (1, 2, 5),
    dp_bits: int = 16,
) -> list[Candidate]:
    """Every setting considered, in rank order (cheapest first).

    Streaming with tau overlap is kept only where tau * P < H, as training requires.
    """
    P = fragment_count(model.layers, fragment_layers)
    out = [Candidate("dp", 1, 1, 0, dp_bits, Variant("dp", f"data-parallel {dp_bits}-bit", "dp", dp_bits))]
    for H in inner_steps:
        p = min(P, H)
        for b in bits:
            out.append(Candidate("diloco", H, 1, 0, b, Variant("diloco", "DiLoCo", "diloco", b)))
            out.append(Candidate("streaming", H, p, 0, b, Variant("streaming", "Streaming", "streaming", b, True)))
            for tau in taus:
                if tau * p < H:
                    v = Variant(f"streaming-tau{tau}", f"Streaming tau={tau}", "streaming", b, True, tau)
                    out.append(Candidate("streaming-tau", H, p, tau, b, v))
            out.append(Candidate("eager", H, p, 0, b, Variant("eager-k1", "eager k=1", "eager", b, True, 0, 1)))
    return sorted(out, key=Candidate.rank)


def plan(
    model: ModelSpec,
    bandwidth_gbps: float,
    target: float,
    workers: int = 2,
    fragment_layers: int = 3,
    scale_bytes: int = 2,
    transport: str = "ring",
    latency_ms: float = 0.0,
    pattern: str = "strided",
    dp_bits: int = 16,
) -> dict[str, Any]:
    """Simulate every candidate at one bandwidth; the first in rank order that meets the target wins.

    Args:
        model: the model (a preset or the user's own: layers, parameters, step time).
        bandwidth_gbps: the link, Gbit/s.
        target: compute utilization to reach, in (0, 1].
        workers, fragment_layers, scale_bytes, transport, latency_ms, pattern, dp_bits: accounting
            as in :func:`eagerloco.sim.model.traffic` and :func:`eagerloco.sim.engine.simulate`.

    Returns:
        {"model", "bandwidth_gbps", "target", "best" (a row or None), "candidates": [rows]}; a row
        holds method, inner_steps, fragments, tau, bits, codec, cu and meets.
    """
    rows = []
    for c in candidates(model, fragment_layers, dp_bits=dp_bits):
        tr = traffic(model, c.variant, workers, c.inner_steps, c.fragments, 32, scale_bytes, transport, pattern)
        cu = float(simulate(model, c.variant, tr, bandwidth_gbps, latency_ms, c.inner_steps).cu[0])
        rows.append({
            "method": c.variant.method, "family": c.family, "inner_steps": c.inner_steps,
            "fragments": c.fragments, "tau": c.tau,
            "eager_rounds": c.variant.eager_rounds if c.family == "eager" else 0,
            "bits": c.bits, "codec": CODEC_FOR_BITS.get(c.bits, f"{c.bits}-bit"), "cu": cu,
            "meets": bool(meets(cu, target)),
        })
    best = next((r for r in rows if r["meets"]), None)
    return {"model": model.as_dict(), "bandwidth_gbps": bandwidth_gbps, "target": target, "best": best,
            "candidates": rows}


def format_plan(report: dict[str, Any]) -> str:
    """The answer first, then every candidate with the utilization it reaches."""
    m, best = report["model"], report["best"]
    lines = [f"plan for {m['name']} ({m['params']:.3g} params, {m['layers']} layers, step {m['step_time']:.3g} s) "
             f"at {report['bandwidth_gbps']:g} Gbit/s, target CU {100 * report['target']:g}%"]
    if best is None:
        top = max(report["candidates"], key=lambda r: r["cu"])
        lines.append(f"no candidate reaches the target; the best reaches CU {top['cu']:.3f} ({_describe(top)})")
    else:
        lines.append(f"cheapest: {_describe(best)} -> CU {best['cu']:.4f}")
    lines.append("")
    head = ["rank", "method", "H", "P", "tau", "codec", "CU", "meets"]
    body = [[str(i + 1), r["family"], str(r["inner_steps"]), str(r["fragments"]), str(r["tau"]), r["codec"],
             f"{r['cu']:.4f}", "yes" if r["meets"] else ""] for i, r in enumerate(report["candidates"])]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    for n, x in enumerate([head, *body]):
        lines.append("  ".join(c.rjust(w) if i in (0, 2, 3, 4, 6) else c.ljust(w)
                               for i, (c, w) in enumerate(zip(x, widths, strict=True))).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _describe(r: dict[str, Any]) -> str:
    if r["family"] == "dp":
        return f"data-parallel, {r['codec']} gradients"
    parts = [r["family"], f"H={r['inner_steps']}"]
    if r["family"] != "diloco":
        parts.append(f"P={r['fragments']}")
    if r["tau"]:
        parts.append(f"tau={r['tau']}")
    if r["family"] == "eager":
        parts.append("k=1")
    parts.append(r["codec"])
    return " ".join(parts)
