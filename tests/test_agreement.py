"""Workers agree before the first step: settings compared through the run's store, one line per difference."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from jobs import popen
from test_hooks_jobs import coordinators, job_env, wait_all

from eagerloco.comm.errors import PeerError
from eagerloco.comm.rendezvous import check_agreement, parameter_digest, publish_and_gather, shapes_digest
from eagerloco.config import ConfigError, TrainConfig
from eagerloco.train.agree import LOCAL_SETTINGS, agreed_settings

ROOT = Path(__file__).resolve().parents[1]


def _name(w: int) -> str:
    return f"worker {w}"


def _meet(settings: list[dict], timeout_s: float = 10.0) -> list[object]:
    """Every worker's result of publish_and_gather, one thread each, over one store."""
    store = dist.HashStore()
    out: list[object] = [None] * len(settings)

    def run(w: int) -> None:
        try:
            out[w] = publish_and_gather(store, w, list(range(len(settings))), settings[w], timeout_s, _name)
        except Exception as e:
            out[w] = e

    threads = [threading.Thread(target=run, args=(w,)) for w in range(len(settings))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_every_worker_gets_every_workers_settings_and_a_difference_names_each_value() -> None:
    a = {"--seed": 0, "--outer-lr": 0.7, "--steps": 8}
    b = {"--seed": 1, "--outer-lr": 0.4, "--steps": 8}
    got = _meet([a, a, b])
    assert got[0] == got[1] == got[2] == {0: a, 1: a, 2: b}
    with pytest.raises(ConfigError) as e:
        check_agreement(got[0], _name, "Start them alike.")  # type: ignore[arg-type]
    msg = str(e.value)
    assert msg == ("the workers disagree on settings that must match: --outer-lr (worker 0: 0.7, worker 1: 0.7, "
                   "worker 2: 0.4); --seed (worker 0: 0, worker 1: 0, worker 2: 1). Start them alike.")
    assert "\n" not in msg
    check_agreement({0: a, 1: dict(a)}, _name, "")  # equal: nothing to say


def test_a_worker_that_never_arrives_is_named_within_the_timeout_and_the_wait_says_so(
        capsys: pytest.CaptureFixture[str]) -> None:
    store = dist.HashStore()
    with pytest.raises(PeerError) as e:
        publish_and_gather(store, 0, [0, 1, 2], {"x": 1}, 0.6, _name, "10.0.0.1:29600", report_every_s=0.2)
    assert "worker 0: worker 1, worker 2 did not arrive within 0.6 s at 10.0.0.1:29600" in str(e.value)
    assert e.value.workers == [1, 2]
    lines = capsys.readouterr().err.splitlines()
    assert lines and all("worker 0: waiting for worker 1, worker 2 at 10.0.0.1:29600 (" in ln for ln in lines)


def test_the_digests_tell_models_and_weights_apart() -> None:
    torch.manual_seed(0)
    a = torch.nn.Linear(3, 2)
    b = torch.nn.Linear(3, 2)
    assert shapes_digest(a.named_parameters()) == shapes_digest(b.named_parameters())
    assert shapes_digest(a.named_parameters()).startswith("2 tensors, 8 values (")
    assert shapes_digest(a.named_parameters()) != shapes_digest(torch.nn.Linear(3, 3).named_parameters())
    assert parameter_digest(a.parameters()) != parameter_digest(b.parameters())
    b.load_state_dict(a.state_dict())
    assert parameter_digest(a.parameters()) == parameter_digest(b.parameters())


def test_the_agreed_settings_are_every_setting_but_the_local_ones() -> None:
    s = agreed_settings(TrainConfig())
    assert {"--seed", "--steps", "--outer-lr", "--inner-steps", "--method", "--codec", "--bandwidth-gbps",
            "--elastic", "--resume", "--checkpoint-every", "--eval-every"} <= set(s)
    assert not {f"--{k.replace('_', '-')}" for k in LOCAL_SETTINGS} & set(s)


def _jobs(tmp_path: Path, args: list[list[str]], port: int) -> list[subprocess.CompletedProcess]:
    base = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--no-progress",
            "--log-every", "2", "--dist-timeout", "60", "--method", "diloco", "--inner-steps", "2"]
    procs = [popen([sys.executable, "-m", "eagerloco", "train", *base, *extra, "--outer-addr", f"127.0.0.1:{port}",
                    "--worker-id", str(w), "--workers", "2", "--out", str(tmp_path / f"w{w}")],
                   env=job_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for w, extra in enumerate(args)]
    return wait_all(procs, 240)


@pytest.mark.processes
def test_jobs_started_with_different_settings_both_stop_with_one_line_naming_them(tmp_path: Path) -> None:
    done = _jobs(tmp_path, [["--steps", "4", "--seed", "0"], ["--steps", "6", "--seed", "1", "--outer-lr", "0.4"]],
                 coordinators(1)[0])
    for w, d in enumerate(done):
        assert d.returncode == 2, f"worker {w}:\n{d.stdout[-3000:]}"
        last = d.stdout.strip().splitlines()[-1]
        assert last.startswith("eagerloco: error: the workers disagree on settings that must match: "), last
        for part in ("--outer-lr (worker 0: 0.7, worker 1: 0.4)", "--seed (worker 0: 0, worker 1: 1)",
                     "--steps (worker 0: 4, worker 1: 6)"):
            assert part in last, last
        assert "Traceback" not in d.stdout
        assert not (tmp_path / f"w{w}" / "metrics.jsonl").exists()  # nothing trained


@pytest.mark.processes
def test_jobs_resumed_from_different_steps_resume_from_the_newest_they_all_have(tmp_path: Path) -> None:
    first = _jobs(tmp_path, [["--steps", "6", "--checkpoint-every", "2", "--keep-checkpoints", "3"]] * 2,
                  coordinators(1)[0])
    assert [d.returncode for d in first] == [0, 0], first[0].stdout[-3000:] + first[1].stdout[-3000:]
    uninterrupted = torch.load(tmp_path / "w0" / "checkpoints" / "step_00000006" / "worker_0.pt", weights_only=False)
    shutil.rmtree(tmp_path / "w1" / "checkpoints" / "step_00000006")  # worker 1 lost its newest checkpoint
    again = _jobs(tmp_path, [["--steps", "6", "--checkpoint-every", "2", "--keep-checkpoints", "3", "--resume"]] * 2,
                  coordinators(1)[0])
    assert [d.returncode for d in again] == [0, 0], again[0].stdout[-3000:] + again[1].stdout[-3000:]
    assert "worker 0: resuming from step 4, the newest checkpoint every worker has (this one also has 6)" \
        in again[0].stdout
    for w in range(2):
        assert f"resuming from {tmp_path / f'w{w}' / 'checkpoints' / 'step_00000004'}" in again[w].stdout
        final = torch.load(tmp_path / f"w{w}" / "checkpoints" / "step_00000006" / f"worker_{w}.pt", weights_only=False)
        assert final["sync"]["step"] == 6
        if w == 0:  # steps 5 and 6 again, from step 4: the very numbers of the run that was never stopped
            assert all(torch.equal(a, b) for a, b in zip(final["sync"]["outer"][0], uninterrupted["sync"]["outer"][0],
                                                         strict=True))
