# One venv, two entry points: `make demo` (build + run the tiny model, write an MP4) and `make test`.
# The demo installs the package alone; the tests add the test tools and the TPU/GPU extras
# (deviceless TPU and GPU builds), which the demo never uses.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# What each entry point needs, installed once per change of pyproject.toml.
$(VENV)/.demo-installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.test-installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[tpu,gpu,test]"
	touch $@ $(VENV)/.demo-installed

# tests/test_playground.py drives Debian's chromium headless (through Playwright's client, from
# the test extra): installed with apt where it is missing (CI runs as root; elsewhere, sudo).
CHROMIUM := /usr/bin/chromium
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
$(CHROMIUM):
	$(SUDO) apt-get update -q
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium

setup: $(VENV)/.test-installed $(CHROMIUM)

# The demo: tiny random weights, a build for 8 CPU host devices (portrait), a run, an MP4.
DEMO := demo
DEMO_SHAPE := --res 192x320 --frames 17 --batch 1
demo: $(VENV)/.demo-installed
	$(BIN)/python -m wan.random_weights --model tiny --out $(DEMO)/weights
	$(BIN)/aot build --model tiny $(DEMO_SHAPE) --target cpu-8 --out $(DEMO)/artifacts
	$(BIN)/runtime run --artifacts $(DEMO)/artifacts --weights $(DEMO)/weights $(DEMO_SHAPE) \
		--prompt "a red cat running in the rain" --steps 10 --seed 0 \
		--out $(DEMO)/video.mp4 --report $(DEMO)/report.json
	@echo "video: $(CURDIR)/$(DEMO)/video.mp4"

lint: $(VENV)/.test-installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# --dist loadscope: a module's tests share one worker, so its module-scoped builds are made
# once, not once per worker.
test: lint $(CHROMIUM)
	$(BIN)/pytest -n 2 --dist loadscope -q --durations=30
