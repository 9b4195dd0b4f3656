# Two commands do all set-up on a fresh machine:
#   make demo   - the METP demo on CPU ranks (creates .venv on first use)
#   make test   - the test suite (creates .venv on first use)
#   make faults - the fault-injection suite alone (part of make test; ~1.5 min on 2 cores)
# TORCH_SPEC pins the CPU build used here and in CI; on a GPU machine pass e.g. TORCH_SPEC=torch
# or use the Dockerfile, which keeps the container's own torch.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.metp-installed

.PHONY: venv demo test faults bench clean

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

faults: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -s --durations=8 tests/test_ring.py tests/test_stalls.py \
		tests/test_checkpoint_faults.py tests/test_agree.py tests/test_finite.py

bench: $(STAMP)
	$(PY) benchmarks/mlp_memory.py

clean:
	rm -rf $(VENV) build *.egg-info
