"""Muon inner steps (--inner-optimizer muon): which parameters Muon steps, the pair as one optimizer
(steps, hooks, schedule, state), a run that trains and resumes bit for bit, and the settings' errors."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from toy import Toy

from eagerloco import checkpoint as ckpt
from eagerloco.config import ConfigError, OuterConfig, TrainConfig
from eagerloco.model import GPT, model_config
from eagerloco.optim import CombinedOptimizer, muon_parameters, muon_with_adamw
from eagerloco.outer import OuterSync
from eagerloco.train.worker import lr_lambda
from testing.scripted import ScriptedCommunicator

ARGS = ["--model", "micro", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "2", "--no-progress",
        "--workers", "2", "--inner-steps", "5", "--log-every", "3", "--warmup-steps", "3", "--steps", "24",
        "--inner-optimizer", "muon"]


def _names(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> list[str]:
    ids = {id(p) for p in params}
    return [n for n, p in model.named_parameters() if id(p) in ids]


def test_only_the_blocks_matrices_go_to_muon() -> None:
    model = GPT(model_config("tiny", vocab_size=256, seq_len=32))
    opt = muon_with_adamw(model)
    adamw, muon = opt.optimizers
    assert isinstance(adamw, torch.optim.AdamW) and isinstance(muon, torch.optim.Muon)
    matrices = [f"blocks.{i}.{w}.weight" for i in range(4) for w in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]
    rest = ["tok_emb.weight", *[f"blocks.{i}.norm{k}.weight" for i in range(4) for k in (1, 2)], "norm.weight"]
    assert _names(model, muon.param_groups[0]["params"]) == matrices
    assert sorted(_names(model, adamw.param_groups[0]["params"])) == sorted(rest)
    # A bias inside a block, and matrices outside the blocks, stay with AdamW.
    toy = Toy(num_blocks=2, width=3)
    toy.outside = torch.nn.Linear(3, 3)
    m, r = muon_parameters(toy)
    assert _names(toy, m) == ["blocks.0.weight", "blocks.1.weight"]
    assert _names(toy, r) == ["embed", "head", "blocks.0.bias", "blocks.1.bias", "outside.weight", "outside.bias"]


def test_a_model_without_blocks_is_refused() -> None:
    with pytest.raises(ConfigError, match="--inner-optimizer muon.*no blocks"):
        muon_with_adamw(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)))


def _grads(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def test_the_combination_steps_as_its_parts_and_hooks_once() -> None:
    torch.manual_seed(0)
    a = Toy(num_blocks=2, width=4)
    b = copy.deepcopy(a)
    opt = muon_with_adamw(a, lr=1e-2, muon_lr=0.05)
    mats, rest = muon_parameters(b)
    alone = [torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95)),
             torch.optim.Muon(mats, lr=0.05, weight_decay=0.1, momentum=0.95)]
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    for step in range(3):
        _grads(a, step)
        _grads(b, step)
        opt.step()
        for o in alone:
            o.step()
    assert calls == ["pre", "post"] * 3
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
    # Every parameter's state, read from its owner; zero_grad reaches both.
    assert len(opt.state) == sum(1 for _ in a.parameters())
    assert "momentum_buffer" in opt.state[a.blocks[0].weight] and "exp_avg" in opt.state[a.head]
    assert a.blocks[0].weight in opt.state and torch.zeros(1) not in opt.state
    opt.zero_grad()
    assert all(p.grad is None for p in a.parameters())


def test_state_dict_round_trip_continues_bit_for_bit() -> None:
    torch.manual_seed(1)
    a = Toy(num_blocks=2, width=4)
    opt = muon_with_adamw(a)
    _grads(a, 0)
    opt.step()
    b = copy.deepcopy(a)
    other = muon_with_adamw(b)
    groups = other.param_groups
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    # The loaded groups are the ones the combination shows, in the list it had: a scheduler sets them.
    assert other.param_groups is groups
    assert all(g is h for g, h in zip(groups, [g for o in other.optimizers for g in o.param_groups], strict=True))
    for step in (1, 2):
        _grads(a, step)
        _grads(b, step)
        opt.step()
        other.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    # A copy is a combination of copies, its views rebuilt on them.
    twin = copy.deepcopy(other)
    assert [type(o) for o in twin.optimizers] == [torch.optim.AdamW, torch.optim.Muon]
    assert twin.param_groups[1] is twin.optimizers[1].param_groups[0] and len(twin.state) == len(other.state)
    with pytest.raises(ValueError, match="holds 2 optimizers, the state dict a single optimizer's state"):
        other.load_state_dict(opt.optimizers[0].state_dict())


def test_a_parameter_in_two_optimizers_is_refused() -> None:
    p = torch.nn.Parameter(torch.ones(2, 2))
    with pytest.raises(ValueError, match="held by two"):
        CombinedOptimizer(torch.optim.AdamW([p]), torch.optim.Muon([p]))
    opt = CombinedOptimizer(torch.optim.AdamW([p]))
    with pytest.raises(TypeError, match="add the group to one of the combined optimizers"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]})


def test_the_schedule_drives_both_from_their_own_peaks() -> None:
    opt = muon_with_adamw(Toy(num_blocks=2, width=4), lr=3e-3, muon_lr=0.02)
    f = lr_lambda(3, 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, f)
    for step in range(10):
        adamw, muon = (o.param_groups[0]["lr"] for o in opt.optimizers)
        assert (adamw, muon) == (3e-3 * f(step), 0.02 * f(step)), step
        assert sched.get_last_lr() == [adamw, muon]
        opt.step()
        sched.step()


def _toy_loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 3, generator=g), torch.randn(4, generator=g)
    return ((model(x) - y) ** 2).mean()


def _peer_comm(init: torch.nn.Module) -> ScriptedCommunicator:
    """Worker 0 of 2, the other worker's contribution to exchange i a fixed tensor."""
    return ScriptedCommunicator(num_workers=2, peers=lambda i: [[torch.full(p.shape, 0.01 * (i + 1))
                                                                 for p in init.parameters()]])


