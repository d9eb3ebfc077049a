# edgerl: `make demo` runs the main job, `make test` runs every check. Each creates .venv itself.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck proto proto-check bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

## The main job on the embedded default: edge server + 64 HalfCheetah envs on loopback.
demo: $(STAMP)
	$(BIN)/edgerl rollout --env HalfCheetah-v5 --envs 64 --seconds 30

## Every check CI runs: generated code fresh, lint, types, tests.
test: $(STAMP) proto-check lint typecheck
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy proto edge_server robot_client sim trainer watchdog launch tests

proto: $(STAMP)
	$(BIN)/python -m edgerl.proto.generate

proto-check: $(STAMP)
	$(BIN)/python -m edgerl.proto.generate --check

## The throughput figures of the README.
bench: $(STAMP)
	$(BIN)/edgerl bench throughput --env HalfCheetah-v5 --envs 64 --policy mlp --repeats 3 --json bench-results/throughput-mlp.json
	$(BIN)/edgerl bench throughput --env HalfCheetah-v5 --envs 64 --policy mlp-large --repeats 3 --json bench-results/throughput-mlp-large.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
