"""A run whose numbers stop being finite stops there with one line (docs/algorithms.md, section 13): nothing
that is not finite reaches a codec or a peer, whatever the method and codec, in process, launched or on the
hook API; a resume never takes a state that is not finite; a loss that is not finite is a failed run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import run_inprocess, seeded_grads
from runs import launch_here, train_here
from toy import Toy

from eagerloco.config import OuterConfig
from eagerloco.errors import DIVERGED_EXIT_CODE, DivergedError
from eagerloco.outer import OuterSync
from testing.scripted import ScriptedCommunicator

SPARSE = {"topk": 2, "topk_chunk": 8, "codec": "2bit"}


def _nan_from(worker: int, step: int, seed: int = 0):
    """seeded_grads, but worker's gradient at step is NaN: its parameters, then its outer gradient, follow."""
    grads = seeded_grads(seed)

    def fn(m: int, s: int, name: str, p: torch.Tensor) -> torch.Tensor:
        g = grads(m, s, name, p)
        return torch.full_like(g, math.nan) if (m, s) == (worker, step) else g

    return fn


@pytest.mark.parametrize("cfg", [
    OuterConfig(method="diloco", inner_steps=2),
    OuterConfig(method="diloco", inner_steps=2, error_feedback=0.95, outer_optimizer="average", **SPARSE),
    OuterConfig(method="eager", inner_steps=2, **SPARSE),
    OuterConfig(method="eager", inner_steps=2, error_feedback=0.95, **SPARSE),
    OuterConfig(method="streaming", inner_steps=4, fragments=2, overlap_steps=1, codec="e2m1"),
    OuterConfig(method="delayed", inner_steps=2, codec="int4"),
], ids=["diloco", "diloco-sparse-ef", "eager-sparse", "eager-sparse-ef", "streaming-overlap-e2m1", "delayed-int4"])
def test_a_non_finite_outer_gradient_stops_the_run_before_any_codec(cfg: OuterConfig) -> None:
    """Worker 1's parameters turn NaN at step 3: at its next sync (step 4) its outer gradient is refused,
    naming it and the step, instead of a codec's traceback (sparse) or a NaN mean for everyone (dense)."""
    with pytest.raises(DivergedError, match=r"^worker 1's outer gradient .*at step 4 is not finite") as e:
        run_inprocess(cfg, 3, 8, _nan_from(1, 3))
    assert (e.value.worker, e.value.step) == (1, 4)


def test_a_non_finite_gradient_stops_data_parallel_before_its_exchange() -> None:
    with pytest.raises(DivergedError, match=r"^worker 0's gradient at step 2 is not finite") as e:
        run_inprocess(OuterConfig(method="dp", codec="e2m1"), 2, 5, _nan_from(0, 3))
    assert e.value.step == 2  # two inner steps completed, the third's gradient refused


def test_the_hook_api_raises_the_same_error_and_exit_on_errors_makes_it_one_line(capsys) -> None:
    import eagerloco
    from eagerloco.hooks.settings import exit_on_errors

    torch.manual_seed(0)
    model = Toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(SystemExit) as stop, exit_on_errors(), eagerloco.outer_loop(
            model, opt, eagerloco.OuterConfig(inner_steps=2, topk=2, topk_chunk=8, codec="2bit", error_feedback=0.95)):
        for step in (1, 2):
            for p in model.parameters():
                p.grad = torch.full_like(p, math.nan if step == 2 else 1.0)
            opt.step()
    assert stop.value.code == DIVERGED_EXIT_CODE
    assert isinstance(stop.value.__context__, DivergedError)
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("eagerloco: error: worker 0's outer gradient with its error feedback of fragment 0 at "
                           "step 2 is not finite"), line


def test_a_non_finite_error_feedback_buffer_is_never_loaded() -> None:
    cfg = OuterConfig(method="eager", inner_steps=2, error_feedback=0.9, **SPARSE)
    sync = OuterSync(Toy(), None, ScriptedCommunicator(), cfg)
    state = sync.state_dict()
    state["error_feedback"][0][0][1] = math.inf
    with pytest.raises(ValueError, match="error-feedback buffers are not finite"):
        OuterSync(Toy(), None, ScriptedCommunicator(), cfg).load_state_dict(state)


# A micro model that diverges within a few steps with learning rates at the top of their ranges.
DIVERGES = ["--model", "micro", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1", "--no-progress",
            "--inner-steps", "2", "--lr", "10", "--outer-lr", "10", "--outer-optimizer", "average",
            "--warmup-steps", "0", "--grad-clip", "0", "--log-every", "1"]


def _one_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


#: Every value sent (k = C) but in 2 bits: the sparse exchange diverges as fast as the dense one.
SPARSE_FLAGS = ["--method", "eager", "--topk", "64", "--topk-chunk", "64", "--codec", "2bit",
                "--error-feedback", "0.95"]


@pytest.mark.parametrize("extra", [[], SPARSE_FLAGS], ids=["diloco", "sparse"])
def test_a_diverged_run_ends_with_one_line_and_keeps_its_good_checkpoints(tmp_path: Path, extra: list[str]) -> None:
    r = train_here([*DIVERGES, *extra, "--steps", "30", "--checkpoint-every", "1", "--keep-checkpoints", "50",
                    "--out", str(tmp_path)])
    assert r.returncode == DIVERGED_EXIT_CODE, (r.stdout, r.stderr)
    line = _one_line(r.stderr)
    assert line.startswith("eagerloco: error: worker ") and "is not finite (NaN or inf): the run diverged" in line
    assert "--lr" in line
    step = int(line.split(" at step ")[1].split()[0])
    metas = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("checkpoints/*/meta.json"))]
    assert all(m["step"] < step for m in metas)  # none written at or after the divergence
    if metas:
        assert f"step_{metas[-1]['step']:08d}" in line  # the line names the newest, from before it


@pytest.mark.processes
def test_a_diverged_launched_run_ends_with_the_same_status(tmp_path: Path) -> None:
    r = launch_here([*DIVERGES, "--steps", "30", "--workers", "2", "--out", str(tmp_path)], 2)
    assert r.returncode == DIVERGED_EXIT_CODE, r.stdout
    assert "is not finite (NaN or inf): the run diverged" in r.stdout
    assert "Traceback" not in r.stdout


def test_a_loss_that_is_not_finite_ends_the_run_where_it_is_read(tmp_path: Path, monkeypatch) -> None:
    """No exchange in the run (H past its steps): the loss alone, read at the first log point, ends it."""
    from eagerloco.train.worker import Worker

    forward_backward = Worker.forward_backward

    def diverging(self: Worker) -> None:
        forward_backward(self)
        if self.comm.rank == 1:
            self.last_loss = math.inf

    monkeypatch.setattr(Worker, "forward_backward", diverging)
    r = train_here(["--model", "micro", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1",
                    "--no-progress", "--steps", "4", "--inner-steps", "50", "--log-every", "2", "--out", str(tmp_path)])
    assert r.returncode == DIVERGED_EXIT_CODE
    assert _one_line(r.stderr).startswith("eagerloco: error: worker 1's loss at step 2 is not finite"), r.stderr
