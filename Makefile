# `make demo` and `make test` work on a fresh machine: they make the virtualenv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo dev test

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/ci-cleanup demo

dev: $(VENV)/.installed
	$(BIN)/ci-cleanup dev

test: $(VENV)/.installed
	$(BIN)/pytest
