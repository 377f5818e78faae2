"""Through the hook API the workers agree before the first step: settings compared, weights made equal.

A torchft script ported as the README says does not seed its workers alike; torchft's Manager sends
worker 0's weights at step 0, and so does ``outer_loop`` (``init_sync``). Without it the weights are
compared, and any setting that differs stops every worker with one line naming it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from jobs import popen
from test_hooks_jobs import coordinators, job_env, wait_all

import eagerloco

HERE = Path(__file__).resolve().parent


def _pair(scenario: str, out: Path) -> list[subprocess.CompletedProcess]:
    port = coordinators(1)[0]
    procs = [popen([sys.executable, str(HERE / "hooks_meet_job.py"), scenario, str(out), str(w), str(port)],
                   env=job_env(), cwd=HERE.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for w in range(2)]
    return wait_all(procs, 120)


@pytest.mark.processes
def test_workers_seeded_differently_start_from_worker_0s_weights_and_agree(tmp_path: Path) -> None:
    done = _pair("synced", tmp_path)
    assert [d.returncode for d in done] == [0, 0], done[0].stdout[-3000:] + done[1].stdout[-3000:]
    a, b = (torch.load(tmp_path / f"synced_{w}.pt") for w in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))  # DiLoCo: one outer model


@pytest.mark.processes
def test_without_init_sync_different_weights_stop_both_workers_with_one_line(tmp_path: Path) -> None:
    for d in _pair("unsynced", tmp_path):
        assert d.returncode == 2, d.stdout[-3000:]
        last = d.stdout.strip().splitlines()[-1]
        assert last.startswith("eagerloco: error: the workers disagree on settings that must match: "
                               "initial parameters (worker 0: "), last
        assert "seed every worker the same way, or leave init_sync=True" in last and "Traceback" not in d.stdout


@pytest.mark.processes
def test_a_setting_that_differs_stops_both_workers_with_one_line_naming_it(tmp_path: Path) -> None:
    for d in _pair("outer_lr", tmp_path):
        assert d.returncode == 2, d.stdout[-3000:]
        last = d.stdout.strip().splitlines()[-1]
        assert last == ("eagerloco: error: the workers disagree on settings that must match: outer_lr (worker 0: 0.7, "
                        "worker 1: 0.4). Pass the same settings to outer_loop on every worker"), last


@pytest.mark.processes
def test_eager_workers_end_with_one_model(tmp_path: Path) -> None:
    done = _pair("eager", tmp_path)
    assert [d.returncode for d in done] == [0, 0], done[0].stdout[-3000:] + done[1].stdout[-3000:]
    for name in ("eager", "eager_model"):
        a, b = (torch.load(tmp_path / f"{name}_{w}.pt") for w in range(2))
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), name


def test_a_step_the_grad_scaler_skips_still_counts_so_the_schedule_stays() -> None:
    """One worker's GradScaler skips a step (an inf): that step counts (the parameters unchanged), so the
    worker launches the same exchanges as one that skipped nothing."""
    from toy import Toy

    from testing.scripted import ScriptedCommunicator

    def run(inf_at: int | None) -> tuple[int, int, list[torch.Tensor]]:
        torch.manual_seed(0)
        model = Toy(num_blocks=2, width=4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        comm = ScriptedCommunicator(num_workers=2)
        with eagerloco.outer_loop(model, opt, eagerloco.OuterConfig(method="diloco", inner_steps=2), peers=comm,
                                  grad_scaler=scaler) as outer:
            for step in range(1, 7):
                opt.zero_grad()
                loss = ((model(torch.ones(3, 4) * step) - 1.0) ** 2).mean()
                scaler.scale(loss * (float("inf") if step == inf_at else 1.0)).backward()
                scaler.step(opt)
                scaler.update()
        assert "update" not in vars(scaler)  # its own update() again once the loop ended
        return outer.sync.step, comm.stats.num_syncs, [p.detach().clone() for p in model.parameters()]

    steps, syncs, _ = run(None)
    skipped_steps, skipped_syncs, _ = run(3)
    assert (steps, syncs) == (skipped_steps, skipped_syncs) == (6, 3)


def test_a_grad_scaler_with_dp_is_refused_with_the_reason() -> None:
    from toy import Toy

    model = Toy(num_blocks=2, width=4)
    with pytest.raises(eagerloco.ConfigError, match="with method dp: the gradient mean"):
        eagerloco.outer_loop(model, torch.optim.SGD(model.parameters(), lr=0.1), eagerloco.OuterConfig(method="dp"),
                             grad_scaler=torch.amp.GradScaler("cpu"))


@pytest.mark.processes
def test_a_torchft_port_seeded_differently_starts_from_worker_0s_weights(tmp_path: Path) -> None:
    """torchft's fragments are parts of the model (blocks, lists of blocks never called themselves): the weights
    are still sent at the model's first forward pass."""
    done = _pair("torchft", tmp_path)
    assert [d.returncode for d in done] == [0, 0], done[0].stdout[-3000:] + done[1].stdout[-3000:]
    a, b = (torch.load(tmp_path / f"torchft_{w}.pt") for w in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.processes
def test_torchfts_outer_optimizers_with_different_settings_stop_both_workers_with_one_line(tmp_path: Path) -> None:
    """The optimizer a torchft script passes is the one that steps: its class and settings are compared, not
    the defaults of the settings it replaces."""
    for d in _pair("torchft_lr", tmp_path):
        assert d.returncode == 2, d.stdout[-3000:]
        last = d.stdout.strip().splitlines()[-1]
        assert last == ("eagerloco: error: the workers disagree on settings that must match: outer optimizer lr "
                        "(worker 0: 0.7, worker 1: 0.4). Pass the same outer optimizer (class and settings) to "
                        "every worker"), last


@pytest.mark.processes
@pytest.mark.parametrize("style", ["torchft", "state"])
def test_workers_resumed_from_different_checkpoints_stop_with_one_line_naming_each_ones_state(
        tmp_path: Path, style: str) -> None:
    """A torchft-style resume starts at step 0 and init_sync sends worker 0's weights, but each worker keeps the
    outer optimizer state it loaded; an eagerloco state resumes at its own step. Both are compared before the
    first step."""
    for d in _pair(f"resume_{style}_other", tmp_path):
        assert d.returncode == 2, d.stdout[-3000:]
        last = d.stdout.strip().splitlines()[-1]
        assert last.startswith("eagerloco: error: the workers disagree on settings that must match: "), last
        assert "outer state (worker 0: " in last and "Traceback" not in d.stdout, last
        if style == "state":
            assert "step (worker 0: 2, worker 1: 4)" in last, last
        assert "load the same checkpoint on every worker" in last, last


@pytest.mark.processes
@pytest.mark.parametrize("style", ["torchft", "state"])
def test_workers_resumed_from_the_same_checkpoint_train_on_with_one_model(tmp_path: Path, style: str) -> None:
    done = _pair(f"resume_{style}_same", tmp_path)
    assert [d.returncode for d in done] == [0, 0], done[0].stdout[-3000:] + done[1].stdout[-3000:]
    a, b = (torch.load(tmp_path / f"resume_{w}.pt") for w in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_the_outer_optimizer_compared_is_the_one_that_steps_each_fragment() -> None:
    """Its class and settings, whether the settings built it or the caller passed it (torchft's way); the
    fragments' apart only where they differ; nothing that changes no number (foreach)."""
    from toy import Toy

    from eagerloco.hooks.start import outer_optimizer_settings, outer_state_digest
    from eagerloco.integrations.torchft import DiLoCo
    from testing.scripted import ScriptedCommunicator

    def described(make_outer) -> dict:  # noqa: ANN001
        torch.manual_seed(0)
        model = Toy(num_blocks=2, width=4)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        loop = make_outer(model, inner)
        try:
            return outer_optimizer_settings(loop.sync)
        finally:
            loop.close()

    def torchft(model, inner, opts):  # noqa: ANN001, ANN202
        return DiLoCo(None, [model.blocks[0], model.blocks[1]], inner, opts(model), 2)

    own = described(lambda m, i: eagerloco.outer_loop(m, i, eagerloco.OuterConfig(method="diloco"),
                                                      peers=ScriptedCommunicator(2)))
    assert own["outer optimizer"] == "SGD" and own["outer optimizer lr"] == 0.7
    assert own["outer optimizer momentum"] == 0.9 and own["outer optimizer nesterov"] is True
    assert "outer optimizer foreach" not in own and "outer optimizer params" not in own
    passed = described(lambda m, i: torchft(m, i, lambda m: torch.optim.SGD(m.parameters(), lr=0.7, momentum=0.9,
                                                                             nesterov=True)))
    assert passed == own  # the same numbers: the same description
    adam = described(lambda m, i: torchft(m, i, lambda m: [torch.optim.Adam(m.blocks[0].parameters(), lr=0.1),
                                                            torch.optim.Adam(m.blocks[1].parameters(), lr=0.2)]))
    assert adam["outer optimizer (fragment 0)"] == adam["outer optimizer (fragment 1)"] == "Adam"
    assert (adam["outer optimizer (fragment 0) lr"], adam["outer optimizer (fragment 1) lr"]) == (0.1, 0.2)
    assert adam["outer optimizer (fragment 0) betas"] == [0.9, 0.999]

    torch.manual_seed(0)
    model = Toy(num_blocks=2, width=4)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with eagerloco.outer_loop(model, inner, eagerloco.OuterConfig(method="diloco", inner_steps=1),
                              peers=ScriptedCommunicator(2)) as loop:
        before = outer_state_digest(loop.sync, copies=False), outer_state_digest(loop.sync, copies=True)
        model(torch.ones(1, 4)).sum().backward()
        inner.step()  # one outer step: momentum, and new outer copies
        after = outer_state_digest(loop.sync, copies=False), outer_state_digest(loop.sync, copies=True)
    assert len({*before, *after}) == 4
