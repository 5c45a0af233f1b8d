# Two commands do all the set-up on a fresh Debian 12 machine (as root):
#   make lab    install everything, then start JupyterLab with the extension on notebooks/
#   make test   install everything, then run the whole test suite
# Every step is idempotent: a second run skips what is already in place.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
JUPYTER := $(VENV)/bin/jupyter
LAB_ARGS ?= --ip=127.0.0.1 --no-browser --allow-root

.PHONY: install system criu venv kernelspec lab test lint pytest test-under-load benchmark clean

install: system criu venv kernelspec

system:
	@bash scripts/install-system-deps.sh
	@bash scripts/install-ui-deps.sh
	@bash scripts/install-hub-deps.sh

criu: system
	@bash scripts/install-criu.sh

venv: $(VENV)/.installed

# The editable install also builds the JupyterLab extension (node, jlpm): redo it when
# the extension's sources change.
LABEXT_SOURCES := $(shell find labextension/src labextension/schema labextension/style \
	-type f 2>/dev/null) labextension/package.json labextension/yarn.lock

$(VENV)/.installed: pyproject.toml $(LABEXT_SOURCES)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

kernelspec: venv
	@$(JUPYTER) gpu-snapshot kernelspec install --sys-prefix

lab: install
	cd notebooks && ../$(JUPYTER) lab $(LAB_ARGS)

test: install lint pytest

# The extension's linters (eslint, prettier, stylelint) and its unit tests (jest) are
# devDependencies in labextension/yarn.lock; the editable install has put them in
# labextension/node_modules. The tests are type-checked by tsc, then run by jest.
lint: venv
	$(VENV)/bin/ruff check jupyter_gpu_snapshot testkit tests benchmarks
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	cd labextension && PATH="$(abspath $(VENV))/bin:$$PATH" jlpm install --immutable >/dev/null
	cd labextension && PATH="$(abspath $(VENV))/bin:$$PATH" jlpm lint:check
	cd labextension && PATH="$(abspath $(VENV))/bin:$$PATH" jlpm test:types
	cd labextension && PATH="$(abspath $(VENV))/bin:$$PATH" jlpm test

# PYTEST_ARGS picks tests or adds options, e.g. PYTEST_ARGS='tests/launch/test_provisioner.py -x'.
PYTEST_ARGS ?=

pytest: install
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# The suite must hold on a busy machine: CI runs it on 2 cores, at times beside other work.
# This runs pytest LOAD_RUNS times in a row while stress-ng keeps 2 cores busy, whatever
# fails, and stops the load at the end, on Ctrl-C too. About 70 minutes on 2 cores.
LOAD_RUNS ?= 3

test-under-load: install
	@stress-ng --cpu 2 --quiet & load=$$!; \
	trap 'kill $$load 2>/dev/null; wait $$load 2>/dev/null' EXIT; trap 'exit 130' INT TERM; \
	failed=0; \
	for run in $$(seq $(LOAD_RUNS)); do \
		echo "test-under-load: run $$run of $(LOAD_RUNS), beside stress-ng --cpu 2"; \
		$(VENV)/bin/pytest $(PYTEST_ARGS) || failed=$$((failed + 1)); \
	done; \
	echo "test-under-load: $$failed of $(LOAD_RUNS) runs failed"; \
	[ $$failed -eq 0 ]

benchmark: install
	$(PY) benchmarks/bench_cpu.py

clean:
	rm -rf $(VENV) build dist *.egg-info
