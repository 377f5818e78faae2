"""The optimizer-hook API (eagerloco.outer_loop): bit for bit the explicit per-step calls, in one process.

The other workers are scripted (ScriptedCommunicator: a peer's fixed contribution per exchange), so
every method runs with M = 2 semantics and no processes; tests/test_hooks_jobs.py runs real ones.
"""

from __future__ import annotations

import copy
import warnings
import zlib

import pytest
import torch
from torch import nn
from toy import Toy

import eagerloco
from eagerloco.comm.connect import connect
from eagerloco.config import ConfigError, OuterConfig
from eagerloco.outer import OuterSync
from testing.scripted import ScriptedCommunicator

METHODS = {
    "dp": {"method": "dp"},
    "diloco": {"method": "diloco", "inner_steps": 3},
    "streaming": {"method": "streaming", "inner_steps": 4, "fragments": 2, "overlap_steps": 1, "alpha": 0.5},
    "delayed": {"method": "delayed", "inner_steps": 3},
    "eager": {"method": "eager", "inner_steps": 2, "eager_rounds": 2, "fragments": 2},
    "eager_int8": {"method": "eager", "inner_steps": 3, "codec": "int8"},
    "eager_sparse": {"method": "eager", "inner_steps": 3, "topk": 2, "topk_chunk": 8, "codec": "2bit",
                     "error_feedback": 0.9, "outer_optimizer": "average", "outer_lr": 1.0},
}
STEPS = 13


def _peer(i: int, shapes: list[torch.Size]) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + i)
    return [[torch.randn(s, generator=g) * 0.01 for s in shapes]]


class _Peered(ScriptedCommunicator):
    """Worker 0 of 2; the peer's contribution to exchange i is fixed (offset: exchanges before a resume)."""

    def __init__(self, offset: int) -> None:
        super().__init__(num_workers=2, peers=lambda i: _peer(i + offset, self.shapes))
        self.shapes: list[torch.Size] = []

    def allreduce_mean(self, tensors, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.shapes = [t.shape for t in tensors]
        return super().allreduce_mean(tensors, *args, **kwargs)


def _comm(offset: int = 0) -> ScriptedCommunicator:
    return _Peered(offset)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(zlib.crc32(f"batch/{step}".encode()))
    return torch.randn(4, 3, generator=g), torch.randn(4, generator=g)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    x, y = _batch(step)
    return ((model(x) - y) ** 2).mean()


def _explicit(init: nn.Module, settings: dict, steps: int = STEPS) -> tuple[nn.Module, OuterSync]:
    model = copy.deepcopy(init)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sync = OuterSync(model, opt, _comm(), OuterConfig(**settings))
    for step in range(1, steps + 1):
        opt.zero_grad()
        _loss(model, step).backward()
        sync.before_inner_step()
        opt.step()
        sync.after_inner_step()
    sync.drain()
    return model, sync


def _hooked(init: nn.Module, settings: dict, steps: int = STEPS) -> tuple[nn.Module, eagerloco.OuterLoop]:
    model = copy.deepcopy(init)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with eagerloco.outer_loop(model, opt, OuterConfig(**settings), peers=_comm()) as outer:
        for step in range(1, steps + 1):  # the user's loop, unchanged
            opt.zero_grad()
            _loss(model, step).backward()
            opt.step()
    return model, outer


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_hooks_are_bit_for_bit_the_explicit_calls(name: str, toy: Toy) -> None:
    settings = METHODS[name]
    ref_model, ref_sync = _explicit(toy, settings)
    model, outer = _hooked(toy, settings)
    _same(list(model.parameters()), list(ref_model.parameters()))
    _same(outer.outer_parameters(), ref_sync.outer_parameters())
    assert outer.sync.step == STEPS and outer.finished
    assert outer.comm.stats.bytes_sent == ref_sync.comm.stats.bytes_sent > 0
    assert not outer.inner_optimizer._optimizer_step_pre_hooks  # detached on leaving the with


def test_a_single_worker_without_torchrun_is_diloco_with_m_1(toy: Toy, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "EAGERLOCO_OUTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    model = copy.deepcopy(toy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # M = 1, H = 1, outer SGD lr 1 without momentum: plain training (ALGORITHMS.md, DiLoCo's invariant).
    with eagerloco.outer_loop(model, opt, OuterConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0,
                                                      outer_nesterov=False)) as outer:
        assert outer.num_workers == 1 and outer.config.inner_steps == 1
        for step in range(1, 6):
            opt.zero_grad()
            _loss(model, step).backward()
            opt.step()
    plain = copy.deepcopy(toy)
    popt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(1, 6):
        popt.zero_grad()
        _loss(plain, step).backward()
        popt.step()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    m = outer.metrics()
    assert m["bytes_sent"] == 0 and m["outer_syncs"] == 5 and 0 < m["compute_utilization"] <= 1


def test_fragments_as_modules(toy: Toy) -> None:
    model = copy.deepcopy(toy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    frags = [nn.ModuleList(model.blocks[:2]), nn.ModuleList(model.blocks[2:])]
    outer = eagerloco.outer_loop(model, opt, OuterConfig(method="streaming", fragments=2, fragment_pattern="sequential",
                                                     inner_steps=4), blocks=frags, peers=_comm())
    names = outer.sync.fragment_names
    assert names[0] == ["embed", "head", "blocks.0.weight", "blocks.0.bias", "blocks.1.weight", "blocks.1.bias"]
    assert names[1] == ["blocks.2.weight", "blocks.2.bias", "blocks.3.weight", "blocks.3.bias"]
    outer.close()


def test_hugging_face_layers_are_found() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters())
    outer = eagerloco.outer_loop(model, opt, OuterConfig(method="streaming", fragments=2, inner_steps=4), peers=_comm())
    layer_frags = [{n.split(".")[2] for n in f if n.startswith("model.layers.")} for f in outer.sync.fragment_names]
    assert layer_frags == [{"0", "2"}, {"1", "3"}]  # strided over model.model.layers
    assert "model.embed_tokens.weight" in outer.sync.fragment_names[0]
    outer.close()


@pytest.mark.parametrize("name", ["streaming", "eager", "eager_sparse"])
def test_state_dict_resumes_with_the_uninterrupted_numbers(name: str, toy: Toy) -> None:
    settings = METHODS[name]
    ref, _ = _hooked(toy, settings)
    # Stop after 6 steps (exchanges in flight), save everything, continue in a fresh loop.
    model = copy.deepcopy(toy)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    comm = _comm()
    with eagerloco.outer_loop(model, opt, OuterConfig(**settings), peers=comm) as outer:
        for step in range(1, 7):
            opt.zero_grad()
            _loss(model, step).backward()
            opt.step()
        saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "outer": outer.state_dict()})
        assert saved["outer"]["sync"]["in_flight"]
    model2 = copy.deepcopy(toy)
    model2.load_state_dict(saved["model"])
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.01)
    opt2.load_state_dict(saved["opt"])
    comm2 = _comm(offset=len(comm.calls))
    with eagerloco.outer_loop(model2, opt2, OuterConfig(**settings), peers=comm2) as outer2:
        outer2.load_state_dict(saved["outer"])
        for step in range(7, STEPS + 1):
            opt2.zero_grad()
            _loss(model2, step).backward()
            opt2.step()
    _same(list(model2.parameters()), list(ref.parameters()))


