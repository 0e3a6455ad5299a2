# One venv, two entry points: `make demo` (build + run the tiny model, write an MP4) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint bench

$(BIN)/aot: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[tpu,test]"
	touch $@

setup: $(BIN)/aot

demo: setup
	$(BIN)/python -m runtime.demo

lint: setup
	$(BIN)/ruff check wan aot runtime tests bench
	$(BIN)/ruff format --check wan aot runtime tests bench

test: setup lint
	$(BIN)/pytest -n 2 -q
