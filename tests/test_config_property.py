"""Property: every invalid configuration is refused before any step; every valid one trains."""

from __future__ import annotations

import copy
import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from toy import Toy

from eagerloco.codecs import CODEC_NAMES
from eagerloco.comm.inprocess import InProcessGroup
from eagerloco.config import ConfigError, LinkConfig, OuterConfig
from eagerloco.outer import OuterSync, after_inner_step_all, before_inner_step_all

NUM_BLOCKS = 4
METHODS = ("dp", "diloco", "streaming", "delayed", "eager")

# Each field: values the rules accept on their own, and values they never accept. A configuration
# takes good values everywhere and then bad values in up to two fields, so every single rule (and
# every combination rule between good values, such as diloco with P > 1) is exercised often.
GOOD = {
    "method": st.sampled_from(METHODS),
    "inner_steps": st.integers(1, 12),
    "fragments": st.integers(1, NUM_BLOCKS),
    "fragment_pattern": st.sampled_from(("sequential", "strided")),
    "overlap_steps": st.integers(0, 4),
    "alpha": st.floats(0, 1),
    "eager_rounds": st.integers(1, 3),
    "eager_weighting": st.sampled_from(("nonlocal", "stale_average")),
    "codec": st.sampled_from(CODEC_NAMES),
    "codec_block": st.integers(1, 64),
    "outer_optimizer": st.sampled_from(("sgd", "adam", "adamw")),
    "outer_lr": st.floats(0.01, 2),
    "outer_momentum": st.sampled_from((0.0, 0.5, 0.9)),
    "outer_nesterov": st.booleans(),
}
BAD = {
    "method": st.sampled_from(("ring", "", "DiLoCo")),
    "inner_steps": st.integers(-2, 0),
    "fragments": st.sampled_from((-1, 0, NUM_BLOCKS + 1, 99)),
    "fragment_pattern": st.just("random"),
    "overlap_steps": st.just(-1),
    "alpha": st.sampled_from((-0.5, 1.5, float("nan"))),
    "eager_rounds": st.sampled_from((0, -1)),
    "eager_weighting": st.just("both"),
    "codec": st.just("fp7"),
    "codec_block": st.sampled_from((0, -32, 2**16 + 1, 10**9)),
    "outer_optimizer": st.just("lion"),
    "outer_lr": st.sampled_from((0.0, -1.0, 100.5, 1e30, float("inf"), float("nan"))),
    "outer_momentum": st.sampled_from((1.0, 1.2, -0.1)),
    "outer_nesterov": st.sampled_from(("no", "yes", 1, None)),
}


@st.composite
def configs(draw: st.DrawFn) -> OuterConfig:
    values = {k: draw(v) for k, v in GOOD.items()}
    for k in draw(st.lists(st.sampled_from(sorted(BAD)), max_size=2, unique=True)):
        values[k] = draw(BAD[k])
    return OuterConfig(**values)


def expected_valid(c: OuterConfig) -> bool:
    """The rules of ALGORITHMS.md and the issue, stated independently of the validator."""
    if c.method not in METHODS or c.fragment_pattern not in ("sequential", "strided"):
        return False
    if c.eager_weighting not in ("nonlocal", "stale_average") or c.codec not in CODEC_NAMES:
        return False
    if c.outer_optimizer not in ("sgd", "adam", "adamw"):
        return False
    if c.inner_steps < 1 or c.fragments < 1 or c.eager_rounds < 1 or c.overlap_steps < 0:
        return False
    if not 1 <= c.codec_block <= 2**16 or not isinstance(c.outer_nesterov, bool):
        return False
    if not (0 <= c.alpha <= 1) or not (math.isfinite(c.outer_lr) and 0 < c.outer_lr <= 10):  # nan fails both
        return False
    if not (0 <= c.outer_momentum < 1):
        return False
    if c.outer_optimizer == "sgd" and c.outer_nesterov and c.outer_momentum == 0:
        return False
    if c.fragments > NUM_BLOCKS:
        return False
    if c.method in ("dp", "diloco") and c.fragments != 1:
        return False
    if c.method in ("dp", "delayed", "eager") and c.overlap_steps != 0:
        return False
    if c.method != "dp" and c.fragments > c.inner_steps:
        return False
    return not (c.overlap_steps > 0 and c.overlap_steps >= c.inner_steps / c.fragments)


_BASE = Toy(NUM_BLOCKS)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs())
def test_invalid_configs_are_refused_and_valid_ones_train(cfg: OuterConfig) -> None:
    models = [copy.deepcopy(_BASE) for _ in range(2)]
    group = InProcessGroup(2, LinkConfig(bandwidth_gbps=1.0))
    if not expected_valid(cfg):
        try:
            OuterSync(models[0], None, group.communicator(0), cfg)
        except ConfigError as e:
            assert str(e).startswith("--") or "fragment" in str(e), e  # names the flag
            return
        raise AssertionError(f"accepted an invalid configuration: {cfg}")
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in models]
    syncs = [OuterSync(m, o, group.communicator(i), cfg) for i, (m, o) in enumerate(zip(models, opts, strict=True))]
    for _ in range(cfg.inner_steps):  # a whole round: every fragment syncs once
        for m in models:
            m(torch.randn(4, 3)).sum().backward()
        before_inner_step_all(syncs)
        for o in opts:
            o.step()
        after_inner_step_all(syncs)
    for s in syncs:
        s.drain(apply=True)
        assert all(torch.isfinite(p).all() for p in s.outer_parameters())
