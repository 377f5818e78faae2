"""The kernel-shaped link (``eagerloco launch --kernel-link-gbps``): network namespaces, a tbf uplink.

The end-to-end test needs root, iproute2 and a kernel with network namespaces, veth, bridges and
sch_tbf; where any is missing it is skipped (the error paths are tested everywhere).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagerloco import checkpoint as ckpt
from eagerloco.cli import main
from eagerloco.comm.link import emulated_link
from eagerloco.config import ConfigError, Environment, LinkConfig, TrainConfig
from eagerloco.environment import KERNEL_LINK_ENV
from eagerloco.lab import kernel_link
from eagerloco.lab.kernel_link import JobLink, KernelLink, LinkShapingError, tbf_args
from eagerloco.lab.launch import KernelShaping
from eagerloco.procs import pid_alive
from eagerloco.train.inprocess import InProcessRuntime


def test_tbf_parameters_follow_the_rate() -> None:
    assert tbf_args(0.1) == ["rate", "100000000bit", "burst", str(64 * 1024), "limit", str(4 * 1024 * 1024)]
    # 10 Gbit/s: one 250 Hz tick of data (5 MB) exceeds the 64 KiB floor, and the queue holds four bursts.
    assert tbf_args(10.0) == ["rate", "10000000000bit", "burst", "5000000", "limit", "20000000"]


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_rate_is_a_clear_error(bad: float) -> None:
    with pytest.raises(LinkShapingError, match="--kernel-link-gbps must be a positive, finite number"):
        KernelLink(2, bad)


def test_owner_pid_reads_only_our_names() -> None:
    assert kernel_link.owner_pid("eloc1234w0") == 1234
    assert kernel_link.owner_pid("eloc1234w17") == 1234
    assert kernel_link.owner_pid("elbr1234") == 1234
    for other in ("eloc1234", "eloc12x4w0", "eloc1234w", "elbr", "elbr12a", "elh1234w0", "docker0", "eth0"):
        assert kernel_link.owner_pid(other) is None, other


def test_without_root_the_error_says_so_and_names_the_alternative(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_link.os, "geteuid", lambda: 1000)
    with pytest.raises(LinkShapingError, match="needs root.*--bandwidth-gbps"):
        KernelLink.check()


def test_launch_refuses_a_second_bandwidth(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["launch", "--workers", "2", "--kernel-link-gbps", "0.1", "--", "--bandwidth-gbps", "0.1", "--out",
            str(tmp_path)]
    assert main(argv) == 2  # refused before any namespace or process
    assert "drop --bandwidth-gbps" in capsys.readouterr().err


def test_under_a_kernel_shaped_link_only_latency_and_jitter_are_emulated() -> None:
    link = LinkConfig(latency_ms=10.0, jitter_ms=2.0)
    assert emulated_link(link, None) is link  # no kernel shaping: all of it
    emulated = emulated_link(link, 0.5)
    assert (emulated.bandwidth_gbps, emulated.latency_ms, emulated.jitter_ms) == (float("inf"), 10.0, 2.0)
    assert link.bandwidth_gbps == float("inf")  # the caller's settings are left alone
    # The run's settings record the kernel's rate; the same rate twice is fine, another one is refused.
    kernel = Environment(kernel_link_gbps=0.5)
    for given in (float("inf"), 0.5):
        cfg = TrainConfig(link=LinkConfig(bandwidth_gbps=given, latency_ms=10.0)).validate(kernel)
        assert (cfg.link.bandwidth_gbps, cfg.runtime.kernel_link_gbps) == (0.5, 0.5)
        assert InProcessRuntime(cfg, kernel).link_shaping() == "kernel"
    with pytest.raises(ConfigError, match="shapes the link to 0.5 Gbit/s.*--bandwidth-gbps 1: pass the bandwidth once"):
        TrainConfig(link=LinkConfig(bandwidth_gbps=1.0)).validate(kernel)
    plain = TrainConfig().validate(Environment())
    assert InProcessRuntime(plain, Environment()).link_shaping() == "emulated"
    assert Environment.read({}).kernel_link_gbps is None
    assert Environment.read({KERNEL_LINK_ENV: "0.25"}).kernel_link_gbps == 0.25
    with pytest.raises(ConfigError, match="EAGERLOCO_KERNEL_LINK_GBPS='fast' is not a number of Gbit/s"):
        Environment.read({KERNEL_LINK_ENV: "fast"})


@functools.cache
def _can_shape() -> str | None:
    """None when this machine can build a shaped namespace, else why not (asked once, by the first
    test that needs it: building a namespace at collection would slow every run of the suite)."""
    try:
        KernelLink.check()
    except LinkShapingError as e:
        return str(e)
    try:
        with KernelLink(1, 1.0):  # named after this process: nobody takes it for a stale one
            return None
    except LinkShapingError as e:
        return str(e)




@pytest.fixture
def shaping() -> None:
    """Skips the test where kernel shaping is not possible."""
    why = _can_shape()
    if why is not None:
        pytest.skip(f"kernel shaping not possible here: {why}")

_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "EAGERLOCO_WORKERS", "EAGERLOCO_RANKS_PER_WORKER", KERNEL_LINK_ENV)


@pytest.mark.processes
@pytest.mark.root
@pytest.mark.usefixtures("shaping")
def test_a_kernel_shaped_link_blocks_diloco_and_eager_hides_it(tmp_path: Path) -> None:
    """2 workers, tiny model (3.28 MB per FP32 exchange; the M = 2 ring sends one payload per worker):
    at 0.08 Gbit/s one exchange needs about 0.33 s on the wire. DiLoCo waits for it every round, eager overlaps
    it with the next round's 10 inner steps, paced to 0.06 s each so that the round outlasts the wire on any
    machine; the namespaces are gone afterwards."""
    gbps, payload = 0.08, 820_352 * 4
    wire_s = payload * 8 / (gbps * 1e9)
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    summaries = {}
    for method in ("diloco", "eager"):
        out = tmp_path / method
        r = subprocess.run(
            [sys.executable, "-m", "eagerloco", "launch", "--workers", "2", "--kernel-link-gbps", str(gbps), "--",
             "--workers", "2", "--method", method, "--model", "tiny", "--batch-size", "8", "--seq-len", "64",
             "--inner-steps", "10", "--steps", "30", "--eval-batches", "2", "--no-progress", "--seed", "3",
             "--sim-step-time", "0.06", "--dist-timeout", "60", "--out", str(out)],
            capture_output=True, text=True, timeout=300, env=env,
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "kernel-shaped link" in r.stdout
        summaries[method] = json.loads((out / "summary.json").read_text())
    d, e = summaries["diloco"], summaries["eager"]
    assert d["link_shaping"] == "kernel" and d["bandwidth_gbps"] == gbps
    # The rate limit is real: every blocking round waits at least most of the wire time (TCP's first
    # bytes ride the token bucket's burst, hence 0.7).
    assert d["blocked_s"] >= 0.7 * 3 * wire_s, d
    assert e["blocked_s"] < 0.25 * d["blocked_s"], (e, d)
    # The launchers are gone, and so are their namespaces.
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not [n for n in left if (pid := kernel_link.owner_pid(n)) is not None and not pid_alive(pid)], left


@pytest.mark.processes
@pytest.mark.root
@pytest.mark.usefixtures("shaping")
def test_concurrent_links_get_their_own_subnets_and_leave_nothing_behind() -> None:
    tags = (os.getpid(), os.getppid())  # both alive: neither set is taken for a stale one
    with KernelLink(2, 0.5, tag=tags[0]) as a, KernelLink(1, 0.5, tag=tags[1]) as b:
        assert a.subnet != b.subnet
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        assert {a.namespace(0), a.namespace(1), b.namespace(0)} <= set(names)
        qdisc = subprocess.run(["tc", "-n", a.namespace(1), "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "500Mbit" in qdisc, qdisc
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not {a.namespace(0), a.namespace(1), b.namespace(0)} & set(names)
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert a.bridge not in links and b.bridge not in links


@pytest.mark.processes
@pytest.mark.root
@pytest.mark.usefixtures("shaping")
def test_what_a_killed_launcher_left_is_removed_at_the_next_start() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid names the leftovers and is no longer alive
    left = KernelLink(2, 0.5, tag=dead.pid)
    left.__enter__()  # entered, never exited: what a SIGKILLed launcher leaves
    try:
        removed = kernel_link.remove_stale()
        assert set(removed) == {left.namespace(0), left.namespace(1), left.bridge}
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        assert not {left.namespace(0), left.namespace(1)} & set(names)
    finally:
        left.close()


def _ours_left() -> tuple[list[str], list[str]]:
    """Namespaces of dead launchers, and job bridges / job uplinks, still on this machine."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names = [f[1].split("@")[0] for line in links.splitlines() if len(f := line.split(": ")) > 1]
    return ([n for n in ns if (pid := kernel_link.owner_pid(n)) is not None and not pid_alive(pid)],
            [n for n in names if n.startswith(("elbj", "elj"))])


