# One-command entry points. `make run` / `make test` create .venv on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Flower: never let the SuperLink install the app's dependencies (it would fetch a CUDA torch), keep
# Ray's socket paths short, telemetry off.
# FLWR_HOME: each checkout keeps its own Flower state (and local SuperLink, stopped after each run),
# so two clones never run on each other's SuperLink.
FLWR_ENV := PATH=$(CURDIR)/$(BIN):$$PATH FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
	RAY_TMPDIR=/tmp/ray-$$(id -u) FLWR_TELEMETRY_ENABLED=0 FLWR_HOME=$(CURDIR)/.flwr

.PHONY: setup run demo compare lint test test-fast flowertune-env test-flowertune test-oldest gpu-check clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: a plain `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]" -c constraints.txt
	# the task-vector merges are tested against mergekit's own functions (they need torch and pydantic only)
	$(BIN)/pip install -q --no-deps mergekit==0.1.5
	touch $(STAMP)

setup: $(STAMP)

# The main job (the app's default run_config): two independently started GPT-2 clients train one
# epoch of the shipped Tiny Shakespeare on 2 SuperNodes (Ray), then FedAvg, aligned and refined
# aggregation side by side on the same replies; a table, runs/flwr/summary.json and comparison.png.
run: $(STAMP)
	mkdir -p /tmp/ray-$$(id -u)
	# fedlmc run = `flwr run . --stream`, but exits non-zero when the ServerApp failed; one CPU per
	# virtual client (Flower's default of 2 would train the two clients one after the other on 2 cores)
	$(FLWR_ENV) $(BIN)/fedlmc run . --federation-config "client-resources-num-cpus=1"

# Two seeds of the tiny presets and their averaging barrier (results/demo).
demo: $(STAMP)
	$(BIN)/fedlmc demo --out results/demo

# FedAvg vs aligned strategies, one-shot, 3 seeds (results/compare_*).
compare: $(STAMP)
	$(BIN)/python -m simulations.compare --setting oneshot --preset vit-tiny

# The code style: ruff's lint and formatter (120 columns; pyproject.toml [tool.ruff]).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Everything (what CI runs: .ci/run): lint, the fast suite and the slow tests (real Ray simulations,
# deployments, training, the main job's claim on seed 0), in two pytest-xdist workers: the deployments
# and simulations spend much of their time waiting on processes and polls, which the other worker fills.
# On a 2-core machine: about 24 minutes of tests beside one other CPU-bound process (three workers are
# no faster).
test: lint
	$(BIN)/python -m pytest -q -n 2 --dist worksteal --durations=15

# The everyday suite (no test marked slow): exactness, matching on tiny models, strategies on crafted
# replies, data. In two workers: about 2 minutes on an idle 2-core machine.
# The HF and LoRA tests beside FlowerTune's pins (transformers 4.50.3, peft 0.6.2), and Flower's FlowerTune
# template app (examples/flowertune-template, with trl and omegaconf at the template's pins) run with
# LoraFedAvg, in a second environment.
FT := .venv-flowertune
$(FT)/.installed: pyproject.toml constraints-flowertune.txt
	test -x $(FT)/bin/python || $(PY) -m venv $(FT)
	$(FT)/bin/pip install -q torch==2.13.0
	$(FT)/bin/pip install -q -e ".[dev]" trl==0.8.1 omegaconf==2.3.0 -c constraints-flowertune.txt
	touch $(FT)/.installed

flowertune-env: $(FT)/.installed

test-flowertune: $(FT)/.installed
	PATH=$(CURDIR)/$(FT)/bin:$$PATH FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 FLWR_TELEMETRY_ENABLED=0 \
		$(FT)/bin/python -m pytest -q -n 2 -m "not slow" tests/test_hf.py tests/test_lora.py \
		tests/test_flowertune_template.py

# The HF and LoRA tests at the oldest versions fedlmc declares (transformers 4.45.2, peft 0.6.2).
OLD := .venv-oldest
test-oldest:
	test -x $(OLD)/bin/python || $(PY) -m venv $(OLD)
	test -f $(OLD)/.installed || ( $(OLD)/bin/pip install -q torch==2.13.0 && \
		$(OLD)/bin/pip install -q -e ".[dev]" -c constraints-oldest.txt && touch $(OLD)/.installed )
	$(OLD)/bin/python -m pytest -q -n 2 -m "not slow" tests/test_hf.py tests/test_lora.py

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist worksteal --durations=15 -m "not slow"

# On a CUDA machine: the everyday suite, the speed benches and the paper's GPT-2 setting (6 layers, d 256,
# block 256, 3 pairs) on the GPU, written to results/gpu/*.json with the device's name.
gpu-check: $(STAMP)
	$(BIN)/python simulations/gpu_check.py

clean:
	rm -rf $(VENV) runs .flwr
