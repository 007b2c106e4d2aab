"""The way out to native PyTorch and back (``nxd_smp.native_torch``): our checkpoint
exported in ``get_state_dict``'s DCP layout and loaded by torch alone; continued by plain
torch under DDP and FSDP2 at DP 2 alongside nxd_smp at DP 2; a native run (one process, and
FSDP2-sharded) imported into nxd_smp at DP 1 and DP 2; malicious files refused; the
safetensors export; bad inputs.

The oracles are torch itself: the layout ``dcp.save`` writes for ``get_state_dict`` of an
fp32 model, what ``dcp.load`` + ``set_state_dict`` put into a torch model and optimizer, and
torch's own training under DDP/FSDP2. One gloo spawn (2 ranks) serves every DP 2 check.
"""

from __future__ import annotations

import contextlib
import pickle
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from nxd_smp import CheckpointError, MixedPrecisionConfig, Zero1Optimizer, load_checkpoint, save_checkpoint
from nxd_smp.checkpoint import read_checkpoint
from nxd_smp.checkpointing import dcp_index
from nxd_smp.checkpointing.files import Folder


def read_metadata(directory):
    """The DCP index of ``directory``, read by nxd_smp's one DCP index reader."""
    with Folder.open(directory) as folder:
        return dcp_index.read_metadata(folder)
from nxd_smp.interop.native_torch import export_safetensors, export_torch, import_torch
from tests.distributed import run_ranks

MAX_NORM = 2.0  # the fixed gradients' mean has a norm of ~3: clipping acts on every step
STEPS_BEFORE, STEPS_AFTER = 2, 3
SHAPES = [(13, 7), (13,), (6, 13), (6,)]  # Net's parameters, in order
# A native fp32 continuation from the same state, fed the same gradients, computes every
# fp32 operation nxd_smp computes, but not in the same order: the gradient norm is summed
# differently (and over gloo), and the Adam kernels differ (fused on nxd_smp's flat shards,
# foreach in torch), so single steps differ by a few ulp (~1e-7 relative). Adam's update
# lr * m / (sqrt(v) + eps) moves by that relative amount: after STEPS_AFTER steps of at most
# lr = 3e-2 each, |difference| <= 3 * 3e-2 * ~1e-6 ~ 1e-7; ATOL is 10x that, and three orders
# of magnitude below one step's size (a lost step, hyperparameter or moment shows up as 1e-2).
# Observed with torch 2.9 on CPU: 3e-8 (DDP and FSDP2 at DP 2), 1.5e-8 (one step at DP 1).
ATOL, RTOL = 1e-6, 1e-6


