"""Two workers in one process, each an `OuterSync` of its own, on a simulated 10 Mbit/s link: the explicit
calls that `outer_loop` makes from the optimizer's hooks, for a loop that steps every worker itself.

    python examples/outer_sync.py
"""

import copy

import torch
from torch import nn

import eagerloco as el
from eagerloco.outer import after_inner_step_all, before_inner_step_all


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))  # fragments split these
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x).squeeze(-1)


torch.manual_seed(0)
workers = 2
# Plain outer SGD here: on a toy this quick to fit, the stale half of eager's update and
# heavy Nesterov momentum (the default: lr 0.7, momentum 0.9) overshoot.
config = el.OuterConfig(
    method="eager", inner_steps=10, fragments=2, codec="e2m1",
    outer_lr=0.5, outer_momentum=0.0, outer_nesterov=False,
)
group = el.InProcessGroup(workers, el.LinkConfig(bandwidth_gbps=0.01, latency_ms=20))
models = [Net() for _ in range(1)]
models += [copy.deepcopy(models[0]) for _ in range(workers - 1)]  # same start on every worker
opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
syncs = [el.OuterSync(m, o, group.communicator(i), config) for i, (m, o) in enumerate(zip(models, opts, strict=True))]
target = torch.randn(16)
x_eval = torch.randn(256, 16)


@torch.no_grad()
def eval_loss(model: nn.Module) -> float:
    return float(((model(x_eval) - x_eval @ target) ** 2).mean())


print(f"eval loss before {eval_loss(models[0]):.3f}")
for _ in range(200):
    for i, (model, opt) in enumerate(zip(models, opts, strict=True)):
        x = torch.randn(32, 16)  # each worker draws its own data
        opt.zero_grad()
        loss = ((model(x) - x @ target) ** 2).mean()
        loss.backward()
        group.communicator(i).add_compute(0.05)  # or the measured seconds of this step
    before_inner_step_all(syncs)  # data-parallel: averages gradients; no-op otherwise
    for opt in opts:
        opt.step()
    after_inner_step_all(syncs)  # launches and applies the outer exchanges due now

for s in syncs:
    s.drain()  # wait on what is still in flight
with syncs[0].outer_weights() as model:  # evaluate the outer parameters
    print(f"eval loss after {eval_loss(model):.3f}")
stats = group.communicator(0).stats
print(f"sent {stats.bytes_sent} B, peak sync {stats.peak_sync_bytes} B, blocked {stats.blocked_s:.3f} s")
