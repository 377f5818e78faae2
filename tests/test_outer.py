"""Closed-form tests of the outer algorithm, in-process (exact math)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import constant_grads, plain_sgd_outer, run_inprocess, seeded_grads
from toy import Toy

from eagerloco.codecs import get_codec
from eagerloco.comm.base import ReadyHandle
from eagerloco.comm.inprocess import InProcessGroup
from eagerloco.config import ConfigError, LinkConfig, OuterConfig
from eagerloco.fragments import assign_fragments
from eagerloco.outer import OuterSync
from eagerloco.schedule import block_groups


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def outer_params(sync: OuterSync) -> list[torch.Tensor]:
    return [t.clone() for t in sync.outer_parameters()]


def assert_all_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), (x - y).abs().max()


def assert_all_close(a: list[torch.Tensor], b: list[torch.Tensor], tol: float = 1e-5) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)


# --------------------------------------------------------------------------- sign and outer step
def test_outer_gradient_sign_moves_toward_the_workers() -> None:
    """Outer SGD lr 1 without momentum lands exactly on the workers' mean: Delta = start - end."""
    cfg = OuterConfig(method="diloco", inner_steps=3, **plain_sgd_outer(1.0))
    models, syncs, _, init = run_inprocess(cfg, 2, 2, constant_grads([1.0, 3.0]))  # mid-round: locals differ
    locals_ = [params(m) for m in models]
    # finish the round: one more step then the sync
    models, syncs, _, init = run_inprocess(cfg, 2, 3, constant_grads([1.0, 3.0]))
    theta0 = params(init)
    v = [torch.arange(1, p.numel() + 1, dtype=torch.float32).view(p.shape) for p in theta0]
    expected = [t - 0.1 * 3 * 2.0 * vv for t, vv in zip(theta0, v, strict=True)]  # mean gradient scale 2
    assert_all_close(outer_params(syncs[0]), expected)
    for p0, p1, l0 in zip(theta0, outer_params(syncs[0]), locals_[0], strict=True):
        assert (p1 < p0).all() and (l0 < p0).all()  # positive gradients: both move down


