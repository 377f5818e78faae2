"""The simulator and the planner with sparse (top-k) exchanges: bytes from codec_sizes, closed-form
utilization, the planner's answer where no dense codec reaches the target, and the flags' errors."""

from __future__ import annotations

import argparse
import json

import pytest

from eagerloco.codec_sizes import CODEC_BITS, CODEC_NAMES, packed_nbytes, sparse_nbytes
from eagerloco.sim import cli
from eagerloco.sim.advice import format_decision
from eagerloco.sim.config import SimConfig
from eagerloco.sim.engine import simulate
from eagerloco.sim.model import PRESETS, ModelSpec, Variant, bits_per_value, fragment_count, traffic
from eagerloco.sim.plan import SPARSE, Question, candidates, format_summary, plan

ONE_B = PRESETS["1b"]
#: One block, 1 s a step: the block's share goes on the link when the backward ends and gates the next
#: forward, so a blocking round is exposed by exactly its transfer.
ONE_BLOCK = ModelSpec("one-block", 4096 * 1000 + 100, 1, 1.0)  # a short last chunk of 100 values
ONE_BLOCK_NUMEL = int(ONE_BLOCK.params)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="eagerloco")
    cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["simulate", *argv])


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = cli.run(_parse(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


# ------------------------------------------------------------------------------------------ bytes


@pytest.mark.parametrize("codec", CODEC_NAMES)
@pytest.mark.parametrize("k, chunk", [(64, 4096), (1024, 4096), (3, 100)])
def test_sparse_exchange_bytes_are_codec_sizes(codec: str, k: int, chunk: int) -> None:
    """1B, M=2: DiLoCo sends the whole model's 10**9 values once, Streaming each fragment's 3 blocks
    (125,000,000 values; strided, 8 fragments); both exactly what sparse_nbytes says they pack."""
    bits = CODEC_BITS[codec]
    diloco = Variant("d", "d", "diloco", bits, topk=k, topk_chunk=chunk)
    (whole,) = traffic(ONE_B, diloco, 2, 100, 1).transfers
    assert whole == sparse_nbytes(codec, 10**9, chunk, k)
    streaming = Variant("s", "s", "streaming", bits, fragmented=True, topk=k, topk_chunk=chunk)
    frags = traffic(ONE_B, streaming, 2, 100, fragment_count(ONE_B.layers, 3)).transfers
    assert frags == [sparse_nbytes(codec, 125_000_000, chunk, k)] * 8
    long = 1024 * chunk  # a long payload: bits on the wire per value of the vector
    assert bits_per_value(diloco) == pytest.approx(8 * sparse_nbytes(codec, long, chunk, k) / long, rel=1e-12)


@pytest.mark.parametrize("transport", ["ring", "allgather"])
def test_a_sparse_payload_is_all_gathered_whatever_the_transport(transport: str) -> None:
    v = Variant("d", "d", "diloco", 2, topk=64, topk_chunk=4096)
    payload = sparse_nbytes("2bit", ONE_BLOCK_NUMEL, 4096, 64)
    for M in (1, 2, 3, 8):
        (sent,) = traffic(ONE_BLOCK, v, M, 10, 1, transport=transport).transfers
        assert sent == (M - 1) * payload


def test_the_cli_charges_the_sparse_payload_and_keeps_dp_dense(capsys: pytest.CaptureFixture[str]) -> None:
    s = SimConfig.from_args(_parse(["--model", "1b", "--codec", "2bit", "--topk", "64", "--bandwidth-gbps", "1",
                                    "--target-cu", "0.9"])).validate()
    report = cli.compute(s)[0]
    rows = {r["key"]: r for r in report["models"][0]["rows"]}
    assert rows["diloco"]["label"] == "DiLoCo 2-bit top64/4096"
    assert rows["diloco"]["bytes_per_step"] * 100 == pytest.approx(sparse_nbytes("2bit", 10**9, 4096, 64), rel=1e-12)
    assert rows["eager-k1"]["topk"] == 64 and rows["streaming-tau1"]["topk"] == 64
    # data-parallel and the --low-codec row keep their dense formats, and a note says so for dp
    assert rows["dp"]["topk"] is None and rows["dp"]["bytes_per_step"] == pytest.approx(10**9 * 2, rel=1e-12)
    assert rows["streaming-tau1-4bit"]["topk"] is None
    assert any("data-parallel row sends its bf16 gradients dense" in n for n in report["notes"])


def test_codec_2bit_dense_is_its_packed_size(capsys: pytest.CaptureFixture[str]) -> None:
    s = SimConfig.from_args(_parse(["--model", "1b", "--codec", "2bit", "--method", "diloco",
                                    "--bandwidth-gbps", "1"])).validate()
    (row,) = cli.compute(s)[0]["models"][0]["rows"]
    assert row["label"] == "DiLoCo 2-bit"
    assert row["bytes_per_step"] * 100 == pytest.approx(packed_nbytes("2bit", 10**9), rel=1e-12)


# -------------------------------------------------------------------------------------- closed forms


@pytest.mark.parametrize("M", [2, 3])
@pytest.mark.parametrize("lat", [0.0, 25.0])
@pytest.mark.parametrize("bw", [0.01, 0.3])
def test_blocking_diloco_with_topk_closed_form(M: int, lat: float, bw: float) -> None:
    """One block, H = 10 steps of 1 s: CU = compute / (compute + latency + transfer), the transfer being
    (M - 1) sparse payloads over the bandwidth."""
    H = 10
    v = Variant("d", "d", "diloco", 2, topk=64, topk_chunk=4096)
    transfer = (M - 1) * sparse_nbytes("2bit", ONE_BLOCK_NUMEL, 4096, 64) * 8 / (bw * 1e9)
    tr = traffic(ONE_BLOCK, v, M, H, 1)
    cu = simulate(ONE_BLOCK, v, tr, bw, lat, H).cu[0]
    assert cu == pytest.approx(H / (H + lat / 1e3 + transfer), rel=1e-12)


def test_the_cli_gives_the_closed_form(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(["--model", "custom", "--params", str(ONE_BLOCK_NUMEL), "--layers", "1", "--step-time", "1",
                       "--codec", "2bit", "--topk", "64", "--method", "diloco", "--inner-steps", "10",
                       "--bandwidth-gbps", "0.001", "--json", "-"], capsys)
    assert rc == 0
    (row,) = json.loads(out)["models"][0]["rows"]
    transfer = sparse_nbytes("2bit", ONE_BLOCK_NUMEL, 4096, 64) * 8 / 1e6
    assert row["cu_at_bandwidth"]["0.001"] == pytest.approx(10 / (10 + transfer), rel=1e-12)


def test_eager_with_topk_is_paced_by_the_link_once_a_round_is_too_short() -> None:
    """Eager k=1 on 1B: full utilization while a round's sparse payload fits in a round, else the
    link's pace: CU = round compute / transfer."""
    H = 30
    v = Variant("e", "e", "eager", 2, eager_rounds=1, topk=64, topk_chunk=4096)
    tr = traffic(ONE_B, v, 2, H, 1)
    bits = sparse_nbytes("2bit", 10**9, 4096, 64) * 8
    for frac in (0.5, 2.0):
        bw = bits / (frac * H * ONE_B.step_time) / 1e9
        want = min(1.0, 1 / frac)
        assert simulate(ONE_B, v, tr, bw, 0.0, H).cu[0] == pytest.approx(want, rel=1e-9)


# -------------------------------------------------------------------------------------------- plan

#: 10B parameters in 6 blocks (P = 2): at 0.1 Gbit/s a round of eager e2m1 at H = 500 carries 45 Gbit in
#: 400 s of compute (CU 0.889), while 2-bit top 64 of 4096 is 2.27 Gbit, under the 24 s of an H = 30 round.
TEN_B_SMALL = ModelSpec("10b-in-6", 1e10, 6, 0.8)


def test_plan_finds_a_sparse_setting_where_no_dense_one_reaches_the_target() -> None:
    report = plan(TEN_B_SMALL, Question(0.1, 0.95))
    rows = report["candidates"]
    assert not any(r["meets"] for r in rows if r["topk"] is None)
    assert max(r["cu"] for r in rows if r["topk"] is None) == pytest.approx(400 / 450, rel=1e-9)
    best = report["best"]
    assert best["format"] == "2bit top64/4096" and (best["family"], best["inner_steps"]) == ("eager", 30)
    assert best["cu"] == pytest.approx(1.0) and not any(r["meets"] for r in rows[: rows.index(best)])
    by_format = {r["format"]: r for r in report["by_format"]}
    assert list(by_format) == ["bf16", "fp8", "e2m1", "2bit top1024/4096", "2bit top256/4096", "2bit top64/4096"]
    assert [r["meets"] for r in by_format.values()] == [False, False, False, True, True, True]
    text = format_decision(report, "given (--step-time)", None, verbose=True)
    assert "recommended: eager H=30 P=2 k=1 2bit top64/4096 -> CU 1.000" in text
    assert "none (best: eager H=500 P=2 k=1 e2m1)  0.8889" in text
    order = [c.rank() for c in candidates(TEN_B_SMALL)]
    assert order == sorted(order)


def test_plan_adds_the_topk_flags_setting(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--plan", "--model", "custom", "--params", "1e10", "--layers", "6", "--step-time", "0.8",
            "--bandwidth-gbps", "0.1", "--target-cu", "0.95", "--codec", "e2m1", "--topk", "16", "--topk-chunk", "1024"]
    cfg = SimConfig.from_args(_parse(argv))
    s = cfg.validate()
    assert s.sparse == (4, 16, 1024) and (4, 16, 1024) not in SPARSE
    report, text = cli.special(cfg, s)
    assert [r["format"] for r in report["by_format"]][-1] == "e2m1 top16/1024"
    assert "e2m1 top16/1024" in text and report["best"] is not None


def test_plan_of_several_models_ends_with_a_summary(capsys: pytest.CaptureFixture[str]) -> None:
    """A 1B model in 6 blocks reaches 95% dense (e2m1, H = 500: 4.5 Gbit in a 50 s round); the 10B does not."""
    cfg = SimConfig.from_args(_parse(["--plan", "--bandwidth-gbps", "0.1", "--target-cu", "0.95"]))
    s = cfg.validate()  # the default models, 1b, 10b and 100b: several are allowed
    assert [m.name for m in s.models] == ["1b", "10b", "100b"]
    s.models = [ModelSpec("1b-in-6", 1e9, 6, 0.1), TEN_B_SMALL]  # the same question on smaller graphs
    report, text = cli.special(cfg, s)
    assert [p["model"]["name"] for p in report["plans"]] == ["1b-in-6", "10b-in-6"]
    assert report["plans"][1]["best"]["format"] == "2bit top64/4096"
    assert text.count("plan for ") == 2
    lines = text.split("\n\n")[-1].splitlines()
    assert lines[0] == "answer at 0.1 Gbit/s, target CU 95%"
    assert lines[1].split() == ["model", "cheapest", "cheapest", "dense", "cheapest", "sparse"]
    assert lines[3].startswith("1b-in-6") and "eager H=500 P=2 k=1 e2m1 (CU 1.000)" in lines[3]
    assert lines[4].startswith("10b-in-6") and "none (best CU 0.889)" in lines[4]
    assert "eager H=30 P=2 k=1 2bit top64/4096 (CU 1.000)" in lines[4]
    assert text.split("\n\n")[-1] == format_summary(report["plans"])


# ------------------------------------------------------------------------------------------- flags


@pytest.mark.parametrize("argv, message", [
    (["--topk", "0"], "--topk must be an integer >= 1, got 0"),
    (["--topk", "-3"], "--topk must be an integer >= 1, got -3"),
    (["--topk", "5000"], "--topk (5000) must not exceed --topk-chunk (4096): it counts the values kept in each chunk"),
    (["--topk", "64", "--topk-chunk", "0"], "--topk-chunk must be an integer >= 1, got 0"),
    (["--topk", "64", "--method", "dp"], "--topk compresses outer gradients; --method dp exchanges gradients"),
])
def test_bad_topk_values_are_one_line_naming_the_flag(argv: list[str], message: str, capsys) -> None:
    rc, out, err = _run(["--model", "1b", "--bandwidth-gbps", "1", *argv], capsys)
    assert rc == 2 and out == ""
    assert err.startswith(f"eagerloco simulate: error: {message}") and err.count("\n") == 1, err
