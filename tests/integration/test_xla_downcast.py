"""``XLA_DOWNCAST_BF16=1`` on the XLA CPU device (NxD Training's default precision, NxD's Llama
launch scripts): the model stays torch float32 (bf16 on the device) and the masters, states and
accumulation are torch float64 (fp32 on the device), as NxD asks with ``optimizer_dtype=
torch.double``. Against exact fp32 arithmetic (tests/xla_downcast_worker.py says why it is
exact); checkpoints hold what the device holds and move to and from a run without downcast."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import nxd_smp
from nxd_smp.checkpoint import read_checkpoint
from tests.distributed import run_python
from tests.xla_downcast_worker import LR, SHAPES, STEPS, Params, initial

pytestmark = pytest.mark.requires_xla  # every test here runs torch_xla (tests/conftest.py skips them without it)
ROOT = Path(__file__).resolve().parents[2]


def fp32_sgd(steps: int) -> dict[str, torch.Tensor]:
    """SGD with gradient 1.0 in fp32 from the initial weights: exact (float64 then cast)."""
    return {n: (v.double() - steps * LR).float() for n, v in initial().items()}


def cpu_run(steps: int, masters: bool = True):
    """The same run in eager CPU with a bf16 model (no downcast): nxd_smp's usual setting."""
    model = Params({n: v.bfloat16() for n, v in initial().items()})
    mp = nxd_smp.MixedPrecisionConfig(use_master_weights_in_ckpt=True) if masters else \
        nxd_smp.MixedPrecisionConfig(use_master_weights=False, use_fp32_grad_acc=False)
    opt = nxd_smp.Zero1Optimizer(model.parameters(), torch.optim.SGD, lr=LR, grad_clipping=False, max_norm=None,
                                 mixed_precision=mp)
    for _ in range(steps):
        sum((p.float() * torch.ones(p.shape)).sum() for p in model.parameters()).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    root = tmp_path_factory.mktemp("downcast")
    model, opt = cpu_run(STEPS)
    nxd_smp.save_checkpoint(root / "cpu", model=model, optimizer=opt)
    out = root / "results.pt"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "XLA_DOWNCAST_BF16": "1", "PYTHONPATH": str(ROOT)}
    env.pop("XLA_USE_BF16", None)
    proc = run_python(["-m", "tests.xla_downcast_worker", str(out), str(root / "xla"), str(root / "cpu")], cwd=ROOT,
                      env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root, torch.load(out, weights_only=False)


def flat_masters(result: dict, reference: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The reference laid out as the run's master shards (its buckets, padding zero)."""
    names = list(SHAPES)
    shards = []
    for indices, numels in result["layouts"]:
        flat = torch.cat([reference[names[i]].reshape(-1) for i in indices])
        padded = len(result["masters"][len(shards)])
        shards.append(torch.cat([flat, torch.zeros(padded - sum(numels))]))
    return shards


@pytest.mark.parametrize("api", ["nxd_config", "neuron"])
def test_masters_are_fp32_on_the_device_and_the_parameters_their_bf16_rounding(child, api):
    _, results = child
    got, want = results[api], fp32_sgd(STEPS)
    assert got["param_dtypes"] == {n: "torch.float32" for n in SHAPES}  # the model stays torch float32
    assert got["master_dtypes"] == ["torch.float64"]  # fp32 on the device
    for shard, expected in zip(got["masters"], flat_masters(got, want)):
        assert torch.equal(shard.float(), expected)  # exactly fp32 SGD
    for n in SHAPES:
        assert torch.equal(got["params"][n], want[n].bfloat16().float()), n  # the masters rounded to bf16
        assert not torch.equal(got["params"][n], initial()[n]), n  # (they moved)
    assert got["compiles"][-1] == got["compiles"][2], "a step compiled a new graph after warm-up"


def test_a_bf16_master_run_would_fail_this_test():
    """The control: with the lr below half a bf16 ulp, bf16 masters (legacy mode) never move."""
    model, _ = cpu_run(STEPS, masters=False)
    assert all(torch.equal(p.float(), initial()[n]) for n, p in model.named_parameters())
    assert not all(torch.equal(initial()[n], fp32_sgd(STEPS)[n]) for n in SHAPES)


def test_the_checkpoint_holds_what_the_device_holds_and_resumes(child):
    _, results = child
    saved, want = results["saved"], fp32_sgd(STEPS)
    for n in SHAPES:
        assert saved["model"][n].dtype == torch.bfloat16 and torch.equal(saved["model"][n].float(), want[n].bfloat16().float())
        assert saved["masters"][n].dtype == torch.float32 and torch.equal(saved["masters"][n], want[n])
        assert all(v.dtype != torch.float64 for v in saved["state"][n].values())
    after = fp32_sgd(STEPS + 1)
    assert all(torch.equal(results["resumed"][n], after[n].bfloat16().float()) for n in SHAPES)


def test_checkpoints_move_between_downcast_and_a_bf16_model(child):
    """Saved under downcast, loaded into the usual bf16 model on the CPU; saved there, loaded
    under downcast: the masters carry over exactly both ways."""
    root, results = child
    after = fp32_sgd(STEPS + 1)
    assert all(torch.equal(results["from_cpu"][n], after[n].bfloat16().float()) for n in SHAPES)
    for shard, expected in zip(results["from_cpu_masters"], flat_masters(results["nxd_config"], after)):
        assert torch.equal(shard.float(), expected)
    model, opt = cpu_run(0)
    nxd_smp.load_checkpoint(root / "xla", model=model, optimizer=opt)
    masters = read_checkpoint(root / "xla")["optimizer"]["master_weights"]
    want = fp32_sgd(STEPS)
    assert all(torch.equal(p, want[n].bfloat16()) for n, p in model.named_parameters())
    assert all(torch.equal(masters[n], want[n]) for n in SHAPES)


def test_remainders_are_refused_under_downcast(child):
    assert "XLA_DOWNCAST_BF16" in child[1]["remainders_refused"]
