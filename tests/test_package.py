"""eagerloco as a library in a user's own environment: light dependencies, extras that say their name,
a typed keyword-only ``outer_loop``, a ``dir()`` of the public API, and frozen parameters left alone.
"""

from __future__ import annotations

import ast
import copy
import inspect
import json
import subprocess
import sys
import tomllib
import typing
import zlib
from dataclasses import fields
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version
from toy import Toy

import eagerloco
from eagerloco.comm.inprocess import InProcessGroup
from eagerloco.config import ConfigError, OuterConfig
from eagerloco.extras import EXTRAS, MissingExtraError, require
from eagerloco.hooks import OuterLoop
from eagerloco.outer import OuterSync, after_inner_step_all, before_inner_step_all

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


# ---------------------------------------------------------------- dependencies and extras

def _names(requirements: list[str]) -> set[str]:
    return {Requirement(r).name for r in requirements}


def test_the_dependencies_are_torch_numpy_tqdm_and_filelock_with_torch_as_a_range() -> None:
    deps = {Requirement(r).name: Requirement(r) for r in PYPROJECT["dependencies"]}
    assert set(deps) == {"torch", "numpy", "tqdm", "filelock"}
    torch_spec = deps["torch"].specifier
    assert not any(s.operator == "==" for s in torch_spec), "torch is a range here; the Makefile pins it for CI"
    assert {s.operator for s in torch_spec} == {">=", "<"}
    assert Version(version("torch").split("+")[0]) in torch_spec, "the torch the tests run on is in the range"


def test_every_optional_package_is_in_its_extra_and_all_and_dev_hold_every_extra() -> None:
    extras = PYPROJECT["optional-dependencies"]
    for module, extra in EXTRAS.items():
        assert module.replace("_", "-") in _names(extras[extra]), (module, extra)
    # docs: the tools that build the documentation site, no feature of the package.
    own = {e for e in extras if e not in ("all", "dev", "docs")}
    assert _names(extras["all"]) == {"eagerloco"}
    assert set(Requirement(extras["all"][0]).extras) == own
    dev = [Requirement(r) for r in extras["dev"] if Requirement(r).name == "eagerloco"]
    assert len(dev) == 1 and {"all", "docs"} <= set(dev[0].extras)


def _bare_optional_imports() -> list[str]:
    found = []
    for path in sorted((REPO / "eagerloco").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in EXTRAS]
    return found


def test_optional_packages_are_imported_only_through_require() -> None:
    assert _bare_optional_imports() == []


def test_require_names_the_extra_in_one_line() -> None:
    with pytest.raises(MissingExtraError) as err:
        require("matplotlib.no_such_module", "a plot")
    message = str(err.value)
    assert "\n" not in message and message.endswith("pip install 'eagerloco[plot]'")
    assert "a plot needs the matplotlib package (importing it failed: " in message  # installed, but broken
    assert isinstance(err.value, ImportError)


#: Run in a fresh interpreter where every optional package is missing (a finder that refuses them,
#: as if they were not installed): the hook API works and imports none of them; each place that
#: needs one fails with one line naming its extra.
WITHOUT_EXTRAS = r'''
import contextlib, io, json, sys, tempfile
from pathlib import Path

OPTIONAL = {"matplotlib", "pyarrow", "rdata", "tokenizers", "tensorboard", "transformers", "accelerate",
            "pytorch_lightning", "lightning"}
asked = []

class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in OPTIONAL:
            asked.append(name)
            raise ModuleNotFoundError(f"No module named {top!r}", name=top)
        return None

sys.meta_path.insert(0, NotInstalled())

import torch
from torch import nn
import eagerloco

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with eagerloco.outer_loop(model, opt, eagerloco.OuterConfig(method="diloco", inner_steps=2)) as outer:
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(8, 3)).pow(2).mean().backward()
        opt.step()
out = {"hook_api": [outer.sync.step, outer.metrics()["outer_syncs"]], "asked": list(asked)}

from eagerloco.cli import main
tmp = tempfile.mkdtemp()
commands = {
    "plot": ["simulate", "--model", "1b", "--bandwidth-gbps", "5", "--plot", tmp],
    "compare": ["compare", "--out", tmp + "/cmp", "--steps", "2"],
    "bpe": ["train", "--tokenizer", "bpe", "--out", tmp + "/bpe"],
    "evals": ["train", "--eval-tasks", "piqa", "--out", tmp + "/evals"],
}
for key, argv in commands.items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv)
    out[key] = [rc, err.getvalue()]

def raised(fn):
    try:
        fn()
    except ImportError as e:
        return [type(e).__name__, str(e)]
    return None

from eagerloco.config import TrainConfig
from eagerloco.lab.corpora.austen import read_lazyload_db
from eagerloco.data.tokenizer import train_bpe
from eagerloco.evals import load_task
from eagerloco.train.outputs import tensorboard_writer

out["calls"] = {
    "tensorboard": raised(lambda: tensorboard_writer(TrainConfig(tensorboard=True), Path(tmp))),
    "data": raised(lambda: read_lazyload_db(Path(tmp) / "austen.rdx")),
    "bpe": raised(lambda: train_bpe(["a text"], 300)),
    "evals": raised(lambda: load_task("piqa")),
    "hf": raised(lambda: __import__("eagerloco.integrations.hf")),
    "lightning": raised(lambda: __import__("eagerloco.integrations.lightning")),
}
err = io.StringIO()
try:
    with contextlib.redirect_stderr(err), eagerloco.exit_on_errors():
        import eagerloco.integrations.lightning
except SystemExit as e:
    out["exit_on_errors"] = [e.code, err.getvalue()]
print(json.dumps(out))
'''


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "EAGERLOCO_OUTER_ADDR", "EAGERLOCO_WORKER_ID",
                         "EAGERLOCO_WORKERS")}