def test_dp_with_a_closure_averages_after_the_closure(toy: Toy) -> None:
    """Lightning (and LBFGS) compute the gradients inside step(closure): dp must average after it."""
    ref_model, _ = _explicit(toy, METHODS["dp"], steps=4)
    model = copy.deepcopy(toy)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with eagerloco.outer_loop(model, opt, OuterConfig(method="dp"), peers=_comm()):
        for step in range(1, 5):
            def closure(step: int = step) -> torch.Tensor:
                opt.zero_grad()
                loss = _loss(model, step)
                loss.backward()
                return loss

            opt.step(closure)
    _same(list(model.parameters()), list(ref_model.parameters()))


def test_an_error_in_the_loop_detaches_and_cancels(toy: Toy) -> None:
    comm = _comm()
    model = copy.deepcopy(toy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="boom"), eagerloco.outer_loop(model, opt, OuterConfig(inner_steps=2),
                                                                         peers=comm):
        raise RuntimeError("boom")
    assert not opt._optimizer_step_post_hooks


def test_workers_without_a_rendezvous_is_a_clear_error(toy: Toy, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "EAGERLOCO_OUTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match="outer_addr"):
        connect(workers=2)
    with pytest.raises(ConfigError, match=r"^worker_id must be an integer in 0\.\.1"):  # the API's name, not the flag
        connect(outer_addr="127.0.0.1:1", workers=2, worker_id=2)


@pytest.mark.parametrize(("steps", "warned"), [(4, True), (5, False), (7, False)])
def test_a_run_shorter_than_one_round_is_told_its_outer_parameters_are_the_initial_ones(
    steps: int, warned: bool, toy: Toy
) -> None:
    """Fewer steps than inner_steps: no outer step happens, and what is evaluated (the outer parameters)
    is the initial model; the loop says so at the end instead of leaving the user to find a loss at
    its initial value."""
    model = copy.deepcopy(toy)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with eagerloco.outer_loop(model, opt, OuterConfig(inner_steps=5), peers=_comm()) as outer:
            for step in range(1, steps + 1):
                opt.zero_grad()
                _loss(model, step).backward()
                opt.step()
            stuck = all(torch.equal(a, b) for a, b in zip(outer.outer_parameters(), toy.parameters(), strict=True))
    assert stuck is warned
    notes = [str(w.message) for w in caught if "less than one round" in str(w.message)]
    assert len(notes) == int(warned)
    if warned:
        assert "inner_steps 5" in notes[0] and "--" not in notes[0]
