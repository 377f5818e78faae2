"""Workers of several ranks, end to end: replicated inside the worker (data-parallel) and sharded
(--fsdp); real processes, gloo on loopback, real files (helpers shared with test_dist_train.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_dist_train import METHODS, SHARED, assert_same_state, final_state, inprocess, launch

from eagerloco import checkpoint as ckpt
from eagerloco.comm.base import wire_bytes

RANKS2 = [*METHODS["streaming"], "--steps", "10", "--checkpoint-every", "10", "--grad-clip", "0"]  # mid-round


@pytest.fixture(scope="module")
def ranks2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Streaming DiLoCo on 2 workers x 2 ranks, replicated ("ddp": data-parallel inside the worker) and
    sharded ("fsdp"), each run once and shared by the tests below. No gradient clipping: its norm is
    summed over shards in another order."""
    root = tmp_path_factory.mktemp("ranks2")
    for name, extra in (("fsdp", ["--fsdp"]), ("ddp", [])):
        r = launch(root / name, 2, [*RANKS2, *extra], ranks=2)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {name: root / name for name in ("fsdp", "ddp")}


def _rank_states(out: Path) -> list[dict]:
    path = ckpt.list_checkpoints(ckpt.checkpoint_root(out))[-1]
    return [ckpt.load_worker_state(path, rank) for rank in range(4)]


@pytest.mark.processes
def test_two_ranks_per_worker_stay_identical_and_count_one_exchange(ranks2: dict[str, Path]) -> None:
    ranks = _rank_states(ranks2["ddp"])
    for w in range(2):
        first, second = ranks[2 * w], ranks[2 * w + 1]
        for k in first["model"]:
            assert torch.equal(first["model"][k], second["model"][k]), k
        assert first["stream"]["num_tokens"] == second["stream"]["num_tokens"]
        assert first["stream"]["seed"] != second["stream"]["seed"]  # each rank draws its own batches
    assert not torch.equal(ranks[0]["model"]["blocks.0.attn.qkv.weight"], ranks[2]["model"]["blocks.0.attn.qkv.weight"])
    s = json.loads((ranks2["ddp"] / "summary.json").read_text())
    # One outer exchange per worker and fragment sync, not one per rank: fragment p of P = 2 syncs at
    # the steps t <= 10 with t mod H == round(p * H / P), H = 4 (steps 4, 8 and 2, 6, 10).
    sizes = [sum(t.numel() for t in frag) for frag in ranks[0]["sync"]["outer"]]
    assert len(sizes) == 2 and sum(sizes) == s["num_params"]
    syncs = [sum(1 for t in range(1, 11) if t % 4 == off) for off in (0, 2)]
    assert syncs == [2, 3] and s["syncs_per_worker"] == sum(syncs)
    # M = 2 ring: one fp32 payload of the fragment per exchange.
    assert s["bytes_sent_per_worker"] == sum(k * wire_bytes(4 * n, 2, True) for k, n in zip(syncs, sizes, strict=True))
    assert len(s["per_worker"]) == 2


def _full(shards: list[torch.Tensor]) -> torch.Tensor:
    """A parameter from its FSDP shards (dim 0 split over the worker's ranks)."""
    return torch.cat(shards) if shards[0].dim() else shards[0]


@pytest.mark.processes
def test_fsdp_shards_each_worker_and_exchanges_shards_with_the_replicated_numbers(ranks2: dict[str, Path]) -> None:
    """--fsdp: each of a worker's 2 ranks holds half of every parameter and exchanges that half; the
    run ends bit for bit where the replicated run (2 ranks per worker, data-parallel) ends, with the
    same bytes on the link."""
    runs = {name: _rank_states(out) for name, out in ranks2.items()}
    for w in range(2):
        first, second = runs["fsdp"][2 * w], runs["fsdp"][2 * w + 1]
        ref = runs["ddp"][2 * w]
        for k, full in ref["model"].items():
            if full.dim():  # a shard each: half the rows (the rank's own part of the parameter)
                assert first["model"][k].shape[0] == (full.shape[0] + 1) // 2, k
                assert not torch.equal(first["model"][k], second["model"][k][: first["model"][k].shape[0]]), k
            assert torch.equal(_full([first["model"][k], second["model"][k]]), full), k
        for fa, fb, fr in zip(first["sync"]["outer"], second["sync"]["outer"], ref["sync"]["outer"], strict=True):
            for a, b, c in zip(fa, fb, fr, strict=True):
                assert torch.equal(_full([a, b]), c)
        ranks_sent = [runs["fsdp"][2 * w + i]["stats"]["bytes_sent"] for i in range(2)]
        assert sum(ranks_sent) == ref["stats"]["bytes_sent"] and min(ranks_sent) > 0
    sf, sd = (json.loads((ranks2[n] / "summary.json").read_text()) for n in ("fsdp", "ddp"))
    assert sf["fsdp"] is True and sd["fsdp"] is False
    for k in ("bytes_sent_per_worker", "peak_sync_bytes", "syncs_per_worker", "num_params"):
        assert sf[k] == sd[k], k
    assert sf["final_eval_loss"] == sd["final_eval_loss"]
    assert len(sf["per_worker"]) == 2