def test_outer_loop_hooks_the_combination_as_the_pair_stepped_by_hand() -> None:
    """The hook API on the combined optimizer: bit for bit the explicit outer calls around AdamW's
    and Muon's own steps (each outer step after both)."""
    import eagerloco

    torch.manual_seed(3)
    init = Toy(num_blocks=2, width=3)
    settings = {"method": "diloco", "inner_steps": 3}
    by_hand = copy.deepcopy(init)
    mats, rest = muon_parameters(by_hand)
    pair = [torch.optim.AdamW(rest, lr=0.01), torch.optim.Muon(mats, lr=0.02)]
    sync = OuterSync(by_hand, None, _peer_comm(init), OuterConfig(**settings))
    for step in range(1, 8):
        _toy_loss(by_hand, step).backward()
        sync.before_inner_step()
        for opt in pair:
            opt.step()
            opt.zero_grad()
        sync.after_inner_step()
    sync.drain()
    hooked = copy.deepcopy(init)
    mats, rest = muon_parameters(hooked)
    combined = CombinedOptimizer(torch.optim.AdamW(rest, lr=0.01), torch.optim.Muon(mats, lr=0.02))
    with eagerloco.outer_loop(hooked, combined, OuterConfig(**settings), peers=_peer_comm(init)) as outer:
        for step in range(1, 8):
            _toy_loss(hooked, step).backward()
            combined.step()
            combined.zero_grad()
    assert outer.comm.stats.bytes_sent == sync.comm.stats.bytes_sent > 0
    for (name, p), q in zip(hooked.named_parameters(), by_hand.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert any(not torch.equal(p, q) for p, q in zip(hooked.parameters(), init.parameters(), strict=True))


def _config(out: Path, *more: str) -> TrainConfig:
    from eagerloco.cli import make_parser
    from eagerloco.flags import build_train_config

    return build_train_config(make_parser().parse_args(["train", *ARGS, "--out", str(out), *more]))


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


# slow: two Muon runs and a resume; Newton-Schulz runs in bf16, which these CPUs emulate (about 8 s)
@pytest.mark.slow
def test_a_muon_run_trains_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    from eagerloco.train import train

    clean, cut = tmp_path / "clean", tmp_path / "cut"
    train(_config(clean, "--checkpoint-every", "8"))
    metrics = _metrics(clean)
    steps = [m for m in metrics if "loss" in m]
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5, [m["loss"] for m in steps]
    # Both lrs on the one schedule: Muon's is its peak times AdamW's multiplier.
    f = lr_lambda(3, 24)
    for m in steps:
        assert math.isclose(m["lr"], 3e-3 * f(m["step"]), rel_tol=1e-12), m
        assert math.isclose(m["muon_lr"], 0.02 * f(m["step"]), rel_tol=1e-12), m
    # The run as if it had died right after its step-16 checkpoint (mid-round: H = 5), then resumed.
    shutil.copytree(clean, cut)
    shutil.rmtree(ckpt.list_checkpoints(ckpt.checkpoint_root(cut))[-1])
    train(_config(cut, "--checkpoint-every", "8", "--resume"))
    assert [m.get("loss") for m in _metrics(cut)] == [m.get("loss") for m in metrics]
    a, b = (json.loads((run / "summary.json").read_text()) for run in (clean, cut))
    assert a["final_eval_loss"] == b["final_eval_loss"]
    last = [ckpt.list_checkpoints(ckpt.checkpoint_root(run))[-1] for run in (clean, cut)]
    assert last[1].name == "step_00000024"
    for w in range(2):
        sa, sb = (ckpt.load_worker_state(p, w) for p in last)
        muon_a, muon_b = (s["opt"]["optimizers"][1]["state"] for s in (sa, sb))
        assert muon_a.keys() == muon_b.keys() and len(muon_a) == 16
        for k in muon_a:
            assert torch.equal(muon_a[k]["momentum_buffer"], muon_b[k]["momentum_buffer"]), (w, k)
        assert all(torch.equal(sa["model"][k], sb["model"][k]) for k in sa["model"]), w


def test_resuming_with_the_other_optimizer_is_refused(tmp_path: Path) -> None:
    from eagerloco.train.resume import check_resume_config

    saved = json.loads(json.dumps(TrainConfig().__dict__, default=lambda o: o.__dict__))
    with pytest.raises(ConfigError, match="inner_optimizer: 'adamw' -> 'muon'"):
        check_resume_config(saved, TrainConfig(inner_optimizer="muon"))


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("inner_optimizer", "sgd", "--inner-optimizer must be one of adamw, muon"),
        ("muon_lr", 0.0, "--muon-lr must be a finite number > 0"),
        ("muon_lr", -0.02, "--muon-lr must be a finite number > 0"),
        ("muon_lr", float("nan"), "--muon-lr must be a finite number > 0"),
        ("muon_lr", float("inf"), "--muon-lr must be a finite number > 0"),
        ("muon_lr", 11.0, "--muon-lr must be a finite number > 0 and at most 10"),
        ("muon_lr", "0.02", "--muon-lr must be a finite number > 0"),
        ("muon_momentum", 1.0, r"--muon-momentum must be a number in \[0, 1\)"),
        ("muon_momentum", -0.1, r"--muon-momentum must be a number in \[0, 1\)"),
        ("muon_momentum", float("nan"), r"--muon-momentum must be a number in \[0, 1\)"),
        ("muon_momentum", True, r"--muon-momentum must be a number in \[0, 1\)"),
    ],
)
def test_invalid_settings_name_the_flag(field: str, value: object, flag: str) -> None:
    with pytest.raises(ConfigError, match=f"^{flag}") as info:
        TrainConfig(**{field: value}).validate()
    assert "\n" not in str(info.value)


