"""bench/quorum/run.py's goodput accounting from a run's records, and the slowed-site fault it drives."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from eagerloco.config import ConfigError
from testing import faults

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "quorum" / "run.py"
spec = importlib.util.spec_from_file_location("quorum_bench", SCRIPT)
assert spec and spec.loader
bench = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclass looks itself up
spec.loader.exec_module(bench)


def test_goodput_counts_merged_compute_over_the_time_the_schedule_left_the_workers() -> None:
    step_s, h = bench.STEP_S, bench.H
    run = {
        "events": [{"kind": "stall", "worker": 2, "t": 10.0}, {"kind": "stall ends", "worker": 2, "t": 40.0},
                   {"kind": "kill", "worker": 3, "t": 42.0},
                   {"kind": "slow", "worker": 1, "t": 20.0, "extra_s": 2 * step_s},
                   {"kind": "slow ends", "worker": 1, "t": 40.0}],
        "records": {
            "0": [[0.0, {"step": 2, "compute_s": 0.6}], [100.0, {"step": 336, "compute_s": 90.0}]],
            "1": [[0.0, {"step": 2, "compute_s": 0.6}], [20.0, {"step": 60, "compute_s": 18.0}],  # at a third
                  [40.0, {"step": 80, "compute_s": 24.0}], [99.0, {"step": 336, "compute_s": 90.0}]],  # of the speed
            "2": [[0.0, {"step": 2, "compute_s": 0.6}], [100.0, {"step": 336, "compute_s": 120.0}]],  # 30 s stopped
            # killed at step 130 (2 steps into a window), back at 50 s, counting its compute from 0 again
            "3": [[0.0, {"step": 2, "compute_s": 0.6}], [41.0, {"step": 130, "compute_s": 39.0}],
                  [50.0, {"step": 140, "compute_s": 0.6}], [100.0, {"step": 336, "compute_s": 45.0}]],
        },
        "summaries": {str(w): {"per_worker": [{"late_dropped": int(w == 0), "late_merged": 2, "quorum_missed": 3}]}
                      for w in range(3)},
        "drop_lines": {"0": ["eagerloco: quorum: dropped worker 0's window of fragment 0 launched at step 24 (3 steps, "
                             "outer gradient norm 1.2): it missed 1 exchange(s) of its fragment"],
                       "1": ["eagerloco: quorum: worker 1's window of fragment 0 launched at step 328 missed its "
                             "exchange, and the run ended before a later one merged it: dropped"], "2": [], "3": []},
    }
    g = bench.goodput(run)
    slowed = (24 - 18) / step_s * 2 * step_s  # the slowed site's steps took three step times
    # less the killed job's 2 steps since its last exchange, and the dropped windows' 3 and (unnamed) H steps
    useful = 90 + 90 + slowed + (120 - 30) + 39 + 45 - (130 % h + 3 + h) * step_s
    available = 4 * 100 - 30 - (50 - 42)
    assert g["useful_s"] == pytest.approx(useful, abs=0.05)
    assert g["available_s"] == pytest.approx(available)
    assert g["goodput"] == pytest.approx(useful / available, abs=5e-4)
    assert g["goodput_wall"] == pytest.approx(useful / 400, abs=5e-4)
    counts = (g["lost_steps"], g["late_dropped"], g["dropped_steps"], g["late_merged"], g["quorum_missed"],
              g["drop_lines"])
    assert counts == (2, 1, 3 + h, 6, 9, 2)


def test_a_slowed_site_sleeps_while_its_file_is_there(tmp_path: Path) -> None:
    f = tmp_path / "slow"
    env = faults.environment({}, slow=f)
    assert faults.slow_after(8, env) == 0.0  # no file: full speed
    f.write_text("0.6")
    assert faults.slow_after(7, env) == 0.6
    f.write_text("1.8:8")  # once a round: a slow uplink
    assert (faults.slow_after(8, env), faults.slow_after(9, env)) == (1.8, 0.0)
    f.write_text("fast")
    with pytest.raises(ConfigError, match="EXTRA_S"):
        faults.slow_after(8, env)
