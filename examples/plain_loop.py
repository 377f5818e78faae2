"""A plain PyTorch training loop with eagerloco: the loop is unchanged, the outer algorithm runs in
the inner optimizer's step hooks.

Alone (one worker, handy for debugging):   python examples/plain_loop.py
Two workers, each its own job, meeting at a coordinator (on two machines, give them its address):

    eagerloco coordinator --port 29600 &
    python examples/plain_loop.py --outer-addr 127.0.0.1:29600 --worker-id 0 --workers 2 &
    python examples/plain_loop.py --outer-addr 127.0.0.1:29600 --worker-id 1 --workers 2

(or set EAGERLOCO_OUTER_ADDR, EAGERLOCO_WORKER_ID and EAGERLOCO_WORKERS). A worker may be a torchrun
job of several ranks with its own DDP: only its rank 0 talks to the other workers.
"""

import argparse

import torch

import eagerloco
from eagerloco.data import get_tokenizer, load_corpus, worker_streams
from eagerloco.model import GPT, GPTConfig

p = argparse.ArgumentParser()
p.add_argument("--outer-addr")
p.add_argument("--worker-id", type=int)
p.add_argument("--workers", type=int)
p.add_argument("--method", default="eager")
p.add_argument("--elastic", action="store_true",
               help="the others go on when a worker dies; started again, the same command rejoins the run")
p.add_argument("--steps", type=int, default=40)
p.add_argument("--save", help="write the outer state to this file at the end (for your own checkpoints)")
a = p.parse_args()

# --8<-- [start:loop]
torch.manual_seed(0)  # every worker starts from the same model
model = GPT(GPTConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=4, d_mlp=256, max_seq_len=64))
inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
worker, workers = a.worker_id or 0, a.workers or 1
data = worker_streams(load_corpus("brown"), get_tokenizer("byte"), workers, 8, 64, seed=0)[worker]

with eagerloco.exit_on_errors():  # a dead peer: one line naming it, exit status 3
    config = eagerloco.OuterConfig(method=a.method, inner_steps=10, fragments=2, outer_lr=0.4)
    peers = eagerloco.connect(a.outer_addr, a.worker_id, a.workers, elastic=a.elastic)
    with eagerloco.outer_loop(model, inner, config, peers=peers) as outer:
        for step in range(outer.ticks + 1, a.steps + 1):  # a worker that joined a run goes on from its step
            x, y = data.next_batch()
            _, loss = model(x, y)
            loss.backward()
            inner.step()  # the outer algorithm runs here, in the optimizer's hooks
            inner.zero_grad()
            if step % 10 == 0:
                print(f"worker {worker} step {step} loss {loss.item():.3f} {outer.metrics()}")
# --8<-- [end:loop]
        if a.save:  # outer copies, outer-optimizer state, exchanges in flight: load_state_dict() resumes them
            torch.save({"model": model.state_dict(), "inner": inner.state_dict(), "outer": outer.state_dict()}, a.save)
