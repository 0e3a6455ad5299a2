# One venv, two entry points: `make demo` (build + run the tiny model, write an MP4) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint

$(BIN)/aot: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[tpu,gpu,test]"
	touch $@

setup: $(BIN)/aot

# The demo: tiny random weights, a build for 8 CPU host devices (portrait), a run, an MP4.
DEMO := demo
DEMO_SHAPE := --res 192x320 --frames 17 --batch 1
demo: setup
	$(BIN)/python -m wan.random_weights --model tiny --out $(DEMO)/weights
	$(BIN)/aot build --model tiny $(DEMO_SHAPE) --target cpu-8 --out $(DEMO)/artifacts
	$(BIN)/runtime run --artifacts $(DEMO)/artifacts --weights $(DEMO)/weights $(DEMO_SHAPE) \
		--prompt "a red cat running in the rain" --steps 10 --seed 0 \
		--out $(DEMO)/video.mp4 --report $(DEMO)/report.json
	@echo "video: $(CURDIR)/$(DEMO)/video.mp4"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: setup lint
	$(BIN)/pytest -n 2 -q
