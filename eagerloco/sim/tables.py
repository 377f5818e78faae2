"""The default mode of ``eagerloco simulate``: every (model, row) on the grid and at each bandwidth asked."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

import numpy as np

from eagerloco.sim.config import Settings
from eagerloco.sim.engine import simulate
from eagerloco.sim.hetero import per_worker_cu
from eagerloco.sim.model import Variant, fragment_layer_counts, traffic
from eagerloco.sim.report import cell_key
from eagerloco.sim.search import bandwidth_grid, least_bandwidth


def compute(s: Settings) -> tuple[dict[str, Any], dict[str, list[tuple[str, np.ndarray]]], np.ndarray]:
    """Simulate every (model, row); returns the report, the CU curves per model and the grid."""
    c = s.cfg
    grid = s.grid if s.grid is not None else bandwidth_grid(c.bw_min, c.bw_max, c.grid_per_decade)
    lanes = np.concatenate([grid, np.asarray(s.bandwidths, dtype=float), [math.inf]])
    curves: dict[str, list[tuple[str, np.ndarray]]] = {}
    out_models = []
    for model in s.models:
        P = s.fragments_for(model)
        dp_bytes_per_step = None
        rows = []
        curves[model.name] = []
        for v in s.variants:
            tr = traffic(model, v, s.workers, c.inner_steps, P, c.codec_block, s.scale_bytes, c.transport,
                         c.fragment_pattern)
            res = simulate(model, v, tr, lanes, c.latency_ms, c.inner_steps, c.warmup_rounds, c.measure_rounds,
                           c.rounds)
            cu_grid = res.cu[: len(grid)]
            cu_bw = res.cu[len(grid) : len(grid) + len(s.bandwidths)]
            cu_inf = float(res.cu[-1])
            curves[model.name].append((v.label, cu_grid))
            if v.method == "dp":
                dp_bytes_per_step = tr.bytes_per_step
            row_extra = {}
            if s.speeds is not None:  # each worker's CU at --bandwidth-gbps and without a limit
                cus = per_worker_cu(model, v, tr, lanes[len(grid):], s.speeds, c.latency_ms, c.inner_steps,
                                    c.warmup_rounds, c.measure_rounds, c.rounds)
                row_extra["cu_per_worker"] = {
                    mode: {cell_key(b): [float(c) for c in cu[i]]
                           for i, b in enumerate([*s.bandwidths, math.inf])} for mode, cu in cus.items()}
            rows.append({
                **row_extra, **asdict(v), "fragments": len(tr.transfers) if v.method != "dp" else 1,
                "least_bandwidth_gbps": {cell_key(t): least_bandwidth(grid, cu_grid, t) for t in s.targets},
                "cu_at_bandwidth": {cell_key(b): float(c) for b, c in zip(s.bandwidths, cu_bw, strict=True)},
                "cu_at_infinite_bandwidth": cu_inf, "bytes_per_step": tr.bytes_per_step,
                "bytes_per_token": tr.bytes_per_step / c.tokens_per_step, "peak_transfer_bytes": tr.peak_bytes,
                "total_bytes": tr.bytes_per_step / c.tokens_per_step * c.tokens,
            })
        if dp_bytes_per_step is None:  # the ratio is against data-parallel even when its row is not shown
            dp = Variant("dp", "data-parallel", "dp", s.dp_bits)
            dp_bytes_per_step = traffic(model, dp, s.workers, c.inner_steps, P).bytes_per_step
        for r in rows:
            r["dp_ratio"] = dp_bytes_per_step / r["bytes_per_step"] if r["bytes_per_step"] > 0 else None
        out_models.append({"model": asdict(model), "fragments": P,
                           "fragment_layer_counts": fragment_layer_counts(model.layers, P),
                           "dp_bytes_per_token": dp_bytes_per_step / c.tokens_per_step, "rows": rows})
    report = {
        "settings": {
            "workers": s.workers, "inner_steps": c.inner_steps, "fragment_layers": c.fragment_layers,
            "fragments": c.fragments, "block": c.codec_block, "scale_bytes": s.scale_bytes, "transport": c.transport,
            "latency_ms": c.latency_ms, "bandwidths_gbps": s.bandwidths, "targets": s.targets,
            "warmup_rounds": c.warmup_rounds, "rounds": c.measure_rounds, "cold_rounds": c.rounds,
            "pattern": c.fragment_pattern, "paper": c.paper, "tokens_per_step": c.tokens_per_step, "tokens": c.tokens,
            "worker_speeds": s.speeds,
        },
        "grid": {"min_gbps": float(grid[0]), "max_gbps": float(grid[-1]),
                 "per_decade": (len(grid) - 1) / math.log10(grid[-1] / grid[0]), "points": len(grid)},
        "models": out_models,
        "notes": s.notes,
    }
    return report, curves, grid
