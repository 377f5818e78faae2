"""eagerloco's annotations are its types for a user's type checker: the wheel carries ``py.typed`` (PEP 561).

``make typecheck`` (run by ``make test``) checks the annotations themselves with ``mypy --strict``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.processes
def test_the_wheel_carries_py_typed(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "eagerloco", src / "eagerloco", ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "dist").glob("eagerloco-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert "eagerloco/py.typed" in z.namelist()


@pytest.mark.processes
def test_a_type_checker_sees_the_top_level_signatures(tmp_path: Path) -> None:
    """``eagerloco.outer_loop`` and ``eagerloco.connect`` are loaded lazily at run time, but a type checker sees
    their signatures (not ``Any``)."""
    user = tmp_path / "user.py"
    user.write_text("import eagerloco\nreveal_type(eagerloco.outer_loop)\nreveal_type(eagerloco.connect)\n"
                    "eagerloco.outer_loop(1, 2, method='eager')\n")
    # A cache of its own: `make test` may run `make typecheck` (the repository's cache) at the same time.
    cache = tmp_path / "mypy_cache"
    done = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(cache), str(user)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "MYPYPATH": str(REPO)})
    out = done.stdout
    assert "Revealed type is \"def (model: torch.nn.modules.module.Module, inner_optimizer: Any, config:" in out, out
    assert "-> eagerloco.comm.connect.Connection" in out, out
    assert 'Unexpected keyword argument "method"' in out, out  # the algorithm's settings go in an OuterConfig