class Net(nn.Sequential):
    """Linear(7, 13) - Tanh - Linear(13, 6) (FQNs ``0.weight`` ...) whose forward takes the
    gradients to produce: ``loss = sum(p * g)`` has ``dL/dp = g`` exactly, so DDP and FSDP2
    reduce them through their own hooks (FSDP2 swaps in the unsharded parameters here)."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        torch.manual_seed(0)
        super().__init__(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 6))
        self.to(dtype)

    def forward(self, grads):
        return sum((p * g.to(p.dtype)).sum() for p, g in zip(self.parameters(), grads))


def groups_of(model: nn.Module, lr: float | None = None) -> list[dict]:
    """Two param groups with different lr and weight decay (``lr``: both the same, to see the
    import set them)."""
    return [{"params": [model[0].weight, model[2].weight], "lr": lr or 1e-2},
            {"params": [model[0].bias, model[2].bias], "lr": lr or 3e-2, "weight_decay": 0.0 if lr is None else 0.1}]


def zero1(model: nn.Module, lr: float | None = None) -> Zero1Optimizer:
    return Zero1Optimizer(groups_of(model, lr), torch.optim.AdamW, max_norm=MAX_NORM, compile_update=False,
                          mixed_precision=MixedPrecisionConfig(use_master_weights_in_ckpt=True))


def fixed_grads(step: int, rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank + 1)
    return [(torch.randn(shape, generator=g) * 0.3).bfloat16() for shape in SHAPES]


def fresh(lr: float | None = None) -> dict:
    """A new bf16 model and its Zero1Optimizer, as keyword arguments."""
    model = Net()
    return {"model": model, "optimizer": zero1(model, lr)}


def torch_step(model: nn.Module, opt: torch.optim.Optimizer, grads, forward=None) -> None:
    """One plain torch step: backward through ``forward`` (the model or its DDP/FSDP wrapper),
    clip as nxd_smp does, AdamW."""
    (forward or model)(grads).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    opt.zero_grad()


def whole_state(model: nn.Module, opt: Zero1Optimizer, where: Path) -> dict:
    """Everything ``opt`` holds, whole and by name (through our own save and reader)."""
    save_checkpoint(where, model=model, optimizer=opt)
    return read_checkpoint(where)


def quiet_dcp(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        return fn(*args, **kwargs)


def torch_load(directory: Path, model: nn.Module, opt: torch.optim.Optimizer, **kwargs) -> None:
    """A DCP directory into a torch model and optimizer with torch alone."""
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    quiet_dcp(dcp.load, state, checkpoint_id=directory, **kwargs)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """An nxd_smp run (bf16, masters saved) after STEPS_BEFORE steps, and its export."""
    root = tmp_path_factory.mktemp("native_torch")
    model = Net()
    opt = zero1(model)
    for step in range(STEPS_BEFORE):
        model(fixed_grads(step, 0)).backward()
        opt.step()
        opt.zero_grad()
    save_checkpoint(root / "ckpt", model=model, optimizer=opt)
    export_torch(root / "ckpt", root / "export")
    return root


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """A native torch run (fp32 AdamW, one process) saved with ``get_state_dict`` +
    ``dcp.save``; returns its directory and its state by name."""
    root = tmp_path_factory.mktemp("native_run")
    model = Net(torch.float32)
    opt = torch.optim.AdamW(groups_of(model))
    for step in range(3):
        torch_step(model, opt, fixed_grads(step, 0))
    msd, osd = get_state_dict(model, opt)
    quiet_dcp(dcp.save, {"model": msd, "optim": osd}, checkpoint_id=root / "dcp", no_dist=True)
    return root, {k: v.clone() for k, v in msd.items()}, osd


@contextlib.contextmanager
def no_collectives():
    """Every collective DCP could call raises instead (it looks them up on torch.distributed)."""
    names = ["all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
             "barrier", "all_reduce", "all_gather", "broadcast", "reduce_scatter"]
    saved = {name: getattr(torch.distributed, name) for name in names}

    def refuse(*args, **kwargs):
        raise AssertionError("a process-local tool joined a collective")

    try:
        for name in names:
            setattr(torch.distributed, name, refuse)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.distributed, name, fn)


def _dp2(rank: int, world: int, root: str) -> dict:
    """On each of 2 gloo ranks: nxd_smp continued from the checkpoint at DP 2; torch under DDP
    and under FSDP2 continued from the export; the native run imported at DP 2. First, rank 0
    alone exports inside the process group (the other goes on to its next collective)."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    root = Path(root)
    grads = [fixed_grads(STEPS_BEFORE + i, rank) for i in range(STEPS_AFTER)]
    out = {}
    if rank == 0:
        with no_collectives():
            export_torch(root / "ckpt", root / "export_in_group")

    model = Net()
    opt = zero1(model)
    load_checkpoint(root / "ckpt", model=model, optimizer=opt)
    for g in grads:
        model(g).backward()
        opt.step()
        opt.zero_grad()
    save_checkpoint(root / "nxd_dp2", model=model, optimizer=opt)

    model = Net(torch.float32)
    opt = torch.optim.AdamW(groups_of(model))
    ddp = DistributedDataParallel(model)
    torch_load(root / "export", ddp, opt)
    for g in grads:
        torch_step(model, opt, g, forward=ddp)
    out["ddp"] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    model = Net(torch.float32)
    fully_shard(model)
    opt = torch.optim.AdamW(groups_of(model))
    torch_load(root / "export", model, opt)
    for g in grads:
        torch_step(model, opt, g)
    out["fsdp"] = {k: v.full_tensor() for k, v in model.state_dict().items()}
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=root / "fsdp_native")  # sharded: 2 chunks a tensor

    model = Net()
    opt = zero1(model, lr=0.5)
    import_torch(root / "native" / "dcp", model=model, optimizer=opt)
    save_checkpoint(root / "imported_dp2", model=model, optimizer=opt)
    return out


