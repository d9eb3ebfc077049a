# edgerl: `make demo` runs the main job, `make test` runs every check. Each creates .venv itself.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck proto proto-check bench bench-learn clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

## The main job on the embedded default: edge server, sim workers and PPO trainer on loopback.
demo: $(STAMP)
	$(BIN)/edgerl train

## Every check CI runs: generated code fresh, lint, types, tests.
test: $(STAMP) proto-check lint typecheck
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy proto edge_server robot_client sim trainer watchdog launch models tests

proto: $(STAMP)
	$(BIN)/python -m edgerl.proto.generate

proto-check: $(STAMP)
	$(BIN)/python -m edgerl.proto.generate --check

## The throughput figures of the README.
bench: $(STAMP)
	$(BIN)/edgerl bench throughput --env HalfCheetah-v5 --envs 64 --policy mlp --repeats 3 --json bench-results/throughput-mlp.json
	$(BIN)/edgerl bench throughput --env HalfCheetah-v5 --envs 64 --policy mlp-large --repeats 3 --json bench-results/throughput-mlp-large.json

## The learning figures of the README (about 10 minutes per env on two cores).
bench-learn: $(STAMP)
	$(BIN)/edgerl bench learn --env HalfCheetah-v5 --seeds 3 --json bench-results/learn-HalfCheetah-v5.json
	$(BIN)/edgerl bench learn --env Hopper-v5 --seeds 3 --json bench-results/learn-Hopper-v5.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
