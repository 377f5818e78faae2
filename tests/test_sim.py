"""The compute-utilization simulator: closed forms, monotonicity, the search and the CLI."""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eagerloco.codec_sizes import SCALE_BYTES
from eagerloco.jsonfiles import finite_json
from eagerloco.sim import cli
from eagerloco.sim.config import SimConfig
from eagerloco.sim.engine import simulate
from eagerloco.sim.model import (
    PRESETS,
    ModelSpec,
    Variant,
    default_variants,
    fragment_count,
    fragment_layer_counts,
    payload_bytes,
    traffic,
    wire_bytes,
)
from eagerloco.sim.search import bandwidth_grid, least_bandwidth, meets

GRID = bandwidth_grid(1e-3, 1e5, 25)
ONE_B = PRESETS["1b"]


def _cu(
    model: ModelSpec, v: Variant, bw, M: int = 2, H: int = 100, P: int | None = None, lat: float = 0.0, **kw
):
    P = fragment_count(model.layers, 3) if P is None else P
    tr = traffic(model, v, M, H, P, **kw)
    return simulate(model, v, tr, bw, lat, H).cu


def _gbps_for_seconds(nbytes: float, seconds: float) -> float:
    """Bandwidth at which nbytes take exactly this long."""
    return nbytes * 8 / seconds / 1e9


# ------------------------------------------------------------------------------------ closed forms


@pytest.mark.parametrize("model", list(PRESETS.values()), ids=list(PRESETS))
@pytest.mark.parametrize("M", [2, 5])
def test_infinite_bandwidth_gives_full_utilization(model: ModelSpec, M: int) -> None:
    for v in default_variants(taus=(0, 1, 5), eager_fragmented=True) + default_variants():
        assert _cu(model, v, math.inf, M=M)[0] == pytest.approx(1.0, abs=1e-12), v.key


@pytest.mark.parametrize("M", [2, 3, 8])
@pytest.mark.parametrize("bw", [0.5, 7.0, 300.0])
@pytest.mark.parametrize("lat", [0.0, 40.0])
def test_diloco_closed_form(M: int, bw: float, lat: float) -> None:
    """Blocking DiLoCo, link slower than the weight gradients appear (a share takes >= 2 nodes).

    The shares run back to back from the last block's weight gradient (2 nodes into the backward);
    block 0's share is the last one queued and gates the next forward, so a round loses
    latency + all shares - (2L - 3) nodes of backward that hid them.
    """
    H, t, L = 30, ONE_B.step_time, ONE_B.layers
    u = t / (3 * L - 1)
    v = Variant("diloco", "DiLoCo", "diloco", 32)
    link = 2 * (M - 1) / M * ONE_B.params * 4 * 8 / (bw * 1e9)
    assert link / L >= 2 * u
    exposed = lat / 1e3 + link - (2 * L - 3) * u
    assert _cu(ONE_B, v, bw, M=M, H=H, lat=lat)[0] == pytest.approx(H * t / (H * t + exposed), rel=1e-9)


