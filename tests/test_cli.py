"""The `eagerloco` command end to end: real data, real files, clear errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from eagerloco.cli import main

FAST = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "2", "--no-progress"]

#: Fields every summary.json has (docs/reference/metrics.md documents them with every other key).
SUMMARY_KEYS = (
    "method", "workers", "inner_steps", "fragments", "overlap_steps", "alpha", "eager_rounds", "codec",
    "steps", "tokens", "final_eval_loss", "bytes_sent_per_worker", "peak_sync_bytes", "compute_s",
    "blocked_s", "wall_s", "compute_utilization", "tokens_per_s", "inner_tokens_per_s", "flops_per_token",
    "peak_tflops", "mfu", "inner_mfu", "device", "precision",
)


def _run(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "run"
    assert main(["train", *FAST, "--out", str(out), *args]) == 0
    summary = json.loads((out / "summary.json").read_text())
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary["_metrics"] = lines
    return summary


def test_train_on_brown_writes_metrics_and_summary(tmp_path: Path, capsys) -> None:
    s = _run(tmp_path, "--method", "streaming", "--workers", "2", "--inner-steps", "4", "--fragments", "2",
             "--overlap-steps", "1", "--alpha", "0.5", "--codec", "e2m1", "--steps", "8", "--log-every", "2",
             "--bandwidth-gbps", "0.001", "--latency-ms", "10", "--sim-step-time", "0.05")
    for key in SUMMARY_KEYS:
        assert key in s, key
    assert s["method"] == "streaming" and s["fragments"] == 2 and s["codec"] == "e2m1"
    assert s["steps"] == 8 and s["tokens"] == 8 * 2 * 2 * 32
    assert math.isfinite(s["final_eval_loss"]) and s["final_eval_loss"] < math.log(256) + 0.5
    assert s["syncs_per_worker"] == 4  # two fragments, each once per 4 steps, over 8 steps
    assert s["bytes_sent_per_worker"] > 0 and s["peak_sync_bytes"] > 0
    assert s["compute_s"] == pytest.approx(8 * 0.05)
    assert 0 < s["compute_utilization"] <= 1
    assert [m["step"] for m in s["_metrics"]] == [2, 4, 6, 8]
    assert "streaming" in capsys.readouterr().out  # the table


def test_config_file_and_flag_override(tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text('steps = 3\nworkers = 3\n[outer]\nmethod = "eager"\ninner_steps = 2\n[link]\nlatency_ms = 5\n')
    s = _run(tmp_path, "--config", str(cfg), "--steps", "4")
    assert s["method"] == "eager" and s["workers"] == 3 and s["inner_steps"] == 2
    assert s["steps"] == 4  # the flag wins over the file
    assert s["latency_ms"] == 5


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--inner-steps", "0"], "--inner-steps"),
        (["--method", "streaming", "--inner-steps", "10", "--fragments", "2", "--overlap-steps", "5"],
         "--overlap-steps"),
        (["--alpha", "2"], "--alpha"),
        (["--method", "streaming", "--fragments", "5", "--inner-steps", "10"], "--fragments"),
        (["--eager-rounds", "0"], "--eager-rounds"),
        (["--bandwidth-gbps", "-1"], "--bandwidth-gbps"),
        (["--model", "huge"], "--model"),
        (["--data", "/nonexistent/corpus.txt"], "/nonexistent/corpus.txt"),
        (["--steps", "0"], "--steps"),
        (["--tokenizer", "wordpiece"], "--tokenizer"),
        (["--eval-tasks", "mmlu"], "--eval-tasks"),
        (["--tokens", "0"], "--tokens"),
    ],
)
def test_bad_input_fails_before_training_with_the_flag_named(tmp_path: Path, capsys, args, needle) -> None:
    out = tmp_path / "bad"
    assert main(["train", *FAST, "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert not (out / "metrics.jsonl").exists()  # nothing trained


@pytest.mark.parametrize("argv", [["train", "--method", "ring"], ["train", "--codec", "fp7"]])
def test_unknown_choices_are_refused_by_the_parser(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_config_file_errors(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[outer]\nmethod = 'eager'\nwarp = 9\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "warp" in capsys.readouterr().err
    assert main(["train", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "no such file" in capsys.readouterr().err
    broken = tmp_path / "broken.toml"
    broken.write_text("steps = = 3\n")
    assert main(["train", "--config", str(broken)]) == 2
    assert "not valid TOML" in capsys.readouterr().err


def test_tensorboard_events_hold_the_logged_metrics(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    s = _run(tmp_path, "--steps", "4", "--inner-steps", "2", "--log-every", "2", "--tensorboard")
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    losses = acc.Scalars("loss")
    assert [e.step for e in losses] == [2, 4]
    assert losses[-1].value == pytest.approx(s["_metrics"][-1]["loss"], rel=1e-6)


@pytest.mark.slow
def test_bpe_tokenizer_and_zero_shot_evals(tmp_path: Path) -> None:
    s = _run(tmp_path, "--steps", "2", "--inner-steps", "2", "--tokenizer", "bpe:512", "--eval-tasks", "piqa",
             "--eval-limit", "8")
    assert 0.0 <= s["piqa"] <= 1.0
    assert s["config"]["tokenizer"] == "bpe:512"
    assert s["num_params"] > 820_352  # a 512-token embedding table instead of 256


def test_only_a_launched_train_ends_without_the_interpreters_teardown(monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m eagerloco`` skips the teardown (os._exit) for a rank of a launched run training, only."""
    from eagerloco.cli import is_launched_training

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert not is_launched_training(["train", "--steps", "2"])  # alone: the normal teardown
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert is_launched_training(["train", "--steps", "2"])
    assert not is_launched_training(["simulate", "--model", "1b"]) and not is_launched_training([])
