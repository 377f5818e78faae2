"""Your own loop with checkpoints that resume bit for bit: the model, the inner optimizer, the outer state
(`outer.state_dict()`), the data position and the random number generators (dropout draws from torch's),
saved together, atomically.

    python examples/resume_loop.py --steps 40 --stop-at 20 --checkpoint ckpt.pt   # trains 20 steps, saves
    python examples/resume_loop.py --steps 40 --checkpoint ckpt.pt --resume      # steps 21-40

ends with the same weights as one run of 40 steps. As two jobs, give each worker its own --checkpoint and the
rendezvous flags of examples/plain_loop.py; restart every worker from its checkpoint of the same step.
"""

import argparse
import os

import torch
from torch import nn

import eagerloco


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Dropout(0.1)) for _ in range(4))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).squeeze(-1)


def save(path: str, state: dict) -> None:
    """Write the checkpoint whole or not at all: a crash while saving leaves the previous one."""
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def main(argv: list[str] | None = None) -> tuple[nn.Module, dict[str, float]]:
    """Train (or resume) and return the model and this worker's `outer.metrics()`."""
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--stop-at", type=int, help="save and stop after this step (as a kill would, but cleanly)")
    p.add_argument("--checkpoint", default="ckpt.pt")
    p.add_argument("--every", type=int, default=10, help="save every this many steps")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--outer-addr")
    p.add_argument("--worker-id", type=int)
    p.add_argument("--workers", type=int)
    a = p.parse_args(argv)

    torch.manual_seed(0)  # every worker starts from the same model
    model = Net()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1 + (a.worker_id or 0))  # each worker draws its own batches
    target = torch.randn(16)
    start = 0
    config = eagerloco.OuterConfig(method="streaming", inner_steps=5, fragments=2, outer_lr=0.5)
    peers = eagerloco.connect(a.outer_addr, a.worker_id, a.workers)
    with eagerloco.outer_loop(model, inner, config, peers=peers) as outer:
        if a.resume:
            ckpt = torch.load(a.checkpoint, weights_only=False)
            model.load_state_dict(ckpt["model"])
            inner.load_state_dict(ckpt["inner"])
            outer.load_state_dict(ckpt["outer"])  # after the model and the inner optimizer
            torch.set_rng_state(ckpt["torch_rng"])  # dropout's masks
            data.set_state(ckpt["data_rng"])
            start = ckpt["step"]
        for step in range(start + 1, a.steps + 1):
            x = torch.randn(32, 16, generator=data)
            loss = ((model(x) - x @ target) ** 2).mean()
            loss.backward()
            inner.step()  # the outer algorithm runs here, in the optimizer's hooks
            inner.zero_grad()
            if step % a.every == 0 or step == a.stop_at:
                save(a.checkpoint, {"step": step, "model": model.state_dict(), "inner": inner.state_dict(),
                                    "outer": outer.state_dict(), "torch_rng": torch.get_rng_state(),
                                    "data_rng": data.get_state()})
            if step == a.stop_at:
                break
        metrics = outer.metrics()
        print(f"step {step} loss {loss.item():.4f} {metrics}")
    return model, metrics


if __name__ == "__main__":
    main()
