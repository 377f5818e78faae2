"""The planner: the cheapest settings that reach a compute-utilization target on a given link.

"Cheapest" gives up the least, in the order the papers' quality results suggest: a smaller H first, then the
simpler method (data-parallel, DiLoCo, Streaming, Streaming with tau overlap, eager), then more bits per value
(dense codecs, then sparse top-k, then beyond 2 workers :data:`SHARED`), then a smaller tau. Each row is
simulated at the question's bandwidth and M, with the bytes of the transport train runs it with
(:func:`row_transport`). Naive delayed is left out: the eager paper finds it clearly worse than eager.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from eagerloco.codec_sizes import SCALE_BYTES
from eagerloco.sim.engine import simulate
from eagerloco.sim.hetero import per_worker_cu
from eagerloco.sim.model import ModelSpec, Variant, bits_per_value, fragment_count, payload_label, traffic
from eagerloco.sim.search import meets
from eagerloco.units import text_table

#: Method order of the ranking (simplest first).
METHOD_RANK = {"dp": 0, "diloco": 1, "streaming": 2, "streaming-tau": 3, "eager": 4}
#: The dense formats tried, in bits per value, and the codec train's --codec names for each bit count.
DENSE_BITS: tuple[int, ...] = (16, 8, 4)
CODEC_FOR_BITS = {32: "fp32", 16: "bf16", 8: "fp8", 4: "e2m1", 2: "2bit"}
#: The sparse formats tried: (bits per kept value, k, chunk): SparseLoCo's 2-bit top 64 of 4096 and
#: denser ones (25%, 6.25% and 1.56% of the values).
SPARSE: tuple[tuple[int, int, int], ...] = ((2, 1024, 4096), (2, 256, 4096), (2, 64, 4096))
#: The shared-support formats tried beyond 2 workers: 1024, 512 and 256 of 4096 reached DiLoCo's loss at M = 8 on two
#: corpora (with error feedback 0.6, 0.4 and 0.2; bench/results/many_workers.md), 128 did not.
SHARED: tuple[tuple[int, int, int], ...] = ((2, 1024, 4096), (2, 512, 4096), (2, 256, 4096))


@dataclass(frozen=True)
class Candidate:
    """One setting the planner considers."""

    family: str  # a key of METHOD_RANK
    inner_steps: int
    fragments: int
    tau: int
    bits: int
    variant: Variant
    bits_per_value: float = 0.0  # on the link, scales and positions included (ranks the formats)

    def rank(self) -> tuple[int, int, float, int]:
        return (self.inner_steps, METHOD_RANK[self.family], -self.bits_per_value, self.tau)


def row_transport(v: Variant, transport: str) -> str:
    """train's --transport for a row charged under ``transport``: shared-support for a shared row, allgather for
    top-k and FP32, and for quantized dense rows reduce-scatter unless the question says allgather."""
    if v.shared:
        return "shared-support"
    return "reduce-scatter" if v.topk is None and v.bits < 32 and transport != "allgather" else "allgather"


def candidates(model: ModelSpec, fragment_layers: int = 3, inner_steps: tuple[int, ...] = (30, 50, 100, 200, 500),
               bits: tuple[int, ...] = DENSE_BITS, taus: tuple[int, ...] = (1, 2, 5), dp_bits: int = 16,
               sparse: tuple[tuple[int, int, int], ...] = SPARSE, block: int = 32, scale_bytes: int = SCALE_BYTES,
               shared: tuple[tuple[int, int, int], ...] = ()) -> list[Candidate]:
    """Every setting considered, cheapest first (overlap tau only where tau * P < H)."""
    P = fragment_count(model.layers, fragment_layers)
    dp = Variant("dp", f"data-parallel {dp_bits}-bit", "dp", dp_bits)
    out = [Candidate("dp", 1, 1, 0, dp_bits, dp, bits_per_value(dp, block, scale_bytes))]
    formats = [(b, None, 4096, False) for b in bits]
    formats += [(b, k, c, False) for b, k, c in sparse] + [(b, k, c, True) for b, k, c in shared]
    for H in inner_steps:
        p = min(P, H)
        for b, k, c, shared in formats:
            sp = {"topk": k, "topk_chunk": c, "shared": shared}
            bpv = bits_per_value(Variant("x", "x", "diloco", b, **sp), block, scale_bytes)
            rows = [("diloco", 1, 0, Variant("diloco", "DiLoCo", "diloco", b, **sp)),
                    ("streaming", p, 0, Variant("streaming", "Streaming", "streaming", b, True, **sp))]
            rows += [("streaming-tau", p, tau,
                      Variant(f"streaming-tau{tau}", f"Streaming tau={tau}", "streaming", b, True, tau, **sp))
                     for tau in taus if tau * p < H]
            rows.append(("eager", p, 0, Variant("eager-k1", "eager k=1", "eager", b, True, 0, 1, **sp)))
            out += [Candidate(family, H, frags, tau, b, v, bpv) for family, frags, tau, v in rows]
    return sorted(out, key=Candidate.rank)


@dataclass(frozen=True)
class Question:
    """What a plan answers: the link, the target and how the workers exchange (the accounting of
    :func:`eagerloco.sim.model.traffic` and :func:`eagerloco.sim.engine.simulate`)."""

    bandwidth_gbps: float
    target: float
    workers: int = 2
    fragment_layers: int = 3
    scale_bytes: int = SCALE_BYTES
    transport: str = "ring"
    latency_ms: float = 0.0
    pattern: str = "strided"
    dp_bits: int = 16
    block: int = 32
    sparse: tuple[tuple[int, int, int], ...] = SPARSE
    speeds: tuple[float, ...] | None = None  # --worker-speeds: each worker's relative speed


def evaluate(model: ModelSpec, q: Question, c: Candidate) -> dict[str, Any]:
    """One candidate simulated: its row of the plan. With unequal speeds the run's utilization is the mean of its
    workers', with a fixed H and with adaptive steps; the row keeps the better and says which."""
    v = c.variant
    codec = CODEC_FOR_BITS.get(c.bits, f"{c.bits}-bit")
    tr = traffic(model, v, q.workers, c.inner_steps, c.fragments, q.block, q.scale_bytes, q.transport, q.pattern)
    adaptive, per_worker = False, None
    if q.speeds is None:
        cu = float(simulate(model, v, tr, q.bandwidth_gbps, q.latency_ms, c.inner_steps).cu[0])
    else:
        modes = per_worker_cu(model, v, tr, np.array([q.bandwidth_gbps]), list(q.speeds), q.latency_ms,
                              c.inner_steps, 8, 32, None)
        means = {mode: float(cus[0].mean()) for mode, cus in modes.items()}
        adaptive = means.get("adaptive", -1.0) > means["fixed"]
        mode = "adaptive" if adaptive else "fixed"
        cu, per_worker = means[mode], [float(x) for x in modes[mode][0]]
    return {
        "method": v.method, "family": c.family, "inner_steps": c.inner_steps,
        "fragments": c.fragments, "tau": c.tau,
        "eager_rounds": v.eager_rounds if c.family == "eager" else 0,
        "bits": c.bits, "codec": codec,
        "topk": v.topk, "topk_chunk": v.topk_chunk if v.sparse else None,
        "format": payload_label(codec, v.topk, v.topk_chunk, v.shared), "bits_per_value": c.bits_per_value,
        "transport": row_transport(v, q.transport),
        "adaptive_steps": adaptive, "cu_per_worker": per_worker,
        "cu": cu, "meets": bool(meets(cu, q.target)),
    }


