"""NxD's checkpoint calls as NxD training scripts write them (``neuronx_distributed.trainer``:
``save_checkpoint(dir, tag, model, optimizer, scheduler, user_content, ...)``,
``load_checkpoint(dir, tag=None, ...)`` returning the user content, ``has_checkpoint``,
``finalize_checkpoint``), and NxD's own folders read into nxd_smp: a plain torch optimizer's
(NxD without ZeRO-1), refusals, and files that must not run code. torch_xla's ZeRO-1 folders
at DP 1, 2 and 4 are in test_xla_state_dict.py and test_xla_replicas.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import nxd_smp
from nxd_smp import CheckpointError, Zero1Optimizer, finalize_checkpoint, has_checkpoint, load_checkpoint, save_checkpoint
from nxd_smp.checkpoint import inspect_checkpoint, read_checkpoint
from tests import nxd_stand_in
from tests.nxd_layout import HYPER, backward, grads, param_groups, scheduler_of
from tests.test_checkpoint_safety import Exploit
from tests.xla_export_worker import make_model


def build(seed: int = 0):
    torch.manual_seed(seed)
    model = make_model()
    if seed:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-1)
    opt = Zero1Optimizer(param_groups(model), torch.optim.AdamW, compile_update=False, bucket_cap_mb=0.0002,
                         mixed_precision=nxd_smp.MixedPrecisionConfig(use_master_weights_in_ckpt=True), **HYPER)
    return model, opt, scheduler_of(opt)


def train(model, opt, scheduler, steps: range) -> None:
    for step in steps:
        backward(model, grads(0, step, model))
        opt.step()
        opt.zero_grad()
        scheduler.step()


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_nxd_call_shapes_save_retain_and_resume_the_newest_tag(tmp_path):
    model, opt, scheduler = build()
    reached = {}
    for step in range(1, 5):
        train(model, opt, scheduler, range(step - 1, step))
        # NxD's positional form: dir, tag, model, optimizer, scheduler, user_content
        save_checkpoint(tmp_path, f"step_{step}", model, opt, scheduler, {"step": step},
                        num_workers=8, use_xser=False, num_kept_ckpts=2, async_save=step % 2 == 0,
                        zero1_optimizer=True, use_zero1_dcp=False, avoid_saving_lower_precision_weights=False)
        reached[step] = params(model)
    finalize_checkpoint()
    assert has_checkpoint(tmp_path) and not has_checkpoint(tmp_path / "nothing_here")
    tags = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert tags == ["step_3", "step_4"]  # retention counts tags

    fresh, fresh_opt, fresh_scheduler = build(seed=5)
    assert load_checkpoint(tmp_path, model=fresh, optimizer=fresh_opt, scheduler=fresh_scheduler) == {"step": 4}
    assert all(torch.equal(p, reached[4][n]) for n, p in fresh.named_parameters())
    assert fresh_scheduler.last_epoch == 4
    # an older tag by name, positionally, as NxD scripts resume
    assert load_checkpoint(tmp_path, "step_3", fresh, fresh_opt, fresh_scheduler, 8, True) == {"step": 3}
    assert all(torch.equal(p, reached[3][n]) for n, p in fresh.named_parameters())
    train(fresh, fresh_opt, fresh_scheduler, range(3, 4))
    assert all(torch.equal(p, reached[4][n]) for n, p in fresh.named_parameters())


def test_both_call_shapes_write_the_same_format(tmp_path):
    model, opt, scheduler = build()
    train(model, opt, scheduler, range(2))
    save_checkpoint(tmp_path / "nxd", "step_2", model, opt, scheduler, {"step": 2})
    save_checkpoint(tmp_path / "kw" / "step_2", model=model, optimizer=opt, scheduler=scheduler, extra={"step": 2})
    a, b = inspect_checkpoint(tmp_path / "nxd" / "step_2"), inspect_checkpoint(tmp_path / "kw" / "step_2")
    assert a["format"] == b["format"] and a["tensors"] == b["tensors"] and a["optimizer"] == b["optimizer"]
    x, y = read_checkpoint(tmp_path / "nxd" / "step_2"), read_checkpoint(tmp_path / "kw" / "step_2")
    assert x["extra"] == y["extra"] == {"step": 2}
    for name, master in x["optimizer"]["master_weights"].items():
        assert torch.equal(master, y["optimizer"]["master_weights"][name])


def test_nxd_arguments_are_checked(tmp_path):
    model, opt, scheduler = build()
    with pytest.raises(ValueError, match="num_workers"):
        save_checkpoint(tmp_path, "t", model, opt, num_workers=0)
    with pytest.raises(TypeError, match="use_xser"):
        save_checkpoint(tmp_path, "t", model, opt, use_xser="yes")
    with pytest.raises(ValueError, match="plain folder name"):
        save_checkpoint(tmp_path, "../elsewhere", model, opt)
    with pytest.raises(ValueError, match="user_content= or extra="):
        save_checkpoint(tmp_path, "t", model, opt, user_content=1, extra=2)
    with pytest.raises(TypeError, match="model="):
        save_checkpoint(tmp_path, "t", None, opt)
    with pytest.raises(ValueError, match="num_kept_ckpts"):
        save_checkpoint(tmp_path, "t", model, opt, num_kept_ckpts=0)
    with pytest.raises(TypeError, match="strict"):
        load_checkpoint(tmp_path, "t", model, opt, strict="no")
    assert not any(tmp_path.iterdir())  # nothing written by a refused call
    save_checkpoint(tmp_path, 7, model, opt, num_kept_ckpts=-1)  # an int tag; -1 keeps all (NxD)
    assert (tmp_path / "7").is_symlink()


def test_strict_false_leaves_what_only_one_side_has(tmp_path):
    model, opt, scheduler = build()
    save_checkpoint(tmp_path, "t", model)
    bigger = torch.nn.Sequential(*make_model(), torch.nn.Linear(6, 2).bfloat16())
    extra_layer = {k: v.clone() for k, v in bigger[3].state_dict().items()}
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: \['3.bias', '3.weight'\]"):
        load_checkpoint(tmp_path, "t", bigger)
    load_checkpoint(tmp_path, "t", bigger, strict=False)
    assert torch.equal(bigger[0].weight, model[0].weight)
    assert all(torch.equal(v, extra_layer[k]) for k, v in bigger[3].state_dict().items())


# ---------------------------------------------------------------- NxD's own folders
def nxd_folder(root: Path, model, optimizer_state, *, user_content=None, done: bool = True, tp: int = 0) -> Path:
    """An NxD tag folder as ``neuronx_distributed.trainer.save_checkpoint`` lays it out (the
    files of tensor-parallel rank ``tp``)."""
    tag = root / "step_3"
    (tag / "model").mkdir(parents=True, exist_ok=True)
    (tag / "optim").mkdir(exist_ok=True)
    (tag / "checkpoint").write_text("1")
    torch.save(model.state_dict(), tag / "model" / f"dp_rank_00_tp_rank_{tp:02d}_pp_rank_00.pt")
    torch.save(optimizer_state, tag / "optim" / f"dp_rank_00_tp_rank_{tp:02d}_pp_rank_00.pt")
    if user_content is not None:
        torch.save(user_content, tag / "user_content.pt")
    if done:
        (tag / "done").write_text("1")
    return tag


def plain_torch_run(steps: int = 3):
    """NxD without ZeRO-1: a torch AdamW over the bf16 model's parameters, replicated."""
    model = make_model()
    opt = torch.optim.AdamW(param_groups(model), **HYPER)
    for step in range(steps):
        backward(model, grads(0, step, model))
        opt.step()
        opt.zero_grad()
    return model, opt


