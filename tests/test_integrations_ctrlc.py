"""A Trainer stopped before its end under a framework callback: Ctrl-C gives one line and no traceback (under
Lightning, its own line: its on_exception releases the loop), an error under the Hugging Face Trainer its own
traceback and one line; none gives the hook API's advice ("use with outer_loop(...)")."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

#: One worker, a linear model, and a callback of the test's that stops the Trainer at step 3 as asked.
SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import torch
    from torch import nn
    from transformers import Trainer, TrainerCallback, TrainingArguments
    import eagerloco
    from eagerloco import OuterConfig
    from eagerloco.integrations.hf import OuterLoopCallback

    class Linear(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x, y):
            return {"loss": ((self.lin(x) - y) ** 2).mean()}

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return {"x": torch.randn(4, generator=g), "y": torch.randn(1, generator=g)}

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 3:
                if sys.argv[2] == "ctrl-c":
                    os.kill(os.getpid(), signal.SIGINT)
                raise RuntimeError("a step failed")

    args = TrainingArguments(output_dir=sys.argv[1], max_steps=10, per_device_train_batch_size=4, report_to="none",
                             use_cpu=True, disable_tqdm=True, save_strategy="no", logging_strategy="no")
    with eagerloco.exit_on_errors():
        Trainer(model=Linear(), args=args, train_dataset=Data(),
                callbacks=[OuterLoopCallback(OuterConfig(method="diloco", inner_steps=2)), Stop()]).train()
""")


def _run(tmp_path: Path, how: str) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("transformers")
    script = tmp_path / "trainer.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(script), str(tmp_path / "out"), how], capture_output=True, text=True,
                          timeout=300, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})


def test_ctrl_c_under_the_trainer_is_one_line(tmp_path: Path) -> None:
    done = _run(tmp_path, "ctrl-c")
    assert done.returncode == -signal.SIGINT, done.stderr[-3000:]  # it still dies by the signal
    lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.strip()]
    assert "Traceback" not in done.stderr and "outer_loop(" not in done.stderr, done.stderr[-3000:]
    assert [ln for ln in lines if ln.startswith("eagerloco:")] == [
        "eagerloco: stopped by Ctrl-C (SIGINT): the outer loop's exchanges in flight are dropped; continue from "
        "the Trainer's last checkpoint (trainer.train(resume_from_checkpoint=True))"], done.stderr[-3000:]


def test_an_error_under_the_trainer_keeps_its_traceback_and_adds_one_line(tmp_path: Path) -> None:
    done = _run(tmp_path, "error")
    assert done.returncode == 1
    assert "RuntimeError: a step failed" in done.stderr and "outer_loop(" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith(
        "eagerloco: training ended before the Trainer's end (see above): ")


#: The same stop under Lightning.
LIGHTNING = textwrap.dedent("""
    import os, signal
    import pytorch_lightning as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import eagerloco
    from eagerloco import OuterConfig
    from eagerloco.integrations.lightning import OuterLoopCallback

    class Linear(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return ((self.lin(x) - y) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Stop(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 3:
                os.kill(os.getpid(), signal.SIGINT)

    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)), batch_size=4)
    trainer = pl.Trainer(max_steps=10, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[OuterLoopCallback(OuterConfig(method="diloco", inner_steps=2)), Stop()])
    with eagerloco.exit_on_errors():
        trainer.fit(Linear(), data)
""")


def test_ctrl_c_under_lightning_is_its_one_line(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    script = tmp_path / "fit.py"
    script.write_text(LIGHTNING)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    text = done.stdout + done.stderr
    assert done.returncode == 1 and "Detected KeyboardInterrupt, attempting graceful shutdown" in text, text[-3000:]
    assert "Traceback" not in text and "eagerloco:" not in text, text[-3000:]
