"""Text output of ``eagerloco simulate``: the tables a person reads and the strict JSON report."""

from __future__ import annotations

import math
from typing import Any

from eagerloco.sim.search import meets
from eagerloco.units import fmt_bytes, text_table


def cell_key(x: float) -> str:
    """A float as a JSON key: 'inf' or its repr."""
    return "inf" if math.isinf(x) else repr(float(x))


def _fmt_bw(x: float | None, cu_inf: float, target: float, bw_max: float) -> str:
    if x is not None:
        return f"{x:.3g}"
    return f">{bw_max:g}" if bool(meets(cu_inf, target)) else "never"


def _fmt_count(x: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.4g}{unit}"
    return f"{x:.4g}"


def _per_worker_tables(rows: list[dict[str, Any]], speeds: list[float]) -> list[str]:
    """--worker-speeds: each worker's CU at each bandwidth asked (and without a limit), fixed H and adaptive."""
    tables = []
    for key in rows[0]["cu_per_worker"]["fixed"]:
        header = [f"CU per worker at {key} Gbit/s"] + [f"w{m} ({v:g})" for m, v in enumerate(speeds)]
        lines = [[f"{r['label']}, {mode}"] + [f"{c:.4f}" for c in cus[key]]
                 for r in rows for mode, cus in r["cu_per_worker"].items()]
        tables.append(text_table(header, lines))
    return tables


def fragments_text(counts: list[int]) -> str:
    """P and the layers of its fragments in whole numbers: "11 fragments (10 of 3 layers, 1 of 2)"."""
    sizes = sorted(set(counts), reverse=True)
    if len(sizes) == 1:
        return f"{len(counts)} fragments of {sizes[0]} layer{'s' if sizes[0] > 1 else ''}"
    parts = [f"{counts.count(n)} of {n}" for n in sizes]
    return f"{len(counts)} fragments ({parts[0]} layers, {', '.join(parts[1:])})"


def format_text(report: dict[str, Any]) -> str:
    """The tables a person reads; every number in them is in the report."""
    st = report["settings"]
    g = report["grid"]
    parts = []
    for m in report["models"]:
        mod = m["model"]
        parts.append(f"model {mod['name']}: {_fmt_count(mod['params'])} params, {mod['layers']} layers, "
                     f"step {mod['step_time']:.3g} s; M={st['workers']}, H={st['inner_steps']}, "
                     f"P={fragments_text(m['fragment_layer_counts'])}, "
                     f"latency {st['latency_ms']:g} ms, {st['transport']} exchange")
        if st["targets"]:
            header = ["Gbit/s to reach CU"] + [f"{100 * t:g}%" for t in st["targets"]]
            rows = []
            for r in m["rows"]:
                inf = r["cu_at_infinite_bandwidth"]
                rows.append([r["label"], *(_fmt_bw(r["least_bandwidth_gbps"][cell_key(t)], inf, t, g["max_gbps"])
                                           for t in st["targets"])])
            parts.append(text_table(header, rows))
        if st["bandwidths_gbps"]:
            header = ["CU at Gbit/s"] + [f"{b:g}" for b in st["bandwidths_gbps"]]
            rows = [[r["label"]] + [f"{c:.4f}" for c in r["cu_at_bandwidth"].values()] for r in m["rows"]]
            parts.append(text_table(header, rows))
        if st.get("worker_speeds"):
            parts.extend(_per_worker_tables(m["rows"], st["worker_speeds"]))
        header = ["bytes per worker", "per token", "dp / this", "peak transfer", f"at {st['tokens']:.3g} tokens"]
        rows = [[r["label"], f"{r['bytes_per_token']:.4g}", "-" if r["dp_ratio"] is None else f"{r['dp_ratio']:.1f}x",
                 fmt_bytes(r["peak_transfer_bytes"], ".3g"), fmt_bytes(r["total_bytes"], ".3g")] for r in m["rows"]]
        parts += [text_table(header, rows), ""]
    parts.append(
        f"grid {g['min_gbps']:g}..{g['max_gbps']:g} Gbit/s, {g['per_decade']:.4g} points per decade; "
        + (
            f"CU over a cold start of {st['cold_rounds']} rounds (exchanges in flight at the end not waited for); "
            if st.get("cold_rounds")
            else f"CU over {st['rounds']} rounds after {st['warmup_rounds']} of warm-up; "
        )
        + f"{st['tokens_per_step']:.4g} tokens per worker per step"
        + (f"; simulated in {report['seconds']:.2f} s" if "seconds" in report else "")
    )
    parts.extend(f"note: {n}" for n in report["notes"])
    return "\n".join(parts)
