# Two commands do all the set-up on a fresh Debian 12 machine (as root):
#   make lab    install everything, then start JupyterLab with the extension on notebooks/
#   make test   install everything, then run the whole test suite (and CRIU's own
#               scenarios on our criu, and the restore path on stock criu)
# Every step is idempotent: a second run skips what is already in place.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
JUPYTER := $(VENV)/bin/jupyter
LAB_ARGS ?= --ip=127.0.0.1 --no-browser --allow-root

.PHONY: installed install system criu criu-stock criu-zdtm test-stock-criu venv kernelspec lab \
	test lint pytest test-quick test-under-load benchmark clean

install: system criu venv kernelspec

system:
	@bash scripts/install-system-deps.sh
	@bash scripts/install-ui-deps.sh
	@bash scripts/install-hub-deps.sh

criu: system
	@bash scripts/install-criu.sh

# Stock criu from the same source, for the tests that the product works without our
# patches (test-stock-criu); built once, kept like the patched one.
STOCK_CRIU ?= /var/cache/jupyter-gpu-snapshot/criu-stock

criu-stock: system
	@CRIU_STOCK=1 CRIU_PREFIX=$(STOCK_CRIU) bash scripts/install-criu.sh

# CRIU's own scenarios that cover what our patches touch, on the installed criu, built
# from the same source; a failure that stock criu does not have is a bug in the patches
# (docs/criu.md).
criu-zdtm: criu
	@scripts/criu-zdtm.py --against scripts/criu-zdtm-results/stock.txt

# The restore path (CPU kernels, the content store, the fallbacks) on stock criu: the
# product never depends on the patches.
STOCK_CRIU_TESTS ?= tests/core/store/test_streamer.py tests/core/test_fill_workers.py \
	tests/server/test_roundtrip.py tests/server/test_fallback.py \
	tests/server/test_api.py::test_status_and_lookup_of_a_ready_kernel

test-stock-criu: criu-stock venv kernelspec
	PATH="$(STOCK_CRIU)/sbin:$$PATH" JUPYTER_GPU_SNAPSHOT_CRIU=$(STOCK_CRIU)/sbin/criu \
		JUPYTER_GPU_SNAPSHOT_LIBDIR=$(STOCK_CRIU)/lib/jupyter-gpu-snapshot \
		$(VENV)/bin/pytest -n $(PYTEST_WORKERS) $(STOCK_CRIU_TESTS)

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

# In this order, whatever -j says: the linters and the tests need what the install puts.
test: install
	@$(MAKE) --no-print-directory lint
	@$(MAKE) --no-print-directory criu-zdtm
	@$(MAKE) --no-print-directory test-stock-criu
	@$(MAKE) --no-print-directory pytest

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
# The suite mostly waits (for kernels, criu, servers) rather than computes, so pytest runs
# it in PYTEST_WORKERS pytest-xdist workers, more than CI's 2 cores; tests that share
# something run one after another on one worker (tests/conftest.py). PYTEST_WORKERS=0 (or
# PYTEST_ARGS=-n0) runs it in one process, serially.
PYTEST_WORKERS ?= 4

# The tests alone, for the inner loop: no apt, no criu build, no pip (make install did them).
pytest: installed
	$(VENV)/bin/pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# The quick suite: the tests that need no root, no criu and no browser, in a few minutes
# on 2 cores. They are picked by what they use: the portable copy written and loaded in
# this process or in plain python3 kernels (no snapshot-ready kernel, whose namespace
# needs root); the store's formats, plans, index, usage, retention and renames on files in
# a temporary directory, and criu's log read as text (no criu run); the server's job
# runner and notebook policies without a server; the GPU layer's plans and driver binding
# against the scripted driver; and the project's own checks (its docs, stdlib-only
# programs and module sizes; not its notebooks, which run the real thing). Left out: every
# test that saves or restores (criu), starts a snapshot-ready kernel or a Jupyter server
# that does, uses Unix users, pods or a hub (root), a browser (tests/ui) or a GPU.
QUICK_TESTS := \
	tests/project/test_docs.py tests/project/test_stdlib_only.py \
	tests/project/test_module_size.py \
	tests/kernel/test_portable.py tests/kernel/test_cell_record.py \
	tests/core/store/packs/test_page_store.py tests/core/store/packs/test_id_workers.py \
	tests/core/store/test_index.py tests/core/store/test_usage.py tests/core/test_retention.py \
	tests/core/store/test_rename.py \
	tests/core/test_criu_log.py \
	tests/server/test_units.py tests/server/test_notebook_policies.py \
	tests/gpu/test_gpu_remap.py tests/gpu/test_cuda_driver.py

test-quick: installed
	$(VENV)/bin/pytest $(QUICK_TESTS) $(PYTEST_ARGS)

installed:
	@test -x $(VENV)/bin/pytest || { echo "no $(VENV)/bin/pytest: run make install first" >&2; exit 1; }

# The suite must hold on a busy machine: CI runs it on 2 cores, at times beside other work.
# This runs pytest LOAD_RUNS times in a row, in PYTEST_WORKERS workers as make pytest does,
# while stress-ng keeps 2 cores busy, whatever fails, and stops the load at the end, on
# Ctrl-C too.
LOAD_RUNS ?= 3

test-under-load: install
	@stress-ng --cpu 2 --quiet & load=$$!; \
	trap 'kill $$load 2>/dev/null; wait $$load 2>/dev/null' EXIT; trap 'exit 130' INT TERM; \
	failed=0; \
	for run in $$(seq $(LOAD_RUNS)); do \
		echo "test-under-load: run $$run of $(LOAD_RUNS), beside stress-ng --cpu 2"; \
		$(VENV)/bin/pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS) || failed=$$((failed + 1)); \
	done; \
	echo "test-under-load: $$failed of $(LOAD_RUNS) runs failed"; \
	[ $$failed -eq 0 ]

benchmark: install
	$(PY) benchmarks/bench_cpu.py

clean:
	rm -rf $(VENV) build dist *.egg-info
