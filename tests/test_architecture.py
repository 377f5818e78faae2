"""The house rules of the package, checked from its source (``archcheck``), and the checker checked.

The rules (docs/architecture.md): no import circle, counting imports inside functions, under
``if TYPE_CHECKING:`` and through ``importlib.import_module``; only the imports that the table
"Who owns what" allows; no torch on the load path of a torch-free row; no ``_private`` name used
from another module, in the package or from the tests, benchmarks and examples; no file over 600
lines. The planted tests build a small package with one violation of each kind and check that it
is caught, with its place and a message that says what to fix.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from archcheck import check_repo, report
from archcheck.table import TableError, parse_table

REPO = Path(__file__).resolve().parents[1]
OUTSIDE = ("testing", "tests", "bench", "examples")
#: The one reader of the process environment.
ENVIRONMENT_READERS = ("eagerloco.environment",)

#: Private names of other libraries that the package uses: (file, name) -> why there is no other way.
PACKAGE_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("eagerloco/comm/groups.py", "_register_backend"):
        "torch has no public way to build a gloo group across jobs without making it WORLD",
    ("eagerloco/comm/groups.py", "_set_default_backend"): "the same group: torch's init_process_group does this",
    ("eagerloco/__main__.py", "_exit"): "os._exit is the documented exit without interpreter shutdown, which would "
                                        "turn a Ctrl-C already handled during torch's import into death by SIGINT",
    ("eagerloco/rankserver.py", "_exit"): "os._exit is how a forked child ends: the rank server's teardown (its "
                                          "socket, its atexit) is not the rank's",
    ("eagerloco/lab/compare/cli.py", "_SubParsersAction"):
        "an annotation: argparse gives add_subparsers() no public type",
    ("eagerloco/sim/cli.py", "_SubParsersAction"): "an annotation: argparse gives add_subparsers() no public type",
}

#: Private names of the package used outside it: (file, name) -> why.
OUTSIDE_EXCEPTIONS: dict[tuple[str, str], str] = {
    **{("bench/peer/worker.py", name): "the peer report's profile times OuterSync's internal stages on one instance"
       for name in ("_wait", "_outer_step", "_merge")},
    **{("bench/peer/worker.py", name): "the peer report's profile times the exchange thread's stages on one instance"
       for name in ("_gather", "_sum", "_execute")},
    ("tests/test_outer.py", "_spare"): "checks that the in-process group reuses a mean's buffer (no public view)",
    ("tests/test_outer.py", "_ex"): "checks that the in-process group reuses a payload's memory (no public view)",
    ("tests/test_transport.py", "_gather"): "counts the all-gathers of one communicator: the agreed schedule skips "
                                             "the header round trip",
}


def test_the_package_keeps_the_house_rules() -> None:
    found = check_repo(REPO, "eagerloco", REPO / "docs" / "architecture.md", OUTSIDE,
                       PACKAGE_EXCEPTIONS, OUTSIDE_EXCEPTIONS, ENVIRONMENT_READERS)
    if any(found.values()):
        pytest.fail(report(found), pytrace=False)


def test_every_exception_says_why_in_one_line() -> None:
    for (path, name), why in {**PACKAGE_EXCEPTIONS, **OUTSIDE_EXCEPTIONS}.items():
        assert why.strip() and "\n" not in why, (path, name)


@pytest.mark.processes
def test_the_parser_and_the_simulator_never_import_torch() -> None:
    """`eagerloco simulate` answers in well under a second because nothing on its path imports torch."""
    code = ("import sys; from eagerloco.cli import main; "
            "rc = main(['simulate', '--model', '1b', '--paper', '--bandwidth-gbps', '5']); "
            "assert rc == 0, rc; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


# ---------------------------------------------------------------- the checker on a planted package

TABLE = """# Toy

## Who owns what

