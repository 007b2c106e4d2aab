# The two commands of the README: `make train` runs the demo (a GPT on the standard
# library's sources), `make test` the tests.
# Each creates .venv with the pinned environment (constraints.txt) when it is missing.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test bench compare bench-peers clean-venv

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "nxd_smp pins torch 2.9 + torch-xla 2.9 for Python 3.11; found " + sys.version.split()[0])'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[xla,test,scripts]'
	touch $(STAMP)

train: $(STAMP)
	PJRT_DEVICE=CPU $(PY) scripts/train_gpt.py $(ARGS)

# Two workers (2 cores); a module's tests stay on one worker, the longest modules first (tests/conftest.py).
test: $(STAMP)
	$(PY) -m pytest -q tests -n 2 --dist loadscope $(ARGS)

bench: $(STAMP)
	$(PY) scripts/bench_step.py $(ARGS)

compare: $(STAMP)
	$(PY) scripts/compare_precision.py $(ARGS)

bench-peers: $(STAMP)
	$(PY) scripts/bench_peers.py $(ARGS)

clean-venv:
	rm -rf $(VENV)