def test_outer_nesterov_step_closed_form() -> None:
    """Two rounds of DiLoCo with outer SGD (lr 0.7, momentum 0.9, Nesterov) on constant gradients."""
    eta, h, lr, mu = 0.1, 3, 0.7, 0.9
    cfg = OuterConfig(method="diloco", inner_steps=h)
    models, syncs, _, init = run_inprocess(cfg, 2, 2 * h, constant_grads([1.0, 2.0]), inner_lr=eta)
    for p0, p2, local in zip(params(init), outer_params(syncs[1]), params(models[1]), strict=True):
        v = torch.arange(1, p0.numel() + 1, dtype=torch.float32).view(p0.shape)
        d = h * eta * 1.5 * v  # mean outer gradient, the same every round
        buf1 = d
        p1 = p0 - lr * (d + mu * buf1)
        buf2 = mu * buf1 + d
        expected = p1 - lr * (d + mu * buf2)
        torch.testing.assert_close(p2, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(local, p2)  # alpha 0: the local parameters restart from the outer copy


# --------------------------------------------------------------------------- invariants
def test_single_worker_h1_lr1_equals_plain_training() -> None:
    torch.manual_seed(1)
    data = [(torch.randn(8, 3), torch.randn(8)) for _ in range(12)]
    base = Toy()
    plain = copy.deepcopy(base)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for x, y in data:
        opt.zero_grad()
        ((plain(x) - y) ** 2).mean().backward()
        opt.step()
    model = copy.deepcopy(base)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    group = InProcessGroup(1)
    sync = OuterSync(model, inner, group.communicator(0), OuterConfig(inner_steps=1, **plain_sgd_outer(1.0)))
    for x, y in data:
        inner.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        sync.before_inner_step()
        inner.step()
        sync.after_inner_step()
    assert sync.step == len(data)
    assert_all_close(outer_params(sync), params(plain), tol=1e-6)
    assert_all_close(params(model), params(plain), tol=1e-6)


def test_streaming_p1_tau0_alpha0_equals_diloco_exactly() -> None:
    grads = seeded_grads(3)
    a = run_inprocess(OuterConfig(method="diloco", inner_steps=4), 2, 13, grads)
    b = run_inprocess(OuterConfig(method="streaming", inner_steps=4, fragments=1, alpha=0.0), 2, 13, grads)
    for m in range(2):
        assert_all_equal(params(a[0][m]), params(b[0][m]))
        assert_all_equal(outer_params(a[1][m]), outer_params(b[1][m]))


def test_eager_single_worker_equals_diloco_exactly() -> None:
    grads = seeded_grads(4)
    a = run_inprocess(OuterConfig(method="diloco", inner_steps=3), 1, 12, grads)
    b = run_inprocess(OuterConfig(method="eager", inner_steps=3), 1, 12, grads)
    assert_all_equal(params(a[0][0]), params(b[0][0]))
    assert_all_equal(outer_params(a[1][0]), outer_params(b[1][0]))


@pytest.mark.parametrize("k", [1, 2])
def test_eager_with_identical_data_equals_diloco_once_in_flight_lands(k: int) -> None:
    """Identical data: eager's outer params equal DiLoCo's once the (M-1)/M still in flight is applied."""
    same = seeded_grads(5)

    def grads(m: int, step: int, name: str, p: torch.Tensor) -> torch.Tensor:
        return same(0, step, name, p)

    cfg = dict(inner_steps=2, **plain_sgd_outer(1.0))
    dil = run_inprocess(OuterConfig(method="diloco", **cfg), 4, 10, grads)
    eag = run_inprocess(OuterConfig(method="eager", eager_rounds=k, **cfg), 4, 10, grads)
    for s in eag[1]:
        s.drain(apply=True)
    for m in range(4):
        assert_all_close(outer_params(eag[1][m]), outer_params(dil[1][0]), tol=1e-5)
    # Before draining, the workers' copies agree with each other (identical data) but not with DiLoCo.
    fresh = run_inprocess(OuterConfig(method="eager", eager_rounds=k, **cfg), 4, 10, grads)
    assert_all_equal(outer_params(fresh[1][0]), outer_params(fresh[1][3]))
    assert not torch.allclose(outer_params(fresh[1][0])[0], outer_params(dil[1][0])[0])


# --------------------------------------------------------------------------- exactly-once accounting
def _round_deltas(grads, workers: int, rounds: int, h: int, eta: float, init: torch.nn.Module):
    """Delta_m^(t) for inner SGD on parameter-independent gradients: eta * sum of the round's grads."""
    names = [n for n, _ in init.named_parameters()]
    shapes = [p.shape for p in init.parameters()]
    out = []
    for t in range(1, rounds + 1):
        per_worker = []
        for m in range(workers):
            per_worker.append([
                eta * sum(grads(m, s, n, torch.zeros(sh)) for s in range((t - 1) * h + 1, t * h + 1))
                for n, sh in zip(names, shapes, strict=True)
            ])
        out.append(per_worker)
    return out  # [round][worker][param]


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("weighting", ["nonlocal", "stale_average"])
def test_eager_applies_each_outer_gradient_once(k: int, weighting: str) -> None:
    m_workers, h, rounds, eta = 3, 2, 4, 0.1
    grads = seeded_grads(7)
    cfg = OuterConfig(method="eager", inner_steps=h, eager_rounds=k, eager_weighting=weighting,
                      **plain_sgd_outer(1.0))
    models, syncs, _, init = run_inprocess(cfg, m_workers, h * rounds, grads, inner_lr=eta)
    deltas = _round_deltas(grads, m_workers, rounds, h, eta, init)
    theta0 = params(init)
    for m in range(m_workers):
        expected = []
        for i, p0 in enumerate(theta0):
            own = sum(deltas[t][m][i] for t in range(rounds)) / m_workers
            landed = range(rounds - k)  # rounds whose exchange has arrived
            if weighting == "nonlocal":
                others = sum(deltas[t][j][i] for t in landed for j in range(m_workers) if j != m) / m_workers
            else:
                mean = [sum(deltas[t][j][i] for j in range(m_workers)) / m_workers for t in landed]
                others = (m_workers - 1) / m_workers * sum(mean) if mean else 0.0
            expected.append(p0 - own - others)
        assert_all_close(outer_params(syncs[m]), expected, tol=1e-5)
        assert_all_close(params(models[m]), expected, tol=1e-5)  # local restarted from outer


@pytest.mark.parametrize("k", [1, 2])
def test_naive_delayed_applies_the_mean_k_rounds_late(k: int) -> None:
    m_workers, h, rounds, eta = 2, 3, 4, 0.05
    grads = seeded_grads(8)
    cfg = OuterConfig(method="delayed", inner_steps=h, eager_rounds=k, **plain_sgd_outer(1.0))
    models, syncs, _, init = run_inprocess(cfg, m_workers, h * rounds, grads, inner_lr=eta)
    deltas = _round_deltas(grads, m_workers, rounds, h, eta, init)
    expected = [
        p0 - sum(sum(deltas[t][j][i] for j in range(m_workers)) / m_workers for t in range(rounds - k))
        for i, p0 in enumerate(params(init))
    ]
    for m in range(m_workers):
        assert_all_close(outer_params(syncs[m]), expected)
        assert_all_close(params(models[m]), expected)
    # After round 1 nothing has arrived: the workers restart from theta_0.
    models1, syncs1, _, init1 = run_inprocess(cfg, m_workers, h, grads, inner_lr=eta)
    assert_all_equal(params(models1[0]), params(init1))


# --------------------------------------------------------------------------- fragments
def test_fragment_assignment_patterns() -> None:
    assert block_groups(6, 3, "strided") == [[0, 3], [1, 4], [2, 5]]
    assert block_groups(6, 3, "sequential") == [[0, 1], [2, 3], [4, 5]]
    assert block_groups(7, 3, "sequential") == [[0, 1, 2], [3, 4], [5, 6]]
    torch.manual_seed(0)
    model = Toy(num_blocks=6)
    for pattern in ("strided", "sequential"):
        frags = assign_fragments(model, 3, pattern)
        names = [n for f in frags for n, _ in f]
        assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # each exactly once
        assert len(names) == len(set(names))
        assert {"embed", "head"} <= {n for n, _ in frags[0]}  # outside the blocks -> fragment 0
    strided = [sorted({n.split(".")[1] for n, _ in f if n.startswith("blocks")}) for f in assign_fragments(model, 3)]
    assert strided == [["0", "3"], ["1", "4"], ["2", "5"]]
    seq = [sorted({n.split(".")[1] for n, _ in f if n.startswith("blocks")})
           for f in assign_fragments(model, 3, "sequential")]
    assert seq == [["0", "1"], ["2", "3"], ["4", "5"]]


@pytest.mark.parametrize("codec", ["fp32", "e2m1", "int8"])
def test_each_fragment_syncs_once_per_round_at_its_offset(codec: str) -> None:
    h, p_frag, steps = 6, 3, 18
    torch.manual_seed(0)
    model = Toy(num_blocks=6, width=5)
    cfg = OuterConfig(method="streaming", inner_steps=h, fragments=p_frag, codec=codec)
    group = InProcessGroup(2)
    log: list[tuple[int, int, int]] = []
    syncs = []
    for m in range(2):
        replica = copy.deepcopy(model)
        sync = OuterSync(replica, None, group.communicator(m), cfg)
        comm = group.communicator(m)
        original = comm.allreduce_mean

        def record(tensors, c, gen=None, *, keep_own=True, _orig=original, _sync=sync, _m=m):
            handle = _orig(tensors, c, gen, keep_own=keep_own)
            if _m == 0:
                log.append((_sync.step, sum(t.numel() for t in tensors), handle.payload_bytes))
            return handle

        comm.allreduce_mean = record  # type: ignore[method-assign]
        syncs.append(sync)
    for _ in range(steps):
        for s in syncs:
            s.launch_outer()
        for s in syncs:
            s.finish_outer()
    sizes = [sum(p.numel() for p in frag) for frag in syncs[0].local]
    assert [step for step, _, _ in log] == [2, 4, 6, 8, 10, 12, 14, 16, 18]  # offsets 0, 2, 4 of H=6
    frag_of_step = {0: 0, 2: 1, 4: 2}
    c = get_codec(codec)
    for step, numel, nbytes in log:
        frag = frag_of_step[step % h]
        assert numel == sizes[frag]
        assert nbytes == c.packed_nbytes(numel)
        if c.bits < 32:  # codes packed at `bits` per value, plus the same scale size for every block
            per_block_scale = c.packed_nbytes(c.block_size) - math.ceil(c.block_size * c.bits / 8)
            assert nbytes == math.ceil(numel * c.bits / 8) + math.ceil(numel / c.block_size) * per_block_scale
        else:
            assert nbytes == 4 * numel
    st = group.communicator(0).stats
    assert st.num_syncs == len(log)
    assert st.peak_sync_bytes == max(c.packed_nbytes(s) for s in sizes)


# --------------------------------------------------------------------------- tau overlap and alpha merge
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_overlap_merge_closed_form(alpha: float) -> None:
    h, tau, eta, lr = 4, 1, 0.1, 0.5
    cfg = OuterConfig(method="diloco", inner_steps=h, overlap_steps=tau, alpha=alpha, **plain_sgd_outer(lr))
    c = [1.0, 3.0]
    models, syncs, _, init = run_inprocess(cfg, 2, h + tau, constant_grads(c), inner_lr=eta)
    for m in range(2):
        for p0, outer, local in zip(params(init), outer_params(syncs[m]), params(models[m]), strict=True):
            v = torch.arange(1, p0.numel() + 1, dtype=torch.float32).view(p0.shape)
            new_outer = p0 - lr * h * eta * (sum(c) / 2) * v
            local_after = p0 - (h + tau) * eta * c[m] * v
            torch.testing.assert_close(outer, new_outer, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(local, alpha * local_after + (1 - alpha) * new_outer, rtol=1e-6, atol=1e-6)
    # Before the exchange lands (step H, tau = 1), the local parameters are untouched.
    models, syncs, _, init = run_inprocess(cfg, 2, h, constant_grads(c), inner_lr=eta)
    assert_all_equal(outer_params(syncs[0]), params(init))


# --------------------------------------------------------------------------- simulated link
def test_simulated_link_blocked_time_closed_form() -> None:
    h, rounds, step_time, lat = 5, 2, 0.1, 20.0
    torch.manual_seed(0)
    model = Toy()
    n = sum(p.numel() for p in model.parameters())
    bw = 4 * n * 8 / 0.3 / 1e9  # one fp32 exchange (wire 2(M-1)/M * 4N = 4N for M = 2) takes 0.3 s + latency
    transfer = lat / 1e3 + 4 * n * 8 / (bw * 1e9)
    link = LinkConfig(bandwidth_gbps=bw, latency_ms=lat)
    dil = run_inprocess(OuterConfig(method="diloco", inner_steps=h), 2, h * rounds, seeded_grads(), model=model,
                        link=link, step_time=step_time)
    st = dil[2].communicator(0).stats
    assert st.compute_s == pytest.approx(h * rounds * step_time)
    assert st.blocked_s == pytest.approx(rounds * transfer, rel=1e-9)
    assert st.bytes_sent == rounds * 4 * n
    eag = run_inprocess(OuterConfig(method="eager", inner_steps=h), 2, h * rounds, seeded_grads(), model=model,
                        link=link, step_time=step_time)
    assert eag[2].communicator(0).stats.blocked_s == 0.0  # 0.32 s fits in a 0.5 s round
    slow = LinkConfig(bandwidth_gbps=bw / 4, latency_ms=lat)  # 1.22 s per exchange: more than a round
    eag_slow = run_inprocess(OuterConfig(method="eager", inner_steps=h), 2, h * 3, seeded_grads(), model=model,
                             link=slow, step_time=step_time)
    assert eag_slow[2].communicator(0).stats.blocked_s > 0.0


def test_lockstep_violation_is_a_clear_error() -> None:
    group = InProcessGroup(2)
    codec = get_codec("fp32")
    handle = group.communicator(0).allreduce_mean([torch.ones(3)], codec)
    with pytest.raises(RuntimeError, match=r"worker\(s\) \[1\] have not launched"):
        handle.wait()
    group.communicator(1).allreduce_mean([torch.ones(3) * 3], codec)
    assert torch.equal(handle.wait()[0], torch.full((3,), 2.0))
    with pytest.raises(RuntimeError, match="already waited"):
        handle.wait()


@pytest.mark.parametrize("codec_name", ["fp32", "int8"])
def test_wait_hands_over_fresh_tensors(codec_name: str) -> None:
    """What wait() returns is the caller's to write into (a foreach optimizer does): another worker's
    result, the payloads and this worker's own share stay as they were."""
    group = InProcessGroup(2)
    codec = get_codec(codec_name)
    xs = [torch.arange(6.0).view(2, 3), torch.full((2, 3), 5.0)]
    handles = [group.communicator(m).allreduce_mean([x], codec) for m, x in enumerate(xs)]
    own_before = [h.own[0].clone() for h in handles]
    first = handles[0].wait()[0]
    expected = first.clone()
    first.mul_(-7)
    xs[1].zero_()  # the caller's input is not the payload either
    assert torch.equal(handles[1].wait()[0], expected)
    assert all(torch.equal(h.own[0], o) for h, o in zip(handles, own_before, strict=True))
    ready = ReadyHandle(group.communicator(0), [expected], [expected], 24, None)
    ready.wait()[0].zero_()
    assert torch.equal(ready.wait()[0], expected)


def test_wait_into_out_and_the_mean_buffer_serves_the_next_exchange() -> None:
    """wait(out=...) writes the mean into the caller's tensors; once every worker has its copy, the
    group reuses the mean's memory for the next exchange of that size, and results stay exact."""
    group = InProcessGroup(2)
    codec = get_codec("fp32")
    outs = [[torch.empty(2, 3)] for _ in range(2)]
    for step in range(3):
        xs = [torch.randn(2, 3, generator=torch.Generator().manual_seed(10 * step + m)) for m in range(2)]
        handles = [group.communicator(m).allreduce_mean([x], codec) for m, x in enumerate(xs)]
        got = [h.wait(out) for h, out in zip(handles, outs, strict=True)]
        for m in range(2):
            assert got[m] is outs[m]
            assert torch.equal(outs[m][0], (xs[0] + xs[1]) / 2)
        assert set(group._spare) == {6}  # the buffer waits for the next exchange of 6 values
    # keep_own=False (data-parallel gradients): no own share, and the payloads' memory is reused too.
    ptrs: set[int] = set()
    kept: list = []
    for step in range(3):
        xs = [torch.randn(2, 3, generator=torch.Generator().manual_seed(99 + 10 * step + m)) for m in range(2)]
        handles = [group.communicator(m).allreduce_mean([x], codec, keep_own=False) for m, x in enumerate(xs)]
        payloads = handles[0]._ex.payloads
        kept.extend(payloads)  # alive, so that only the group's reuse can give the same address again
        ptrs |= {p.data_ptr() for p in payloads}  # type: ignore[union-attr]
        assert handles[0].own == []
        xs[0].zero_()  # launched: the caller may change its tensors
        for h, out in zip(handles, outs, strict=True):
            h.wait(out)
        expected = (torch.randn(2, 3, generator=torch.Generator().manual_seed(99 + 10 * step)) + xs[1]) / 2
        assert all(torch.equal(o[0], expected) for o in outs)
    assert len(ptrs) == 2  # two payload buffers, reused in every later step
    with pytest.raises(ValueError, match="needs 1 tensors"):
        h = [group.communicator(m).allreduce_mean([torch.ones(3)], codec) for m in range(2)]
        h[0].wait([torch.empty(1), torch.empty(2)])


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"inner_steps": 0}, "--inner-steps"),
        ({"method": "streaming", "inner_steps": 10, "fragments": 2, "overlap_steps": 5}, "--overlap-steps"),
        ({"alpha": 1.5}, "--alpha"),
        ({"alpha": -0.1}, "--alpha"),
        ({"method": "streaming", "fragments": 9}, "--fragments"),
        ({"method": "nope"}, "--method"),
        ({"codec": "fp7"}, "--codec"),
        ({"method": "eager", "eager_rounds": 0}, "--eager-rounds"),
        ({"eager_weighting": "both"}, "--eager-weighting"),
        ({"fragment_pattern": "random"}, "--fragment-pattern"),
        ({"method": "diloco", "fragments": 2}, "--fragments"),
        ({"method": "eager", "overlap_steps": 1}, "--overlap-steps"),
        ({"outer_lr": 0.0}, "--outer-lr"),
    ],
)
def test_invalid_settings_fail_before_training(kwargs: dict, flag: str) -> None:
    torch.manual_seed(0)
    model = Toy(num_blocks=4)
    with pytest.raises(ConfigError, match=flag):
        OuterSync(model, None, InProcessGroup(1).communicator(0), OuterConfig(**kwargs))


@pytest.mark.parametrize("bw", [-1.0, 0.0, float("nan")])
def test_invalid_bandwidth(bw: float) -> None:
    with pytest.raises(ConfigError, match="--bandwidth-gbps"):
        InProcessGroup(2, LinkConfig(bandwidth_gbps=bw))


def test_fragments_larger_than_blocks_names_both() -> None:
    torch.manual_seed(0)
    with pytest.raises(ConfigError, match=r"--fragments \(5\).*blocks \(4\)"):
        OuterSync(Toy(4), None, InProcessGroup(1).communicator(0),
                  OuterConfig(method="streaming", inner_steps=10, fragments=5))