@pytest.mark.parametrize("tau", [0, 1, 3])
def test_streaming_blocks_for_what_tau_steps_do_not_hide(tau: int) -> None:
    """One block per fragment: fragment p's share goes on the link when block p's weight gradient
    exists, 2p - 1 nodes before the end of the launch step (block 0: at its end), and gates block
    p's forward tau + 1 steps later, p nodes into that step. It blocks max(0, d - slack) with
    slack = tau*t + (3p - 1) nodes (tau*t for p = 0), each exchange landing before the next starts.
    """
    model, H = ModelSpec("x", 4e9, 4, 0.8), 100
    P, L = 4, 4
    u = model.step_time / (3 * L - 1)
    v = Variant("s", "s", "streaming", 32, fragmented=True, overlap_steps=tau)
    d_bytes = traffic(model, v, 2, H, P).peak_bytes
    for d in (0.5 * model.step_time, 2.5 * model.step_time, 5.0 * model.step_time):
        bw = _gbps_for_seconds(d_bytes, d)
        slack = [tau * model.step_time] + [tau * model.step_time + (3 * p - 1) * u for p in range(1, P)]
        blocked = sum(max(0.0, d - s) for s in slack)
        want = H * model.step_time / (H * model.step_time + blocked)
        assert _cu(model, v, bw, H=H, P=P)[0] == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("method", ["eager", "delayed"])
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("fragmented", [False, True])
def test_eager_full_when_a_sync_fits_in_a_round(method: str, k: int, fragmented: bool) -> None:
    H, t = 100, ONE_B.step_time
    v = Variant("e", "e", method, 32, fragmented=fragmented, eager_rounds=k)
    tr = traffic(ONE_B, v, 2, H, 8)
    round_bytes = sum(tr.transfers)  # every exchange of a round, back to back on the link
    for frac in (0.3, 0.9, 1.0):
        bw = _gbps_for_seconds(round_bytes, frac * H * t)
        assert _cu(ONE_B, v, bw, H=H, P=8)[0] == pytest.approx(1.0, abs=1e-12)
    # One sync longer than a round: the backlog grows, and the link's pace sets the run's pace.
    for frac in (1.25, 3.0):
        bw = _gbps_for_seconds(round_bytes, frac * H * t)
        assert _cu(ONE_B, v, bw, H=H, P=8)[0] == pytest.approx(1.0 / frac, rel=1e-9)


def test_link_carries_one_transfer_at_a_time() -> None:
    """Two blocks in two fragments, H=3 (offsets 0 and 2), tau=1, t=1 s (nodes of 0.2 s), 1.5 s each.

    Fragment 1 (block 1) launches at step 2 when block 1's weight gradient exists, one node before
    the end of the step; fragment 0 (block 0) launches at the end of step 3 and has to queue
    behind it: one link carries one transfer at a time.
    """
    model = ModelSpec("x", 2e9, 2, 1.0)
    v = Variant("s", "s", "streaming", 32, fragmented=True, overlap_steps=1)
    tr = traffic(model, v, 2, 3, 2)
    bw = _gbps_for_seconds(tr.transfers[0], 1.5)
    shared = simulate(model, v, tr, bw, 0.0, 3).cu[0]
    # Times from the end of step 2. Fragment 1: on the link at -0.2 s, lands at 1.3 s; step 3 is not
    # gated and ends at 1.0 s. Fragment 0: launched at 1.0 s, queues until 1.3 s, lands at 2.8 s.
    # Fragment 1 is applied after step 3, so block 1's forward of step 4, due at 1.2 s, waits until
    # 1.3 s (0.1 s); step 4 ends at 2.1 s; block 0's forward of step 5 waits for fragment 0 until
    # 2.8 s (0.7 s). Per round of 3 steps: 0.8 s lost.
    assert shared == pytest.approx(3 / (3 + 0.1 + 0.7), rel=1e-9)


def test_dp_overlaps_each_block_with_the_rest_of_the_backward() -> None:
    model = ONE_B
    v = Variant("dp", "dp", "dp", 16)
    layer_bytes = traffic(model, v, 2, 100, 1).peak_bytes
    t, L = model.step_time, model.layers
    u = t / (3 * L - 1)
    # Link faster than one node: only block 0's all-reduce (launched last) sticks out of the step.
    d = 0.5 * u
    assert _cu(model, v, _gbps_for_seconds(layer_bytes, d))[0] == pytest.approx(t / (t + d), rel=1e-9)
    # Link slower than two nodes: back to back from block L-1's weight gradient (2 nodes into the
    # backward); the next forward waits for block 0's share, the last one.
    d = 3 * u
    want = t / (t + L * d - (2 * L - 3) * u)
    assert _cu(model, v, _gbps_for_seconds(layer_bytes, d))[0] == pytest.approx(want, rel=1e-9)


