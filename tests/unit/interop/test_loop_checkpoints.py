"""nxd_smp's checkpoint beside a training loop's one-rank optimizer file, in one process: the
reference the optimizer's ``state_dict()`` becomes, what ``load_state_dict`` does with it, and
torch's state-dict hooks around both (the Trainer and accelerate at DP 2: test_trainer_dp.py,
test_accelerate_dp.py)."""

from __future__ import annotations

import copy

import pytest
import torch

import nxd_smp
import nxd_smp.optim.rank_state
from nxd_smp.checkpoint import read_checkpoint
from nxd_smp.checkpoint import CheckpointError
from nxd_smp.interop.loop_checkpoints import is_reference
from nxd_smp.interop.loop_checkpoints import checkpoint_reference, load_beside, read_reference, save_beside


def trained(seed: int = 0, steps: int = 2):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)).to(torch.bfloat16)
    opt = nxd_smp.Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2,
                                 mixed_precision=nxd_smp.MixedPrecisionConfig(use_master_weights_in_ckpt=True))
    for _ in range(steps):
        model(torch.randn(4, 8).bfloat16()).float().pow(2).mean().backward()
        opt.step()
    return model, opt


def snapshot(model, opt) -> dict:
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "masters": [m.clone() for m in opt.master_shards],
            "inner": copy.deepcopy(opt.inner_optimizer.state_dict()["state"])}


def assert_same(a: dict, b: dict) -> None:
    assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
    assert all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"], strict=True))
    assert a["inner"].keys() == b["inner"].keys()
    for i, entry in a["inner"].items():
        assert all(torch.equal(v, b["inner"][i][k]) for k, v in entry.items())


def test_torchs_state_dict_hooks_run_around_the_optimizers_own():
    model, opt = trained()
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "tagged": True})
    opt.register_load_state_dict_pre_hook(lambda o, sd: {k: v for k, v in sd.items() if k != "tagged"})
    opt.register_load_state_dict_post_hook(lambda o: calls.append("loaded"))
    state = opt.state_dict()
    assert state["tagged"] and calls == ["pre"]
    opt.load_state_dict(state)  # (the pre-hook takes the tag out again)
    assert calls == ["pre", "loaded"]


def test_after_save_beside_the_state_dict_is_the_reference_until_the_next_step(tmp_path):
    model, opt = trained()
    reference = save_beside(tmp_path, model, opt)
    assert opt.state_dict() == reference and is_reference(reference) and reference["dp_size"] == 1
    opt.load_state_dict(reference)  # what it names is this state: nothing to do
    model(torch.randn(4, 8).bfloat16()).float().pow(2).mean().backward()
    opt.step()
    assert checkpoint_reference(opt) is None and not is_reference(opt.state_dict()) and "state" in opt.state_dict()


def test_while_the_reference_is_held_the_state_dict_builds_no_copy_of_the_state(tmp_path, monkeypatch):
    model, opt = trained()
    save_beside(tmp_path, model, opt)
    built = []
    real = nxd_smp.optim.rank_state.RankState.state_dict
    monkeypatch.setattr(nxd_smp.optim.rank_state.RankState, "state_dict", lambda held: built.append(held) or real(held))
    assert is_reference(opt.state_dict()) and built == []  # (with the masters it would clone them all)
    model(torch.randn(4, 8).bfloat16()).float().pow(2).mean().backward()
    opt.step()
    assert not is_reference(opt.state_dict()) and built == [opt.rank_state]


def test_load_beside_restores_what_was_saved_and_then_accepts_the_reference(tmp_path):
    model, opt = trained()
    reference = save_beside(tmp_path, model, opt)
    saved = read_checkpoint(tmp_path / "nxd_smp")  # the oracle: what the files hold
    fresh_model, fresh = trained(seed=1, steps=1)
    load_beside(tmp_path, fresh_model, fresh, reference)
    for (name, p), master in zip(fresh_model.named_parameters(), saved["optimizer"]["master_weights"].values()):
        assert torch.equal(p, saved["model"][name]) and torch.equal(p, master.bfloat16()), name
    assert_same(snapshot(fresh_model, fresh), snapshot(model, opt))
    fresh.load_state_dict(reference)


def test_a_reference_to_a_checkpoint_not_loaded_is_refused_naming_the_calls_that_load_it(tmp_path):
    model, opt = trained()
    reference = save_beside(tmp_path, model, opt)
    other_model, other = trained(seed=1)
    before = snapshot(other_model, other)
    with pytest.raises(ValueError, match=r"Zero1TrainerCallback\(trainer\).*register_accelerate_hooks"):
        other.load_state_dict(reference)
    assert_same(snapshot(other_model, other), before)


