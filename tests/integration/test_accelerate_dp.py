"""accelerate's ``save_state`` / ``load_state`` at DP 2 with a nxd_smp optimizer, on two ranks with
the environment ``torchrun --nproc-per-node 2`` gives them (gloo on the CPU; forked from the tests'
preloaded server, ``tests/distributed.py``; one launch runs every scenario of
``tests/accelerate_dp_worker.py``), against the uninterrupted run. The same save and load under
``torchrun`` itself is the guide's snippet ("accelerate at DP > 1, with save_state and
load_state", ``tests/docs/test_docs_snippets.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nxd_smp.checkpoint import read_checkpoint
from nxd_smp.interop.loop_checkpoints import check_reference
from tests.distributed import run_launched
from tests.oracle import assert_same_run

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("accelerate_dp")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_USE_BF16", "XLA_DOWNCAST_BF16")}
    proc = run_launched(2, ["tests/accelerate_dp_worker.py", str(out)], cwd=ROOT,
                        env={**env, "PYTHONPATH": str(ROOT), "USE_TORCH_XLA": "0"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


def ranks(out: Path, scenario: str) -> list[dict]:
    found = [torch.load(f, weights_only=True) for f in sorted((out / scenario).glob("rank*.pt"))]
    assert len(found) == 2
    return found


def test_load_state_resumes_exactly_on_every_rank(out):
    (full0, full1), resumed = ranks(out, "full"), ranks(out, "resumed")
    for name, value in full0["params"].items():
        assert torch.equal(value, full1["params"][name]), name  # the ranks agree
    for got, expected in zip(resumed, (full0, full1), strict=True):
        assert_same_run(got, expected)


def test_save_state_keeps_every_ranks_shard_beside_accelerates_reference(out):
    """``optimizer.bin`` (the main process's file) is the reference; the nxd_smp checkpoint
    beside it holds both ranks' shards of the masters, at the DP size they were saved at."""
    reference = check_reference(torch.load(out / "state" / "optimizer.bin", weights_only=True), "optimizer.bin")
    assert reference["dp_size"] == 2
    saved = read_checkpoint(out / "state" / "nxd_smp")["optimizer"]
    assert saved["master_weights"] and all(t.dtype == torch.float32 for t in saved["master_weights"].values())
    assert {f.name for f in (out / "state" / "nxd_smp").resolve().iterdir()} >= {"__0_0.bin", "__1_0.bin"}


@pytest.mark.parametrize("scenario, says", [
    ("without_hooks", "register_accelerate_hooks(accelerator, model, optimizer) before load_state()"),
    ("loaded_without_hooks", "nxd_smp.interop.accelerate.register_accelerate_hooks"),
])
def test_a_load_without_the_hooks_is_refused_on_every_rank_naming_them_and_changes_nothing(out, scenario, says):
    """With a reference saved by the hooks, or with the main process's shard that accelerate
    alone saves: every rank refuses (none trains alone), and the state stays what it was
    when accelerate handed over ``optimizer.bin``."""
    for rank in ranks(out, scenario):
        assert rank["error"] is not None and says in rank["error"], rank["error"]
        for a, b in zip(rank["masters"], rank["at_load"]["masters"], strict=True):
            assert torch.equal(a, b)
        for name, value in rank["at_load"]["params"].items():
            assert torch.equal(rank["params"][name], value), name
