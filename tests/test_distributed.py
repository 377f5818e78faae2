"""Multi-process tests of the torch.distributed transport and the local launcher.

Real processes talk gloo over 127.0.0.1 (no mocks): each scenario in dist_worker.py runs once per
module (fixtures), writes what it measured, and the tests assert on those numbers. Every spawn is
guarded by a timeout so that a hang fails the test instead of stalling the suite.
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
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from eagerloco.codecs import get_codec
from eagerloco.comm.base import flatten, mean_of_payloads, wire_bytes
from eagerloco.launch import launch
from eagerloco.procs import pid_stopped

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("dist_worker.py")
_spec = importlib.util.spec_from_file_location("dist_worker", WORKER)
assert _spec is not None and _spec.loader is not None
dist_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dist_worker)

SPAWN_TIMEOUT_S = 60.0
PEER_TIMEOUT_S = 4.0  # collective timeout in the dead/hung peer scenarios
L = dist_worker.LATENCY_S


def _pythonpath() -> str:
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def _spawn(args: list[str], nproc: int, logdir: Path) -> list[int | None]:
    """Run nproc workers with torchrun's environment, independently of launch(); return their exit codes.

    The test process hosts the rendezvous store, as torchrun's agent would.
    """
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    procs, logs = [], []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                   TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1", PYTHONPATH=_pythonpath())
        log = open(logdir / f"log_{args[0]}_{rank}.txt", "w")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(WORKER), *args], env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        hung = [r for r, p in enumerate(procs) if p.poll() is None]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in logs:
            log.close()
    if hung:
        pytest.fail(f"ranks {hung} of {args[0]} still running after {SPAWN_TIMEOUT_S} s:\n"
                    + _logs(logdir, args[0]))
    return [p.returncode for p in procs]


def _logs(logdir: Path, scenario: str) -> str:
    files = sorted(logdir.glob(f"log_{scenario}_*.txt"))
    return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in files)


def _read(outdir: Path, scenario: str, rank: int) -> dict:
    f = outdir / f"{scenario}_{rank}.json"
    assert f.exists(), f"rank {rank} wrote no result:\n{_logs(outdir, scenario)}"
    return json.loads(f.read_text())


# --------------------------------------------------------------------------------------------------
# Exact results: every rank's mean equals the single-process mean of the same payloads, bit for bit
# (fp32 beyond 2 workers: up to the all-reduce's summation order)


@pytest.fixture(scope="module")
def main_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The exactness and timing scenarios, run once by 3 processes."""
    out = tmp_path_factory.mktemp("main")
    codes = _spawn(["main", str(out)], 3, out)
    assert codes == [0, 0, 0], _logs(out, "main")
    return out


@pytest.fixture(scope="module")
def exact(main_run: Path) -> dict[int, dict]:
    return {r: torch.load(main_run / f"exact_{r}.pt", weights_only=True) for r in range(3)}