# ---------------------------------------------------------------------------------- monotonicity


@pytest.mark.parametrize("model", list(PRESETS.values()), ids=list(PRESETS))
def test_monotone_in_bandwidth_for_every_method(model: ModelSpec) -> None:
    for lat in (0.0, 30.0):
        streamed = [v for v in default_variants(eager_fragmented=True) if v.method in ("delayed", "eager")]
        for v in default_variants(taus=(1, 5)) + streamed:
            cu = _cu(model, v, GRID, M=4, lat=lat)
            assert np.all(np.diff(cu) >= -1e-12), (model.name, v.key, lat)
            assert cu[0] < 0.5 and (lat > 0 or cu[-1] > 0.99)


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 30),
    fragment_layers=st.integers(1, 6),
    H=st.integers(4, 60),
    tau=st.integers(0, 4),
    k=st.integers(1, 3),
    M=st.integers(2, 9),
    lat=st.sampled_from([0.0, 5.0, 200.0]),
    method=st.sampled_from(["dp", "diloco", "streaming", "delayed", "eager"]),
    fragmented=st.booleans(),
)
def test_monotone_in_bandwidth_random_schedules(
    layers: int,
    fragment_layers: int,
    H: int,
    tau: int,
    k: int,
    M: int,
    lat: float,
    method: str,
    fragmented: bool,
) -> None:
    model = ModelSpec("x", 1e8 * layers, layers, 0.05)
    P = min(fragment_count(layers, fragment_layers), H)
    v = Variant(
        "x",
        "x",
        method,
        8,
        fragmented=method == "streaming" or (fragmented and method in ("delayed", "eager")),
        overlap_steps=tau if method == "streaming" else 0,
        eager_rounds=k,
    )
    cu = _cu(model, v, bandwidth_grid(1e-2, 1e4, 8), M=M, H=H, P=P, lat=lat)
    assert np.all(np.diff(cu) >= -1e-12)
    assert np.all((cu > 0) & (cu <= 1 + 1e-12))


@pytest.mark.parametrize("model", list(PRESETS.values()), ids=list(PRESETS))
@pytest.mark.parametrize("M", [2, 4, 64])
def test_four_bit_never_needs_more_bandwidth_than_32_bit(model: ModelSpec, M: int) -> None:
    targets = (0.5, 0.8, 0.9, 0.95, 0.99)
    for v32 in default_variants(bits=32, taus=(1, 5), eager_fragmented=True):
        if v32.method == "dp":
            continue
        v4 = replace(v32, bits=4)
        cu32, cu4 = _cu(model, v32, GRID, M=M), _cu(model, v4, GRID, M=M)
        assert np.all(cu4 >= cu32 - 1e-12), v32.key
        for t in targets:
            b32, b4 = least_bandwidth(GRID, cu32, t), least_bandwidth(GRID, cu4, t)
            assert b4 is not None and (b32 is None or b4 <= b32), (v32.key, t)


@pytest.mark.parametrize("layers", [1, 7, 24, 48, 108])
def test_more_fragments_never_raise_the_peak_transfer(layers: int) -> None:
    model = ModelSpec("x", 1e9, layers, 0.1)
    v = Variant("s", "s", "streaming", 4, fragmented=True)
    peaks = [traffic(model, v, 4, 10_000, P).peak_bytes for P in range(1, layers + 1)]
    assert all(b <= a for a, b in zip(peaks, peaks[1:], strict=False))
    assert peaks[-1] < peaks[0] or layers == 1
    for P in range(1, layers + 1):  # every block in exactly one fragment
        assert sum(fragment_layer_counts(layers, P)) == layers


# ---------------------------------------------------------------------------------------- search


