"""A Hugging Face Trainer on a small Llama (built from a config, no downloaded weights), with eagerloco.

One worker per job; start the coordinator, then each worker with its own id:

    eagerloco coordinator --port 29600 &
    python examples/hf_trainer.py --outer-addr 127.0.0.1:29600 --worker-id 0 --workers 2 --out runs/hf0 &
    python examples/hf_trainer.py --outer-addr 127.0.0.1:29600 --worker-id 1 --workers 2 --out runs/hf1

A worker may be a data-parallel job of its own (the Trainer's DDP stays inside it):
``torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --worker-id 0 ...``.
Without --outer-addr it trains alone (one worker). The text is the Brown Corpus, as bytes.
"""

import argparse
import os

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import eagerloco
from eagerloco.data import get_tokenizer, load_corpus, worker_streams
from eagerloco.integrations.hf import OuterLoopCallback


class Windows(Dataset):
    """Fixed windows of this worker's share of the text (its own shard: the workers see different data)."""

    def __init__(self, worker: int, workers: int, seq_len: int, count: int) -> None:
        corpus = load_corpus("brown")
        stream = worker_streams(corpus, get_tokenizer("byte"), workers, count, seq_len, seed=0)[worker]
        self.x = stream.next_batch()[0]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}  # the model shifts the labels itself


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--outer-addr", default=os.environ.get("EAGERLOCO_OUTER_ADDR"))
    p.add_argument("--worker-id", type=int, default=int(os.environ.get("EAGERLOCO_WORKER_ID", 0)))
    p.add_argument("--workers", type=int, default=int(os.environ.get("EAGERLOCO_WORKERS", 1)))
    p.add_argument("--method", default="diloco")
    p.add_argument("--elastic", action="store_true",
                   help="the others go on when a worker dies; started again, the same command rejoins the run")
    p.add_argument("--inner-steps", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-steps", type=int, default=4)
    p.add_argument("--out", default="runs/hf")
    p.add_argument("--resume", default=None, help="a checkpoint folder to resume from")
    a = p.parse_args()

    torch.manual_seed(0)  # the same initial model in every worker
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32)
    model = LlamaForCausalLM(config)
    args = TrainingArguments(
        output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=4, learning_rate=1e-3,
        save_strategy="steps", save_steps=a.save_steps, logging_steps=a.save_steps, report_to="none",
        use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )
    outer = OuterLoopCallback(eagerloco.OuterConfig(method=a.method, inner_steps=a.inner_steps, outer_lr=0.7),
                              outer_addr=a.outer_addr, worker_id=a.worker_id, workers=a.workers, timeout_s=60,
                              elastic=a.elastic,
                              resume_from=a.resume)
    data = Windows(a.worker_id, a.workers, seq_len=32, count=256)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[outer])
    trainer.train(resume_from_checkpoint=a.resume)


if __name__ == "__main__":
    with eagerloco.exit_on_errors():  # a dead peer: one line naming it, exit status 3
        main()
