# Two commands do all set-up on a fresh machine:
#   make demo     - the METP demo on CPU ranks (creates .venv on first use)
#   make test     - the test suite (creates .venv and .venv-019 on first use): the whole suite on
#                   .venv (Megatron-LM core_v0.16.1), then the Megatron-LM tests (pytest -m
#                   megatron_lm) on .venv-019 against core_v0.19.0
#   make faults   - the fault-injection suite alone (part of make test; ~1.5 min on 2 cores)
# Environments, one per supported Megatron-LM release:
#   make venv     - .venv: $(PYTHON) (3.11 here), torch 2.13.0 (CPU build), megatron-core 0.16.1
#   make venv-019 - .venv-019: $(PYTHON312), torch 2.13.0, megatron-core 0.19.x (needs Python >= 3.12, found by scripts/find_python312.sh or given as PYTHON312=...;
#                   the registry's torch for 3.12 is a CUDA build, ~4.7 GB, that runs on the CPU)
# TORCH_SPEC pins the CPU build used here and in CI; on a GPU machine pass e.g. TORCH_SPEC=torch
# or use the Dockerfile, which keeps the container's own torch.

PYTHON ?= python3
# PYTHON312: a Python >= 3.12 for .venv-019; unset, scripts/find_python312.sh looks on PATH and in pyenv
export PYTHON312
VENV ?= .venv
VENV019 ?= .venv-019
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PY019 := $(VENV019)/bin/python
STAMP := $(VENV)/.metp-installed
STAMP019 := $(VENV019)/.metp-installed

.PHONY: venv venv-019 demo test test-019 faults bench clean

venv: $(STAMP)

venv-019: $(STAMP019)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, so nothing that depends on it pulls a CUDA build
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,megatron-lm]"
	touch $(STAMP)

# pyproject's environment markers pick megatron-core 0.19.x on Python >= 3.12
$(STAMP019): pyproject.toml
	test -x $(PY019) || { py=$$(scripts/find_python312.sh) && "$$py" -m venv $(VENV019); }
	$(PY019) -c 'import sys; assert sys.version_info >= (3, 12), "make venv-019 needs Python >= 3.12: PYTHON312=/path/to/python3.12"'
	$(PY019) -m pip install -q --upgrade pip
	$(PY019) -m pip install -q "$(TORCH_SPEC)"
	$(PY019) -m pip install -q -e ".[test,megatron-lm]"
	$(PY019) -c 'import importlib.metadata as m; v = m.version("megatron-core"); assert v.startswith("0.19."), v'
	touch $(STAMP019)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m megatron_metp.demo

test: $(STAMP) $(STAMP019)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --durations=30 tests
	$(MAKE) test-019

# the Megatron-LM tests (patch, dry run, training, compare, save/load, HF, packed) against
# core_v0.19.0; the marker is set by tests/conftest.py on every test using a Megatron-LM checkout
test-019: $(STAMP019)
	OMP_NUM_THREADS=1 METP_MEGATRON_LM_RELEASE=core_v0.19.0 $(PY019) -m pytest -q --durations=30 -m megatron_lm tests

faults: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -s --durations=8 tests/test_ring.py tests/test_stalls.py \
		tests/test_checkpoint_faults.py tests/test_agree.py tests/test_finite.py

bench: $(STAMP)
	$(PY) benchmarks/mlp_memory.py

clean:
	rm -rf $(VENV) $(VENV019) build *.egg-info