@pytest.mark.processes
def test_fsdp_ranks_share_the_workers_emulated_link(tmp_path: Path) -> None:
    """Each of a worker's 2 ranks sends half the payload over half the link's bandwidth, so a DiLoCo
    round blocks for the whole payload's link time, as with one rank sending it all."""
    n_bytes = 820_352 * 4  # tiny preset, fp32
    link_time = 0.3
    bw = n_bytes * 8 / link_time / 1e9  # M = 2: the ring sends one payload's worth per worker
    args = ["--method", "diloco", "--inner-steps", "4", "--steps", "8", "--bandwidth-gbps", f"{bw:.6f}", "--fsdp"]
    r = launch(tmp_path, 2, args, ranks=2)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["bytes_sent_per_worker"] == 2 * n_bytes
    assert s["blocked_s"] >= 0.95 * 2 * link_time, s["blocked_s"]  # 2 rounds; the full link would halve it


@pytest.mark.processes
def test_fsdp_resume_after_a_killed_worker_gives_the_uninterrupted_numbers(tmp_path: Path) -> None:
    """Sharded checkpoints: every rank writes its shards; after worker 1 dies the others stop naming it,
    and resuming (4-bit eager, two rounds in flight) ends bit for bit where an uninterrupted run ends.
    Resuming with another layout is refused. The inner optimizer is Muon for the blocks' matrices (its
    Newton-Schulz products work on the DTensor shards) and AdamW for the rest: each rank checkpoints its
    half of both optimizers' state."""
    # The micro preset: Muon's Newton-Schulz runs in bf16, which a CPU without bf16 matmul emulates slowly.
    args = [*METHODS["eager"], *SHARED, "--fsdp", "--inner-optimizer", "muon", "--model", "micro"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    r = launch(ref, 2, args, ranks=2)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = launch(run, 2, args, ranks=2, kill="1:6:0.01")
    assert r.returncode != 0 and "worker 1" in r.stdout and "Traceback" not in r.stdout, r.stdout[-3000:]
    path, meta = ckpt.latest_valid(ckpt.checkpoint_root(run))
    assert meta["step"] == 4 and meta["fsdp"] is True and len(meta["files"]) == 4, path
    r = launch(run, 2, [*(a for a in args if a != "--fsdp"), "--resume"], ranks=2)
    assert r.returncode != 0 and "--ranks-per-worker 2 --fsdp" in r.stdout + r.stderr, r.stdout[-3000:]
    r = launch(run, 2, [*args, "--resume"], ranks=2)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for rank in range(4):
        a, b = final_state(ref, rank), final_state(run, rank)
        assert_same_state(a, b, f"rank {rank}", exact=True)
        adamw, muon = a["opt"]["optimizers"]
        assert len(muon["state"]) == 16 and muon["state"][0]["momentum_buffer"].shape == (96, 64)  # qkv: 192/2
        for part_a, part_b in zip(a["opt"]["optimizers"], b["opt"]["optimizers"], strict=True):
            for x, y in zip(part_a["state"].values(), part_b["state"].values(), strict=True):
                for k in x:
                    assert torch.equal(x[k], y[k]), k
    sa, sb = (json.loads((p / "summary.json").read_text()) for p in (ref, run))
    assert sa["final_eval_loss"] == sb["final_eval_loss"]


@pytest.mark.processes
def test_fsdp_needs_several_ranks_per_worker(tmp_path: Path) -> None:
    r = launch(tmp_path, 2, [*METHODS["diloco"], "--steps", "2", "--fsdp"], ranks=1)
    assert r.returncode != 0
    assert "--fsdp shards each worker's model over its ranks" in r.stdout + r.stderr, r.stdout[-2000:]
    r = inprocess(tmp_path / "inproc", 2, ["--steps", "2", "--fsdp"])
    assert r.returncode != 0 and "--fsdp needs several processes" in r.stderr, r.stderr[-2000:]


def test_sharded_accounting_adds_a_workers_shards() -> None:
    """Each rank of a sharded worker moves its shard at the same time: bytes and the peak payload add
    up, times are the mean over the worker's ranks, syncs are counted once."""
    from eagerloco.train.outputs import per_worker as _per_worker

    def entry(worker: int, sent: int, peak: int, compute: float, slow: int) -> dict:
        stats = {"bytes_sent": sent, "bytes_received": sent, "peak_sync_bytes": peak, "num_syncs": 3,
                 "compute_s": compute, "overhead_s": compute / 4, "blocked_s": 1.0, "drain_s": 0.5,
                 "slow_steps": slow}
        return {"outer": True, "worker": worker, "stats": stats, "wall": compute + 1}

    merged = _per_worker([entry(1, 30, 7, 4.0, 0), entry(0, 10, 5, 2.0, 1), entry(0, 12, 6, 4.0, 0),
                          entry(1, 30, 7, 2.0, 2)])
    assert [m["worker"] for m in merged] == [0, 1]
    s0 = merged[0]["stats"]
    assert (s0["bytes_sent"], s0["bytes_received"], s0["peak_sync_bytes"], s0["num_syncs"]) == (22, 22, 11, 3)
    assert (s0["compute_s"], s0["overhead_s"], s0["blocked_s"], s0["slow_steps"]) == (3.0, 0.75, 1.0, 1)
    assert merged[0]["wall"] == 5.0 and merged[1]["stats"]["slow_steps"] == 2
    one = entry(2, 1, 1, 1.0, 0)
    assert _per_worker([one]) == [one]  # a worker with one link-using rank: its entry as it is
