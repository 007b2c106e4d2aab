"""Test-session settings that must exist before any test module imports a library, and how
the suite shares out over workers."""

import os

import pytest

# transformers imports torch_xla when it is installed, unless told not to; the XLA tests
# run torch_xla in child processes of their own, and this process stays free of it.
os.environ.setdefault("USE_TORCH_XLA", "0")
# inductor checks in every process that this machine's compiler builds each vector ISA, by
# starting a Python interpreter per ISA (~3 s a process, and the suite starts dozens that
# compile nxd_smp's CPU kernels); the machine that runs the tests is the one that compiles.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``make test`` runs two workers), the tests that share an expensive
    module-scoped fixture (a replica child, a set of gloo ranks, a training run) run on one
    worker, so that it is built once; every other test goes wherever a worker is free."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        shared = []
        for name in info.names_closure:
            defs = info.name2fixturedefs.get(name)
            if not defs or defs[-1].scope == "function" or not defs[-1].baseid:  # ("": pytest's own)
                continue
            params = getattr(getattr(item, "callspec", None), "params", {})
            shared.append(f"{name}[{params[name]}]" if name in params else name)
        if shared:
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}:{'+'.join(sorted(shared))}"))
