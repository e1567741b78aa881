# Everything installs from nothing: `make demo` and `make test` each build the venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# --no-loadscope-reorder: files in the order tests/conftest.py gives (slow files first), not by
# their number of tests (which put the few-test, minutes-long files last, one worker busy alone)
PYTEST_ARGS ?= -n 2 --dist loadfile --no-loadscope-reorder
CHROMIUM ?= /usr/bin/chromium
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install demo test quick coverage test-floor lint typecheck unit bench docs clean

install: $(STAMP) $(CHROMIUM)

# Debian's Chromium: the HTML report's tests open it in a real headless browser (Playwright,
# from requirements-dev.txt, drives this binary; it downloads no browser of its own).
$(CHROMIUM):
	$(SUDO) apt-get install -y --no-install-recommends chromium \
		|| ($(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends chromium)

$(STAMP): pyproject.toml constraints-dev.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -c constraints-dev.txt torch==2.13.0 -r requirements-dev.txt
	$(PY) -m pip install -c constraints-dev.txt -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/torchrepro check examples/digits_train.py
	$(VENV)/bin/torchrepro check --report .torchrepro/demo-report.html examples/digits_broken.py \
		|| test $$? -eq 1  # a divergence is the point; open .torchrepro/demo-report.html to see it
	$(PY) examples/seed_demo.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Bytecode first: with PYTHONDONTWRITEBYTECODE set (as on CI) every subprocess a test starts would
# compile the package again (about 0.2 s of CPU per process, over hundreds of launches).
unit: $(STAMP) $(CHROMIUM)
	$(PY) -m compileall -q src tests benchmarks examples
	$(VENV)/bin/pytest $(PYTEST_ARGS)

test: lint typecheck unit

# The tests without the `slow` marker (many subprocesses): a quicker loop while working.
quick: $(STAMP)
	$(VENV)/bin/pytest $(PYTEST_ARGS) -m "not slow"

# Line and branch coverage of src/torchrepro over the whole suite, subprocesses included
# (coverage's `patch = subprocess`); the figure goes in docs/development.md.
coverage: $(STAMP)
	rm -f .coverage .coverage.*
	$(VENV)/bin/pytest $(PYTEST_ARGS) --cov=torchrepro --cov-branch --cov-report=term:skip-covered

# `make test-floor` (not part of `make test`): the unit tier on the oldest torch the package claims
# (pyproject's torch>=) and on the newest one pip may take here, each in a venv of its own built
# from nothing (.venv-torch<version>). The unit tier is every test that runs in-process: tests/
# without tests/e2e, tests/cli and tests/integrations (those start scripts in subprocesses or need
# the frameworks), plus the doctests of src/torchrepro. Test tools, numpy and xxhash at the pins of
# constraints-dev.txt (torch 2.5 is built against NumPy 2 and runs with it).
FLOOR_TORCHES ?= 2.5.1 2.14.1
FLOOR_PYTEST_ARGS ?= -n 2 --dist loadfile --no-loadscope-reorder
UNIT_TIER := tests src/torchrepro --ignore=tests/e2e --ignore=tests/cli --ignore=tests/integrations --ignore=tests/docs
FLOOR_PINS = $$(grep -E '^(numpy|xxhash|pytest|pytest-xdist|pytest-timeout|hypothesis)==' constraints-dev.txt)

.venv-torch%/.installed-stamp: pyproject.toml constraints-dev.txt
	rm -rf .venv-torch$*
	$(PYTHON) -m venv .venv-torch$*
	.venv-torch$*/bin/python -m pip install torch==$* $(FLOOR_PINS)
	.venv-torch$*/bin/python -m pip install -e .
	touch $@

test-floor: $(foreach v,$(FLOOR_TORCHES),.venv-torch$(v)/.installed-stamp)
	status=0; for v in $(FLOOR_TORCHES); do \
		echo "== unit tier on torch $$(.venv-torch$$v/bin/python -c 'import torch; print(torch.__version__)')"; \
		.venv-torch$$v/bin/pytest $(FLOOR_PYTEST_ARGS) $(UNIT_TIER) || status=1; \
	done; exit $$status

# The documentation site, into site/ (a broken link or nav entry fails the build); make test
# builds it again and runs every code block of docs/ (tests/docs/).
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

bench: $(STAMP)
	for f in benchmarks/*.py; do echo "== $$f"; $(PY) $$f || exit 1; done

clean:
	rm -rf $(VENV) .venv-torch* site .pytest_cache .mypy_cache .ruff_cache .hypothesis