def plan(model: ModelSpec, q: Question) -> dict[str, Any]:
    """Simulate every candidate at one bandwidth; the first in rank order that meets the target wins (``best``).

    Returns the question, ``best`` and ``runner_up`` (rows or None), ``by_format`` (per format, densest first, the
    cheapest row meeting the target, else the highest CU) and every row in ``candidates``.
    """
    rows = [evaluate(model, q, c) for c in _candidates(model, q)]
    best = next((r for r in rows if r["meets"]), None)
    return {"model": asdict(model), "bandwidth_gbps": q.bandwidth_gbps, "target": q.target,
            "workers": q.workers, "latency_ms": q.latency_ms, "transport": q.transport,
            "worker_speeds": None if q.speeds is None else list(q.speeds), "best": best,
            "runner_up": runner_up(rows, best), "by_format": by_format(rows), "candidates": rows}


def cheapest(model: ModelSpec, q: Question) -> dict[str, Any] | None:
    """The answer of :func:`plan` alone: candidates are simulated in rank order until one meets the target."""
    return next((r for r in (evaluate(model, q, c) for c in _candidates(model, q)) if r["meets"]), None)


def _candidates(model: ModelSpec, q: Question) -> list[Candidate]:
    return candidates(model, q.fragment_layers, dp_bits=q.dp_bits, sparse=q.sparse, block=q.block,
                      scale_bytes=q.scale_bytes, shared=SHARED if q.workers > 2 else ())