@pytest.mark.processes
def test_without_the_extras_the_hook_api_runs_and_each_command_names_its_extra() -> None:
    done = subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env=_clean_env())
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["hook_api"] == [4, 2.0]
    assert out["asked"] == [], "the hook API must not import an optional package"
    for key, extra in {"plot": "plot", "compare": "plot", "bpe": "bpe", "evals": "evals"}.items():
        rc, err = out[key]
        assert rc == 2, (key, err)
        assert err.count("\n") == 1 and err.startswith("eagerloco"), (key, err)  # one line, no traceback
        assert f"pip install 'eagerloco[{extra}]'" in err, (key, err)
    assert out["exit_on_errors"] == [2, "eagerloco: error: eagerloco.integrations.lightning needs the "
                                        "pytorch_lightning package: pip install 'eagerloco[lightning]'\n"]
    for extra, got in out["calls"].items():
        assert got is not None, extra
        kind, message = got
        assert kind == "MissingExtraError" and "\n" not in message, got
        assert message.endswith(f"pip install 'eagerloco[{extra}]'"), got


# ---------------------------------------------------------------- the public API

@pytest.mark.processes
def test_dir_shows_only_the_public_api() -> None:
    code = ("import eagerloco; before = dir(eagerloco); eagerloco.outer_loop; eagerloco.OuterSync; "
            "print(before == dir(eagerloco) == sorted([*eagerloco.__all__, '__version__']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.stdout.strip() == "True", done.stderr
    names = dir(eagerloco)
    assert not {"importlib", "Any", "annotations", "_EXPORTS"} & set(names)
    assert {"outer_loop", "OuterLoop", "OuterConfig", "MissingExtraError", "__version__"} <= set(names)
    for name in names:
        assert getattr(eagerloco, name) is not None


def test_outer_loop_takes_a_config_and_its_peers_apart() -> None:
    """The algorithm's settings in one typed OuterConfig, connecting in peers=: a few typed arguments."""
    sig = inspect.signature(eagerloco.outer_loop)
    params = list(sig.parameters.values())
    assert [p.name for p in params[:3]] == ["model", "inner_optimizer", "config"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[3:])
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    assert "peers" in sig.parameters and len(params) <= 9
    # The settings are the config's; outer_optimizer= here is a factory in place of the config's named one.
    assert {f.name for f in fields(OuterConfig)} & set(sig.parameters) == {"outer_optimizer"}
    hints = typing.get_type_hints(eagerloco.outer_loop)
    assert set(hints) == {p.name for p in params} | {"return"}
    assert hints["config"] == OuterConfig | None and hints["return"] is OuterLoop


def test_outer_loop_runs_the_config_it_is_given(toy: Toy) -> None:
    def loop(*args: object, **kwargs: object) -> OuterLoop:
        return eagerloco.outer_loop(toy, torch.optim.SGD(toy.parameters(), lr=0.1), *args,  # type: ignore[arg-type]
                                    peers=InProcessGroup(1).communicator(0), **kwargs)

    given = OuterConfig(method="eager", inner_steps=7, outer_lr=0.4)
    assert loop(given).config == given
    assert loop().config == OuterConfig()
    with pytest.raises(TypeError, match="sync_every"):
        loop(sync_every=3)  # torchft's names: eagerloco.integrations.torchft
    with pytest.raises(TypeError):
        loop(OuterConfig(), "diloco")  # only the config is positional


# ---------------------------------------------------------------- frozen parameters

def _grads(m: int, step: int, name: str, p: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{m}/{step}/{name}".encode()))
    return torch.randn(p.shape, generator=g)


def _train(init: Toy, cfg: OuterConfig, steps: range, state: list[dict] | None = None,
           workers: int = 2) -> tuple[list[Toy], list[OuterSync]]:
    """M workers in lockstep, from ``init`` or from each worker's saved state; only trainable
    parameters get gradients (as backward gives them)."""
    models = [copy.deepcopy(init) for _ in range(workers)]
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1) for m in models]
    group = InProcessGroup(workers)
    syncs = [OuterSync(m, o, group.communicator(i), cfg) for i, (m, o) in enumerate(zip(models, opts, strict=True))]
    for i, s in enumerate(state or []):
        models[i].load_state_dict(s["model"])
        opts[i].load_state_dict(s["opt"])
        syncs[i].load_state_dict(s["sync"])
    for step in steps:
        for i, m in enumerate(models):
            for name, p in m.named_parameters():
                p.grad = _grads(i, step, name, p) if p.requires_grad else None
        before_inner_step_all(syncs)
        for o in opts:
            o.step()
        after_inner_step_all(syncs)
    return models, syncs


