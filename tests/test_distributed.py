"""Multi-process tests of the torch.distributed transport and the local launcher: what needs real
processes (a dead or hung peer, WORLD and its groups under torchrun, the launcher's exits and signals).

Real processes talk gloo over 127.0.0.1 (no mocks): each scenario in dist_worker.py runs once per
module (fixtures), writes what it measured, and the tests assert on those numbers. Every spawn is
guarded by a timeout so that a hang fails the test instead of stalling the suite. The transport's
exact results, byte accounting and emulated link are checked on threads in test_transport.py.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from eagerloco.codecs import get_codec
from eagerloco.comm.base import flatten
from eagerloco.launch import launch
from eagerloco.procs import pid_alive, pid_stopped

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("dist_worker.py")
_spec = importlib.util.spec_from_file_location("dist_worker", WORKER)
assert _spec is not None and _spec.loader is not None
dist_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dist_worker)

SPAWN_TIMEOUT_S = 60.0
PEER_TIMEOUT_S = 4.0  # collective timeout in the dead/hung peer scenarios

pytestmark = pytest.mark.processes


def _pythonpath() -> str:
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def _logs(logdir: Path, scenario: str) -> str:
    files = sorted(logdir.glob(f"log_{scenario}_*.txt"))
    return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in files)


def _read(outdir: Path, scenario: str, rank: int) -> dict:
    f = outdir / f"{scenario}_{rank}.json"
    assert f.exists(), f"rank {rank} wrote no result:\n{_logs(outdir, scenario)}"
    return json.loads(f.read_text())


# --------------------------------------------------------------------------------------------------
# A dead or hung peer never hangs the run


@pytest.fixture(scope="module", params=["dead", "hang"])
def peer(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, int, str, list]:
    """Worker 2 dies (exit 7) or hangs (alive, never joins; exits 3 later) under launch()."""
    mode = request.param
    out = tmp_path_factory.mktemp(mode)
    mp = pytest.MonkeyPatch()
    mp.setenv("PYTHONPATH", _pythonpath())
    mp.setenv("TEST_DIST_TIMEOUT", str(PEER_TIMEOUT_S))
    try:
        rc, logs = _launch_guarded([mode, str(out)], 3, timeout_s=20, command=[sys.executable, str(WORKER)])
    finally:
        mp.undo()
    results = []
    for r in (0, 1):
        f = out / f"{mode}_{r}.json"
        assert f.exists(), f"rank {r} wrote no result:\n{logs}"
        results.append(json.loads(f.read_text()))
    return mode, rc, logs, results


def test_peer_failure_raises_peer_error_naming_the_worker(peer: tuple[str, int, str, list]) -> None:
    mode, rc, logs, results = peer
    assert rc == (7 if mode == "dead" else 3), logs
    assert "stopping the processes" not in logs, logs  # the survivors ended on their own
    for r in results:
        msg = r["error"]
        assert msg is not None, r
        assert r["workers"] == [2], r
        assert "worker 2" in msg and "resume from the last checkpoint" in msg, msg
        if mode == "dead":
            assert "gone" in msg and r["elapsed_s"] < PEER_TIMEOUT_S, r  # no need to wait for the timeout
        else:
            assert "has not reached exchange #2" in msg, msg
            assert PEER_TIMEOUT_S - 0.5 <= r["elapsed_s"] < PEER_TIMEOUT_S + 10, r
        assert r["blocked_s"] >= 0.9 * r["elapsed_s"] - 0.1, r
        assert r["later"] == msg and r["later_s"] < 0.5, r


# --------------------------------------------------------------------------------------------------
# Process groups and the launcher


def _launch_guarded(*args, **kwargs) -> tuple[int, str]:
    """launch() in a thread with a deadline, output captured."""
    buf = io.StringIO()
    box: dict[str, int] = {}
    t = threading.Thread(target=lambda: box.setdefault("rc", launch(*args, out=buf, **kwargs)), daemon=True)
    t.start()
    t.join(SPAWN_TIMEOUT_S)
    assert not t.is_alive(), "launch() did not return in time:\n" + buf.getvalue()
    return box["rc"], buf.getvalue()


def _check_groups(outdir: Path) -> None:
    expected_inner = {0: 0 + 1, 1: 2 + 3}
    for rank in range(4):
        r = _read(outdir, "groups", rank)
        assert (r["worker"], r["rank_in_worker"]) == divmod(rank, 2), r
        assert r["inner_size"] == 2 and r["inner_sum"] == expected_inner[r["worker"]], r
        assert r["outer"] == (rank % 2 == 0), r
        if r["outer"]:
            assert r["outer_sum"] == 0 + 2, r
        else:
            assert "outer_sum" not in r, r
        assert "WORLD_SIZE is 4" in r["mismatch"], r
    # Every rank, first of its worker or not, gets the workers' mean through communicator_for.
    expected, payloads = dist_worker.expected_mean("int8", 1, 2)
    codec = get_codec("int8")
    for rank in range(4):
        got = torch.load(outdir / f"groups_{rank}.pt", weights_only=True)
        assert torch.equal(flatten(got["mean"]), expected), f"rank {rank}"
        own = codec.unpack(payloads[rank // 2], expected.numel())
        assert torch.equal(flatten(got["own"]), own), f"rank {rank}"


def test_torchrun_standalone_works_with_init_process_groups(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=_pythonpath(), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(WORKER), "groups", str(tmp_path), "2", "2"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=SPAWN_TIMEOUT_S)
    assert p.returncode == 0, p.stdout + p.stderr
    _check_groups(tmp_path)


_ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_USE_AGENT_STORE", "EAGERLOCO_WORKERS", "EAGERLOCO_RANKS_PER_WORKER")
_EXIT_SCRIPT = (
    "import os, sys; r = int(os.environ['RANK']); "
    f"print('env', *(os.environ.get(k) for k in {_ENV_KEYS!r})); "
    "sys.exit(int(sys.argv[1]) if r == 1 else 0)"
)


def test_launch_sets_torchrun_env_and_returns_the_exit_code() -> None:
    rc, logs = _launch_guarded(["0"], 2, 2, command=[sys.executable, "-c", _EXIT_SCRIPT])
    assert rc == 0, logs
    ports = set()
    for rank in range(4):
        line = next(ln for ln in logs.splitlines() if ln.startswith(f"[rank {rank}] env "))
        values = line.split()[3:]
        env = dict(zip(_ENV_KEYS, values, strict=True))
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank), line
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("4", "4"), line
        assert (env["EAGERLOCO_WORKERS"], env["EAGERLOCO_RANKS_PER_WORKER"]) == ("2", "2"), line
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["TORCHELASTIC_USE_AGENT_STORE"] == "True", line
        ports.add(env["MASTER_PORT"])
    assert len(ports) == 1 and int(ports.pop()) > 0
    rc, logs = _launch_guarded(["3"], 2, command=[sys.executable, "-c", _EXIT_SCRIPT])
    assert rc == 3, logs


def test_launch_stops_the_others_after_the_grace_period() -> None:
    script = (
        "import os, sys, time; r = int(os.environ['RANK']); print('up', r, flush=True); "
        "time.sleep(0.3); sys.exit(5) if r == 1 else time.sleep(60)"
    )
    t0 = time.monotonic()
    rc, logs = _launch_guarded([], 2, timeout_s=0.5, command=[sys.executable, "-c", script])
    assert rc == 5, logs
    assert time.monotonic() - t0 < 15, logs  # rank 0 (sleeping 60 s) was terminated
    assert "rank 1 exited with code 5" in logs, logs


def test_launch_kills_a_frozen_rank_at_once_instead_of_waiting_out_the_grace_period() -> None:
    """Rank 1 fails; rank 0 has stopped itself (SIGSTOP: it cannot finish or handle SIGTERM). With a
    grace period of 60 s, the launcher still ends within seconds, saying which rank it killed."""
    script = (
        "import os, signal, sys, time; r = int(os.environ['RANK']); print('up', r, flush=True); "
        "os.kill(os.getpid(), signal.SIGSTOP) if r == 0 else (time.sleep(0.5), sys.exit(5))"
    )
    t0 = time.monotonic()
    rc, logs = _launch_guarded([], 2, timeout_s=60, command=[sys.executable, "-c", script])
    assert rc == 5, logs
    assert time.monotonic() - t0 < 30, logs
    assert "rank(s) 0 are stopped by a signal and cannot finish: killing them now" in logs, logs


def test_pid_stopped_reads_the_process_state() -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not pid_stopped(p.pid)
        os.kill(p.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not pid_stopped(p.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pid_stopped(p.pid)
    finally:
        p.kill()
        p.wait()
    assert not pid_stopped(p.pid)  # gone


def test_a_zombie_is_not_alive() -> None:
    """A process dead but not yet reaped (its parent killed, say) holds no run lock: pid_alive says so."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{p.pid}/stat").read_text().split(") ")[1][0] != "Z" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not pid_alive(p.pid)
    finally:
        p.wait()
    assert not pid_alive(p.pid)  # reaped
    assert pid_alive(os.getpid())


def test_launch_forwards_ctrl_c() -> None:
    script = (
        "import os, time; print('ready', flush=True)\n"
        "try:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n"
        "    print('got ctrl-c', os.environ['RANK'], flush=True); raise SystemExit(0)"
    )
    code = ("import sys; from eagerloco.launch import launch; "
            f"sys.exit(launch([], 2, command=[sys.executable, '-c', {script!r}]))")
    p = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=_pythonpath()),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(p.stdout.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while sum("ready" in ln for ln in lines) < 2 and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    try:
        rc = p.wait(timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
    reader.join(5)
    text = "".join(lines)
    assert rc == 130, text
    assert "[rank 0] got ctrl-c 0" in text and "[rank 1] got ctrl-c 1" in text, text