def test_search_returns_least_grid_value_meeting_each_target() -> None:
    model = PRESETS["1b"]
    targets = (0.5, 0.8, 0.9, 0.95, 0.99)
    for v in default_variants():
        cu = _cu(model, v, GRID)
        for t in targets:
            b = least_bandwidth(GRID, cu, t)
            assert b is not None
            i = int(np.flatnonzero(GRID == b)[0])
            assert meets(cu[i], t) and not meets(cu[:i], t).any()
            # the same answer from independent one-bandwidth simulations
            assert meets(_cu(model, v, float(GRID[i]))[0], t)
            if i > 0:
                assert not meets(_cu(model, v, float(GRID[i - 1]))[0], t)


def test_search_on_a_synthetic_curve() -> None:
    grid = np.array([1.0, 2.0, 4.0, 8.0])
    cu = np.array([0.1, 0.5, 0.9, 1.0])
    assert least_bandwidth(grid, cu, 0.5) == 2.0
    assert least_bandwidth(grid, cu, 0.51) == 4.0
    assert least_bandwidth(grid, cu, 1.0) == 8.0
    assert least_bandwidth(grid, cu[:3], 0.95) is None
    assert len(bandwidth_grid(1e-3, 1e5, 100)) == 801


def test_vectorized_lanes_match_single_bandwidths() -> None:
    model = PRESETS["1b"]
    bws = np.array([0.3, 3.0, 30.0, 300.0])
    for v in default_variants(taus=(1, 5)):
        lanes = _cu(model, v, bws, M=3, lat=20.0)
        single = [_cu(model, v, float(b), M=3, lat=20.0)[0] for b in bws]
        assert lanes == pytest.approx(single, rel=1e-12)


# ----------------------------------------------------------------------------------------- bytes


def test_bytes_per_token_ratio_against_data_parallel() -> None:
    H, P = 100, 8
    dp = traffic(ONE_B, Variant("dp", "dp", "dp", 16), 2, H, P)
    s4 = traffic(ONE_B, Variant("s", "s", "streaming", 4, True, 1), 2, H, P)
    s4_noscale = traffic(ONE_B, Variant("s", "s", "streaming", 4, True, 1), 2, H, P, scale_bytes=0)
    assert dp.bytes_per_step / s4_noscale.bytes_per_step == pytest.approx(H * 16 / 4)
    assert dp.bytes_per_step / s4.bytes_per_step == pytest.approx(H * 16 / (4 + 8 * SCALE_BYTES / 32))
    assert payload_bytes(64, 4, 32, 1) == 64 * 4 / 8 + 2
    assert wire_bytes(100.0, 4, 4, "allgather") == 300.0 and wire_bytes(100.0, 4, 32, "allgather") == 150.0
    assert wire_bytes(100.0, 1, 32) == 0.0


