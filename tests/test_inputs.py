"""Bad input gets one clear line and loses nothing: typed config files, bounds, guarded run directories."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from eagerloco.cli import main
from eagerloco.config.schema import train_config_from_tables
from eagerloco.train.rundir import LOCK_NAME

FAST = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--no-progress",
        "--log-every", "1"]


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(("eagerloco: error: ", "eagerloco simulate: error: ")) and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(
    ("toml", "needles"),
    [
        ("outer = 3\n", ["[outer] must be a table", "outer = 3"]),
        ("link = [1, 2]\n", ["[link] must be a table"]),
        ('[link]\nbandwidth_gbps = "fast"\n', ["bandwidth_gbps = 'fast'", "[link] of --config", "expected a number"]),
        ('sim_step_time = "x"\n', ["sim_step_time = 'x'", "expected a number"]),
        ("tokenizer = 5\n", ["tokenizer = 5", "expected a string"]),
        ("eval_tasks = 1\n", ["eval_tasks = 1", "expected a string"]),
        ("data = 3\n", ["data = 3", "expected a string"]),
        ('[outer]\nouter_nesterov = "no"\n', ["outer_nesterov = 'no'", "expected true or false"]),
        ('iid = "false"\n', ["iid = 'false'", "expected true or false"]),
        ('resume = "no"\n', ["resume = 'no'", "expected true or false"]),
        ("workers = 2.5\n", ["workers = 2.5", "expected an integer"]),
        ('slow_workers = [1]\n', ["slow_workers = [1]", "expected a list of strings"]),
        ("non_iid = false\n", ["unknown setting(s) non_iid", "known:"]),
    ],
)
def test_config_values_of_the_wrong_type_are_named(tmp_path: Path, capsys, toml: str, needles: list[str]) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(toml)
    err = _error(capsys, ["train", *FAST, "--config", str(cfg), "--out", str(tmp_path / "run")])
    for needle in needles:
        assert needle in err
    assert str(cfg) in err
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_binary_config_file_is_named(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_bytes(bytes(range(256)))
    assert "not a text file" in _error(capsys, ["train", "--config", str(cfg)])


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--tokenizer", "bpe:10"], "the vocabulary must be an integer >= 256"),
        (["--seed", str(2**70)], "--seed must be at most 2**63 - 1"),
        (["--tokens", "1000", "--steps", "3"], "either steps or tokens"),
        (["--resume", "--overwrite"], "pass one of them"),
        (["--out", ""], "--out must name a directory"),
    ],
)
def test_values_that_can_only_be_mistakes(tmp_path: Path, capsys, argv: list[str], needle: str) -> None:
    args = ["train", *FAST, *argv] if "--out" in argv else ["train", *FAST, "--out", str(tmp_path / "r"), *argv]
    assert needle in _error(capsys, args)


def test_out_naming_a_file_or_a_path_under_one(tmp_path: Path, capsys) -> None:
    f = tmp_path / "file"
    f.write_text("keep me")
    assert "is a file, not a directory" in _error(capsys, ["train", *FAST, "--out", str(f)])
    assert f"is under {f}, which is a file" in _error(capsys, ["train", *FAST, "--out", str(f / "run")])
    assert f.read_text() == "keep me"


@pytest.mark.root
@pytest.mark.processes
def test_out_in_a_read_only_directory(tmp_path: Path, capsys) -> None:
    """A read-only mount (root writes through a chmod, not through a read-only file system)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(ro)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here (needs root): {r.stderr.decode().strip()}")
    try:
        assert "is not a writable directory" in _error(capsys, ["train", *FAST, "--out", str(ro / "run")])
    finally:
        subprocess.run(["umount", "-l", str(ro)], capture_output=True)


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_a_new_run_never_mixes_with_an_earlier_one(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    base = ["train", *FAST, "--out", str(out), "--checkpoint-every", "2", "--method", "diloco", "--inner-steps", "2"]
    assert main([*base, "--steps", "4"]) == 0
    before = _files(out)
    capsys.readouterr()
    err = _error(capsys, [*base, "--steps", "6", "--seed", "1"])
    assert "holds an earlier run" in err and "step_00000002 .. step_00000004" in err
    assert "--resume" in err and "--overwrite" in err
    assert _files(out) == before  # nothing touched
    # --overwrite starts afresh: no checkpoint or metrics line of the old run survives
    assert main([*base, "--steps", "2", "--seed", "1", "--overwrite"]) == 0
    steps = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert steps == ["step_00000002"]
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    assert json.loads((out / "summary.json").read_text())["config"]["seed"] == 1
    assert not (out / LOCK_NAME).exists()


@pytest.mark.processes
def test_a_live_lock_keeps_a_second_run_out(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / LOCK_NAME).write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname()}))
        err = _error(capsys, ["train", *FAST, "--out", str(out), "--steps", "1"])
        assert f"in use by another run (process {holder.pid}" in err
        assert not (out / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone: its lock is stale and taken over with a message
    assert main(["train", *FAST, "--out", str(out), "--steps", "1"]) == 0
    assert f"taking over {out / LOCK_NAME} from process {holder.pid}" in capsys.readouterr().err
    assert not (out / LOCK_NAME).exists()


def _checkpointed_argv(out: Path) -> list[str]:
    return ["train", *FAST, "--out", str(out), "--method", "diloco", "--inner-steps", "2", "--steps", "6",
            "--checkpoint-every", "2", "--keep-checkpoints", "3"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One finished run with checkpoints at steps 2, 4 and 6, trained once for the tests that damage a copy."""
    out = tmp_path_factory.mktemp("trained") / "run"
    assert main(_checkpointed_argv(out)) == 0
    return out


def _checkpointed_run(tmp_path: Path, trained: Path) -> tuple[Path, list[str]]:
    """A copy of the trained run in this test's directory, and the command that made it (there)."""
    out = tmp_path / "run"
    shutil.copytree(trained, out, symlinks=True)
    return out, _checkpointed_argv(out)


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (lambda m: "not json {", "unreadable or corrupt"),
        (lambda m: json.dumps({**json.loads(m), "files": [{"file": "worker_0.pt"}]}), "size None is not a byte count"),
        (lambda m: json.dumps({**json.loads(m), "files": "x"}), "'files' must be a non-empty list"),
        (lambda m: json.dumps({**json.loads(m), "step": "six"}), "step 'six' is not a step number"),
        (lambda m: json.dumps({k: v for k, v in json.loads(m).items() if k != "config"}), "records no 'config' table"),
    ],
)
def test_resume_skips_a_damaged_meta_for_the_previous_good_checkpoint(tmp_path: Path, trained: Path, capsys, damage,
                                                                     needle) -> None:
    out, argv = _checkpointed_run(tmp_path, trained)
    clean = json.loads((out / "summary.json").read_text())
    meta = out / "checkpoints" / "step_00000006" / "meta.json"
    meta.write_text(damage(meta.read_text()))
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    captured = capsys.readouterr()
    assert "skipping checkpoint step_00000006" in captured.err and needle in captured.err
    assert "resuming from" in captured.out and "step_00000004" in captured.out
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["final_eval_loss"] == clean["final_eval_loss"]


