"""The eager path's device decisions, checked on the CPU: which devices get torch's fused kernels and which
of those take the clip coefficient as ``grad_scale``; the demo's device and process group from
``torch.accelerator`` (which reports none here); checkpoint coordination without gloo."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import sys

import pytest
import torch
import torch.distributed as dist

from nxd_smp import Zero1Optimizer, load_checkpoint, save_checkpoint
from nxd_smp.backend.eager import EagerBackend
from tests.distributed import run_python, run_ranks

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _train_gpt():
    name = "train_gpt_for_tests"
    if name not in sys.modules:
        sys.path.insert(0, str(ROOT / "scripts"))  # (it imports gpt_lib beside it)
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "train_gpt.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def test_fused_kernels_and_grad_scale_by_device_type():
    cpu = EagerBackend(torch.device("cpu"))
    assert cpu.has_fused_kernels and cpu.fused_grad_scale
    meta = EagerBackend(torch.device("meta"))  # a device torch has no fused optimizer kernels for
    assert not meta.has_fused_kernels and not meta.fused_grad_scale


@pytest.mark.parametrize("kernel_scales", [True, False])
def test_a_fused_kernel_that_takes_no_grad_scale_gets_scaled_gradients(monkeypatch, kernel_scales):
    """Where the device's fused kernel is not known to take ``grad_scale`` (a PrivateUse1 device), the clip
    coefficient is applied to the gradient before the step: the same numbers, with no ``grad_scale`` passed."""
    seen = []
    original = torch.optim.AdamW.step

    def spy(self, *args, **kwargs):  # (every AdamW's: the state-kind probe steps one of its own, once a process)
        seen.append((self, getattr(self, "grad_scale", None)))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    if not kernel_scales:
        monkeypatch.setattr("nxd_smp.backend.eager.FUSED_GRAD_SCALE_DEVICES", ())
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8).bfloat16()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, max_norm=0.01, compile_update=False)
    assert opt.backend.fused_grad_scale == kernel_scales
    for step in range(3):
        torch.manual_seed(step)
        model(torch.randn(4, 16).bfloat16()).float().pow(2).sum().backward()
        opt.step()
    assert opt.inner_optimizer.param_groups[0]["fused"]
    scales = [scale for inner, scale in seen if inner is opt.inner_optimizer]
    assert len(scales) == 3 and all((scale is not None) == kernel_scales for scale in scales), scales
    (want,) = _plain_reference()
    torch.testing.assert_close(opt.master_shards[0][: want.numel()], want, rtol=1e-6, atol=1e-7)


def _plain_reference() -> list[torch.Tensor]:
    """The same three steps with a stock fp32 AdamW on fp32 copies, clipped by the global norm."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8).bfloat16()
    masters = [p.detach().float().clone() for p in model.parameters()]
    inner = torch.optim.AdamW(masters, lr=1e-2)
    for step in range(3):
        torch.manual_seed(step)
        model.zero_grad()
        model(torch.randn(4, 16).bfloat16()).float().pow(2).sum().backward()
        grads = [p.grad.float() for p in model.parameters()]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        coef = torch.clamp(0.01 / (norm + 1e-6), max=1.0)
        for m, g in zip(masters, grads):
            m.grad = g * coef
        inner.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)
    return [torch.cat([m.reshape(-1) for m in masters])]


def test_the_demo_picks_the_device_through_torch_accelerator(monkeypatch):
    demo = _train_gpt()
    here = torch.accelerator.current_accelerator(check_available=True)  # None on a CPU-only machine
    assert demo.eager_device("auto") == (torch.device("cpu") if here is None else here)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: None)
    assert demo.eager_device("auto") == torch.device("cpu")
    assert demo.eager_device("cpu") == torch.device("cpu")
    with pytest.raises(SystemExit, match="torch.accelerator reports no accelerator"):
        demo.eager_device("accelerator")
    assert demo.process_group_backend(torch.device("cpu")) == "gloo"
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    chosen = []
    monkeypatch.setattr(torch.accelerator, "set_device_index", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "1")  # under torchrun: the local rank's device
    assert demo.eager_device("auto") == torch.device("cuda", 1) and chosen == [1]
    assert demo.eager_device("cpu") == torch.device("cpu")
    if hasattr(dist, "get_default_backend_for_device"):
        assert demo.process_group_backend(torch.device("cuda")) == "nccl"


def _save_and_load_without_gloo(rank: int, world_size: int, root: str) -> tuple[list, bool]:
    from torch.distributed import distributed_c10d

    dist.is_gloo_available = lambda: False  # a torch built without gloo: the default group's backend
    asked, new_group = [], distributed_c10d.new_group

    def spy(*args, **kwargs):
        asked.append(kwargs.get("backend", "missing"))
        return new_group(*args, **kwargs)

    distributed_c10d.new_group = spy
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).bfloat16()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    model(torch.randn(3, 8).bfloat16()).float().sum().backward()
    opt.step()
    save_checkpoint(f"{root}/ckpt", model=model, optimizer=opt)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_checkpoint(f"{root}/ckpt", model=model, optimizer=opt)
    same = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return asked, same


def test_checkpoints_coordinate_without_gloo(tmp_path):
    for asked, same in run_ranks(2, _save_and_load_without_gloo, str(tmp_path)):
        assert asked and all(backend is None for backend in asked) and same, asked


def test_check_accelerator_passes_on_the_cpu(tmp_path):
    """The accelerator check (what a CUDA or neuron machine runs) passes its own checks on the CPU: every
    row ok, and a failing row would fail the command."""
    out = run_python([str(ROOT / "scripts" / "check_accelerator.py"), "--device", "cpu", "--out", str(tmp_path / "c.json")],
                     timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert [r["check"] for r in rows] == ["step", "prescaled", "dtensor", "checkpoint", "compiled_model"]
    assert all(r["ok"] for r in rows) and rows[1]["grad_scale_in_kernel"] is False
