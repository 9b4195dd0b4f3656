# Two commands do all set-up on a fresh machine:
#   make demo     - the METP demo on CPU ranks (creates .venv on first use)
#   make test     - the test suite (creates .venv and .venv-019 on first use): the whole suite on
#                   .venv (Megatron-LM core_v0.16.1; .venv-019 is built meanwhile, its log in
#                   .venv-019.log), then the release-sensitive Megatron-LM tests (pytest -m
#                   "megatron_lm and release_sensitive", tests/markers.py) on .venv-019 against
#                   core_v0.19.0
#   make test-fast - the inner loop: pytest -m "not slow" on .venv (no Megatron-LM launches, no
#                   test over 5 s; tests/markers.py), a few minutes on 2 cores
#   JOBS=N        - test workers for make test / test-019 / test-fast (default 2; JOBS=0: none)
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

# --no-compile: no .pyc for the thousands of modules never imported (torch, transformers); the
# imported ones are compiled on first use
PIP_INSTALL := -m pip install -q --no-compile --disable-pip-version-check

# pytest-xdist: the test files run on JOBS workers (--dist loadfile: a file's module fixtures,
# such as one Megatron-LM training run shared by its tests, stay on one worker); one worker keeps
# about one core busy, so two fill the CI machine's two cores (the .venv leg: 804 s against
# 1,277 s serial). Files run in an order the workers pick, so tests/conftest.py fails any test
# that leaves process state changed for later files (tests/leak_guard.py). JOBS=0: serial.
JOBS ?= 2
XDIST := $(if $(filter 0,$(JOBS)),,-n $(JOBS) --dist loadfile)

.PHONY: venv venv-019 demo test test-019 test-fast faults test-slurm bench clean

venv: $(STAMP)

venv-019: $(STAMP019)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) $(PIP_INSTALL) --upgrade pip
	# torch first, so nothing that depends on it pulls a CUDA build
	$(PY) $(PIP_INSTALL) "$(TORCH_SPEC)"
	$(PY) $(PIP_INSTALL) -e ".[test,megatron-lm]"
	touch $(STAMP)

# pyproject's environment markers pick megatron-core 0.19.x on Python >= 3.12
$(STAMP019): pyproject.toml
	test -x $(PY019) || { py=$$(scripts/find_python312.sh) && "$$py" -m venv $(VENV019); }
	$(PY019) -c 'import sys; assert sys.version_info >= (3, 12), "make venv-019 needs Python >= 3.12: PYTHON312=/path/to/python3.12"'
	$(PY019) $(PIP_INSTALL) --upgrade pip
	$(PY019) $(PIP_INSTALL) "$(TORCH_SPEC)"
	$(PY019) $(PIP_INSTALL) -e ".[test,megatron-lm]"
	$(PY019) -c 'import importlib.metadata as m; v = m.version("megatron-core"); assert v.startswith("0.19."), v'
	touch $(STAMP019)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m megatron_metp.demo

# .venv-019 is installed (mostly download and unpacking; at a lower priority) while the .venv leg
# runs; its log (.venv-019.log) is printed when it fails
test: $(STAMP)
	nice -n 10 $(MAKE) --no-print-directory venv-019 >$(VENV019).log 2>&1 & pid=$$!; \
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(XDIST) --durations=30 tests; rc=$$?; \
	wait $$pid || { cat $(VENV019).log; echo "make venv-019 failed (log above)"; exit 1; }; \
	exit $$rc
	$(MAKE) test-019

# the release-sensitive Megatron-LM tests (patch, hooks, dry run, training vs stock TP, save/load,
# saved args, HF args, packed data) against core_v0.19.0; tests/conftest.py sets the markers
# (megatron_lm: every test using a Megatron-LM checkout; release_sensitive: tests/markers.py),
# and megatron-core's MoE with METP (its CPU shims and dispatcher seams differ between 0.16 and 0.19)
MOE_CORE_TESTS := tests/test_moe.py tests/test_moe_tiles.py tests/test_moe_routers.py \
	tests/test_model_variants.py tests/test_attention_sinks.py
# ... and the kept attention's and the selective recompute's gradients (Megatron's checkpoint
# and schedules; the streaming and separate ops under each release's torch and megatron-core)
KEEP_ATTENTION_TESTS := tests/test_keep_attention.py tests/test_layer_keep.py \
	tests/test_selective_op.py
test-019: $(STAMP019)
	# ... and the HF tests (marker hf, tests/conftest.py HF_TESTS) against .venv-019's transformers 5
	OMP_NUM_THREADS=1 METP_MEGATRON_LM_RELEASE=core_v0.19.0 $(PY019) -m pytest -q $(XDIST) --durations=30 -m "(megatron_lm and release_sensitive) or hf" tests
	# serial: on two workers these 36 short tests took 41 s against 27 s (each worker imports
	# megatron-core and forks its own ranks)
	OMP_NUM_THREADS=1 METP_MEGATRON_LM_RELEASE=core_v0.19.0 $(PY019) -m pytest -q --durations=5 $(MOE_CORE_TESTS) $(KEEP_ATTENTION_TESTS)

# the inner loop: everything but the slow tests (Megatron-LM launches, tests over 5 s)
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(XDIST) --durations=10 -m "not slow" tests

faults: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -s --durations=8 tests/test_ring.py tests/test_stalls.py \
		tests/test_checkpoint_faults.py tests/test_agree.py tests/test_finite.py \
		tests/test_stalls_train_step.py tests/test_right_rank.py

# scripts/slurm/pretrain_gpt.sbatch on a two-node Slurm cluster on this machine
# (scripts/slurm/ci_test.sh: root; apt-get installs Slurm and munge when absent; ~2 min on 2
# cores); not part of make test. MEGATRON_LM_DIR: the patched Megatron-LM checkout
test-slurm: $(STAMP)
	PYTHON=$(abspath $(PY)) bash scripts/slurm/ci_test.sh

bench: $(STAMP)
	$(PY) benchmarks/mlp_memory.py

clean:
	rm -rf $(VENV) $(VENV019) build *.egg-info