def runner_up(rows: list[dict[str, Any]], best: dict[str, Any] | None) -> dict[str, Any] | None:
    """The alternative to the answer: the cheapest row meeting the target with the other kind of exchange (dense
    for a sparse answer, sparse for a dense one), or else the next row meeting it."""
    if best is None:
        return None
    hits = [r for r in rows if r["meets"] and r is not best]
    other = [r for r in hits if (r["topk"] is None) != (best["topk"] is None) and r["family"] != "dp"]
    pool = other or hits
    return pool[0] if pool else None


def by_format(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per exchange format of the outer methods (most bits per value first): its cheapest row that meets
    the target (rows are in rank order), or else its row with the highest CU."""
    formats = sorted({r["format"]: r["bits_per_value"] for r in rows if r["family"] != "dp"}.items(),
                     key=lambda x: -x[1])
    out = []
    for name, _ in formats:
        mine = [r for r in rows if r["format"] == name and r["family"] != "dp"]
        out.append(next((r for r in mine if r["meets"]), None) or max(mine, key=lambda r: r["cu"]))
    return out


def plan_tables(report: dict[str, Any]) -> list[str]:
    """A plan's tables (``--verbose``): the cheapest setting per exchange format, then every candidate with its CU."""
    lines = [""]
    head = ["format", "bits/value", "cheapest reaching the target", "CU"]
    body = [[r["format"], f"{r['bits_per_value']:.3g}",
             describe(r) if r["meets"] else f"none (best: {describe(r)})", f"{r['cu']:.4f}"]
            for r in report["by_format"]]
    lines.append(text_table(head, body, right=(1, 3)))
    lines.append("")
    head = ["rank", "method", "H", "P", "tau", "codec", "topk", "bits/value", "CU", "meets"]
    body = [[str(i + 1), r["family"], str(r["inner_steps"]), str(r["fragments"]), str(r["tau"]), r["codec"],
             "-" if r["topk"] is None else f"{r['topk']}/{r['topk_chunk']}", f"{r['bits_per_value']:.3g}",
             f"{r['cu']:.4f}", "yes" if r["meets"] else ""] for i, r in enumerate(report["candidates"])]
    lines.append(text_table(head, body, right=(0, 2, 3, 4, 6, 7, 8)))
    return lines


def format_summary(reports: list[dict[str, Any]]) -> str:
    """One line per model: the cheapest setting that reaches the target, and the cheapest dense and sparse."""
    first = reports[0]
    lines = [f"answer at {first['bandwidth_gbps']:g} Gbit/s, target CU {100 * first['target']:g}%"]

    def cheapest(rows: list[dict[str, Any]]) -> str:
        hit = next((r for r in rows if r["meets"]), None)
        if hit is not None:
            return f"{describe(hit)} (CU {hit['cu']:.3f})"
        top = max(rows, key=lambda r: r["cu"], default=None)
        return "none" if top is None else f"none (best CU {top['cu']:.3f})"

    body = []
    for rep in reports:
        rows = rep["candidates"]
        body.append([rep["model"]["name"], cheapest(rows),
                     cheapest([r for r in rows if r["topk"] is None]),
                     cheapest([r for r in rows if r["topk"] is not None])])
    lines.append(text_table(["model", "cheapest", "cheapest dense", "cheapest sparse"], body, right=()))
    return "\n".join(lines)


def describe(r: dict[str, Any]) -> str:
    """A candidate row in words: method, H, P, tau, k, then its exchange format."""
    if r["family"] == "dp":
        return f"data-parallel, {r['codec']} gradients"
    parts = [r["family"], f"H={r['inner_steps']}"]
    if r["family"] != "diloco":
        parts.append(f"P={r['fragments']}")
    if r["tau"]:
        parts.append(f"tau={r['tau']}")
    if r["family"] == "eager":
        parts.append("k=1")
    parts.append(r.get("format", r["codec"]))
    return " ".join(parts)