@pytest.fixture(scope="module")
def dp2(trained, native):
    shutil.copytree(native[0], trained / "native")
    return run_ranks(2, _dp2, str(trained))


# ---------------------------------------------------------------------------- export
def test_export_has_get_state_dict_layout_and_loads_with_torch_alone(trained, tmp_path):
    full = read_checkpoint(trained / "ckpt")
    opt_saved = full["optimizer"]

    # The layout: what dcp.save writes for get_state_dict of the same model in fp32 + AdamW.
    ref_model = Net(torch.float32)
    ref_opt = torch.optim.AdamW(groups_of(ref_model))
    msd, osd = get_state_dict(ref_model, ref_opt)  # (materializes AdamW's state)
    quiet_dcp(dcp.save, {"model": msd, "optim": osd}, checkpoint_id=tmp_path / "ref", no_dist=True)
    ours, ref = read_metadata(trained / "export"), read_metadata(tmp_path / "ref")
    assert ours.planner_data == ref.planner_data
    assert ours.state_dict_metadata.keys() == ref.state_dict_metadata.keys()
    for key, meta in ref.state_dict_metadata.items():
        mine = ours.state_dict_metadata[key]
        assert type(mine) is type(meta), key
        if hasattr(meta, "size"):
            assert (mine.size, mine.properties.dtype) == (meta.size, meta.properties.dtype), key
    assert ours.storage_meta.checkpoint_id == (trained / "export").absolute()

    # Loaded by torch alone, into an fp32 model and a fresh AdamW with other hyperparameters.
    model = Net(torch.float32)
    opt = torch.optim.AdamW(groups_of(model, lr=0.5))
    torch_load(trained / "export", model, opt, no_dist=True)
    for name, master in opt_saved["master_weights"].items():
        assert torch.equal(model.state_dict()[name], master), name
    msd, osd = get_state_dict(model, opt)
    assert osd["state"].keys() == opt_saved["state"].keys()
    for name, saved in opt_saved["state"].items():
        assert osd["state"][name].keys() == saved.keys()
        for key, value in saved.items():
            assert osd["state"][name][key].dtype == torch.float32
            assert torch.equal(osd["state"][name][key], value), (name, key)
    assert float(osd["state"]["0.weight"]["step"]) == STEPS_BEFORE
    ref_groups = torch.optim.AdamW(groups_of(Net(torch.float32))).state_dict()["param_groups"]
    for group, ref_group, saved in zip(osd["param_groups"], ref_groups, opt_saved["groups"]):
        assert group.keys() == ref_group.keys()
        assert {k: v for k, v in group.items() if k != "params"} == {k: v for k, v in ref_group.items() if k != "params"}
        assert group["params"] == saved["params"]


def test_export_without_masters_warns_and_model_only_exports_the_model(tmp_path):
    model = Net()
    opt = zero1(model)
    model(fixed_grads(0, 0)).backward()
    opt.step()
    save_checkpoint(tmp_path / "no_masters", model=model, optimizer=opt, save_master_weights=False)
    with pytest.warns(UserWarning, match="no fp32 master weights.*precision"):
        export_torch(tmp_path / "no_masters", tmp_path / "e1")
    f = Net(torch.float32)
    torch_load(tmp_path / "e1", f, torch.optim.AdamW(groups_of(f)), no_dist=True)
    for name, value in model.state_dict().items():
        assert torch.equal(f.state_dict()[name], value.float()), name

    save_checkpoint(tmp_path / "model_only", model=model)
    with pytest.warns(UserWarning, match="precision"):
        export_torch(tmp_path / "model_only", tmp_path / "e2")
    assert {path[0] for path in read_metadata(tmp_path / "e2").planner_data.values()} == {"model"}
    with pytest.raises(CheckpointError, match="needs 'model' and 'optim'"):
        import_torch(tmp_path / "e2", **fresh())


