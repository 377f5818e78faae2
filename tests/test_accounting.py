"""Numbers that tell the truth: no link time for a worker that sends nothing, each worker's blocked time in the
table, one meaning for outer syncs, and one set of metric names for the trainer and the hook API."""

from __future__ import annotations

import copy
import json
import typing
from pathlib import Path

import pytest
import torch

import eagerloco
from eagerloco.cli import main
from eagerloco.config import LinkConfig, OuterConfig
from eagerloco.metrics import LinkMetrics, OuterMetrics
from eagerloco.train.outputs import format_table
from tests.conftest import Toy, run_inprocess, seeded_grads

FAST = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "2", "--no-progress"]
#: The comparisons' link: 0.03 Gbit/s, 50 ms, with jitter.
SLOW_LINK = LinkConfig(bandwidth_gbps=0.03, latency_ms=50.0, jitter_ms=5.0)


def test_a_worker_alone_spends_no_time_on_the_link() -> None:
    """dp with M = 1 on a slow link: every step's exchange moves 0 bytes, so it takes no latency, no jitter and
    no bandwidth; the clock is the compute alone."""
    _, _, group, _ = run_inprocess(OuterConfig(method="dp"), workers=1, steps=40, grads=seeded_grads(0),
                                   link=SLOW_LINK, step_time=0.1)
    st = group.communicator(0).stats
    assert (st.bytes_sent, st.peak_sync_bytes, st.blocked_s) == (0, 0, 0.0)
    assert group.communicator(0).clock() == pytest.approx(40 * 0.1)
    assert SLOW_LINK.transfer_seconds(0) == 0.0 and SLOW_LINK.transfer_seconds(1) > 0.05


def test_the_single_worker_run_shows_no_blocked_time_and_full_utilization(tmp_path: Path, capsys) -> None:
    """The command of the report (`train --workers 1 --method dp` on 0.03 Gbit/s + 50 ms), on the tiny model."""
    out = tmp_path / "run"
    assert main(["train", *FAST, "--workers", "1", "--method", "dp", "--bandwidth-gbps", "0.03", "--latency-ms",
                 "50", "--sim-step-time", "0.1", "--steps", "8", "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert (s["blocked_s"], s["compute_utilization"], s["bytes_sent_per_worker"]) == (0.0, 1.0, 0)
    row = capsys.readouterr().out.splitlines()[2].split()
    assert row[0] == "dp" and row[6:8] == ["0.00", "1.000"]  # blocked s and CU, after bytes and peak ("0 B")


def _summary(blocked: list[float]) -> dict[str, typing.Any]:
    return {"method": "eager", "final_eval_loss": 4.5, "bytes_sent_per_worker": 1e6, "peak_sync_bytes": 5e5,
            "blocked_s": sum(blocked) / len(blocked), "compute_utilization": 0.9, "tokens_per_s": 100.0, "mfu": None,
            "per_worker": [{"blocked_s": b} for b in blocked]}


def test_the_table_shows_each_workers_blocked_time() -> None:
    """A mean of 2.5 s hides that the fast worker waited 5 s: the table gives each worker's beside it."""
    lines = format_table([_summary([5.0, 0.0])]).splitlines()
    head = [c.strip() for c in lines[0].split("  ") if c.strip()]
    assert head[4:6] == ["blocked s", "blocked s by worker"]
    assert "2.50" in lines[2] and "5.00 / 0.00" in lines[2]
    alone = format_table([_summary([1.0])]).splitlines()[0]
    assert "by worker" not in alone  # one worker: the mean is its own


def _loss(model: Toy, step: int) -> torch.Tensor:
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))
    return model(x).pow(2).mean()


@pytest.mark.parametrize("settings", [{"method": "diloco", "adaptive_steps": True}, {"method": "eager"}],
                         ids=["adaptive", "eager"])
def test_outer_syncs_count_the_outer_exchanges_alone(settings: dict[str, typing.Any],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Five rounds are five outer syncs: adaptive steps' speeds (an exchange every round) and eager's closing
    mean are not counted; the count is an int, as the TypedDict says."""
    for var in ("RANK", "WORLD_SIZE", "EAGERLOCO_OUTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    model = Toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with eagerloco.outer_loop(model, opt, eagerloco.OuterConfig(inner_steps=2, **settings)) as outer:
        for step in range(1, 11):
            opt.zero_grad()
            _loss(model, step).backward()
            opt.step()
    m = outer.metrics()
    assert m["outer_syncs"] == 5 and type(m["outer_syncs"]) is int and type(m["bytes_sent"]) is int


def test_the_hook_api_and_the_trainer_share_the_metric_names(tmp_path: Path) -> None:
    """outer.metrics() has every key of OuterMetrics, which holds LinkMetrics; every metrics.jsonl line has
    LinkMetrics' keys under the same names."""
    shared = set(typing.get_type_hints(LinkMetrics))
    assert shared < set(typing.get_type_hints(OuterMetrics))
    model = copy.deepcopy(Toy())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with eagerloco.outer_loop(model, opt, eagerloco.OuterConfig(inner_steps=1)) as outer:
        pass
    assert set(outer.metrics()) == set(typing.get_type_hints(OuterMetrics))
    out = tmp_path / "run"
    assert main(["train", *FAST, "--steps", "2", "--log-every", "1", "--out", str(out)]) == 0
    line = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert shared <= set(line)
