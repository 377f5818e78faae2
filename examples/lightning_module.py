"""A PyTorch Lightning module (a small GPT on the Brown Corpus) trained with eagerloco's callback.

One worker per job, meeting at a coordinator:

    eagerloco coordinator --port 29601 &
    python examples/lightning_module.py --outer-addr 127.0.0.1:29601 --worker-id 0 --workers 2 --out runs/pl0 &
    python examples/lightning_module.py --outer-addr 127.0.0.1:29601 --worker-id 1 --workers 2 --out runs/pl1

Resume with ``--resume runs/pl0/checkpoints/epoch=0.ckpt``. Without --outer-addr it trains alone.
"""

import argparse
import os

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

import eagerloco
from eagerloco.data import get_tokenizer, load_corpus, worker_streams
from eagerloco.integrations.lightning import OuterLoopCallback
from eagerloco.model import GPT, GPTConfig


class LanguageModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(GPTConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=4, d_mlp=256,
                                          max_seq_len=32))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        _, loss = self.gpt(x, y)
        self.log("loss", loss, on_step=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def worker_data(worker: int, workers: int, count: int = 32, seq_len: int = 32) -> DataLoader:
    """This worker's shard of the text as fixed windows, in a fixed order (exact resumption)."""
    stream = worker_streams(load_corpus("brown"), get_tokenizer("byte"), workers, count, seq_len, seed=0)[worker]
    return DataLoader(TensorDataset(*stream.next_batch()), batch_size=4, shuffle=False)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--outer-addr", default=os.environ.get("EAGERLOCO_OUTER_ADDR"))
    p.add_argument("--worker-id", type=int, default=int(os.environ.get("EAGERLOCO_WORKER_ID", 0)))
    p.add_argument("--workers", type=int, default=int(os.environ.get("EAGERLOCO_WORKERS", 1)))
    p.add_argument("--method", default="diloco")
    p.add_argument("--elastic", action="store_true",
                   help="the others go on when a worker dies; started again, the same command rejoins the run")
    p.add_argument("--inner-steps", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--out", default="runs/pl")
    p.add_argument("--resume", default=None, help="a Lightning checkpoint to resume from")
    a = p.parse_args()

    torch.manual_seed(0)  # the same initial model in every worker
    module = LanguageModel()
    outer = OuterLoopCallback(eagerloco.OuterConfig(method=a.method, inner_steps=a.inner_steps),
                              outer_addr=a.outer_addr,
                              worker_id=a.worker_id, workers=a.workers, timeout_s=60,
                              elastic=a.elastic)
    saves = ModelCheckpoint(dirpath=f"{a.out}/checkpoints", filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    trainer = pl.Trainer(max_epochs=a.epochs, accelerator="cpu", devices=1, callbacks=[outer, saves],
                         logger=CSVLogger(a.out, name="logs"), log_every_n_steps=1, enable_progress_bar=False,
                         enable_model_summary=False, deterministic=True)
    trainer.fit(module, worker_data(a.worker_id, a.workers), ckpt_path=a.resume)


if __name__ == "__main__":
    with eagerloco.exit_on_errors():  # a dead peer: one line naming it, exit status 3
        main()