def test_jobs_behind_a_kernel_link_need_the_loopback_address() -> None:
    from eagerloco.launch import launch

    with pytest.raises(ValueError, match="give every job --outer-addr 127.0.0.1:29600 .*drop --kernel-link-gbps"):
        launch([], 2, outer_addr="10.0.0.1:29600", worker_id=0, shaping=KernelShaping(1.0))


@pytest.mark.processes
@pytest.mark.root
@pytest.mark.usefixtures("shaping")
def test_separate_jobs_share_one_shaped_bridge_and_train_as_unshaped(tmp_path: Path) -> None:
    """Two `eagerloco launch --outer-addr 127.0.0.1:P --worker-id I --kernel-link-gbps B` jobs, tiny model,
    two blocking DiLoCo rounds of 3.28 MB each (about 0.52 s on the wire at 0.05 Gbit/s): each round waits
    for the wire, the numbers are those of an unshaped run, and nothing is left behind."""
    from test_hooks_jobs import coordinators, wait_all

    gbps, payload = 0.05, 820_352 * 4
    wire_s = payload * 8 / (gbps * 1e9)
    port = coordinators(1)[0]
    args = ["--method", "diloco", "--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--inner-steps", "4",
            "--steps", "8", "--eval-batches", "1", "--no-progress", "--seed", "3", "--dist-timeout", "30",
            "--checkpoint-every", "8"]
    env = {k: v for k, v in os.environ.items()  # the session's data cache stays: the reference below reads it
           if k not in _DIST_ENV and (not k.startswith("EAGERLOCO_") or k == "EAGERLOCO_DATA_DIR")}
    jobs = [subprocess.Popen([sys.executable, "-m", "eagerloco", "launch", "--outer-addr", f"127.0.0.1:{port}",
                              "--worker-id", str(w), "--workers", "2", "--kernel-link-gbps", str(gbps), "--", *args,
                              "--out", str(tmp_path / f"w{w}")],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for w in range(2)]
    for w, done in enumerate(wait_all(jobs, 180)):
        assert done.returncode == 0, f"worker {w}:\n{done.stdout[-4000:]}"
        assert "-> 10.213." in done.stdout and f"bridge elbj{port}" in done.stdout, done.stdout[-2000:]
    assert _ours_left() == ([], [])
    summaries = [json.loads((tmp_path / f"w{w}" / "summary.json").read_text()) for w in range(2)]
    for s in summaries:
        assert s["runtime"] == "job" and s["link_shaping"] == "kernel" and s["bandwidth_gbps"] == gbps
        assert s["blocked_s"] >= 0.7 * 2 * wire_s, s  # as in the single launch's test: the burst rides free
    # The same run unshaped, in one process: the same outer parameters and evaluation.
    assert main(["train", *args, "--workers", "2", "--out", str(tmp_path / "ref")]) == 0
    ref = json.loads((tmp_path / "ref" / "summary.json").read_text())
    assert summaries[0]["final_eval_loss"] == summaries[1]["final_eval_loss"]
    assert summaries[0]["final_eval_loss"] == pytest.approx(ref["final_eval_loss"], rel=1e-5)
    ref_ckpt = ckpt.list_checkpoints(ckpt.checkpoint_root(tmp_path / "ref"))[-1]
    for w in range(2):
        got = ckpt.load_worker_state(ckpt.list_checkpoints(ckpt.checkpoint_root(tmp_path / f"w{w}"))[-1], w)
        want = ckpt.load_worker_state(ref_ckpt, w)
        for x, y in zip(got["sync"]["outer"][0], want["sync"]["outer"][0], strict=True):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


@pytest.mark.processes
@pytest.mark.root
@pytest.mark.usefixtures("shaping")
def test_job_links_share_a_bridge_refuse_a_second_worker_and_the_last_one_out_removes_it() -> None:
    port = 1  # a port no run's bridge is named after while this test runs
    with JobLink(port, 0, 2, 0.5) as a:
        with JobLink(port, 1, 2, 0.5, tag=os.getppid()) as b:  # another live job
            assert a.bridge == b.bridge and a.subnet == b.subnet and a.ns != b.ns
            with pytest.raises(LinkShapingError, match="worker 1 of the run at port 1 already runs"):
                JobLink(port, 1, 2, 0.5, tag=os.getpid()).__enter__()
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        assert a.bridge in links and b.uplink not in links  # a is still on it
    assert _ours_left() == ([], [])