def test_a_torn_metrics_line_is_dropped_with_a_message(tmp_path: Path, trained: Path, capsys) -> None:
    out, argv = _checkpointed_run(tmp_path, trained)
    metrics = out / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(lines[:4]) + "\n" + lines[4][:7])  # a writer killed mid-line at step 5
    shutil.rmtree(out / "checkpoints" / "step_00000006")  # ... before its step-6 checkpoint
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    assert "dropped 1 unreadable line(s)" in capsys.readouterr().err
    assert [json.loads(ln)["step"] for ln in metrics.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]


def test_a_checkpoint_resumes_only_in_the_runtime_that_wrote_it(tmp_path: Path, trained: Path, capsys) -> None:
    from eagerloco.config import ConfigError
    from eagerloco.flags import build_train_config

    out, argv = _checkpointed_run(tmp_path, trained)
    from eagerloco.cli import make_parser
    from eagerloco.train.resume import resume_checkpoint

    cfg = build_train_config(make_parser().parse_args([*argv, "--resume"]))
    with pytest.raises(ConfigError, match=r"written by a run in one process .* resume it the same way"):
        resume_checkpoint(cfg, "distributed")
    meta = out / "checkpoints" / "step_00000006" / "meta.json"
    m = json.loads(meta.read_text())
    m["runtime"] = "distributed"
    del m["group"]
    for step in ("step_00000002", "step_00000004", "step_00000006"):
        (out / "checkpoints" / step / "meta.json").write_text(json.dumps(m))
    err = _error(capsys, [*argv, "--resume"])
    assert "written by a run on several processes" in err and "eagerloco launch" in err


