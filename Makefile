# Everything installs from nothing: `make demo` and `make test` each build the venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?= -n 2 --dist loadfile

.PHONY: install demo test quick coverage lint typecheck unit bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints-dev.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -c constraints-dev.txt torch==2.13.0 -r requirements-dev.txt
	$(PY) -m pip install -c constraints-dev.txt -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/torchrepro check examples/digits_train.py
	$(VENV)/bin/torchrepro check examples/digits_broken.py || test $$? -eq 1  # a divergence is the point
	$(PY) examples/seed_demo.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(VENV)/bin/pytest $(PYTEST_ARGS)

test: lint typecheck unit

# The tests without the `slow` marker (many subprocesses): a quicker loop while working.
quick: $(STAMP)
	$(VENV)/bin/pytest $(PYTEST_ARGS) -m "not slow"

# Line and branch coverage of src/torchrepro over the whole suite, subprocesses included
# (coverage's `patch = subprocess`); the figure goes in the README's development section.
coverage: $(STAMP)
	rm -f .coverage .coverage.*
	$(VENV)/bin/pytest $(PYTEST_ARGS) --cov=torchrepro --cov-branch --cov-report=term:skip-covered

bench: $(STAMP)
	for f in benchmarks/*.py; do echo "== $$f"; $(PY) $$f || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
