"""The schedules of sites that come and go, replayed in one process with exact means: how much of the final loss
under churn is the churn itself, and how much is where a chaotic trajectory happens to end.

Run from the repository root: ``nice -n 10 .venv/bin/python bench/sites/replay.py`` (about 10 minutes on 2 cores).
The bench's workers (tiny model, 192 steps, H = 4, the same seed, shards and eval batches as bench/sites/run.py),
one fresh in-process group per membership epoch: a worker killed after a round boundary's exchange leaves with
its last contribution counted; a worker that (re)joins at a boundary takes the lowest member's whole state (model,
inner and outer optimizers, the exchange in flight), keeping its own data position, as comm/elastic.py hands it
over. Each schedule is the bench's (worker 0 killed and back, worker 3 killed for good, worker 4 joining) at
shifted steps. Prints one JSON line per run and writes bench/results/sites_replay.json.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from eagerloco.cli import make_parser  # noqa: E402
from eagerloco.comm.inprocess import InProcessGroup  # noqa: E402
from eagerloco.data import worker_streams  # noqa: E402
from eagerloco.flags import build_train_config  # noqa: E402
from eagerloco.outer import after_inner_step_all, before_inner_step_all  # noqa: E402
from eagerloco.train.worker import Worker, evaluate, prepare  # noqa: E402

STEPS, WORKERS = 192, 4
#: name -> {step: [(kill or join, worker)]}: the change happens after that step's exchange.
SCHEDULES: dict[str, dict[int, list[tuple[str, int]]]] = {
    "uninterrupted": {},
    "bench's steps": {32: [("kill", 0)], 64: [("join", 0)], 120: [("kill", 3)], 136: [("join", 4)]},
    "4 steps later": {36: [("kill", 0)], 68: [("join", 0)], 124: [("kill", 3)], 140: [("join", 4)]},
    "4 steps earlier": {28: [("kill", 0)], 60: [("join", 0)], 116: [("join", 4)], 124: [("kill", 3)]},
    "a join at 160": {160: [("join", 4)]},
    "M = 3 throughout": {0: [("kill", 3)]},
}


def replay(method: str, schedule: dict[int, list[tuple[str, int]]]) -> dict[str, Any]:
    argv = ["train", "--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "16",
            "--inner-steps", "4", "--steps", str(STEPS), "--method", method, "--workers", str(WORKERS)]
    cfg = build_train_config(make_parser().parse_args(argv))
    torch.manual_seed(cfg.seed)
    corpus, tok, base, eval_batches = prepare(cfg)

    def stream(w: int) -> Any:  # a worker beyond the first M takes the last shard of its id + 1 (train/job.py)
        return worker_streams(corpus, tok, max(WORKERS, w + 1), cfg.batch_size, cfg.seq_len, cfg.seed,
                             iid=cfg.iid)[w]

    group = InProcessGroup(WORKERS, cfg.link, seed=cfg.seed)
    workers = {w: Worker(copy.deepcopy(base), group.communicator(w), stream(w), cfg) for w in range(WORKERS)}
    streams: dict[int, Any] = {}  # a killed worker's data position, which it resumes from
    epoch = worker_steps = 0

    def change(step: int) -> None:
        nonlocal epoch
        for kind, w in schedule.get(step, []):
            if kind == "kill":
                streams[w] = workers.pop(w).stream
                continue
            src = workers[min(workers)]
            joiner = Worker(copy.deepcopy(base), src.comm, streams.pop(w, None) or stream(w), cfg)
            # Copies, as the bytes comm/elastic.py sends are: Optimizer.load_state_dict keeps the tensors it is
            # given, and a joiner sharing its source's AdamW moments and step counts would update them twice a step.
            state = copy.deepcopy({"model": src.model.state_dict(), "opt": src.opt.state_dict(),
                                   "sched": src.sched.state_dict(), "sync": src.sync.state_dict()})
            joiner.model.load_state_dict(state["model"])
            joiner.opt.load_state_dict(state["opt"])
            joiner.sched.load_state_dict(state["sched"])
            joiner.sync.load_state_dict(state["sync"])
            workers[w] = joiner
        if schedule.get(step):
            epoch += 1
            group = InProcessGroup(len(workers), cfg.link, seed=cfg.seed + epoch)
            for pos, w in enumerate(sorted(workers)):
                workers[w].comm = workers[w].sync.comm = group.communicator(pos)

    change(0)
    trajectory = []
    for step in range(1, STEPS + 1):
        present = [workers[w] for w in sorted(workers)]
        for w in present:
            w.forward_backward()
        before_inner_step_all([w.sync for w in present])
        for w in present:
            w.finish_tick(1)
        after_inner_step_all([w.sync for w in present])
        worker_steps += len(present)
        change(step)
        if step % 16 == 0 and 1 in workers:
            with workers[1].sync.outer_weights() as m:
                trajectory.append(round(evaluate(m, eval_batches, workers[1].precision), 4))
    # The trainer drains what is in flight without applying it: the last evaluation is the final one.
    return {"method": method, "worker_steps": worker_steps, "final_eval_loss_w1": trajectory[-1],
            "eval_loss_every_16_steps_w1": trajectory}


def main() -> None:
    torch.set_num_threads(1)
    results = []
    for method in ("diloco", "eager"):
        for name, schedule in SCHEDULES.items():
            r = {"schedule": name, **replay(method, schedule)}
            print(json.dumps(r), flush=True)
            results.append(r)
    (ROOT / "bench" / "results" / "sites_replay.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