def test_progress_lines_when_stdout_is_not_a_terminal(tmp_path: Path, capsys, monkeypatch) -> None:
    from eagerloco.train import outputs

    monkeypatch.setattr(outputs, "PROGRESS_EVERY_S", 0.0)
    argv = ["train", "--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1",
            "--out", str(tmp_path / "run"), "--steps", "3", "--method", "eager", "--inner-steps", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    progress = [ln for ln in out.splitlines() if ln.startswith("eager: step ")]
    assert [ln.split()[2] for ln in progress] == ["1/3", "2/3", "3/3"]
    assert all("loss " in ln and "sent " in ln and "steps/s" in ln for ln in progress)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--bandwidth-gbps", "1e-300"], "below 1e-06 Gbit/s"),
        (["--eager-rounds", "1000000000"], "--eager-rounds must be at most 64"),
    ],
)
def test_bounds_with_their_reason(tmp_path: Path, capsys, argv: list[str], needle: str) -> None:
    assert needle in _error(capsys, ["train", *FAST, "--out", str(tmp_path / "r"), "--method", "eager", *argv])


def test_simulate_refuses_what_would_never_finish_or_write_where_asked(tmp_path: Path, capsys) -> None:
    assert "--inner-steps must be at most 100,000" in _error(capsys, ["simulate", "--inner-steps", "1000000000"])
    assert "--eager-rounds values must be at most 64" in _error(capsys, ["simulate", "--eager-rounds", "1000000"])
    missing = tmp_path / "no" / "such" / "dir" / "x.json"
    assert "does not exist" in _error(capsys, ["simulate", "--model", "1b", "--json", str(missing)])
    assert not (tmp_path / "no").exists()


def test_a_link_slower_than_the_timeout_is_refused_on_processes(tmp_path: Path) -> None:
    from eagerloco.comm.link import check_exchange_fits
    from eagerloco.config import ConfigError, LinkConfig, TrainConfig

    cfg = TrainConfig(workers=3)
    with pytest.raises(ConfigError, match=r"takes 1.6e\+03 s on a 1e-05 Gbit/s link, longer than --dist-timeout 300"):
        check_exchange_fits(LinkConfig(bandwidth_gbps=1e-5), cfg.outer, cfg.workers, num_params=250_000,
                            timeout_s=300.0)
    check_exchange_fits(LinkConfig(bandwidth_gbps=1e-3), cfg.outer, cfg.workers, num_params=250_000, timeout_s=300.0)


def test_a_run_shorter_than_one_round_says_the_outer_parameters_stay_the_initial_ones(tmp_path: Path,
                                                                                      capsys) -> None:
    assert main(["train", *FAST, "--workers", "1", "--steps", "3", "--inner-steps", "4", "--out",
                 str(tmp_path / "short")]) == 0
    out = capsys.readouterr().out
    assert "eagerloco: warning: 3 inner step(s) is less than one round (--inner-steps 4)" in out


def test_a_number_of_grace_seconds_in_a_config_file_reads_as_the_flag_does(tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text("[outer]\ngrace = 30\n")
    outer = train_config_from_tables(tomllib.loads(cfg.read_text()), str(cfg)).outer
    assert outer.grace == "30" and outer.grace_seconds() == 30.0  # the same settings digest as --grace 30