def _expected(name: str, ci: int, workers: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The in-process computation: every worker packs its input, mean_of_payloads in worker order."""
    stochastic = name == "e2m1"
    codec = get_codec(name, stochastic=stochastic)
    payloads = []
    for w in range(workers):
        gen = dist_worker.rounding_generator(w) if stochastic else None
        payloads.append(codec.pack(flatten(dist_worker.inputs(w, ci)), gen))
    numel = payloads[0].numel() and flatten(dist_worker.inputs(0, ci)).numel()
    return mean_of_payloads(codec, payloads, numel), payloads


@pytest.mark.parametrize("label,workers", [("all", 3), ("pair", 2)])
@pytest.mark.parametrize("ci,name", list(enumerate(dist_worker.CODECS)))
def test_mean_is_bit_exact_with_single_process(exact: dict[int, dict], label: str, workers: int,
                                               ci: int, name: str) -> None:
    expected, payloads = _expected(name, ci, workers)
    codec = get_codec(name)
    numel = expected.numel()
    for rank in range(workers):
        got = exact[rank][f"{label}/{name}"]
        assert [tuple(t.shape) for t in got["mean"]] == [tuple(s) for s in dist_worker.SHAPES]
        mean = flatten(got["mean"])
        if codec.summable and workers > 2:
            # One all-reduce: its ring adds in another order than worker order (last-bit rounding),
            # but every rank gets the same bits.
            torch.testing.assert_close(mean, expected, rtol=1e-6, atol=1e-7)
            assert torch.equal(mean, flatten(exact[0][f"{label}/{name}"]["mean"])), f"rank {rank} differs from rank 0"
        else:
            assert torch.equal(mean.view(torch.int32), expected.view(torch.int32)), (
                f"rank {rank}: max diff {(mean - expected).abs().max().item():g}"
            )
        assert got["kept_intact"], f"rank {rank}: writing into wait()'s result changed the kept mean"
        if "mean_no_own" in got:
            assert torch.equal(flatten(got["mean_no_own"]), flatten(got["mean"])), f"rank {rank}: keep_own=False"
        own = flatten(got["own"])
        assert torch.equal(own.view(torch.int32), codec.unpack(payloads[rank], numel).view(torch.int32))
        assert got["payload_bytes"] == codec.packed_nbytes(numel)
    if name != "fp32":  # a lossy codec really is lossy: the test would see a wrong transport
        exact_mean = sum(flatten(dist_worker.inputs(w, ci)) for w in range(workers)) / workers
        assert not torch.equal(expected, exact_mean)


@pytest.mark.parametrize("label,workers", [("all", 3), ("pair", 2)])
def test_byte_accounting_is_wire_bytes(exact: dict[int, dict], label: str, workers: int) -> None:
    numel = flatten(dist_worker.inputs(0, 0)).numel()
    codecs = [get_codec(n) for n in dist_worker.CODECS]
    wires = [wire_bytes(c.packed_nbytes(numel), workers, c.summable) for c in codecs]
    # Every deterministic codec also ran a second exchange, without keep_own.
    wires += [w for w, n in zip(wires, dist_worker.CODECS, strict=True) if n != "e2m1"]
    for rank in range(workers):
        st = exact[rank][f"{label}/stats"]
        assert exact[rank][f"{label}/workers"] == workers
        assert st["num_syncs"] == len(wires)
        assert st["bytes_sent"] == sum(wires)
        assert st["bytes_received"] == sum(wires)
        assert st["peak_sync_bytes"] == max(c.packed_nbytes(numel) for c in codecs)


def test_mismatched_exchange_is_a_clear_error_on_every_rank(exact: dict[int, dict]) -> None:
    for rank in range(3):
        msg = exact[rank]["mismatch"]
        assert "10 values" in msg and "11 values" in msg and "same exchanges" in msg, msg


def test_agreed_schedule_skips_the_per_exchange_header(main_run: Path) -> None:
    """OuterSync's exchanges: one agreement (header + schedule digest), then payloads only; on an
    emulated link a header per exchange and no agreement; the outer parameters agree either way."""
    runs = [_read(main_run, "agreement", r) for r in range(3)]
    header, digest = 5 * 8, 32  # bytes of one header row, of one schedule digest
    for r in runs:
        plain, emulated = r["plain"], r["emulated"]
        assert plain["agreed"] is True and emulated["agreed"] is False, r
        assert plain["syncs"] == emulated["syncs"] == 2, r
        assert plain["gathers"] == [header, digest], r  # no header for the 2 exchanges
        assert emulated["gathers"] == [header, header], r
    for mode in ("plain", "emulated"):
        assert len({tuple(r[mode]["outer"]) for r in runs}) == 1, [r[mode]["outer"] for r in runs]
    assert runs[0]["plain"]["outer"] == runs[0]["emulated"]["outer"]


def test_different_schedules_are_a_clear_error_on_every_rank(main_run: Path) -> None:
    runs = [_read(main_run, "agreement", r) for r in range(3)]
    for rank, r in enumerate(runs):
        msg = r["mismatch"].get("error", "no error")
        assert "different exchange schedule" in msg and "same settings" in msg, msg
        others = ["worker 1", "worker 2"] if rank == 0 else ["worker 0"]
        assert all(w in msg.split(" run(s)")[0] for w in others), msg
        assert ("[144] values" if rank == 0 else "[162] values") in msg, msg  # its own schedule, in words


# --------------------------------------------------------------------------------------------------
# Background exchange, blocking and the emulated link


@pytest.fixture(scope="module")
def timing(main_run: Path) -> list[dict]:
    return [_read(main_run, "timing", r) for r in range(3)]


def test_exchange_runs_in_background(timing: list[dict]) -> None:
    for r in timing:
        assert r["launch_s"] < 0.2 * L, r
        assert r["done_right_after"] is False, r
        # Compute of about the link time hid the exchange: little left to wait for.
        assert r["blocked_overlap_s"] < 0.25 * L, r


def test_waiting_at_once_blocks_for_the_link_time(timing: list[dict]) -> None:
    for r in timing:
        assert r["elapsed_immediate_s"] >= L, r
        # blocked_s starts at wait(), microseconds after the launch stamp the link counts from.
        assert r["blocked_immediate_s"] >= L - 0.01, r
        assert r["blocked_immediate_s"] < L + 0.5, r


def test_queued_exchanges_use_the_link_in_turn(timing: list[dict]) -> None:
    for r in timing:
        assert r["first_of_two_s"] >= L, r
        assert r["second_done_with_first"] is False, r
        assert r["second_of_two_s"] >= 2 * L, r


def test_bandwidth_term_of_the_link(timing: list[dict]) -> None:
    for r in timing:
        assert r["bandwidth_s"] >= r["bandwidth_expected_s"], r
        assert r["bandwidth_s"] < r["bandwidth_expected_s"] + 1.0, r


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
    expected, payloads = _expected("int8", 1, 2)
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