def test_the_muloco_grid_entry_resolves_to_a_valid_muon_config() -> None:
    from eagerloco.lab import compare

    base = TrainConfig(outer=OuterConfig(inner_steps=20))
    [plan] = compare.plan_runs(base, compare.resolve_grid("muloco"), Path("unused"), 0.35)
    assert plan.cfg.inner_optimizer == "muon" and plan.cfg.outer.method == "diloco"
    plan.cfg.validate()
    assert compare.ENTRIES["muloco"].fixes("inner_optimizer")


def test_the_demo_says_a_muon_run_is_no_sample_of_the_seeded_adamw_comparison() -> None:
    """The shipped comparison ran before --inner-optimizer existed: it counts as adamw, and a muon run
    is named as a change of its protocol."""
    from dataclasses import asdict, replace

    from eagerloco.lab.compare import demo
    from eagerloco.lab.compare.reference import load_reference, protocol_of

    ref = load_reference()
    assert ref["protocol"]["inner_optimizer"] == "adamw"
    base = TrainConfig(**{k: v for k, v in ref["protocol"].items() if k in ("steps", "tokenizer", "batch_size")})
    old = {k: v for k, v in asdict(base).items() if k != "inner_optimizer"}  # a summary from before the setting
    assert protocol_of(old)["inner_optimizer"] == "adamw"
    changes = demo.protocol_changes(replace(base, inner_optimizer="muon"), ref)
    assert "inner_optimizer muon (seeded: adamw)" in changes
    assert not any("inner_optimizer" in c for c in demo.protocol_changes(base, ref))
