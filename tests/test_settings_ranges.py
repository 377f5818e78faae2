"""Every numeric setting has a range, checked once by its dataclass's validate (so the command line, TOML and
the hook API all get it), and booleans are booleans: a value far out of range is one ConfigError, never a run
whose memory or wait grows without bound."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from eagerloco.config import ConfigError, Environment, LinkConfig, OuterConfig, RuntimeConfig, TrainConfig

#: Numeric settings a huge value cannot hurt, and why: each is capped by something else the run has.
UNBOUNDED = {
    "inner_steps": "a round longer than the run has no exchange (the run warns)",
    "topk_chunk": "a chunk longer than a fragment is the fragment",
    "eval_limit": "capped by the task's examples",
    "eval_batches": "capped by the held-out text",
    "eval_every": "an evaluation point never reached",
    "log_every": "a log point never reached",
    "checkpoint_every": "a checkpoint step never reached",
    "keep_checkpoints": "at most one checkpoint per checkpoint step is written",
    "warmup_steps": "the learning rate stays in its warmup",
    "grad_clip": "no clipping",
    "peak_tflops": "only the divisor of MFU",
    "ranks_per_worker": "must equal the launcher's, which starts that many processes",
}


def _numeric_fields(cls: type) -> list[tuple[str, bool]]:
    """(name, whether an int) of each numeric setting of cls that is not in UNBOUNDED."""
    return [(f.name, "int" in str(f.type)) for f in dataclasses.fields(cls)
            if any(t in str(f.type) for t in ("int", "float")) and "list" not in str(f.type)
            and f.name not in UNBOUNDED]


def _validate(owner: str, name: str, value: Any) -> None:
    cfg = TrainConfig(model="micro", batch_size=2, seq_len=16)
    setattr(cfg if owner == "train" else getattr(cfg, owner), name, value)
    cfg.validate(Environment.read())


CASES = [(owner, name, is_int)
         for owner, cls in (("train", TrainConfig), ("outer", OuterConfig), ("link", LinkConfig),
                            ("runtime", RuntimeConfig))
         for name, is_int in _numeric_fields(cls)
         if name not in ("bandwidth_gbps", "kernel_link_gbps")]  # Gbit/s: any value past 1 kbit/s is a link
#: The flag a setting's refusal names, where not its own (a token budget becomes steps).
FLAG = {"tokens": "--steps"}


@pytest.mark.parametrize(("owner", "name", "is_int"), CASES)
def test_a_huge_value_of_every_numeric_setting_is_refused(owner: str, name: str, is_int: bool) -> None:
    flag = FLAG.get(name, "--" + name.replace("_", "-"))
    with pytest.raises(ConfigError, match=flag):
        _validate(owner, name, 10**30 if is_int else 1e30)


def test_the_list_of_unbounded_settings_names_only_settings() -> None:
    names = {f.name for cls in (TrainConfig, OuterConfig, LinkConfig, RuntimeConfig) for f in dataclasses.fields(cls)}
    assert set(UNBOUNDED) <= names


@pytest.mark.parametrize("name", ["outer_nesterov", "adaptive_steps", "stochastic_rounding"])
@pytest.mark.parametrize("value", ["no", "yes", 1, None])
def test_a_switch_takes_only_a_bool(name: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=rf"--{name.replace('_', '-')} is a switch \(true/false\), got"):
        OuterConfig(**{name: value}).validate()


@pytest.mark.parametrize(("owner", "name", "value", "flag"), [
    ("outer", "worker_speeds", [1.0, 1e-300], "--worker-speeds"),
    ("train", "slow_workers", ["1:1e30"], "--slow-worker"),
])
def test_a_list_setting_far_out_of_range_is_refused(owner: str, name: str, value: Any, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        _validate(owner, name, value)