def test_a_folder_holding_another_save_is_refused_before_anything_changes(tmp_path):
    model, opt = trained()
    reference = save_beside(tmp_path, model, opt)
    save_beside(tmp_path, model, opt)  # a second save replaces the first's checkpoint
    other_model, other = trained(seed=1)
    before = snapshot(other_model, other)
    with pytest.raises(CheckpointError, match=f"refers to save '{reference['id']}'"):
        load_beside(tmp_path, other_model, other, reference)
    assert_same(snapshot(other_model, other), before)


def test_a_missing_checkpoint_is_refused_naming_the_folder(tmp_path):
    model, opt = trained()
    reference = save_beside(tmp_path / "a", model, opt)
    with pytest.raises(CheckpointError, match="b/nxd_smp is missing"):
        load_beside(tmp_path / "b", model, opt, reference)


@pytest.mark.parametrize("field, value, says", [
    ("checkpoint", "../elsewhere", "nxd_smp writes 'nxd_smp'"),
    ("id", "../../etc", "32 hex digits"),
    ("dp_size", -1, "dp_size"),
])
def test_a_crafted_reference_is_refused_before_any_path_is_read(tmp_path, field, value, says):
    model, opt = trained()
    reference = {**save_beside(tmp_path, model, opt), field: value}
    torch.save(reference, tmp_path / "optimizer.pt")
    with pytest.raises(CheckpointError, match=says):
        read_reference(tmp_path / "optimizer.pt")
    with pytest.raises(CheckpointError, match=says):
        load_beside(tmp_path, model, opt, reference)


def test_an_optimizer_file_that_is_not_a_reference_reads_as_none(tmp_path):
    model, opt = trained()
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")  # a state of its own (DP 1, no hooks)
    assert read_reference(tmp_path / "optimizer.pt") is None
    assert read_reference(tmp_path / "missing.pt") is None


def _planted_elsewhere(folder, tmp_path):
    """The loop's ``nxd_smp`` link pointed at another run's version folder (the same save's bytes,
    moved out of the checkpoint folder)."""
    import os
    import shutil

    link = folder / "nxd_smp"
    version = link.resolve()
    other = tmp_path / "other_run"
    other.mkdir()
    shutil.move(str(version), other / version.name)
    link.unlink()
    os.symlink(os.path.relpath(other / version.name, folder), link)
    return other / version.name


def _values_the_class_refuses(folder, tmp_path):
    """betas = (1.0, 0.999) in the checkpoint's metadata, the completion record resealed."""
    import json
    import zlib

    version = (folder / "nxd_smp").resolve()
    meta = json.loads((version / "nxd_smp_meta.json").read_text())
    meta["optimizer"]["groups"][0]["hyper"]["betas"] = {"$tuple": [1.0, 0.999]}
    data = json.dumps(meta).encode()
    (version / "nxd_smp_meta.json").write_bytes(data)
    record = json.loads((version / "COMPLETE.json").read_text())
    record["files"]["nxd_smp_meta.json"] = [len(data), zlib.crc32(data)]
    (version / "COMPLETE.json").write_text(json.dumps(record))


def _fifo_for_the_completion_record(folder, tmp_path):
    import os

    record = (folder / "nxd_smp").resolve() / "COMPLETE.json"
    record.unlink()
    os.mkfifo(record)


@pytest.mark.parametrize("craft, says", [
    (_planted_elsewhere, "nxd_smp"), (_values_the_class_refuses, "betas"),
    (_fifo_for_the_completion_record, "FIFO"),
], ids=["a link to another run", "betas the class refuses", "a FIFO as the completion record"])
def test_a_loops_resume_refuses_a_hostile_folder_and_changes_nothing(tmp_path, craft, says):
    """The Trainer's and accelerate's resume (``load_beside``, which both call) meets round two's
    folders: a link out of the folder (it must neither load nor, later, delete another run's
    checkpoint), values the live class refuses, a FIFO that would block the read."""
    model, opt = trained()
    reference = save_beside(tmp_path / "ckpt", model, opt)
    outside = craft(tmp_path / "ckpt", tmp_path)
    fresh_model, fresh = trained(seed=1)
    before = snapshot(fresh_model, fresh)
    with pytest.raises(CheckpointError, match=says):
        load_beside(tmp_path / "ckpt", fresh_model, fresh, reference)
    assert_same(snapshot(fresh_model, fresh), before)
    if outside is not None:
        save_beside(tmp_path / "ckpt", model, opt)  # a re-save replaces the link, never the run it points to
        assert (outside / "COMPLETE.json").is_file()
