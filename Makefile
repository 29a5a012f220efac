# `make demo` and `make test` work on a fresh machine: they make the virtualenv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
ARGS ?=
IS_311 := import sys; sys.exit(sys.version_info[:2] != (3, 11))
# A .venv whose python is missing or not 3.11 (left by another interpreter, or a failed install) is
# rebuilt from scratch instead of being reused by every later make.
VENV_OK := $(shell $(BIN)/python -c '$(IS_311)' >/dev/null 2>&1 && echo yes)

.PHONY: demo dev test clean bytecode FORCE

$(VENV)/.installed: pyproject.toml dagster_cli.pth $(if $(VENV_OK),,FORCE)
	@$(PYTHON) -c '$(IS_311)' 2>/dev/null || { \
	  echo "ci_cleanup needs Python 3.11, and $(PYTHON) is $$($(PYTHON) -V 2>&1 || echo missing)." >&2; \
	  echo "Run again with one: make $(or $(MAKECMDGOALS),demo) PYTHON=python3.11" >&2; exit 1; }
	$(if $(VENV_OK),,rm -rf $(VENV))
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@# setuptools' editable-install banner (a UserWarning) says nothing to act on here.
	PYTHONWARNINGS=ignore::UserWarning $(BIN)/python -m pip install -q -e '.[test,embedded]'
	cp dagster_cli.pth "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
	touch $@

FORCE:

# ci_cleanup's bytecode, written ahead (and again for what changed): a job's process then loads it instead of
# compiling every module as it starts, also where PYTHONDONTWRITEBYTECODE keeps Python from writing it. The
# workshop's too (tools/ci_cleanup_dev: the dev stack, demo and benchmark), which the demo and dev load.
bytecode: $(VENV)/.installed
	@$(BIN)/python -m compileall -q ci_cleanup tools/ci_cleanup_dev

demo: bytecode
	$(BIN)/ci-cleanup demo $(ARGS)

dev: bytecode
	$(BIN)/ci-cleanup dev $(ARGS)

# Two workers (pytest-xdist), each with its own embedded stack: most of a test's time is a server or a Dagster
# process starting, so two of them fill 2 cores. Every temporary file of the run (pytest's folders, the servers'
# data, pgserver's runtime folder, Dagster's sockets) goes in one folder of ours (TMPDIR), removed after; it is
# 0755 so that PostgreSQL, run as another user when we are root, reaches its data inside.
# --dist loadgroup: the tests of a module marked xdist_group run on one worker, which starts its module's servers once.
TEST_WORKERS ?= 2
test: bytecode
	$(BIN)/ruff check .
	@[ -n "$(ARGS)" ] || echo "The whole suite: several minutes on 2 cores (docs/performance.md#the-test-suite has its last time)"
	tmp=$$(mktemp -d -t ci_cleanup_pytest_XXXXXXXX) && chmod 755 $$tmp && \
	  TMPDIR=$$tmp $(BIN)/pytest -n $(TEST_WORKERS) --dist loadgroup --basetemp=$$tmp/basetemp $(ARGS); \
	  status=$$?; rm -rf $$tmp; exit $$status

# The virtualenv and build leftovers; the dev stack's data (.ci_cleanup_dev/) is kept.
clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache test-artifacts
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