def test_export_refuses_an_existing_target(trained, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not an empty directory"):
        export_torch(trained / "ckpt", tmp_path / "full")
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not an empty directory"):
        export_torch(trained / "ckpt", tmp_path / "file")
    (tmp_path / "empty").mkdir()
    export_torch(trained / "ckpt", tmp_path / "empty")  # an empty directory is taken
    assert (tmp_path / "empty" / ".metadata").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file", "full"]  # no temporary left


def test_export_safetensors(trained, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    full = read_checkpoint(trained / "ckpt")
    weights = load_file(export_safetensors(trained / "ckpt", tmp_path / "w.safetensors"))
    assert weights.keys() == full["model"].keys()
    for name, value in full["model"].items():
        assert weights[name].dtype == torch.bfloat16 and torch.equal(weights[name], value), name
    masters = load_file(export_safetensors(trained / "ckpt", tmp_path / "m.safetensors", masters=True))
    for name, value in full["optimizer"]["master_weights"].items():
        assert masters[name].dtype == torch.float32 and torch.equal(masters[name], value), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors", "w.safetensors"]
    with pytest.raises(CheckpointError, match="exists"):  # a user's file is never replaced unasked
        export_safetensors(trained / "ckpt", tmp_path / "w.safetensors", masters=True)
    assert torch.equal(load_file(tmp_path / "w.safetensors")[name], full["model"][name])
    export_safetensors(trained / "ckpt", tmp_path / "w.safetensors", masters=True, overwrite=True)
    assert load_file(tmp_path / "w.safetensors").keys() == masters.keys()

    save_checkpoint(tmp_path / "model_only", model=Net())
    with pytest.raises(CheckpointError, match="no fp32 master weights"):
        export_safetensors(tmp_path / "model_only", tmp_path / "x.safetensors", masters=True)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install safetensors"):
        export_safetensors(trained / "ckpt", tmp_path / "y.safetensors")


# ---------------------------------------------------------------------------- import
def assert_imported(imported: dict, native_model: dict, native_optim: dict) -> None:
    """``read_checkpoint`` of an nxd_smp run equals the native run exactly."""
    opt = imported["optimizer"]
    for name, value in native_model.items():
        assert torch.equal(opt["master_weights"][name], value), name
        assert torch.equal(imported["model"][name], value.to(torch.bfloat16)), name
        for key, state in native_optim["state"][name].items():
            assert torch.equal(opt["state"][name][key], state), (name, key)
    for group, native_group in zip(opt["groups"], native_optim["param_groups"]):
        assert group["params"] == native_group["params"]
        assert (group["hyper"]["lr"], group["hyper"]["weight_decay"]) == (native_group["lr"], native_group["weight_decay"])


def test_native_run_imports_at_dp1_exactly_and_continues_alike(native, tmp_path):
    directory, native_model, native_optim = native
    model = Net()
    opt = zero1(model, lr=0.5)
    import_torch(directory / "dcp", model=model, optimizer=opt)
    assert_imported(whole_state(model, opt, tmp_path / "imported"), native_model, native_optim)

    # One more step on each side, same gradients: the imported state is the state Adam uses.
    theirs = Net(torch.float32)
    their_opt = torch.optim.AdamW(groups_of(theirs))
    torch_load(directory / "dcp", theirs, their_opt, no_dist=True)
    torch_step(theirs, their_opt, fixed_grads(3, 0))
    model(fixed_grads(3, 0)).backward()
    opt.step()
    masters = whole_state(model, opt, tmp_path / "next")["optimizer"]["master_weights"]
    for name, value in theirs.state_dict().items():
        torch.testing.assert_close(masters[name], value, atol=ATOL, rtol=RTOL)
        assert not torch.equal(value, native_model[name])


class _Payload:
    """Unpickling it opens (creates) ``marker``: code that a safe reader never runs."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_import_refuses_malicious_files_and_runs_nothing(native, tmp_path):
    directory, msd, osd = native
    bad_index = tmp_path / "bad_index"
    shutil.copytree(directory / "dcp", bad_index)
    marker = tmp_path / "ran_index"
    payload = pickle.dumps(_Payload(str(marker)))
    (bad_index / ".metadata").write_bytes(payload)
    with pytest.raises(CheckpointError, match="refused"):
        import_torch(bad_index, **fresh())
    assert not marker.exists()

    marker = tmp_path / "ran_entry"  # a param group value: a byte entry written by torch.save
    groups = [{**g, "lr": _Payload(str(marker))} if i == 0 else g for i, g in enumerate(osd["param_groups"])]
    quiet_dcp(dcp.save, {"model": msd, "optim": {**osd, "param_groups": groups}},
              checkpoint_id=tmp_path / "bad_entry", no_dist=True)
    with pytest.raises(CheckpointError, match="io.open.*refused|refused.*io.open"):
        import_torch(tmp_path / "bad_entry", **fresh())
    assert not marker.exists()

    pickle.loads(payload).close()  # the payload is live: a plain unpickler runs it
    assert (tmp_path / "ran_index").exists()


def test_import_refuses_what_does_not_fit(native, tmp_path):
    directory = native[0] / "dcp"

    class Wider(Net):
        def __init__(self):
            super().__init__()
            self[2] = nn.Linear(13, 5).bfloat16()

    wider = Wider()
    wider_opt = zero1(wider)
    before = [p.detach().clone() for p in wider.parameters()] + [m.clone() for m in wider_opt.master_shards]
    with pytest.raises(CheckpointError, match=r"2\.weight: shape \(6, 13\) in the checkpoint, \(5, 13\)"):
        import_torch(directory, model=wider, optimizer=wider_opt)
    after = [p.detach() for p in wider.parameters()] + list(wider_opt.master_shards)
    assert all(torch.equal(a, b) for a, b in zip(after, before))  # a refused import changes nothing
    longer = Net()
    longer.append(nn.Linear(6, 2).bfloat16())
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: \['3\.bias', '3\.weight'\]"):
        import_torch(directory, model=longer, optimizer=zero1(longer))
    model = Net()
    with pytest.raises(TypeError, match="Zero1Optimizer"):
        import_torch(directory, model=model, optimizer=torch.optim.AdamW(model.parameters()))
    with pytest.raises(CheckpointError, match="no .metadata"):
        import_torch(tmp_path, model=model, optimizer=zero1(model))
    ours = save_checkpoint(tmp_path / "ours", model=model, optimizer=zero1(model))
    with pytest.raises(CheckpointError, match="nxd_smp.load_checkpoint"):
        import_torch(ours, model=model, optimizer=zero1(model))


# ---------------------------------------------------------------------------- DP 2
def test_import_state_that_does_not_fit_is_refused_by_the_one_check(native, tmp_path):
    """The reader stages what the file holds and the one check (the same as every format's) refuses what does
    not fit, the model and the optimizer unchanged: a managed parameter without state where the others have
    it, state for a parameter the optimizer does not manage, another optimizer class's state (SGD's
    ``momentum_buffer``, whose groups lack Adam's hyperparameters), and groups of other parameters with no
    state yet."""
    _, msd, osd = native

    def saved(name, state, groups=None):
        directory = tmp_path / name
        quiet_dcp(dcp.save, {"model": msd, "optim": {"state": state, "param_groups": groups or osd["param_groups"]}},
                  checkpoint_id=directory, no_dist=True)
        return directory

    def refused(directory, match):
        target = fresh()
        before = [p.detach().clone() for p in target["model"].parameters()] + [
            m.clone() for m in target["optimizer"].master_shards]
        with pytest.raises(CheckpointError, match=match):
            import_torch(directory, **target)
        after = [p.detach() for p in target["model"].parameters()] + list(target["optimizer"].master_shards)
        assert all(torch.equal(a, b) for a, b in zip(after, before))

    without = {k: v for k, v in osd["state"].items() if k != "2.bias"}
    refused(saved("without", without), r"parameters missing from it: \['2\.bias'\]")
    surplus = {**osd["state"], "3.weight": osd["state"]["2.weight"]}
    refused(saved("surplus", surplus), r"parameters it holds that the optimizer does not manage: \['3\.weight'\]")
    sgd = {k: {"momentum_buffer": v["exp_avg"].clone()} for k, v in osd["state"].items()}
    sgd_groups = [{"lr": g["lr"], "momentum": 0.9, "dampening": 0.0, "weight_decay": g["weight_decay"],
                   "nesterov": False, "maximize": False, "params": g["params"]} for g in osd["param_groups"]]
    refused(saved("sgd", sgd, sgd_groups), r"state keys \['momentum_buffer'\], the optimizer's are")
    renamed = [{**g, "params": [f"other.{n}" for n in g["params"]]} for g in osd["param_groups"]]
    refused(saved("renamed_without_state", {}, renamed), r"parameters missing from it: \['0\.bias', '0\.weight'")


def test_ddp_and_fsdp2_continue_the_export_like_nxd_smp_at_dp2(trained, dp2):
    assert read_metadata(trained / "export_in_group").planner_data == read_metadata(trained / "export").planner_data
    masters = read_checkpoint(trained / "nxd_dp2")["optimizer"]["master_weights"]
    before = read_checkpoint(trained / "ckpt")["optimizer"]["master_weights"]
    for rank in dp2:
        for kind in ("ddp", "fsdp"):
            for name, value in masters.items():
                torch.testing.assert_close(rank[kind][name], value, atol=ATOL, rtol=RTOL, msg=f"{kind} {name}")
                assert not torch.equal(value, before[name])  # (they moved)


def test_native_run_imports_at_dp2_exactly(trained, native, dp2):
    assert_imported(read_checkpoint(trained / "imported_dp2"), native[1], native[2])


def test_fsdp2_sharded_save_imports_at_dp1(trained, dp2, tmp_path):
    index = read_metadata(trained / "fsdp_native")
    assert len(index.state_dict_metadata["model.0.weight"].chunks) == 2  # sharded along dim 0
    model = Net()
    opt = zero1(model, lr=0.5)
    import_torch(trained / "fsdp_native", model=model, optimizer=opt)
    imported = whole_state(model, opt, tmp_path / "imported")
    for name, value in dp2[0]["fsdp"].items():
        assert torch.equal(imported["optimizer"]["master_weights"][name], value), name
    assert float(imported["optimizer"]["state"]["0.weight"]["step"]) == STEPS_BEFORE + STEPS_AFTER


class Fused(nn.Module):
    """A fused projection presented by its state-dict hook as two (TorchTitan's ``wqkv`` as ``wq``/``wk``...):
    the state dict's keys are not the parameters' names."""

    def __init__(self) -> None:
        super().__init__()
        self.wqk = nn.Linear(4, 8, bias=False)
        self.out = nn.Linear(8, 1)
        self._register_state_dict_hook(Fused._split)

    @staticmethod
    def _split(module, state, prefix, local_metadata):
        fused = state.pop(prefix + "wqk.weight")
        state[prefix + "wq.weight"], state[prefix + "wk.weight"] = fused.chunk(2)

    def forward(self, x):
        return self.out(self.wqk(x))


def test_masters_under_names_the_state_dict_renames_are_refused_not_upcast(tmp_path):
    """The export writes the masters under the model's state-dict keys; where the model's hooks rename or
    split parameters, no entry is named by the fused master, and the split entries would be their bf16
    values upcast: refused, naming both; the parameters as saved still export (``masters=False``)."""
    torch.manual_seed(0)
    model = Fused().to(torch.bfloat16)
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, compile_update=False,
                         mixed_precision=MixedPrecisionConfig(use_master_weights_in_ckpt=True))
    model(torch.randn(3, 4).bfloat16()).float().pow(2).mean().backward()
    opt.step()
    save_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt)
    for export in (lambda: export_torch(tmp_path / "ckpt", tmp_path / "dcp"),
                   lambda: export_safetensors(tmp_path / "ckpt", tmp_path / "m.safetensors", masters=True)):
        with pytest.raises(CheckpointError, match=r"wqk\.weight.*wk\.weight.*wq\.weight"):
            export()
    assert not (tmp_path / "dcp").exists() and not (tmp_path / "m.safetensors").exists()
    from safetensors.torch import load_file

    export_safetensors(tmp_path / "ckpt", tmp_path / "saved.safetensors")
    saved = load_file(tmp_path / "saved.safetensors")
    assert torch.equal(saved["wq.weight"], model.wqk.weight[:4]) and saved["wq.weight"].dtype == torch.bfloat16
