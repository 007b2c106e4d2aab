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
from tests.distributed import run_ranks
from tests.nxd_layout import HYPER, backward, grads, param_groups, scheduler_of
from tests.crafted import Exploit
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


def test_a_tag_folder_holding_only_nxds_markers_is_replaced(tmp_path):
    """optimum-neuron's wait before an asynchronous save touches ``<tag>/done`` (when NxD's io
    state exists): that folder holds nothing to keep, so the save takes its place. Anything
    else in it is refused, and stays."""
    model, opt, _ = build()
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "done").touch()
    save_checkpoint(tmp_path, "shards", model, opt)
    assert (tmp_path / "shards").is_symlink() and not (tmp_path / "shards" / "done").exists()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "done").touch()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="exists and is not an nxd_smp checkpoint"):
        save_checkpoint(tmp_path, "other", model, opt)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_a_folder_made_at_the_tag_during_a_background_save_joins_the_checkpoint(tmp_path, monkeypatch):
    """optimum-neuron writes its consolidation metadata into the tag folder as soon as
    ``save_checkpoint`` returns, before a background save has published the folder: the file is
    kept, inside the checkpoint, and the link takes the folder's place."""
    import threading

    from nxd_smp.checkpointing import save as checkpoint_save

    gate, write = threading.Event(), checkpoint_save.write_tensors
    monkeypatch.setattr(checkpoint_save, "write_tensors", lambda *a, **k: (gate.wait(60), write(*a, **k))[1])
    model, opt, scheduler = build()
    train(model, opt, scheduler, range(1))
    save_checkpoint(tmp_path, "shards", model, opt, async_save=True)
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "mp_metadata_pp_rank_0.json").write_text("{}")
    gate.set()
    finalize_checkpoint()
    assert (tmp_path / "shards").is_symlink() and (tmp_path / "shards" / "mp_metadata_pp_rank_0.json").read_text() == "{}"
    fresh, fresh_opt, _ = build(seed=5)
    load_checkpoint(tmp_path, "shards", fresh, fresh_opt)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))


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
    masters_before = [m.clone() for m in opt.master_shards]
    nxd_folder(tmp_path / "a", theirs, their_opt.state_dict(), done=False)
    with pytest.raises(CheckpointError, match="incomplete"):
        load_checkpoint(tmp_path / "a" / "step_3", model=model, optimizer=opt)
    assert not has_checkpoint(tmp_path / "a")
    state = their_opt.state_dict()
    state["param_groups"] = state["param_groups"][:1]
    nxd_folder(tmp_path / "b", theirs, state)
    with pytest.raises(CheckpointError, match=r"its groups hold \[2, 2\]\): param_groups: 1 param groups, the optimizer has 2"):
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
    assert all(torch.equal(m, b) for m, b in zip(opt.master_shards, masters_before))


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


def square_model(seed: int = 0) -> torch.nn.Module:
    """Two layers of one shape: listed in another order, NxD's numbered files still fit by shape."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8)).bfloat16()


def square_optimizer(model, reverse: bool = False) -> Zero1Optimizer:
    weights, biases = [model[0].weight, model[2].weight], [model[0].bias, model[2].bias]
    groups = [{"params": weights[::-1] if reverse else weights, "lr": 1e-2},
              {"params": biases, "lr": 3e-2, "weight_decay": 0.0}]
    return Zero1Optimizer(groups, torch.optim.AdamW, compile_update=False, bucket_cap_mb=0.0002,
                          mixed_precision=nxd_smp.MixedPrecisionConfig(use_master_weights_in_ckpt=True), **HYPER)


def zero1_nxd_folder(root: Path, dp_size: int) -> tuple[Path, dict]:
    """An NxD tag folder of a ZeRO-1 run at ``dp_size`` (master weights saved): the optimizer
    files in torch_xla's layout written by ``export_xla``, the model file, ``done``."""
    from nxd_smp.interop.torch_xla import export_xla

    model = square_model()
    opt = square_optimizer(model)
    for step in range(2):
        backward(model, grads(0, step, model))
        opt.step()
        opt.zero_grad()
    save_checkpoint(root / "ours", model=model, optimizer=opt)
    tag = root / "step_2"
    export_xla(root / "ours", tag / "optim", dp_size=dp_size)
    (tag / "model").mkdir()
    torch.save(model.state_dict(), tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt")
    (tag / "checkpoint").write_text("1")
    (tag / "done").write_text("1")
    return tag, read_checkpoint(root / "ours")


def test_the_newest_tag_is_the_one_saved_last_not_the_last_by_name(tmp_path):
    model, opt, scheduler = build()
    for step, tag in enumerate(["step_10", "step_9", "step_11"]):
        train(model, opt, scheduler, range(step, step + 1))
        save_checkpoint(tmp_path / "ours", tag, model, opt, user_content=tag, num_kept_ckpts=2)
    assert sorted(p.name for p in (tmp_path / "ours").iterdir() if not p.name.startswith(".")) == ["step_11", "step_9"]
    assert load_checkpoint(tmp_path / "ours", model=model, optimizer=opt) == "step_11"
    theirs, their_opt = plain_torch_run()
    for name, age in (("step_20", 200), ("step_3", 100)):  # NxD: the newest done file wins
        tag = nxd_folder(tmp_path / "nxd" / "tmp", theirs, their_opt.state_dict(), user_content=name)
        tag.rename(tmp_path / "nxd" / name)
        os.utime(tmp_path / "nxd" / name / "done", (1_000_000 + age, 1_000_000 + age))
    with pytest.warns(UserWarning, match="master"):
        assert load_checkpoint(tmp_path / "nxd", model=model, optimizer=opt) == "step_20"


def test_has_checkpoint_on_a_checkpoint_itself(tmp_path):
    model, opt, _ = build()
    save_checkpoint(tmp_path / "latest", model=model)
    assert has_checkpoint(tmp_path / "latest") and has_checkpoint(tmp_path)
    assert not has_checkpoint(tmp_path / "missing")
    theirs, their_opt = plain_torch_run()
    tag = nxd_folder(tmp_path / "nxd", theirs, their_opt.state_dict(), done=False)
    assert not has_checkpoint(tag) and not has_checkpoint(tmp_path / "nxd")
    (tag / "done").write_text("1")
    assert has_checkpoint(tag) and has_checkpoint(tmp_path / "nxd")


def test_nxds_keyword_names_and_converted_pretrained_weights(tmp_path):
    model, opt, _ = build()
    save_checkpoint(checkpoint_dir_str=tmp_path / "kw", tag="lora", model=model)  # NxD's lightning example
    assert (tmp_path / "kw" / "lora").is_symlink()
    with pytest.raises(TypeError, match="path once"):
        save_checkpoint(tmp_path / "a", checkpoint_dir_str=tmp_path / "b", model=model)
    # NxD's checkpoint converter writes model files only: no marker, no done; scripts load them
    # by tag with strict=False
    theirs, _ = plain_torch_run()
    (tmp_path / "converted" / "pretrained_weight" / "model").mkdir(parents=True)
    state = {**theirs.state_dict(), "rotary.inv_freq": torch.ones(3)}  # a surplus entry
    torch.save(state, tmp_path / "converted" / "pretrained_weight" / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt")
    fresh, _, _ = build(seed=5)
    assert load_checkpoint(tmp_path / "converted", tag="pretrained_weight", model=fresh, strict=False) is None
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), theirs.parameters()))
    with pytest.raises(CheckpointError, match="rotary.inv_freq"):
        load_checkpoint(tmp_path / "converted", tag="pretrained_weight", model=fresh)


