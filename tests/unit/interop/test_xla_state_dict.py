"""torch_xla's / NxD's per-rank ZeRO-1 state dicts: our checkpoint exported to that layout
and loaded by torch_xla's own ZeroRedundancyOptimizer (on the XLA CPU device, in a child
process), and imported back; the same round trip on CPU across DP sizes; refusals."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nxd_smp import CheckpointError, save_checkpoint
from nxd_smp.interop.torch_xla import export_xla, import_xla
from nxd_smp import MixedPrecisionConfig, Zero1Optimizer
from tests.distributed import run_python
from tests.nxd_layout import LAYOUTS, SAVED_AT, USER_CONTENT, resume
from tests.nxd_layout import oracle as nxd_oracle
from tests.oracle import assert_params_close
from tests.xla_export_worker import backward, fixed_grads, make_model

ROOT = Path(__file__).resolve().parents[3]


def build(seed=0):
    """torch_xla's layout has no 0-dim parameters: a plain MLP, two param groups."""
    model = make_model()
    if seed:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-1)
    groups = [{"params": [model[0].weight, model[2].weight], "lr": 1e-2},
              {"params": [model[0].bias, model[2].bias], "lr": 3e-2, "weight_decay": 0.0}]
    mp = MixedPrecisionConfig(use_master_weights_in_ckpt=True)
    return model, Zero1Optimizer(groups, torch.optim.AdamW, mixed_precision=mp, bucket_cap_mb=0.0002)


def train(model, opt, steps):
    for grads in fixed_grads(model, steps):
        backward(model, grads)
        opt.step()
        opt.zero_grad()


def test_export_at_dp2_imports_back_at_dp1(tmp_path):
    model, opt = build()
    train(model, opt, 2)
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt)
    files = export_xla(tmp_path / "c", tmp_path / "xla", dp_size=2)
    record = torch.load(files[1], weights_only=False)
    assert set(record) == {"state", "param_groups", "base_state", "shape_info", "sharded_master_weights"}
    assert record["shape_info"][0] == model[0].weight.shape
    assert record["base_state"][0]["exp_avg"].shape == (7, 7)  # 13 rows padded to 14, chunk 1 of 2

    fresh, fresh_opt = build(seed=5)
    fresh.load_state_dict(model.state_dict())
    import_xla(files, model=fresh, optimizer=fresh_opt)
    for mine, theirs in zip(opt.master_shards, fresh_opt.master_shards):
        assert torch.equal(mine, theirs)
        for key, value in opt.inner_optimizer.state[mine].items():
            assert torch.equal(fresh_opt.inner_optimizer.state[theirs][key], value), key
    assert [g["lr"] for g in fresh_opt.param_groups] == [g["lr"] for g in opt.param_groups]


def test_import_refuses_files_that_do_not_fit(tmp_path):
    model, opt = build()
    train(model, opt, 1)
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt)
    files = export_xla(tmp_path / "c", tmp_path / "xla", dp_size=1)
    other, other_opt = build()
    with pytest.raises(CheckpointError, match="param groups"):
        import_xla(files, model=other, optimizer=type(other_opt)(other.parameters(), torch.optim.AdamW))
    with pytest.raises(ValueError, match="per-rank files"):
        import_xla([], model=other, optimizer=other_opt)
    with pytest.raises(ValueError, match="dp_size"):
        export_xla(tmp_path / "c", tmp_path / "xla2", dp_size=0)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("xla_export")
    out = root / "results.pt"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(ROOT)}
    proc = run_python(["-m", "tests.xla_export_worker", str(out), str(root / "nxd")], cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {**torch.load(out, weights_only=False), "nxd": root / "nxd"}


@pytest.mark.requires_xla  # (the exported fixture runs torch_xla)
def test_export_loads_into_torch_xla_zero1_and_takes_the_same_next_step(exported):
    names = [str(i) for i in range(len(exported["ours"]))]
    assert_params_close(dict(zip(names, exported["theirs"])), dict(zip(names, exported["ours"])))


@pytest.mark.requires_xla  # (the exported fixture runs torch_xla)
def test_torch_xla_state_imports_back(exported):
    for ours, imported in zip(exported["ours_state"], exported["imported_state"]):
        assert ours.keys() == imported.keys()
        assert float(ours["step"]) == float(imported["step"]) == 3
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(imported[key], ours[key], rtol=1e-4, atol=1e-7)
    for ours, imported in zip(exported["ours_masters"], exported["imported_masters"]):
        torch.testing.assert_close(imported, ours, rtol=1e-5, atol=1e-6)


@pytest.mark.requires_xla  # (the exported fixture runs torch_xla)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_nxd_checkpoint_written_by_torch_xla_at_dp1_resumes(exported, layout):
    # NxD's folder (torch_xla's ZeRO-1 with NxD's settings on the XLA device) loads and goes on
    # like the unsharded run; the DP 2 and 4 folders are in test_xla_replicas.py
    resumed = resume(0, exported["nxd"] / layout)
    assert resumed["user_content"] == USER_CONTENT and resumed["scheduler_epoch"] == SAVED_AT
    assert_params_close(resumed["params"], nxd_oracle(1, 1))