# ------------------------------------------------------------------------------------------- CLI


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="eagerloco")
    sub = parser.add_subparsers(dest="command", required=True)
    cli.add_parser(sub)
    args = parser.parse_args(["simulate", *argv])
    assert args.func is cli.run
    return args


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = cli.run(_parse(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_prints_one_row_per_method(capsys: pytest.CaptureFixture[str]) -> None:
    start = time.perf_counter()
    rc, out, _ = _run(["--model", "1b", "--target-cu", "0.5,0.8,0.9,0.95,0.99"], capsys)
    assert time.perf_counter() - start < 10
    assert rc == 0
    table = out.split("\n\n")[0].splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("Gbit/s to reach CU"))
    assert table[header].split()[-5:] == ["50%", "80%", "90%", "95%", "99%"]
    labels = [v.label for v in default_variants()]
    rows = table[header + 2 : header + 2 + len(labels)]
    for label, line in zip(labels, rows, strict=True):
        assert line.startswith(label)
        cells = line[len(label) :].split()
        assert len(cells) == 5 and all(float(c) > 0 for c in cells)
        assert [float(c) for c in cells] == sorted(float(c) for c in cells)
    assert {v.method for v in default_variants()} == {"dp", "diloco", "streaming", "delayed", "eager"}


def test_cli_method_selects_rows(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(["--model", "1b", "--method", "eager", "--bandwidth-gbps", "1,10"], capsys)
    assert rc == 0
    assert "eager k=1" in out and "eager k=2" in out and "DiLoCo" not in out and "data-parallel" not in out
    assert "dp / this" in out  # the ratio still compares with data-parallel


def test_cli_plot_writes_pngs(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, _ = _run(
        ["--model", "1b,10b", "--grid-per-decade", "10", "--plot", str(tmp_path / "figs")], capsys
    )
    assert rc == 0
    files = sorted((tmp_path / "figs").glob("*.png"))
    assert [f.name for f in files] == ["cu_10b.png", "cu_1b.png"]
    for f in files:
        data = f.read_bytes()
        assert len(data) > 10_000 and data[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_json_round_trips(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "out.json"
    argv = ["--model", "1b", "--target-cu", "0.5,0.95", "--bandwidth-gbps", "2,inf", "--json", str(path)]
    rc, out, _ = _run(argv, capsys)
    assert rc == 0
    data = json.loads(path.read_text())
    report, _, _ = cli.compute(SimConfig.from_args(_parse(argv)).validate())
    report.pop("seconds", None)
    data.pop("seconds")
    assert data == json.loads(json.dumps(finite_json(report)))
    assert data["settings"]["bandwidths_gbps"] == [2.0, "inf"]
    rows = data["models"][0]["rows"]
    assert len(rows) == len(default_variants())
    for r in rows:  # every printed number is in the JSON
        line = next(line for line in out.splitlines() if line.startswith(r["label"] + " "))
        assert f"{r['least_bandwidth_gbps']['0.95']:.3g}" in line.split()
        assert r["cu_at_bandwidth"]["inf"] == pytest.approx(1.0)
    rc, out, err = _run([*argv[:-2], "--json", "-"], capsys)
    assert rc == 0 and json.loads(out)["models"][0]["rows"][0]["key"] == "dp" and "Gbit/s" in err


def test_cli_custom_model_from_flops(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "custom", "--params", "3e9", "--layers", "30", "--peak-tflops", "4000"]
    rc, out, _ = _run([*argv, "--tokens-per-step", "1e5", "--mfu", "0.5", "--bandwidth-gbps", "5"], capsys)
    assert rc == 0
    assert "step 0.9 s" in out and "P=10 fragments" in out


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--bandwidth-gbps", "-1"], "--bandwidth-gbps"),
        (["--bandwidth-gbps", "0"], "--bandwidth-gbps"),
        (["--model", "7b"], "--model"),
        (["--target-cu", "0.5,1.2"], "--target-cu"),
        (["--target-cu", "0"], "--target-cu"),
        (["--target-cu", "abc"], "--target-cu"),
        (["--method", "gossip"], "--method"),
        (["--latency-ms", "-3"], "--latency-ms"),
        (["--model", "custom", "--params", "1e9"], "--layers"),
        (["--workers", "0"], "--workers"),
        (["--codec-block", "0"], "--codec-block"),
        (["--mfu", "1.5"], "--mfu"),
        (["--model", "custom", "--params", "1e9", "--layers", "10", "--peak-tflops", "0"], "--peak-tflops"),
    ],
)
def test_cli_bad_inputs_name_the_flag(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(argv, capsys)
    assert rc == 2 and out == ""
    assert flag in err and "error" in err


def test_fragment_counts_are_whole_numbers() -> None:
    """32 blocks in fragments of 3: ten of 3 and one of 2 (not "fragments of 2/3 layers")."""
    from eagerloco.sim.model import fragment_layer_counts
    from eagerloco.sim.report import fragments_text

    assert fragments_text(fragment_layer_counts(32, 11)) == "11 fragments (10 of 3 layers, 1 of 2)"
    assert fragments_text(fragment_layer_counts(24, 8)) == "8 fragments of 3 layers"
    assert fragments_text([1, 1]) == "2 fragments of 1 layer"