@pytest.mark.parametrize("dp_size", [2, 4])
def test_a_zero1_nxd_folder_refuses_groups_in_another_order_and_a_missing_rank(tmp_path, dp_size):
    tag, saved = zero1_nxd_folder(tmp_path, dp_size)
    model = square_model(seed=5)
    opt = square_optimizer(model)
    load_checkpoint(tag, model=model, optimizer=opt)  # fits: masters kept, bit for bit
    save_checkpoint(tmp_path / "again", model=model, optimizer=opt)
    again = read_checkpoint(tmp_path / "again")["optimizer"]
    for name, master in saved["optimizer"]["master_weights"].items():
        assert torch.equal(again["master_weights"][name], master), name
    # the same group sizes and shapes, the weights listed in the other order: NxD's ids would
    # name them wrongly
    swapped = square_model(seed=5)
    other = square_optimizer(swapped, reverse=True)
    before = params(swapped)
    with pytest.raises(CheckpointError, match="another order"):
        load_checkpoint(tag, model=swapped, optimizer=other)
    assert all(torch.equal(p, before[n]) for n, p in swapped.named_parameters())
    (tag / "optim" / f"dp_rank_{dp_size - 1:02d}_tp_rank_00_pp_rank_00.pt").unlink()
    with pytest.raises(CheckpointError, match="file is missing"):
        load_checkpoint(tag, model=model, optimizer=opt)


def test_parameters_without_state_in_an_nxd_folder_start_from_zero(tmp_path):
    # NxD without ZeRO-1: torch creates state lazily, so a parameter that got no gradient has none
    theirs, their_opt = plain_torch_run()
    state = their_opt.state_dict()
    state["state"].pop(3)  # the last bias never had a gradient
    nxd_folder(tmp_path, theirs, state)
    model, opt, _ = build(seed=5)
    with pytest.warns(UserWarning, match="master"):
        load_checkpoint(tmp_path, model=model, optimizer=opt)
    save_checkpoint(tmp_path / "ours", model=model, optimizer=opt)
    loaded = read_checkpoint(tmp_path / "ours")["optimizer"]["state"]
    assert not loaded["2.bias"]["exp_avg"].any() and not loaded["2.bias"]["exp_avg_sq"].any()
    assert torch.equal(loaded["0.bias"]["exp_avg"], their_opt.state[theirs[0].bias]["exp_avg"].float())


def _one_rank_cannot_read(rank: int, world: int, root: str) -> tuple[str, bool]:
    import nxd_smp.interop.nxd.folders

    if rank == 1:  # this rank's (TP) files are not there
        from nxd_smp.optim.topology import Coordinate

        nxd_smp.interop.nxd.folders.nxd_coordinate = lambda: Coordinate(0, 1, 1, 0)
    model, opt, _ = build(seed=5)
    before = params(model)
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(root, model=model, optimizer=opt)
    return str(refused.value), all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_when_one_rank_cannot_read_an_nxd_folder_every_rank_refuses(tmp_path):
    theirs, their_opt = plain_torch_run()
    nxd_folder(tmp_path, theirs, their_opt.state_dict())
    (first, unchanged_0), (second, unchanged_1) = run_ranks(2, _one_rank_cannot_read, str(tmp_path))
    assert "another rank could not load" in first and "tp_rank_01" in first
    assert "dp_rank_00_tp_rank_01_pp_rank_00.pt" in second and unchanged_0 and unchanged_1