def _frozen_toy() -> Toy:
    torch.manual_seed(0)
    toy = Toy(num_blocks=2, width=5)
    toy.embed.requires_grad_(False)
    return toy


def test_frozen_parameters_are_not_sent_and_stay_bit_identical() -> None:
    # AdamW's weight decay would move a parameter whose outer gradient is zero: frozen ones must not be touched.
    cfg = OuterConfig(method="diloco", inner_steps=3, outer_optimizer="adamw", outer_lr=0.1)
    frozen = _frozen_toy()
    trainable = copy.deepcopy(frozen).requires_grad_(True)
    models, syncs = _train(frozen, cfg, range(1, 10))
    _, full = _train(trainable, cfg, range(1, 10))
    for m in models:
        assert torch.equal(m.embed, frozen.embed) and not m.embed.requires_grad
    stats, full_stats = syncs[0].comm.stats, full[0].comm.stats
    assert stats.num_syncs == full_stats.num_syncs == 3
    assert full_stats.peak_sync_bytes - stats.peak_sync_bytes == frozen.embed.numel() * 4  # fp32 payload
    assert stats.bytes_sent < full_stats.bytes_sent
    assert "embed" not in syncs[0].fragment_names[0] and "embed" in full[0].fragment_names[0]
    outer = syncs[0].outer_parameters()
    assert len(outer) == len(list(frozen.parameters())) and torch.equal(outer[0], frozen.embed)
    # The others trained: the outer step ran on the trainable parameters.
    assert not torch.equal(models[0].head, frozen.head)


def test_frozen_parameters_checkpoint_round_trip_resumes_bit_for_bit() -> None:
    cfg = OuterConfig(method="streaming", inner_steps=4, fragments=2, overlap_steps=1, alpha=0.5)
    init = _frozen_toy()
    ref, _ = _train(init, cfg, range(1, 14))
    models, syncs = _train(init, cfg, range(1, 7))
    saved = copy.deepcopy([{"model": m.state_dict(), "opt": s.inner_optimizer.state_dict(), "sync": s.state_dict()}
                           for m, s in zip(models, syncs, strict=True)])
    assert saved[0]["sync"]["in_flight"], "an exchange is in flight at the checkpoint"
    assert sum(len(f) for f in saved[0]["sync"]["outer"]) == len([p for p in init.parameters() if p.requires_grad])
    resumed, _ = _train(init, cfg, range(7, 14), state=saved)
    for a, b in zip(resumed, ref, strict=True):
        for x, y in zip(a.parameters(), b.parameters(), strict=True):
            assert torch.equal(x, y)
    assert torch.equal(resumed[0].embed, init.embed)


def test_a_fragment_of_only_frozen_parameters_is_a_clear_error() -> None:
    toy = _frozen_toy()
    toy.head.requires_grad_(False)
    toy.blocks[0].requires_grad_(False)
    cfg = OuterConfig(method="streaming", inner_steps=4, fragments=2, fragment_pattern="sequential")
    with pytest.raises(ConfigError, match=r"fragment 0 holds only frozen parameters .*embed.*use fewer fragments"):
        OuterSync(toy, None, InProcessGroup(1).communicator(0), cfg)
