"""The framework callbacks give the loop the framework's GradScaler (fp16): a step that the scaler skips on one
worker alone (an inf in its gradients) still counts, so both workers run the same outer rounds.

Two workers of a real gloo group, one thread each (tests/gloo_threads.py), each stepping through the
framework's own fp16 path: accelerate's ``AcceleratedOptimizer.step`` (the Trainer's optimizer under fp16)
and Lightning's ``MixedPrecision`` plugin inside ``Trainer.fit``. Without the scaler a skipped step leaves
one worker a step behind: the other waits for an exchange it never launches, until the gloo timeout.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gloo_threads import context, run_ranks
from toy import Toy

from eagerloco.comm.worker import communicator_for
from eagerloco.config import ConfigError, OuterConfig

H, STEPS, INF_STEP = 2, 6, 3  # DiLoCo rounds end at steps 2, 4 and 6; worker 1 overflows at step 3
TIMEOUT_S = 30.0  # a worker waiting for an exchange the other never launches fails after this (a busy CI machine
# can hold one thread, building its Trainer, seconds behind the other)


def _loss(model: torch.nn.Module, worker: int, step: int) -> torch.Tensor:
    """The workers see different data; worker 1's gradients hold an inf at INF_STEP."""
    loss = ((model(torch.ones(3, 4) * (step + worker)) - 1.0) ** 2).mean()
    return loss * float("inf") if worker == 1 and step == INF_STEP else loss


def _start() -> dict[str, torch.Tensor]:
    """The workers' common initial weights, drawn here: the threads share torch's random generator."""
    torch.manual_seed(0)
    return Toy(num_blocks=2, width=4).state_dict()


def _toy(start: dict[str, torch.Tensor]) -> Toy:
    model = Toy(num_blocks=2, width=4)
    model.load_state_dict(start)
    return model


# ---------------------------------------------------------------------------------------- Hugging Face

@pytest.fixture
def accelerator() -> Iterator[None]:
    """accelerate's process-wide state, which its optimizer wrapper reads, set up as the Trainer does on CPU;
    reset after (accelerate has no public reset; its own tests reset it so), so that no later test meets it."""
    accelerate = pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    accelerate.Accelerator(cpu=True)
    yield
    accelerate.state.AcceleratorState._reset_state(True)


def _accelerated(model: torch.nn.Module, scaler: torch.amp.GradScaler | None) -> Any:
    """The optimizer as the Trainer gives it to its callbacks: accelerate's wrapper, holding the GradScaler
    under fp16 (on CPU accelerate makes none, so the test gives it one, as Accelerator.prepare_optimizer would)."""
    from accelerate.optimizer import AcceleratedOptimizer

    return AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler)


def _hf_worker(rank: int, store: dist.Store, start: dict[str, torch.Tensor]) -> dict[str, Any]:
    from transformers import TrainerControl, TrainerState

    from eagerloco.integrations.hf import OuterLoopCallback

    comm = communicator_for(context(store, rank, 2, TIMEOUT_S), None, seed=0, timeout_s=TIMEOUT_S)
    try:
        model = _toy(start)
        scaler = torch.amp.GradScaler("cpu")
        optimizer = _accelerated(model, scaler)
        callback = OuterLoopCallback(OuterConfig(method="diloco", inner_steps=H), peers=comm)
        state, control = TrainerState(), TrainerControl()
        callback.on_train_begin(None, state, control, model=model, optimizer=optimizer)
        assert callback.outer is not None and callback.outer.grad_scaler is scaler
        skipped = []
        for step in range(1, STEPS + 1):  # as the Trainer's loop under fp16: accelerator.backward, optimizer.step
            optimizer.zero_grad()
            scaler.scale(_loss(model, rank, step)).backward()
            optimizer.step()  # scaler.step(optimizer), scaler.update()
            skipped.append(optimizer.step_was_skipped)
        callback.on_train_end(None, state, control)
        return {"skipped": skipped, "ticks": callback.outer.ticks, "syncs": comm.stats.num_syncs,
                "outer": callback.outer.outer_parameters(), "params": [p.detach().clone() for p in model.parameters()],
                "scaler restored": "update" not in vars(scaler)}
    finally:
        comm.close()