| package / module | owns | may import |
|---|---|---|
| `__init__.py`, `cli.py` | the command line | `core/`; everything else lazily |
| `extra.py` | extras | the leaves |
| `core/` | the engine; never imports torch | the leaves |
| the torch-free leaves: `leaf.py`, `util.py` | small things | nothing |

## Next
"""

CLEAN = {
    "toy/__init__.py": "",
    "toy/cli.py": "from toy.core import run\n\n\ndef main():\n    from toy import extra\n    return run(extra.X)\n",
    "toy/extra.py": "import importlib\n\nX = importlib.import_module('toy.leaf').helper\n",
    "toy/core/__init__.py": "from toy.core.engine import run\n",
    "toy/core/engine.py": "from toy.leaf import Box, helper\n\n\ndef run(x):\n    return helper(Box(x)).__class__\n",
    "toy/leaf.py": ("class Box:\n    def __init__(self, x):\n        self._secret = x\n\n"
                    "    def open(self, other=None):\n        return (other or self)._secret\n\n\n"
                    "def helper(box):\n    return box.open()\n\n\ndef _hidden():\n    return 0\n"),
    "toy/util.py": "def on_gpu():\n    import torch\n    return torch.cuda.is_available()\n",
    "tests/test_toy.py": "from toy.leaf import Box\n\n\ndef test_box():\n    assert Box(1).open() == 1\n",
}


def check(tmp_path: Path, changes: dict[str, str], table: str = TABLE,
          exceptions: dict[tuple[str, str], str] | None = None) -> dict[str, list[str]]:
    """The checks on the clean toy package with ``changes`` (path -> text appended to the file)."""
    files = dict(CLEAN)
    for path, text in changes.items():
        files[path] = files.get(path, "") + text
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "architecture.md").write_text(table)
    return check_repo(tmp_path, "toy", tmp_path / "docs" / "architecture.md", ["tests"], {}, exceptions or {},
                      ["toy.leaf"])


def test_a_clean_package_passes(tmp_path: Path) -> None:
    found = check(tmp_path, {})
    assert not any(found.values()), report(found)


def test_a_circle_under_type_checking_is_caught(tmp_path: Path) -> None:
    found = check(tmp_path, {"toy/leaf.py": "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                            "    from toy.core.engine import run\n"})
    assert found["import circles"] == [
        "import circle: toy.core.engine -> toy.leaf -> toy.core.engine  (all of: toy.core.engine, toy.leaf)\n"
        "    toy/core/engine.py:1 from toy.leaf import Box, helper\n"
        "    toy/leaf.py:18 from toy.core.engine import run (under TYPE_CHECKING)"]
    assert "toy/leaf.py:18 from toy.core.engine import run (under TYPE_CHECKING): row 'the torch-free leaves' " \
           "may import only: nothing" in found["may-import table"]


def test_circles_through_import_module_and_dunder_import_are_caught(tmp_path: Path) -> None:
    found = check(tmp_path, {"toy/extra.py": "\n\ndef back():\n    return importlib.import_module('toy.cli')\n",
                             "toy/util.py": "\n\ndef twice():\n    return __import__('toy.leaf')\n",
                             "toy/leaf.py": "\n\ndef g():\n    from toy import util\n"})
    assert found["import circles"] == [
        "import circle: toy.cli -> toy.extra -> toy.cli  (all of: toy.cli, toy.extra)\n"
        "    toy/cli.py:5 from toy import extra (inside a function)\n"
        "    toy/extra.py:7 importlib.import_module('toy.cli') (inside a function)",
        "import circle: toy.leaf -> toy.util -> toy.leaf  (all of: toy.leaf, toy.util)\n"
        "    toy/leaf.py:18 from toy import util (inside a function)\n"
        "    toy/util.py:7 __import__('toy.leaf') (inside a function)"]
    assert "toy/extra.py:7 importlib.import_module('toy.cli') (inside a function): row 'extra.py' may import " \
           "only: the leaves" in found["may-import table"]


def test_private_names_across_modules_are_caught(tmp_path: Path) -> None:
    found = check(tmp_path, {
        "toy/core/engine.py": "\nfrom toy.leaf import _hidden\n\n\ndef peek(box):\n    return box._secret\n",
        "toy/extra.py": "import toy.leaf as leaf\nY = leaf._hidden()\n",
        "toy/cli.py": "\n\ndef probe():\n    from toy import leaf\n    return getattr(leaf, '_hidden'), "
                      "hasattr(leaf.Box(1), '_secret')\n",
    })
    assert found["private names in the package"] == [
        "toy/cli.py:11 getattr(leaf, '_hidden'): _hidden is private to toy.leaf",
        "toy/cli.py:11 hasattr(leaf.Box(1), '_secret'): _secret is not defined in toy.cli but in toy.leaf",
        "toy/core/engine.py:7 from toy.leaf import _hidden: _hidden is private to toy.leaf",
        "toy/core/engine.py:11 box._secret: _secret is not defined in toy.core.engine but in toy.leaf",
        "toy/extra.py:5 leaf._hidden: _hidden is private to toy.leaf",
    ]


def test_dunders_self_and_own_names_are_not_private_uses(tmp_path: Path) -> None:
    found = check(tmp_path, {"toy/extra.py": ("\n\nclass Own:\n    _n: int = 0\n\n    def f(self, other):\n"
                                              "        return other._n + self._x + super().__hash__() "
                                              "+ Own._n + other.__dict__\n")})
    assert found["private names in the package"] == []


def test_an_import_against_the_table_is_caught(tmp_path: Path) -> None:
    found = check(tmp_path, {"toy/leaf.py": "\nfrom toy.util import on_gpu\n",
                             "toy/cli.py": "\nfrom toy import extra\n",
                             "toy/stray.py": "X = 1\n"})
    assert found["may-import table"] == [
        "toy/stray.py:1 toy.stray is in no row of the may-import table: put it in exactly one",
        "toy/cli.py:8 from toy import extra at module level: row '__init__.py, cli.py' may import it only lazily",
        "toy/leaf.py:16 from toy.util import on_gpu: row 'the torch-free leaves' may import only: nothing",
    ]


def test_the_table_itself_is_checked(tmp_path: Path) -> None:
    missing = TABLE.replace("`leaf.py`, `util.py`", "`leaf.py`, `util.py`, `gone.py`")
    assert check(tmp_path, {}, missing)["may-import table"] == [
        "docs/architecture.md: row 'the torch-free leaves' names `gone.py`, which is not in the package"]
    vague = TABLE.replace("| the leaves |\n| `core/`", "| whatever is below |\n| `core/`")
    with pytest.raises(TableError, match="row 'extra.py': cannot read 'whatever is below'"):
        parse_table(vague, "toy")
    with pytest.raises(TableError, match="write a module as `name.py` and a package as `name/`"):
        parse_table(TABLE.replace("`extra.py`", "`extra`"), "toy")


def test_the_table_reads_as_the_doc_says() -> None:
    rows = {r.title: r for r in parse_table(TABLE, "toy")}
    cli = rows["__init__.py, cli.py"]
    assert [(a.target.name, a.target.package, a.lazily) for a in cli.allowed] == [
        ("toy.core", True, False), ("toy", True, True)]
    assert [a.target.name for a in rows["extra.py"].allowed] == ["toy.leaf", "toy.util"]
    assert rows["the torch-free leaves"].allowed == ()


def test_the_library_never_imports_the_lab(tmp_path: Path) -> None:
    """"the library" is every row but the lab's: a library row that imports the lab is caught, and the
    lab imports the library."""
    table = TABLE.replace("| `__init__.py`, `cli.py` | the command line | `core/`; everything else lazily |",
                          "| `__init__.py` | the public names | the library lazily |\n"
                          "| `cli.py` | the command line | `core/`; everything else lazily |\n"
                          "| the lab: `lab/` | the experiments | the library |")
    assert [a.target.name for a in {r.title: r for r in parse_table(table, "toy")}["__init__.py"].allowed] == [
        "toy", "toy.cli", "toy.extra", "toy.core", "toy.leaf", "toy.util"]
    found = check(tmp_path, {"toy/lab/__init__.py": "from toy.core import run\n",
                             "toy/__init__.py": "\n\ndef lab():\n    from toy import lab\n    return lab\n",
                             "toy/core/engine.py": "\n\ndef g():\n    from toy.lab import run as r\n    return r\n"},
                  table)
    assert found["may-import table"] == [
        "toy/__init__.py:4 from toy import lab (inside a function): row '__init__.py' may import only: "
        "the library lazily",
        "toy/core/engine.py:9 from toy.lab import run (inside a function): row 'core/' may import only: "
        "the leaves"]


def test_torch_on_the_load_path_of_a_torch_free_row_is_caught(tmp_path: Path) -> None:
    found = check(tmp_path, {"toy/util.py": "import torch\n", "toy/core/engine.py": "from toy.util import on_gpu\n"})
    assert found["torch-free rows"] == [
        "toy/util.py:4 imports torch when loaded, and row 'core/' is torch-free: "
        "toy.core -> toy.core.engine -> toy.util",
        "toy/util.py:4 imports torch when loaded, and row 'core/' is torch-free: toy.core.engine -> toy.util",
        "toy/util.py:4 imports torch when loaded, and row 'the torch-free leaves' is torch-free: toy.util",
    ]


def test_private_uses_in_tests_are_caught_and_exceptions_are_honoured(tmp_path: Path) -> None:
    planted = ("\n\ndef test_peek(monkeypatch):\n    from toy.leaf import _hidden\n    import toy.leaf as leaf\n"
               "    monkeypatch.setattr('toy.leaf._hidden', lambda: 1)\n    leaf._hidden()\n"
               "    assert Box(1)._secret == 1\n    getattr(Box(2), '_secret')\n    return _hidden, obj._mine\n")
    found = check(tmp_path, {"tests/test_toy.py": planted})
    assert found["private names outside the package"] == [
        "tests/test_toy.py:9 from toy.leaf import _hidden: _hidden is private to toy.leaf",
        "tests/test_toy.py:11 'toy.leaf._hidden': _hidden is private to toy.leaf",
        "tests/test_toy.py:12 leaf._hidden: _hidden is private to toy.leaf",
        "tests/test_toy.py:13 Box(1)._secret: _secret is private to toy.leaf",
        "tests/test_toy.py:14 getattr(Box(2), '_secret'): _secret is private to toy.leaf",
    ]  # obj._mine: the package defines no _mine, so it is not the package's private
    excused = check(tmp_path / "x", {"tests/test_toy.py": planted}, exceptions={
        ("tests/test_toy.py", "_hidden"): "a reason", ("tests/test_toy.py", "_secret"): "a reason",
        ("tests/test_toy.py", "_gone"): "a reason"})
    assert excused["private names outside the package"] == [
        "exception (tests/test_toy.py, _gone) is stale: tests/test_toy.py does not use _gone; remove it"]


def test_a_long_file_is_caught(tmp_path: Path) -> None:
    found = check(tmp_path, {"toy/util.py": "# a line\n" * 600})
    assert found["long files"] == ["toy/util.py has 603 lines, over 600: split it by concern"]


def test_an_environment_read_outside_its_reader_is_caught(tmp_path: Path) -> None:
    found = check(tmp_path, {"toy/leaf.py": "\n\nimport os\n\nHOME = os.environ.get('HOME')\n",
                             "toy/util.py": "\n\nfrom os import getenv\n\n\ndef home():\n    return getenv('HOME')\n"})
    assert found["environment reads"] == [
        "toy/util.py:6 reads the process environment: read it through toy.leaf (a field of its Environment), "
        "and never write it"]
