"""The simulator and ``simulate --plan`` by transport and number of workers (issue 36, item 3): all-gathered,
reduce-scattered and shared-support exchanges as M grows, and a plan that changes its answer with M."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagerloco.codec_sizes import packed_nbytes, reduce_scatter_wire_bytes, sparse_counts, sparse_nbytes
from eagerloco.lab.compare.stats import paired_difference
from eagerloco.sim.advice import SHARED_MEASURED, measured_note, settings, train_command
from eagerloco.sim.model import ModelSpec, Variant, exchange_wire_bytes, traffic
from eagerloco.sim.plan import Question, plan

NUMEL = 4096 * 256
TOPK = Variant("d", "d", "diloco", 2, topk=64, topk_chunk=4096)
SHARED = Variant("d", "d", "diloco", 2, topk=64, topk_chunk=4096, shared=True)
DENSE = Variant("d", "d", "diloco", 4)


@pytest.mark.parametrize("workers", [2, 4, 8, 16, 32, 128])
def test_each_transport_as_m_grows(workers: int) -> None:
    """All-gathered payloads cost M-1 each; the reduce-scatter and the shared support about 2 whatever M, the
    bytes the runtime's communicators count (codec_sizes)."""
    top = sparse_nbytes("2bit", NUMEL, 4096, 64)
    assert exchange_wire_bytes(NUMEL, TOPK, workers, transport="allgather") == (workers - 1) * top
    assert exchange_wire_bytes(NUMEL, TOPK, workers, transport="ring") == (workers - 1) * top
    kept = sparse_counts(NUMEL, 4096, 64)[0]
    for transport in ("ring", "allgather", "reduce-scatter", "shared-support"):  # shared: whatever the transport
        assert exchange_wire_bytes(NUMEL, SHARED, workers, transport=transport) == \
            reduce_scatter_wire_bytes("2bit", kept, workers)
    for transport in ("reduce-scatter", "shared-support"):
        assert exchange_wire_bytes(NUMEL, DENSE, workers, transport=transport) == \
            reduce_scatter_wire_bytes("e2m1", NUMEL, workers)
    flat = exchange_wire_bytes(NUMEL, SHARED, workers) / exchange_wire_bytes(NUMEL, SHARED, 2)
    assert flat < 2.0


def test_data_parallel_rows_follow_the_transport() -> None:
    """A quantized data-parallel gradient is all-gathered under allgather (as the runtime does), sharded under
    reduce-scatter, ring-reduced under ring."""
    model = ModelSpec("m", 8 * NUMEL, 8, 0.1)
    dp = Variant("dp", "dp", "dp", 16)
    per = packed_nbytes("bf16", NUMEL)
    assert traffic(model, dp, 8, 1, 1, transport="ring").transfers == [2 * 7 / 8 * per] * 8
    assert traffic(model, dp, 8, 1, 1, transport="allgather").transfers == [7 * per] * 8
    assert traffic(model, dp, 8, 1, 1, transport="reduce-scatter").transfers == \
        [reduce_scatter_wire_bytes("bf16", NUMEL, 8)] * 8


def test_plan_takes_the_workers_into_account() -> None:
    """On a link where all-gathered top-k reaches the target with 2 workers but not with 32, the plan at 32
    recommends the shared support and says so in its command; at 2 it offers no shared row."""
    model = ModelSpec("custom", 7e9, 32, 1.0)
    small = plan(model, Question(0.1, 0.95, workers=2))
    assert small["best"] is not None and small["best"]["topk"] is not None
    assert not any(r["transport"] == "shared-support" for r in small["candidates"])
    large = plan(model, Question(0.1, 0.95, workers=32))
    best = large["best"]
    assert best is not None and best["transport"] == "shared-support" and "shared" in best["format"]
    assert not any(r["meets"] and r["topk"] is not None and r["transport"] == "allgather"
                   and r["inner_steps"] <= best["inner_steps"] for r in large["candidates"])
    assert settings(best)["transport"] == "shared-support"
    assert "--transport shared-support --topk" in train_command(best, large)
    # A quantized dense row runs with the reduce-scatter, whose bytes the plan's ring stands for.
    e2m1 = next(r for r in large["candidates"] if r["codec"] == "e2m1" and r["topk"] is None)
    assert e2m1["transport"] == "reduce-scatter" and "--transport reduce-scatter" in train_command(e2m1, large)


def test_the_shared_supports_measured_cost_is_the_committed_check() -> None:
    """The plan's note, outer lr and error feedback for the shared support are the tuned Pareto's on Brown
    (many_workers_loss.json), paired by seed against DiLoCo at its own tuned lr."""
    runs = json.loads((Path(__file__).resolve().parents[1] / "bench/results/many_workers_loss.json").read_text())
    for (family, fmt), (mean, lo, hi, lr, beta) in SHARED_MEASURED.items():
        k = fmt.split("shared")[1].split("/")[0]
        row_runs = {s: runs[f"shared-ef{beta:g}-{k}@lr{lr:g}/seed{s}"] for s in range(3)}
        gap = paired_difference({s: r["final_eval_loss"] for s, r in row_runs.items()},
                                {s: runs[f"diloco-fp32@lr0.4/seed{s}"]["final_eval_loss"] for s in range(3)})
        assert gap is not None and (mean, lo, hi) == (round(gap.mean, 3), round(gap.lo, 3), round(gap.hi, 3))
        flags = row_runs[0]["flags"]
        assert float(flags[flags.index("--outer-lr") + 1]) == lr
        assert float(flags[len(flags) - 1 - flags[::-1].index("--error-feedback") + 1]) == beta  # the last one counts
        row = next(r for r in plan(ModelSpec("custom", 7e9, 32, 1.0), Question(0.1, 0.95, workers=32))["candidates"]
                   if (r["family"], r["format"]) == (family, fmt))
        assert measured_note(row).startswith(f"measured loss cost: {mean:+.3f} nats [{lo:+.3f}, {hi:+.3f}]")
        assert settings(row)["error_feedback"] == beta and settings(row)["outer_lr"] == lr
        streaming = {**row, "family": "streaming", "method": "streaming", "fragments": 4}  # measured with DiLoCo
        assert measured_note(streaming).startswith("measured loss cost: none")
        assert settings(streaming)["error_feedback"] == beta and settings(streaming)["outer_lr"] == lr