def assert_same_rounds_and_one_model(w0: dict[str, Any], w1: dict[str, Any]) -> None:
    """Both workers ran every step and every round, hold equal outer parameters and (the last step ended a round)
    one model, and each scaler has its own update() back."""
    assert w0["ticks"] == w1["ticks"] == STEPS and w0["syncs"] == w1["syncs"] == STEPS // H
    for a, b in zip(w0["outer"], w1["outer"], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(w0["params"], w1["params"], strict=True):
        assert torch.equal(a, b)
    assert w0["scaler restored"] and w1["scaler restored"]


def test_hf_a_step_skipped_under_fp16_on_one_worker_keeps_both_in_the_same_rounds(accelerator: None) -> None:
    start = _start()
    w0, w1 = run_ranks(lambda rank, store: _hf_worker(rank, store, start), 2, timeout_s=4 * TIMEOUT_S)
    assert w0["skipped"] == [False] * STEPS
    assert w1["skipped"] == [step == INF_STEP for step in range(1, STEPS + 1)]  # the scaler did skip one
    assert_same_rounds_and_one_model(w0, w1)


def test_hf_fp16_with_dp_is_refused_at_train_begin_in_one_line(accelerator: None) -> None:
    from transformers import TrainerControl, TrainerState

    from eagerloco.integrations.hf import OuterLoopCallback

    model = Toy(num_blocks=2, width=4)
    callback = OuterLoopCallback(OuterConfig(method="dp"))  # valid alone: the Trainer's scaler is not known yet
    with pytest.raises(ConfigError) as e:
        callback.on_train_begin(None, TrainerState(), TrainerControl(), model=model,
                                optimizer=_accelerated(model, torch.amp.GradScaler("cpu")))
    text = str(e.value)
    assert text.startswith("a GradScaler (grad_scaler=, or an fp16 Trainer's) with method dp: ") and "\n" not in text
    assert e.value.__cause__ is None and e.value.__suppress_context__  # no chain: one line under exit_on_errors


@pytest.mark.parametrize("case", ["fp32", "the user's own"])
def test_hf_the_loop_gets_no_scaler_without_fp16_and_the_users_own_before_the_trainers(accelerator: None,
                                                                                       case: str) -> None:
    from transformers import TrainerControl, TrainerState

    from eagerloco.integrations.hf import OuterLoopCallback
    from testing.scripted import ScriptedCommunicator

    model = Toy(num_blocks=2, width=4)
    own = torch.amp.GradScaler("cpu")
    settings: dict[str, Any] = {"grad_scaler": own} if case == "the user's own" else {}
    trainers = torch.amp.GradScaler("cpu") if case == "the user's own" else None
    callback = OuterLoopCallback(OuterConfig(method="diloco", inner_steps=H), peers=ScriptedCommunicator(2),
                                 **settings)
    callback.on_train_begin(None, TrainerState(), TrainerControl(), model=model,
                            optimizer=_accelerated(model, trainers))
    assert callback.outer is not None and callback.outer.grad_scaler is (own if settings else None)
    callback.on_train_end(None, TrainerState(), TrainerControl())


# ---------------------------------------------------------------------------------------- Lightning

#: The fp16 scaler's first scale: low enough that only worker 1's inf overflows (the default, 2**16, overflows
#: the toy's fp16 gradients on both workers in its first steps, hiding which worker skipped what).
INIT_SCALE = 256.0


def _lightning_worker(rank: int, store: dist.Store, start: dict[str, torch.Tensor]) -> dict[str, Any]:
    import pytorch_lightning as pl
    from pytorch_lightning.plugins.precision import MixedPrecision
    from torch.utils.data import DataLoader

    from eagerloco.integrations.lightning import OuterLoopCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.toy = _toy(start)
            self.scales: list[float] = []  # the scaler's scale after each step: it halves on a skipped step

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return _loss(self.toy, rank, batch_idx + 1)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.scales.append(self.trainer.precision_plugin.scaler.get_scale())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    comm = communicator_for(context(store, rank, 2, TIMEOUT_S), None, seed=0, timeout_s=TIMEOUT_S)
    try:
        module = Module()
        callback = OuterLoopCallback(OuterConfig(method="diloco", inner_steps=H), peers=comm)
        # Trainer(precision="16-mixed") turns into bf16 on a CPU: the plugin it makes on a GPU, given here.
        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=INIT_SCALE))
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, plugins=[plugin], callbacks=[callback],
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)
        trainer.fit(module, DataLoader(torch.zeros(STEPS, 1), batch_size=1))
        assert callback.outer is not None
        return {"scales": module.scales, "ticks": callback.outer.ticks, "syncs": comm.stats.num_syncs,
                "outer": callback.outer.outer_parameters(),
                "params": [p.detach().clone() for p in module.toy.parameters()],
                "scaler restored": "update" not in vars(plugin.scaler)}
    finally:
        comm.close()


def test_lightning_a_step_skipped_under_16_mixed_on_one_worker_keeps_both_in_the_same_rounds() -> None:
    pytest.importorskip("pytorch_lightning")
    start = _start()
    w0, w1 = run_ranks(lambda rank, store: _lightning_worker(rank, store, start), 2, timeout_s=6 * TIMEOUT_S)
    assert w0["scales"] == [INIT_SCALE] * STEPS
    assert w1["scales"] == [INIT_SCALE if step < INF_STEP else INIT_SCALE / 2 for step in range(1, STEPS + 1)]
    assert_same_rounds_and_one_model(w0, w1)


def test_lightning_16_mixed_with_dp_is_refused_at_train_start_in_one_line() -> None:
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.plugins.precision import MixedPrecision
    from torch.utils.data import DataLoader

    from eagerloco.integrations.lightning import OuterLoopCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.toy = Toy(num_blocks=2, width=4)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return _loss(self.toy, 0, batch_idx + 1)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    callback = OuterLoopCallback(OuterConfig(method="dp"))  # valid on its own: the precision is not known yet
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, plugins=[MixedPrecision("16-mixed", "cpu")],
                         callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with pytest.raises(ConfigError) as e:
        trainer.fit(Module(), DataLoader(torch.zeros(2, 1), batch_size=1))
    text = str(e.value)
    assert text.startswith("a GradScaler (grad_scaler=, or an fp16 Trainer's) with method dp: ") and "\n" not in text
    assert e.value.__cause__ is None and e.value.__suppress_context__  # no chain: one line under exit_on_errors
    assert callback.outer is None
