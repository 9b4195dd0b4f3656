# Two commands do all set-up on a fresh machine:
#   make demo   - the METP demo on CPU ranks (creates .venv on first use)
#   make test   - the test suite (creates .venv on first use)
# TORCH_SPEC pins the CPU build used here and in CI; on a GPU machine pass e.g. TORCH_SPEC=torch
# or use the Dockerfile, which keeps the container's own torch.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.metp-installed

.PHONY: venv demo test bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, so nothing that depends on it pulls a CUDA build
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,megatron-lm]"
	touch $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m megatron_metp.demo

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) benchmarks/mlp_memory.py

clean:
	rm -rf $(VENV) build *.egg-info
