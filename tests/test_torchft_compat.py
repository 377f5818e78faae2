"""torchft's DiLoCo call (positional, in torchft's order) over eagerloco: the same numbers as outer_loop."""

from __future__ import annotations

import zlib

import pytest
import torch
from toy import Toy

import eagerloco
from eagerloco.config import ConfigError, OuterConfig
from eagerloco.integrations.torchft import DiLoCo, Manager

STEPS = 12


def _train(make_outer) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Toy(num_blocks=4, width=8)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    with make_outer(model, inner):
        for step in range(1, STEPS + 1):
            g = torch.Generator().manual_seed(zlib.crc32(f"toy/{step}".encode()))
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, generator=g)
            inner.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            inner.step()
    return [p.detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_diloco_in_torchfts_argument_order_is_outer_loop_bit_for_bit() -> None:
    def ported(model, inner):
        outer_opt = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        return DiLoCo(Manager(), [model], inner, outer_opt, 3)  # positional, as torchft's scripts call it

    def native(model, inner):
        return eagerloco.outer_loop(model, inner, OuterConfig(method="diloco", inner_steps=3, outer_lr=0.7))

    got, want = _train(ported), _train(native)
    assert _same(got, want)
    assert not _same(got, _train(lambda m, i: eagerloco.outer_loop(m, i, OuterConfig(method="diloco", inner_steps=3,
                                                                                      outer_lr=0.3))))


def test_streaming_fragments_delay_alpha_and_an_optimizer_per_fragment() -> None:
    def ported(model, inner):
        frags = [torch.nn.ModuleList([model.blocks[0], model.blocks[1]]),
                 torch.nn.ModuleList([model.blocks[2], model.blocks[3]])]
        outer = [torch.optim.SGD(f.parameters(), lr=0.5, momentum=0.8, nesterov=True) for f in frags]
        return DiLoCo(None, frags, inner, outer, 4, torch.device("cpu"), True, False, None, False, 1, 0.5)

    def native(model, inner):
        frags = [torch.nn.ModuleList([model.blocks[0], model.blocks[1]]),
                 torch.nn.ModuleList([model.blocks[2], model.blocks[3]])]
        config = OuterConfig(method="streaming", inner_steps=4, fragments=2, fragment_pattern="sequential",
                             overlap_steps=1, alpha=0.5, outer_lr=0.5, outer_momentum=0.8)
        return eagerloco.outer_loop(torch.nn.ModuleList(frags), inner, config, blocks=frags)

    assert _same(_train(ported), _train(native))


def test_what_cannot_port_is_named() -> None:
    torch.manual_seed(0)
    model = Toy(num_blocks=2, width=4)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    outer_opt = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    with pytest.raises(TypeError, match=r"Manager\(outer_addr='host:port', worker_id=i, workers=M\)"):
        DiLoCo(object(), [model], inner, outer_opt, 3)
    grouped = torch.optim.SGD([{"params": [model.embed], "lr": 0.1}, {"params": [model.head]}], lr=0.7)
    with pytest.raises(ConfigError, match="param group 0 has settings of its own"):
        DiLoCo(None, [model], inner, grouped, 3)
    with pytest.raises(ConfigError, match="a list of 3 optimizers for 1 model fragments"):
        DiLoCo(None, [model], inner, [outer_opt] * 3, 3)
    quantized = DiLoCo(None, [model], inner, outer_opt, 3, should_quantize=True)
    assert quantized.config.codec == "fp8" and quantized.config.method == "diloco"
    quantized.close()


def test_a_torchft_style_checkpoint_of_the_outer_optimizer_resumes_bit_for_bit() -> None:
    """torchft scripts checkpoint model, inner and outer optimizer state dicts: the outer optimizer passed
    is the one that steps, so its state dict carries the outer momentum, and a resume at a sync step
    gives the numbers of a run never stopped."""
    def new_run():  # noqa: ANN202 - model, inner, outer optimizer, manager, DiLoCo
        torch.manual_seed(0)
        model = Toy(num_blocks=4, width=8)
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        manager = Manager()
        return model, inner, outer, manager, lambda: DiLoCo(manager, [model], inner, outer, 3)

    def steps(model, inner, first: int, last: int) -> None:  # noqa: ANN001
        for step in range(first, last + 1):
            g = torch.Generator().manual_seed(zlib.crc32(f"toy/{step}".encode()))
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, generator=g)
            inner.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            inner.step()

    model, inner, outer, manager, diloco = new_run()
    with diloco():
        steps(model, inner, 1, STEPS)
        assert manager.current_step() == STEPS // 3 and manager.num_participants() == 1
    want = [p.detach().clone() for p in model.parameters()]

    model, inner, outer, _, diloco = new_run()
    with diloco():
        steps(model, inner, 1, 6)  # two syncs, then a checkpoint as a torchft script writes it
    saved = {"model": model.state_dict(), "inner": inner.state_dict(), "outer": outer.state_dict()}
    assert any("momentum_buffer" in s for s in saved["outer"]["state"].values())  # not an empty state

    model, inner, outer, _, diloco = new_run()
    model.load_state_dict(saved["model"])
    inner.load_state_dict(saved["inner"])
    with diloco() as loop:
        outer.load_state_dict(saved["outer"])
        assert loop.sync.outer_opts[0] is outer
        steps(model, inner, 7, STEPS)
    assert _same([p.detach() for p in model.parameters()], want)


def test_an_outer_optimizer_with_state_is_refused_with_the_order_that_works() -> None:
    torch.manual_seed(0)
    model = Toy(num_blocks=2, width=4)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    outer.step()
    with pytest.raises(ConfigError, match="already holds state: create DiLoCo first, then load"):
        DiLoCo(None, [model], inner, outer, 3)
    with pytest.raises(RuntimeError, match="has no DiLoCo yet"):
        Manager().current_step()
