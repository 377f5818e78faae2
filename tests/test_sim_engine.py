"""The per-block engine against closed forms on small graphs (one block, two blocks, exact fits)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from eagerloco.sim.engine import StepGraph, simulate
from eagerloco.sim.model import ModelSpec, Variant, traffic


def _gbps(nbytes: float, seconds: float) -> float:
    return nbytes * 8 / seconds / 1e9


def _run(model: ModelSpec, v: Variant, seconds_per_exchange: float, H: int, P: int = 1, **kw) -> float:
    tr = traffic(model, v, 2, H, P)
    bw = _gbps(tr.peak_bytes, seconds_per_exchange)
    return float(simulate(model, v, tr, bw, 0.0, H, **kw).cu[0])


def test_step_graph_nodes() -> None:
    g = StepGraph(layers=3, step_time=8.0)  # 3 forward + 2 activation + 3 weight nodes of 1 s
    assert g.unit == 1.0 and g.backward_time == 5.0
    # backward order: Ba2 Bw2 Ba1 Bw1 Bw0
    assert [g.weight_grad_done(layer) for layer in (2, 1, 0)] == [2.0, 4.0, 5.0]


@pytest.mark.parametrize("d", [0.3, 1.0, 2.5])
def test_one_block_diloco_loses_the_whole_transfer(d: float) -> None:
    """One block: its weight gradient is the step's last node, so nothing hides the exchange."""
    model, H = ModelSpec("one", 1e9, 1, 1.0), 10
    v = Variant("diloco", "DiLoCo", "diloco", 32)
    assert _run(model, v, d, H) == pytest.approx(H / (H + d), rel=1e-12)


@pytest.mark.parametrize("tau", [1, 2])
def test_one_block_transfer_that_fits_the_slack_exactly(tau: int) -> None:
    """tau steps of overlap hide exactly tau * t; one nanosecond more shows."""
    model, H = ModelSpec("one", 1e9, 1, 1.0), 10
    v = Variant("s", "s", "streaming", 32, fragmented=True, overlap_steps=tau)
    assert _run(model, v, tau * 1.0, H) == pytest.approx(1.0, abs=1e-12)
    assert _run(model, v, tau * 1.0 + 0.5, H) == pytest.approx(H / (H + 0.5), rel=1e-12)


@pytest.mark.parametrize("d", [0.1, 0.2, 0.35, 1.0])
def test_two_blocks_diloco(d: float) -> None:
    """Two blocks, t = 1 (nodes of 0.2 s: F0 F1 Ba1 Bw1 Bw0), each block's share takes d.

    Block 1's share starts one node before the end, block 0's at the end or when the link frees;
    the next forward of block 0 waits for it: exposed = d if d <= u, else 2d - u.
    """
    model, H = ModelSpec("two", 2e9, 2, 1.0), 10
    u = 0.2
    v = Variant("diloco", "DiLoCo", "diloco", 32)
    tr = traffic(model, v, 2, H, 1)
    bw = _gbps(tr.transfers[0] / 2, d)
    exposed = d if d <= u else 2 * d - u
    assert float(simulate(model, v, tr, bw, 0.0, H).cu[0]) == pytest.approx(H / (H + exposed), rel=1e-12)


def test_two_blocks_share_of_the_last_block_fits_in_one_node() -> None:
    """Block 1's share fits exactly in the one node (block 0's weight gradient) before the end of the
    step: it does not delay block 0's share, so only block 0's share shows."""
    model, H = ModelSpec("two", 2e9, 2, 1.0), 10
    v = Variant("diloco", "DiLoCo", "diloco", 32)
    tr = traffic(model, v, 2, H, 1)
    bw = _gbps(tr.transfers[0] / 2, 0.2)
    assert float(simulate(model, v, tr, bw, 0.0, H).cu[0]) == pytest.approx(H / (H + 0.2), rel=1e-12)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_cold_start_does_not_wait_for_the_last_exchange(n: int) -> None:
    """One block, blocking DiLoCo, n rounds from step 0: n - 1 exchanges are waited for."""
    model, H, d = ModelSpec("one", 1e9, 1, 1.0), 10, 3.0
    v = Variant("diloco", "DiLoCo", "diloco", 32)
    want = n * H / (n * H + (n - 1) * d)
    assert _run(model, v, d, H, cold_rounds=n) == pytest.approx(want, rel=1e-12)


def test_cold_start_eager_first_round_is_free() -> None:
    """Eager k=1, one block, one exchange per round taking 1.5 rounds.

    Round r's exchange gates round r + 2, so a 2-round cold start waits for nothing; a 3-round one
    waits for round 1's exchange (launched at 10 s, lands at 25 s, needed at 20 s): 5 s. The steady
    state is link-bound: 1 / 1.5."""
    model, H = ModelSpec("one", 1e9, 1, 1.0), 10
    v = Variant("e", "e", "eager", 32, eager_rounds=1)
    assert _run(model, v, 15.0, H, cold_rounds=2) == pytest.approx(1.0, abs=1e-12)
    assert _run(model, v, 15.0, H, cold_rounds=3) == pytest.approx(30 / 35, rel=1e-12)
    assert _run(model, v, 15.0, H) == pytest.approx(1 / 1.5, rel=1e-9)


def test_infinite_bandwidth_is_full_utilization_with_latency_charged_once_per_exchange() -> None:
    model, H = ModelSpec("two", 2e9, 2, 1.0), 10
    v = Variant("diloco", "DiLoCo", "diloco", 32)
    tr = traffic(model, v, 2, H, 1)
    # 0.3 s once per round, on block 1's share, which starts one node (0.2 s) before the step ends;
    # block 0's share queues behind it: 0.1 s shows.
    cu = simulate(model, v, tr, np.array([math.inf]), 300.0, H).cu[0]
    assert cu == pytest.approx(H / (H + 0.1), rel=1e-12)
