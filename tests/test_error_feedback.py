"""Error feedback in the outer algorithm (section 10 of docs/algorithms.md), in closed form: the buffer loses
nothing, the uncompressed limit is DiLoCo exactly, eager applies every sent value once, and the buffers
are part of the state."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from conftest import plain_sgd_outer, run_inprocess, seeded_grads
from toy import Toy

from eagerloco.codecs import get_codec
from eagerloco.config import ConfigError, OuterConfig
from eagerloco.outer import OuterSync
from testing.scripted import ScriptedCommunicator

SPARSE = {"topk": 2, "topk_chunk": 8, "codec": "2bit"}


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _fragment_params(sync: OuterSync, p: int) -> list[torch.Tensor]:
    return [t.detach().clone() for t in sync.outer[p]]


@pytest.mark.parametrize("values", ["fp32", "2bit"])
@pytest.mark.parametrize("beta", [0.0, 0.9, 1.0])
def test_the_buffer_loses_nothing(values: str, beta: float) -> None:
    """At every sync the exchange carries e = beta * e_before + Delta, sends C = Q(TopK(e)) and keeps
    e - C: beta * e_before + Delta == e_after + C, with C at most k a chunk at the largest |e|."""
    torch.manual_seed(0)
    model = Toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    comm = ScriptedCommunicator(num_workers=2, peers=lambda i: [])
    cfg = OuterConfig(method="streaming", inner_steps=4, fragments=2, codec=values, topk=3, topk_chunk=5,
                      error_feedback=beta)
    sync = OuterSync(model, opt, comm, cfg)
    codec = get_codec(values, topk=3, chunk=5)
    grads = seeded_grads(1)
    for step in range(1, 17):
        for name, p in model.named_parameters():
            p.grad = grads(0, step, name, p.detach())
        opt.step()
        before = [_flat(frag).clone() for frag in sync.feedback.buffers]
        delta = [_flat(o) - _flat(loc).detach() for o, loc in zip(sync.outer, sync.local, strict=True)]
        launched = len(comm.calls)
        sync.after_inner_step()
        for call in comm.calls[launched:]:
            p = next(f for f in range(2) if _flat(sync.outer[f]).numel() == call.numel)
            e = _flat(call.tensors)  # what the exchange was given: the buffer after the update
            torch.testing.assert_close(e, beta * before[p] + delta[p], rtol=0, atol=1e-6)
            c = codec.unpack(codec.pack(e), e.numel())
            assert torch.equal(_flat(sync.feedback.buffers[p]), e - c)
            for sent, buf in zip(c.split(5), e.split(5), strict=True):
                kept = sent != 0
                assert int(kept.sum()) <= 3
                if int(kept.sum()) < buf.numel():
                    assert buf[kept].abs().min() >= buf[~kept].abs().max()
    assert len(comm.calls) == 8


@pytest.mark.parametrize("method", ["diloco", "streaming", "eager", "delayed"])
def test_every_value_kept_beta_zero_and_fp32_values_is_the_method_exactly(method: str) -> None:
    grads = seeded_grads(2)
    frags = {"fragments": 2} if method == "streaming" else {}
    base = OuterConfig(method=method, inner_steps=3, **frags)
    plain = run_inprocess(base, 3, 12, grads)
    full = run_inprocess(replace(base, topk=8, topk_chunk=8, error_feedback=0.0), 3, 12, grads)
    for m in range(3):
        for a, b in zip(plain[0][m].parameters(), full[0][m].parameters(), strict=True):
            assert torch.equal(a, b)
        for a, b in zip(plain[1][m].outer_parameters(), full[1][m].outer_parameters(), strict=True):
            assert torch.equal(a, b)
        assert all(t.eq(0).all() for frag in full[1][m].feedback.buffers for t in frag)


@pytest.mark.parametrize(("method", "k"), [("eager", 1), ("eager", 2), ("delayed", 1), ("delayed", 2), ("diloco", 1)])
def test_every_sent_value_is_applied_once_and_the_rest_stays_in_the_buffer(method: str, k: int) -> None:
    """beta = 1, plain outer SGD with lr 1: once everything in flight is applied, every worker's outer
    copy is theta_0 - (1/M) sum_m (sum_t Delta_m^t - e_m): what was sent, applied exactly once, whatever
    the compression did."""
    m_workers, h, rounds, eta = 3, 2, 5, 0.1
    grads = seeded_grads(9)
    rounds_kw = {"eager_rounds": k} if method != "diloco" else {}
    cfg = OuterConfig(method=method, inner_steps=h, error_feedback=1.0, **SPARSE, **rounds_kw,
                      **plain_sgd_outer(1.0))
    models, syncs, _, init = run_inprocess(cfg, m_workers, h * rounds, grads, inner_lr=eta)
    for s in syncs:
        s.drain(apply=True)
    names = syncs[0].fragment_names[0]
    shapes = dict(init.named_parameters())
    total_delta = [
        [eta * sum(grads(m, s, n, torch.zeros(shapes[n].shape)) for s in range(1, h * rounds + 1)) for n in names]
        for m in range(m_workers)
    ]
    theta0 = [shapes[n].detach() for n in names]
    expected = [
        t0 - sum(total_delta[m][i] - syncs[m].feedback.buffers[0][i] for m in range(m_workers)) / m_workers
        for i, t0 in enumerate(theta0)
    ]
    for m in range(m_workers):
        for got, want in zip(syncs[m].outer[0], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    # Something really was held back: the buffers are not empty.
    assert any(e.abs().max() > 1e-3 for s in syncs for e in s.feedback.buffers[0])


@pytest.mark.parametrize(("values", "k"), [("fp32", 1), ("fp32", 2), ("e2m1", 1)])
def test_without_error_feedback_eager_applies_what_it_sent_and_drops_the_rest(values: str, k: int) -> None:
    """No --error-feedback is beta = 0 of section 10 with the buffer's rest dropped: eager's own share is C_m/M,
    what it sent, as for the others. Plain outer SGD with lr 1, drained: every worker's outer copy is
    theta_0 - (1/M) sum_m sum_r C_m^r, each C_m^r = Q(TopK(Delta_m^r)) with Delta_m^r = eta * (the round's
    gradients summed), from the codec alone (the inner steps restart from the outer copy every round)."""
    m_workers, h, rounds, eta = 3, 2, 4, 0.1
    grads = seeded_grads(11)
    cfg = OuterConfig(method="eager", inner_steps=h, eager_rounds=k, topk=2, topk_chunk=8, codec=values,
                      **plain_sgd_outer(1.0))
    models, syncs, _, init = run_inprocess(cfg, m_workers, h * rounds, grads, inner_lr=eta)
    for s in syncs:
        s.drain(apply=True)
    names = syncs[0].fragment_names[0]
    shapes = {n: p.shape for n, p in init.named_parameters()}
    codec = get_codec(values, topk=2, chunk=8)
    sent = torch.zeros(sum(shapes[n].numel() for n in names))
    for m in range(m_workers):
        for r in range(rounds):
            steps = range(r * h + 1, (r + 1) * h + 1)
            delta = _flat([eta * sum(grads(m, st, n, torch.zeros(shapes[n])) for st in steps) for n in names])
            sent += codec.unpack(codec.pack(delta), delta.numel())
    theta0 = _flat([dict(init.named_parameters())[n].detach() for n in names])
    for s in syncs:
        torch.testing.assert_close(_flat(s.outer[0]), theta0 - sent / m_workers, rtol=0, atol=2e-6)


def test_eager_applies_its_own_sent_values_not_its_outer_gradient() -> None:
    """Eager's own share is C_m / M (what it sent), so after one round a worker's outer copy moved by
    exactly its own sent values over M, the others' not yet arrived."""
    grads = seeded_grads(4)
    cfg = OuterConfig(method="eager", inner_steps=2, error_feedback=0.5, **SPARSE, **plain_sgd_outer(1.0))
    models, syncs, group, init = run_inprocess(cfg, 2, 2, grads, inner_lr=0.1)
    theta0 = _fragment_params(OuterSync(copy.deepcopy(init), None, ScriptedCommunicator(), OuterConfig()), 0)
    for s in syncs:
        own = s.in_flight[0].handle.own
        moved = [t0 - o for t0, o in zip(theta0, s.outer[0], strict=True)]
        for got, c in zip(moved, own, strict=True):
            torch.testing.assert_close(got, c / 2, rtol=0, atol=1e-7)
        assert sum(int(c.ne(0).sum()) for c in own) <= 2 * sum(-(-c.numel() // 8) for c in own) + 2


def test_state_dict_carries_the_buffers_and_resumes_bit_for_bit() -> None:
    cfg = OuterConfig(method="eager", inner_steps=2, error_feedback=0.9, **SPARSE)
    grads = seeded_grads(5)

    def run(steps: range, model: torch.nn.Module, opt: torch.optim.Optimizer, sync: OuterSync) -> None:
        for step in steps:
            for name, p in model.named_parameters():
                p.grad = grads(0, step, name, p.detach())
            opt.step()
            sync.after_inner_step()

    def fresh(init: torch.nn.Module) -> tuple[torch.nn.Module, torch.optim.Optimizer, OuterSync]:
        model = copy.deepcopy(init)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        comm = ScriptedCommunicator(num_workers=2, peers=lambda i: [])
        return model, opt, OuterSync(model, opt, comm, cfg)

    torch.manual_seed(0)
    init = Toy()
    ref = fresh(init)
    run(range(1, 11), *ref)
    cut = fresh(init)
    run(range(1, 6), *cut)
    state = copy.deepcopy({"model": cut[0].state_dict(), "opt": cut[1].state_dict(), "sync": cut[2].state_dict()})
    assert state["sync"]["in_flight"] and any(t.ne(0).any() for f in state["sync"]["error_feedback"] for t in f)
    back = fresh(init)
    back[0].load_state_dict(state["model"])
    back[1].load_state_dict(state["opt"])
    back[2].comm.calls.extend(cut[2].comm.calls)  # the exchange count goes on
    back[2].load_state_dict(state["sync"])
    run(range(6, 11), *back)
    for a, b in zip(ref[0].parameters(), back[0].parameters(), strict=True):
        assert torch.equal(a, b)
    for fa, fb in zip(ref[2].feedback.buffers, back[2].feedback.buffers, strict=True):
        for a, b in zip(fa, fb, strict=True):
            assert torch.equal(a, b)
    # A state without buffers does not load into a run with error feedback (nor the reverse).
    plain = OuterSync(copy.deepcopy(init), None, ScriptedCommunicator(), replace(cfg, error_feedback=None))
    with pytest.raises(ValueError, match="same --error-feedback"):
        plain.load_state_dict(state["sync"])
    # A state saved before a part existed is one line naming what it lacks.
    older = {**state["sync"], "in_flight": [{k: v for k, v in x.items() if k != "window"}
                                            for x in state["sync"]["in_flight"]]}
    del older["adaptive"]
    with pytest.raises(ValueError, match=r"^the outer state lacks adaptive, window: saved by an earlier development"):
        back[2].load_state_dict(older)


def test_clear_empties_the_buffers() -> None:
    grads = seeded_grads(6)
    _, syncs, _, _ = run_inprocess(OuterConfig(method="diloco", inner_steps=2, error_feedback=1.0, **SPARSE), 1, 4,
                                   grads)
    assert any(t.ne(0).any() for t in syncs[0].feedback.buffers[0])
    syncs[0].feedback.clear()
    assert all(t.eq(0).all() for t in syncs[0].feedback.buffers[0])


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"topk": 0}, "--topk"),
    ({"topk": 9, "topk_chunk": 8}, "--topk"),
    ({"topk_chunk": 0}, "--topk-chunk"),
    ({"error_feedback": 1.5}, "--error-feedback"),
    ({"error_feedback": float("nan")}, "--error-feedback"),
    ({"method": "dp", "topk": 4}, "--method dp"),
])
def test_invalid_compression_settings_name_the_flag(kwargs: dict, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        OuterConfig(**kwargs).validate()


def test_data_parallel_state_has_no_buffers_and_round_trips() -> None:
    """dp has no outer copies and takes no error feedback: its state says so and loads back."""
    model = Toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = OuterSync(model, opt, ScriptedCommunicator(), OuterConfig(method="dp"))
    state = sync.state_dict()
    assert state["error_feedback"] is None and sync.feedback is None
    sync.load_state_dict(state)
