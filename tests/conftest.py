"""Test-session settings that must exist before any test module imports a library, and how
the suite shares out over workers."""

import importlib.util
import os

import pytest


# transformers imports torch_xla when it is installed, unless told not to; the XLA tests
# run torch_xla in child processes of their own, and this process stays free of it.
os.environ.setdefault("USE_TORCH_XLA", "0")
# inductor checks in every process that this machine's compiler builds each vector ISA, by
# starting a Python interpreter per ISA (~3 s a process, and the suite starts dozens that
# compile nxd_smp's CPU kernels); the machine that runs the tests is the one that compiles.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")


# The tests that need torch_xla (the XLA CPU device in a child process, its runtime, its modules)
# carry the ``requires_xla`` marker: ``pytestmark = pytest.mark.requires_xla`` in a module that is
# all XLA, ``@pytest.mark.requires_xla`` on a test (or a parameter's ``marks``) in a mixed one.
# ``make test`` (the pinned stack) has torch_xla and runs them; ``make test-native`` (the newest
# torch alone) skips them here, with the reason below. (find_spec: torch_xla is not imported.)
HAVE_TORCH_XLA = importlib.util.find_spec("torch_xla") is not None
WITHOUT_TORCH_XLA = ("torch_xla is absent (the native stack, make test-native); "
                     "make test runs this test with torch 2.9 + torch-xla")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "requires_xla: needs torch_xla; skipped where it is absent (make test runs it)")


# ``make test`` runs two pytest-xdist workers with ``--dist loadscope --no-loadscope-reorder``: a
# module's tests run on one worker (its module-scoped fixtures, a replica child or a set of gloo
# ranks, are built once), and the modules are handed out longest first so that no long one starts
# last (xdist would otherwise order them by their number of tests).
LONGEST_FIRST = ["test_xla_replicas", "test_docs_snippets", "test_trainer_dp", "test_checkpoint", "test_launch",
                 "test_param_semantics", "test_zero1_oracle", "test_training_loops", "test_lightning", "test_parse_budgets",
                 "test_xla", "test_memory_options", "test_loss_scaler", "test_package", "test_hostile_checkpoints"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rpartition(".")[2], len(rank)))
    if not HAVE_TORCH_XLA:
        skip = pytest.mark.skip(reason=WITHOUT_TORCH_XLA)
        for item in items:
            if item.get_closest_marker("requires_xla") is not None:
                item.add_marker(skip)
