# The two commands of the README: `make train` runs the demo (a GPT on the standard
# library's sources), `make test` the tests.
# Each creates .venv with the pinned environment (constraints.txt) when it is missing.
# `make test-native` runs the same tests on the native stack (the newest torch, no torch-xla:
# the XLA tests skip) in .venv-native (constraints-native.txt); CI runs both test targets.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# The native stack takes Python 3.11 to 3.13: TorchNeuron's wheels are for 3.12 and newer, and
# torch 2.13 has wheels for all three. The default is 3.11 because this machine holds torch
# 2.13.0's CPU wheel for 3.11 only (/opt/wheels); another Python fetches torch from the index,
# a multi-GB download with its CUDA libraries. Choose with `make test-native PYTHON_NATIVE=python3.12`
# (after `make clean-venv` if .venv-native was made with another Python).
PYTHON_NATIVE ?= $(shell command -v python3.11 || command -v python3)
VENV_NATIVE := .venv-native
PY_NATIVE := $(VENV_NATIVE)/bin/python
STAMP_NATIVE := $(VENV_NATIVE)/.installed

.PHONY: train test test-native bench compare bench-peers clean-venv

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "nxd_smp pins torch 2.9 + torch-xla 2.9 for Python 3.11; found " + sys.version.split()[0])'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[xla,test,scripts,lightning,s3]'
	touch $(STAMP)

# A plain install (torch's own dependencies resolved, torch kept at constraints-native.txt's
# version), then pip check: the native stack must be one that pip itself finds consistent.
$(STAMP_NATIVE): pyproject.toml constraints-native.txt
	@$$(test -x $(PY_NATIVE) && echo $(PY_NATIVE) || echo $(PYTHON_NATIVE)) -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] <= (3, 13) else "make test-native takes Python 3.11 to 3.13 (torch 2.13; TorchNeuron is 3.12+); found " + sys.version.split()[0] + " at " + sys.executable + ": set PYTHON_NATIVE (and make clean-venv)")'
	test -x $(PY_NATIVE) || $(PYTHON_NATIVE) -m venv $(VENV_NATIVE)
	$(PY_NATIVE) -m pip install --upgrade --quiet pip
	$(PY_NATIVE) -m pip install --quiet -c constraints-native.txt -e '.[test,frameworks,s3]'
	$(PY_NATIVE) -m pip check
	touch $(STAMP_NATIVE)

train: $(STAMP)
	PJRT_DEVICE=CPU $(PY) scripts/train_gpt.py $(ARGS)

# Two workers (2 cores); a module's tests stay on one worker, the longest modules first (tests/conftest.py).
test: $(STAMP)
	$(PY) -m pytest -q tests -n 2 --dist loadscope --no-loadscope-reorder $(ARGS)

# The same suite without torch-xla: its tests skip, naming `make test` as where they run.
test-native: $(STAMP_NATIVE)
	$(PY_NATIVE) -m pytest -q tests -n 2 --dist loadscope --no-loadscope-reorder $(ARGS)

bench: $(STAMP)
	$(PY) scripts/bench_step.py $(ARGS)

compare: $(STAMP)
	$(PY) scripts/compare_precision.py $(ARGS)

bench-peers: $(STAMP)
	$(PY) scripts/bench_peers.py $(ARGS)

clean-venv:
	rm -rf $(VENV) $(VENV_NATIVE)