def test_an_nxd_folder_of_a_plain_torch_optimizer_loads_by_name(tmp_path):
    theirs, their_opt = plain_torch_run()
    nxd_folder(tmp_path, theirs, their_opt.state_dict(), user_content={"step": 3})
    assert has_checkpoint(tmp_path)
    model, opt, _ = build(seed=5)
    with pytest.warns(UserWarning, match="master"):  # no masters in NxD's file: rebuilt from the params
        assert load_checkpoint(tmp_path, model=model, optimizer=opt) == {"step": 3}
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), theirs.parameters()))
    save_checkpoint(tmp_path / "ours", model=model, optimizer=opt)
    state = read_checkpoint(tmp_path / "ours")["optimizer"]["state"]
    for (name, _), p in zip(model.named_parameters(), theirs.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[name][key], their_opt.state[p][key].float()), (name, key)
        assert float(state[name]["step"]) == 3


def test_nxd_folders_that_do_not_fit_are_refused_and_change_nothing(tmp_path):
    theirs, their_opt = plain_torch_run()
    model, opt, _ = build(seed=5)
    before = params(model)
    nxd_folder(tmp_path / "a", theirs, their_opt.state_dict(), done=False)
    with pytest.raises(CheckpointError, match="incomplete"):
        load_checkpoint(tmp_path / "a" / "step_3", model=model, optimizer=opt)
    assert not has_checkpoint(tmp_path / "a")
    state = their_opt.state_dict()
    state["param_groups"] = state["param_groups"][:1]
    nxd_folder(tmp_path / "b", theirs, state)
    with pytest.raises(CheckpointError, match="parameters in its param groups"):
        load_checkpoint(tmp_path / "b", model=model, optimizer=opt)
    other = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 6)).bfloat16()
    nxd_folder(tmp_path / "c", other, their_opt.state_dict())
    with pytest.raises(CheckpointError, match="does not fit the model"):
        load_checkpoint(tmp_path / "c", model=model, optimizer=opt)
    tag = nxd_folder(tmp_path / "d", theirs, their_opt.state_dict())
    (tag / "optim" / ".metadata").write_bytes(b"")  # NxD's use_zero1_dcp=True optimizer folder
    with pytest.raises(CheckpointError, match="use_zero1_dcp"):
        load_checkpoint(tmp_path / "d", model=model, optimizer=opt)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_nxd_files_never_run_code(tmp_path):
    theirs, their_opt = plain_torch_run()
    model, opt, _ = build(seed=5)
    marker = tmp_path / "ran"
    nxd_folder(tmp_path / "content", theirs, their_opt.state_dict(), user_content={"x": Exploit(str(marker))})
    with pytest.raises(CheckpointError, match="user_content.pt"):
        load_checkpoint(tmp_path / "content", model=model, optimizer=opt)
    # an xser file whose reference is replaced by the exploit: only the reference class is admitted
    tag = nxd_folder(tmp_path / "xser", theirs, their_opt.state_dict())
    model_file = tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"
    (Path(f"{model_file}.tensors")).mkdir()
    torch.save({"0.weight": Exploit(str(marker))}, model_file)
    with pytest.raises(CheckpointError, match="dp_rank_00_tp_rank_00_pp_rank_00.pt"):
        load_checkpoint(tmp_path / "xser", model=model, optimizer=opt)
    assert not marker.exists() and not os.path.lexists(marker)


def test_each_tensor_parallel_rank_reads_its_own_nxd_files(tmp_path):
    first, first_opt = plain_torch_run(steps=2)
    second, second_opt = plain_torch_run(steps=3)
    nxd_folder(tmp_path, first, first_opt.state_dict(), tp=0)
    nxd_folder(tmp_path, second, second_opt.state_dict(), tp=1)
    model, opt, _ = build(seed=5)
    nxd_stand_in.install(world=2, tp=2, rank=1)  # this process: TP rank 1 of NxD's parallel state
    try:
        with pytest.warns(UserWarning, match="master"):
            load_checkpoint(tmp_path, model=model, optimizer=opt)
    finally:
        nxd_stand_in.uninstall()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), second.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), first.parameters()))
