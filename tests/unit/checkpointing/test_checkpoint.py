"""Checkpoints: resume equivalence across DP sizes, master weights optional, refusals,
kill-safety, offline inspect/consolidate."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from nxd_smp import (
    CheckpointError,
    MixedPrecisionConfig,
    Zero1Optimizer,
    finalize_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from nxd_smp.checkpoint import consolidate, inspect_checkpoint
from tests.distributed import run_ranks
from tests.checkpoint_scenario import build, load_then_continue, params_of, save_then_continue, train
from tests.oracle import assert_params_close, make_model

ROOT = Path(__file__).resolve().parents[3]


# ---------------------------------------------------------------- across DP sizes
@pytest.fixture(scope="module")
def dp2_run(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dp2") / "ckpt")
    return path, run_ranks(2, save_then_continue, path)


def test_resume_at_the_same_dp_size_is_bit_exact(dp2_run):
    path, uninterrupted = dp2_run
    resumed = run_ranks(2, load_then_continue, path)
    for rank in range(2):
        for name, value in uninterrupted[rank].items():
            assert torch.equal(resumed[rank][name], value), (rank, name)


def test_resume_from_dp2_at_dp3_matches_within_rounding(dp2_run):
    path, uninterrupted = dp2_run
    resumed = run_ranks(3, load_then_continue, path)
    assert_params_close(resumed[0], uninterrupted[0], max_ulp=2, max_flip_fraction=0.05)


def test_resume_from_dp3_saved_in_the_background_at_dp1_matches_within_rounding(tmp_path):
    path = str(tmp_path / "ckpt")
    uninterrupted = run_ranks(3, save_then_continue, path, True)
    resumed = load_then_continue(0, 1, path)
    assert_params_close(resumed, uninterrupted[0], max_ulp=2, max_flip_fraction=0.05)


def test_a_checkpoint_with_the_memory_options_moves_across_dp_sizes_and_modes(tmp_path):
    """Saved at DP 2 with sharded accumulation and remainders (in the background), resumed at
    DP 3 without them and at DP 1 with them: the file holds full fp32 masters either way."""
    path = str(tmp_path / "ckpt")
    uninterrupted = run_ranks(2, save_then_continue, path, True, True)
    consolidate(path, tmp_path / "plain.pt")
    masters = torch.load(tmp_path / "plain.pt", weights_only=True)["master_weights"]
    # fp32 masters, not the bf16 parameters: the remainders went into the file
    assert any(not torch.equal(m, m.bfloat16().float()) for m in masters.values())
    assert_params_close(run_ranks(3, load_then_continue, path)[0], uninterrupted[0],
                        max_ulp=2, max_flip_fraction=0.05)
    assert_params_close(load_then_continue(0, 1, path, True), uninterrupted[0], max_ulp=2, max_flip_fraction=0.05)


def test_resume_in_process_at_dp1_is_bit_exact(tmp_path):
    path = tmp_path / "ckpt"
    uninterrupted = save_then_continue(0, 1, path)
    resumed = load_then_continue(0, 1, path)
    assert all(torch.equal(value, uninterrupted[name]) for name, value in resumed.items())


# ---------------------------------------------------------------- master weights
def test_without_master_weights_masters_are_rebuilt_from_the_loaded_params(tmp_path):
    model, opt = build(seed=0, master_in_ckpt=False)
    train(model, opt, 3, 0)
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt)
    saved_params = params_of(model)
    saved_state = {b: {k: v.clone() for k, v in opt.inner_optimizer.state[m].items()}
                   for b, m in enumerate(opt.master_shards)}
    assert any(not torch.equal(m, p) for m, p in zip(opt.master_shards, (m.bfloat16().float() for m in opt.master_shards)))

    fresh, fresh_opt = build(seed=5, master_in_ckpt=False)
    with pytest.warns(UserWarning, match="precision"):
        load_checkpoint(tmp_path / "c", model=fresh, optimizer=fresh_opt)
    for name, value in params_of(fresh).items():
        assert torch.equal(value, saved_params[name]), name
    # Oracle: the masters are the loaded bf16 parameters, widened to fp32.
    for layout, master in zip(fresh_opt.bucket_layouts, fresh_opt.master_shards):
        for i, index in enumerate(layout.param_indices):
            start, end = layout.param_range(i)
            expected = fresh_opt.managed_params[index].detach().float().reshape(-1)
            assert torch.equal(master[start:end], expected)
    for b, m in enumerate(fresh_opt.master_shards):
        for key, value in saved_state[b].items():
            assert torch.equal(fresh_opt.inner_optimizer.state[m][key].cpu(), value.cpu()), key


@pytest.mark.parametrize("saved_master, loaded_master", [(True, False), (False, True)])
def test_smp_and_legacy_checkpoints_load_into_each_other(tmp_path, saved_master, loaded_master):
    model, opt = build(seed=0, master=saved_master)
    train(model, opt, 2, 0)
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt)
    fresh, fresh_opt = build(seed=5, master=loaded_master)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_checkpoint(tmp_path / "c", model=fresh, optimizer=fresh_opt)
    for name, value in params_of(fresh).items():
        assert torch.equal(value, params_of(model)[name]), name
    for m_saved, m_loaded in zip(opt.master_shards, fresh_opt.master_shards):
        saved = opt.inner_optimizer.state[m_saved]["exp_avg"]
        loaded = fresh_opt.inner_optimizer.state[m_loaded]["exp_avg"]
        assert loaded.dtype == m_loaded.dtype
        torch.testing.assert_close(loaded.float(), saved.float(), rtol=1e-2, atol=1e-6)
    train(fresh, fresh_opt, 1, 2)  # and it trains on


def test_lr_changed_by_a_scheduler_survives(tmp_path):
    model, opt = build()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(model, opt, 1, 0)
    scheduler.step()
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt)
    fresh, fresh_opt = build(seed=5)
    load_checkpoint(tmp_path / "c", model=fresh, optimizer=fresh_opt)
    assert [g["lr"] for g in fresh_opt.param_groups] == [5e-3, 1.5e-2]
    assert [g["lr"] for g in fresh_opt.inner_optimizer.param_groups] == [5e-3, 1.5e-2]


def test_sgd_momentum_state_survives(tmp_path):
    model, opt = build(optimizer=torch.optim.SGD, momentum=0.9)
    train(model, opt, 2, 0)
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt)
    train(model, opt, 2, 2)
    fresh, fresh_opt = build(seed=5, optimizer=torch.optim.SGD, momentum=0.9)
    load_checkpoint(tmp_path / "c", model=fresh, optimizer=fresh_opt)
    train(fresh, fresh_opt, 2, 2)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))


# ---------------------------------------------------------------- refusals
def snapshot_all(model, opt):
    state = {b: {k: v.clone() for k, v in opt.inner_optimizer.state[m].items()}
             for b, m in enumerate(opt.master_shards)}
    return params_of(model), [m.clone() for m in opt.master_shards], state


def assert_unchanged(model, opt, before):
    params, masters, state = before
    assert all(torch.equal(v, params[n]) for n, v in params_of(model).items())
    assert all(torch.equal(a, b) for a, b in zip(opt.master_shards, masters))
    for b, m in enumerate(opt.master_shards):
        assert state[b].keys() == opt.inner_optimizer.state[m].keys()
        assert all(torch.equal(v, opt.inner_optimizer.state[m][k]) for k, v in state[b].items())


@pytest.fixture
def saved(tmp_path):
    model, opt = build()
    train(model, opt, 2, 0)
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt)
    return tmp_path / "c"


@pytest.fixture
def live():
    model, opt = build(seed=7)
    train(model, opt, 1, 0)
    return model, opt


class Wider(torch.nn.Module):
    pass


def test_wrong_shape_is_refused_naming_it(saved):
    model, opt = build(seed=7)
    model.lin1.weight = torch.nn.Parameter(torch.zeros(14, 7, dtype=torch.bfloat16))
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW)
    before = snapshot_all(model, opt)
    with pytest.raises(CheckpointError, match=r"lin1\.weight: shape \(13, 7\)"):
        load_checkpoint(saved, model=model, optimizer=opt)
    assert_unchanged(model, opt, before)


def test_missing_and_extra_names_are_refused_naming_them(saved, live):
    model, opt = live
    model.extra_param = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    before = snapshot_all(model, opt)
    with pytest.raises(CheckpointError, match="extra_param"):
        load_checkpoint(saved, model=model, optimizer=opt)
    del model.extra_param
    del model.unused
    with pytest.raises(CheckpointError, match="unused"):
        load_checkpoint(saved, model=model, optimizer=None)
    assert_unchanged(model, opt, before)


def test_wrong_dtype_is_refused(saved):
    model = make_model(7).float()
    with pytest.raises(CheckpointError, match="dtype"):
        load_checkpoint(saved, model=model)


def version_dir(path: Path) -> Path:
    return path.resolve()


def test_truncated_shard_file_is_refused_naming_it(saved, live):
    model, opt = live
    shard = next(version_dir(saved).glob("__0_*.bin"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    before = snapshot_all(model, opt)
    with pytest.raises(CheckpointError, match=f"{shard.name} is truncated"):
        load_checkpoint(saved, model=model, optimizer=opt)
    assert_unchanged(model, opt, before)


def test_corrupted_shard_file_is_refused_naming_it(saved, live):
    model, opt = live
    shard = next(version_dir(saved).glob("__0_*.bin"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    before = snapshot_all(model, opt)
    with pytest.raises(CheckpointError, match=f"{shard.name} is corrupted"):
        load_checkpoint(saved, model=model, optimizer=opt)
    assert_unchanged(model, opt, before)


@pytest.mark.parametrize("name", ["nxd_smp_index.json", "nxd_smp_meta.json", "extra.json"])
def test_missing_metadata_is_refused(saved, live, name):
    model, opt = live
    (version_dir(saved) / name).unlink()
    before = snapshot_all(model, opt)
    with pytest.raises(CheckpointError, match=f"{name} is missing"):
        load_checkpoint(saved, model=model, optimizer=opt)
    assert_unchanged(model, opt, before)


def test_missing_completion_record_is_refused_as_incomplete(saved, live):
    model, opt = live
    (version_dir(saved) / "COMPLETE.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        load_checkpoint(saved, model=model, optimizer=opt)


def test_nonexistent_path_is_refused(tmp_path, live):
    model, opt = live
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nothing", model=model, optimizer=opt)


def test_bad_arguments_are_refused(tmp_path, live):
    model, opt = live
    with pytest.raises(TypeError, match="Zero1Optimizer"):
        save_checkpoint(tmp_path / "c", model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1))
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("the user's")
    with pytest.raises(CheckpointError, match="not an nxd_smp checkpoint link"):
        save_checkpoint(tmp_path / "plain", model=model, optimizer=opt)
    assert (tmp_path / "plain" / "notes.txt").read_text() == "the user's"
    legacy_model, legacy = build(master=False)
    with pytest.raises(CheckpointError, match="no master weights"):
        save_checkpoint(tmp_path / "c", model=legacy_model, optimizer=legacy, save_master_weights=True)


def test_missing_parents_are_created_and_an_empty_directory_is_taken_over(tmp_path, live):
    model, opt = live
    save_checkpoint(tmp_path / "runs" / "a" / "c", model=model, optimizer=opt)
    load_checkpoint(tmp_path / "runs" / "a" / "c", model=model, optimizer=opt)
    (tmp_path / "empty").mkdir()
    save_checkpoint(tmp_path / "empty", model=model, optimizer=opt)
    assert (tmp_path / "empty").is_symlink()
    load_checkpoint(tmp_path / "empty", model=model, optimizer=opt)


def test_saving_again_replaces_the_old_version(tmp_path):
    model, opt = build()
    first = save_checkpoint(tmp_path / "c", model=model, optimizer=opt)
    train(model, opt, 1, 0)
    second = save_checkpoint(tmp_path / "c", model=model, optimizer=opt)
    assert not first.exists() and second.exists()
    assert (tmp_path / "c").resolve() == second.resolve()


# ---------------------------------------------------------------- offline tools
def test_inspect_and_consolidate(tmp_path):
    model, opt = build()
    train(model, opt, 2, 0)
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt, extra={"epoch": 1})
    info = inspect_checkpoint(tmp_path / "c")
    assert info["optimizer"]["dp_size_written_at"] == 1 and info["optimizer"]["master_weights"]
    assert info["tensors"]["model/lin1.weight"]["shape"] == (13, 7)
    consolidate(tmp_path / "c", tmp_path / "plain.pt")
    plain = torch.load(tmp_path / "plain.pt", weights_only=False)
    assert plain["extra"] == {"epoch": 1}
    # The consolidated optimizer state drops into a plain torch.optim.AdamW over fp32
    # copies of the trainable parameters, in the saved group order.
    masters = [plain["master_weights"][n].clone() for g in plain["optimizer"]["param_groups"]
               for n in g["param_names"]]
    groups, i = [], 0
    for g in plain["optimizer"]["param_groups"]:
        n = len(g["params"])
        groups.append({"params": masters[i:i + n]})
        i += n
    reference = torch.optim.AdamW(groups)
    reference.load_state_dict(plain["optimizer"])
    by_name = dict(model.named_parameters())
    names = [n for g in plain["optimizer"]["param_groups"] for n in g["param_names"]]
    for name, master in zip(names, masters):
        assert torch.equal(master.bfloat16(), by_name[name].detach())
        assert reference.state[master]["exp_avg"].shape == by_name[name].shape


# ---------------------------------------------------------------- kill safety
KILL_SCRIPT = r"""
import sys, time, torch
from nxd_smp import Zero1Optimizer, MixedPrecisionConfig, finalize_checkpoint, save_checkpoint
path, background, versions = sys.argv[1], sys.argv[2] == "async", [int(v) for v in sys.argv[3:]]
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, dtype=torch.bfloat16) for _ in range(12)])  # 12.6M
opt = Zero1Optimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9,
                     mixed_precision=MixedPrecisionConfig(use_master_weights_in_ckpt=True))
for i, v in enumerate(versions):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(v)
    save_checkpoint(path, model=model, optimizer=opt, async_save=background and i > 0)
    print(f"saved {v}", flush=True)
    if background:  # "training" overwrites the live tensors while the background write runs
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(-1)
        finalize_checkpoint()
        print(f"finished {v}", flush=True)
"""


def _spawn_saver(path, *versions, background=False):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    mode = "async" if background else "sync"
    return subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(path), mode, *map(str, versions)],
                            stdout=subprocess.PIPE, text=True, env=env)


def _loaded_version(path) -> set[float]:
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, dtype=torch.bfloat16) for _ in range(12)])
    load_checkpoint(path, model=model)
    return {float(v) for p in model.parameters() for v in p.detach().unique()}


def _new_version_written(path, before: set) -> bool:
    """Whether a version folder of ``path`` not in ``before`` holds a written tensor file (a save is
    under way)."""
    return any(folder not in before and any(folder.glob("__0_*")) for folder in path.parent.glob(f".{path.name}.v-*"))


def _kill_mid_save(path, background: bool) -> set[float]:
    """Save version 1, start saving version 2 and SIGKILL the process once version 2's folder holds
    its first tensor file (mid-write; in the background: after the step that staged it returned);
    the versions a fresh model then loads."""
    proc = _spawn_saver(path, 1, 2, background=background)
    for line in ["saved 1", "finished 1"] if background else ["saved 1"]:
        assert proc.stdout.readline().strip() == line
    before = set(path.parent.glob(f".{path.name}.v-*"))
    if background:  # "saved 2": staged, its write runs on in the background
        assert proc.stdout.readline().strip() == "saved 2"
    deadline = time.time() + 120
    while not _new_version_written(path, before) and time.time() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    rest, _ = proc.communicate()
    assert proc.returncode == -signal.SIGKILL and ("finished 2" if background else "saved 2") not in rest, \
        "the save ended before the kill: nothing was tested"
    return _loaded_version(path)


def test_a_killed_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    assert _kill_mid_save(tmp_path / "c", background=False) == {1.0}


def test_a_process_killed_during_a_background_save_leaves_the_previous_checkpoint(tmp_path):
    assert _kill_mid_save(tmp_path / "c", background=True) == {1.0}


def test_a_first_save_killed_midway_is_refused_as_incomplete(tmp_path):
    path = tmp_path / "c"
    proc = _spawn_saver(path, 1)
    deadline = time.time() + 120
    while not list(tmp_path.glob(".c.v-*/__0_*")) and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not path.exists()
    with pytest.raises(CheckpointError, match="incomplete"):
        _loaded_version(path)


def test_progress_is_shown_when_asked(tmp_path, capsys):
    model, opt = build()
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt, progress=True)
    load_checkpoint(tmp_path / "c", model=model, optimizer=opt, progress=True)
    err = capsys.readouterr().err
    assert "save c" in err and "load c" in err
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt)  # default: quiet unless logging asks
    assert "save c" not in capsys.readouterr().err


# ---------------------------------------------------------------- asynchronous saves
@pytest.fixture
def gated_writes(monkeypatch):
    """Background writes wait for ``gate.set()``: what happens to the live tensors before
    that must not reach the checkpoint."""
    import threading

    from nxd_smp.checkpointing import save as ckpt

    gate = threading.Event()

    write = ckpt.write_tensors

    def gated_write(*args, **kwargs):
        assert gate.wait(60), "the test never opened the gate"
        return write(*args, **kwargs)

    monkeypatch.setattr(ckpt, "write_tensors", gated_write)
    yield gate
    gate.set()
    finalize_checkpoint()


def opt_state(opt):
    return [{k: v.clone() for k, v in opt.inner_optimizer.state[m].items()} for m in opt.master_shards]


def test_an_async_save_holds_the_state_of_the_call_not_of_the_write(tmp_path, gated_writes):
    model, opt = build()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(model, opt, 2, 0)
    scheduler.step()
    expected = params_of(model), [m.clone() for m in opt.master_shards], opt_state(opt), scheduler.state_dict()
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt, scheduler=scheduler, extra={"step": 2},
                    async_save=True)
    assert not (tmp_path / "c").exists()  # nothing published before the write
    train(model, opt, 2, 2)  # the live tensors change while the write waits
    scheduler.step()
    gated_writes.set()
    finalize_checkpoint()

    fresh, fresh_opt = build(seed=5)
    fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.5)
    assert load_checkpoint(tmp_path / "c", model=fresh, optimizer=fresh_opt, scheduler=fresh_scheduler) == {"step": 2}
    params, masters, state, sched = expected
    assert all(torch.equal(v, params[n]) for n, v in params_of(fresh).items())
    assert all(torch.equal(a, b) for a, b in zip(fresh_opt.master_shards, masters))
    for mine, saved in zip(opt_state(fresh_opt), state):
        assert all(torch.equal(mine[k], v) for k, v in saved.items())
    assert fresh_scheduler.state_dict() == sched and fresh_opt.param_groups[0]["lr"] == 5e-3


def test_two_saves_in_quick_succession_both_complete_in_order(tmp_path):
    model, opt = build()
    save_checkpoint(tmp_path / "run" / "a", model=model, optimizer=opt, extra="a", async_save=True)
    train(model, opt, 1, 0)
    save_checkpoint(tmp_path / "run" / "b", model=model, optimizer=opt, extra="b", async_save=True)  # waits for a
    save_checkpoint(tmp_path / "run" / "b", model=model, optimizer=opt, extra="b2", async_save=True)
    finalize_checkpoint()
    assert load_checkpoint(tmp_path / "run" / "a", model=build()[0]) == "a"
    assert load_checkpoint(tmp_path / "run" / "b", model=build()[0]) == "b2"
    assert load_checkpoint(tmp_path / "run", model=build()[0]) == "b2"  # the directory: its newest


def test_a_failed_background_save_is_raised_once_and_the_next_save_works(tmp_path, monkeypatch):
    from nxd_smp.checkpointing import save as ckpt

    def broken_write(*args, **kwargs):
        raise OSError("disk full")

    model, opt = build()
    save_checkpoint(tmp_path / "good", model=model, optimizer=opt, extra=1)
    working = ckpt.write_tensors
    monkeypatch.setattr(ckpt, "write_tensors", broken_write)
    save_checkpoint(tmp_path / "good", model=model, optimizer=opt, extra=2, async_save=True)
    with pytest.raises(CheckpointError, match="disk full"):
        finalize_checkpoint()
    finalize_checkpoint()  # raised once
    save_checkpoint(tmp_path / "good", model=model, optimizer=opt, extra=3, async_save=True)
    monkeypatch.setattr(ckpt, "write_tensors", working)
    with pytest.raises(CheckpointError, match="disk full"):  # not finalized: the next save says so
        save_checkpoint(tmp_path / "good", model=model, optimizer=opt, extra=4)
    save_checkpoint(tmp_path / "good", model=model, optimizer=opt, extra=5)
    assert load_checkpoint(tmp_path / "good", model=model, optimizer=opt) == 5
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".good.v-") and p != (tmp_path / "good").resolve()]


# ---------------------------------------------------------------- retention
def test_retention_keeps_the_newest_k_and_no_partial_version(tmp_path):
    model, opt = build()
    run = tmp_path / "run"
    (run / ".step_0.v-killed").mkdir(parents=True)  # what a save killed before its swap leaves
    (run / ".step_0.v-killed" / "__0_0.bin").write_bytes(b"partial")
    for step in range(1, 6):
        train(model, opt, 1, step)
        save_checkpoint(run / f"step_{step}", model=model, optimizer=opt, extra=step, num_kept_ckpts=2,
                        async_save=step % 2 == 0)
    finalize_checkpoint()
    assert sorted(p.name for p in run.iterdir()) == [
        ".nxd_smp_saves.json",  # the writer's own record of its saves, oldest first
        f".step_4.v-{os.readlink(run / 'step_4').split('.v-')[1]}",
        f".step_5.v-{os.readlink(run / 'step_5').split('.v-')[1]}", "step_4", "step_5"]
    assert load_checkpoint(run, model=build()[0]) == 5
    with pytest.raises(ValueError, match="num_kept_ckpts"):
        save_checkpoint(run / "x", model=model, num_kept_ckpts=0)


# ---------------------------------------------------------------- the scheduler and other state
class Counter:
    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def test_scheduler_and_stateful_objects_round_trip_and_missing_ones_are_refused(tmp_path):
    model, opt = build()
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.9**step)
    counter = Counter()
    for _ in range(3):
        train(model, opt, 1, 0)
        scheduler.step()
        counter.n += 1
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt, scheduler=scheduler, stateful={"data": counter})
    fresh, fresh_opt = build(seed=5)
    fresh_scheduler = torch.optim.lr_scheduler.LambdaLR(fresh_opt, lambda step: 0.9**step)
    fresh_counter = Counter()
    load_checkpoint(tmp_path / "c", model=fresh, optimizer=fresh_opt, scheduler=fresh_scheduler,
                    stateful={"data": fresh_counter})
    assert fresh_scheduler.state_dict()["last_epoch"] == 3 and fresh_counter.n == 3
    assert fresh_opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.9**3)
    fresh_scheduler.step()
    scheduler.step()
    assert fresh_opt.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])

    save_checkpoint(tmp_path / "plain", model=model, optimizer=opt)
    live, live_opt = build(seed=7)
    before = snapshot_all(live, live_opt)
    with pytest.raises(CheckpointError, match="scheduler"):
        load_checkpoint(tmp_path / "plain", model=live, optimizer=live_opt, scheduler=fresh_scheduler)
    assert_unchanged(live, live_opt, before)
    with pytest.raises(TypeError, match="state_dict"):
        save_checkpoint(tmp_path / "x", model=model, stateful={"bad": object()})


# ---------------------------------------------------------------- the pre-release formats
@pytest.mark.parametrize("earlier", ["nxd_smp.checkpoint/1", "nxd_smp.checkpoint/2"])
def test_a_checkpoint_of_a_pre_release_format_is_refused_by_name(tmp_path, earlier):
    """Formats 1 and 2 held pickles (DCP's own files, a pickled index and small files); their readers are
    gone, and a folder of theirs is refused with a message that says so, before any of it is read."""
    import json

    model, opt = build()
    train(model, opt, 1, 0)
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt)
    version = (tmp_path / "c").resolve()
    record = json.loads((version / "COMPLETE.json").read_text())
    (version / "COMPLETE.json").write_text(json.dumps({**record, "format": earlier}))
    fresh, fresh_opt = build(seed=5)
    before = snapshot_all(fresh, fresh_opt)
    with pytest.raises(CheckpointError, match=f"format {earlier}.*before the first release"):
        load_checkpoint(tmp_path / "c", model=fresh, optimizer=fresh_opt)
    assert_unchanged(fresh, fresh_opt, before)


def test_an_async_save_a_background_thread_cannot_coordinate_is_refused_before_writing(tmp_path):
    """XLA replicas in separate processes without torch.distributed coordinate through
    xm.rendezvous, which only the replica's own thread may call."""
    from nxd_smp.backend.coordination import RendezvousCoordinator

    model, opt = build()
    opt.backend._coordinator = RendezvousCoordinator([0, 1], 0)
    with pytest.raises(CheckpointError, match="async_save=False"):
        save_checkpoint(tmp_path / "c", model=model, optimizer=opt, async_save=True)
    assert list(tmp_path.iterdir()) == []


def _every_state(tmp_path):
    """A run with every kind of state nxd_smp's format holds: two param groups (tuples in their
    betas, a tensor lr), an fp16 loss scaler, master weights, a scheduler, a stateful object, RNG
    states, and user content with integer keys, non-finite floats, dtypes, bytes and tensors."""
    model, opt = build(master_in_ckpt=True)
    train(model, opt, 2, 0)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    scheduler.step()
    extra = {
        "step": 2, "loss": float("nan"), "best": float("-inf"), "ratio": 0.1, "betas": (0.9, (0.95, None)),
        3: "an integer key", (1, "a"): [True, None], "$dollar": "a key the encoding tags", "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]), "raw": b"\x00\xff", "rng": torch.get_rng_state(), "ids": torch.arange(5),
        "empty": torch.empty(0, 3), "ordered": __import__("collections").OrderedDict(b=1, a=2),
        "python_rng": __import__("random").getstate(),
    }
    return model, opt, scheduler, extra


def test_nothing_nxd_smp_writes_in_its_own_format_is_a_pickle(tmp_path):
    """Every file of a fresh checkpoint is JSON or a raw data file whose bytes are exactly its
    index's tensors, one after the other: there is no byte a pickle could hide in."""
    import json

    model, opt, scheduler, extra = _every_state(tmp_path)
    save_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt, scheduler=scheduler, extra=extra)
    version = (tmp_path / "ckpt").resolve()
    index = json.loads((version / "nxd_smp_index.json").read_text())["entries"]
    spans: dict[str, list] = {}
    for file, offset, length, *_ in index.values():
        spans.setdefault(file, []).append((offset, length))
    for f in sorted(version.iterdir()):
        data = f.read_bytes()
        assert b"PK\x03\x04" not in data[:4], f.name
        if f.suffix == ".json":
            json.loads(data)  # (a JSON file holds no pickle)
        else:
            assert f.suffix == ".bin" and f.name in spans, f.name
            covered = 0
            for offset, length in sorted(spans[f.name]):
                assert offset == covered, f.name
                covered += length
            assert covered == len(data), f.name


def test_every_state_round_trips_exactly_in_type_and_value(tmp_path):
    model, opt, scheduler, extra = _every_state(tmp_path)
    save_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt, scheduler=scheduler, extra=extra)
    fresh, fresh_opt = build(seed=5)
    fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=3, gamma=0.5)
    got = load_checkpoint(tmp_path / "ckpt", model=fresh, optimizer=fresh_opt, scheduler=fresh_scheduler)
    assert same_value(got, extra)
    assert same_value(fresh_scheduler.state_dict(), scheduler.state_dict())
    assert same_value([{k: v for k, v in g.items() if k != "params"} for g in fresh_opt.param_groups],
                      [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])


def same_value(a, b) -> bool:
    """``a`` and ``b`` equal in type and value, recursively (NaN equal to NaN; tensors by dtype,
    shape and bytes)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8)
                                                                         if a.numel() else a, b.view(-1).view(torch.uint8)
                                                                         if b.numel() else b)
    if isinstance(a, float):
        return a == b or (a != a and b != b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("value, where", [
    (object(), "extra (the top level)"), ({"a": [1, {2}]}, "extra['a'][1]"),
    ({"p": torch.nn.Parameter(torch.ones(2))}, "extra['p']"), ({"n": __import__("numpy").ones(2)}, "extra['n']"),
])
def test_user_content_that_is_not_json_or_tensors_is_refused_at_save_with_the_fix(tmp_path, value, where):
    model, opt = build()
    with pytest.raises(TypeError, match=__import__("re").escape(where) + ".*never a pickle"):
        save_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt, extra=value)
    assert not os.path.lexists(tmp_path / "ckpt") and not list(tmp_path.glob(".ckpt.v-*"))


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0, 0.0])
def test_a_loss_scale_the_scaler_would_not_accept_is_refused(tmp_path, scale):
    """A NaN or infinite scale skips every later step: training would stall without a word."""
    import json
    import zlib

    from nxd_smp import DynamicLossScaler

    def fp16_run():
        model = make_model(0).half()
        opt = Zero1Optimizer(model.parameters(), torch.optim.SGD, lr=0.1, loss_scaler=DynamicLossScaler(init_scale=4.0),
                             bucket_cap_mb=0.0004)
        return model, opt

    model, opt = fp16_run()
    opt.scale_loss(sum(p.float().pow(2).sum() for p in model.parameters())).backward()
    opt.step()
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt)
    version = (tmp_path / "c").resolve()
    index = json.loads((version / "nxd_smp_index.json").read_text())
    file, offset, length, _, _, _ = index["entries"]["loss_scaler/scale"]
    data = bytearray((version / file).read_bytes())
    data[offset:offset + length] = torch.tensor(scale, dtype=torch.float32).numpy().tobytes()
    (version / file).write_bytes(bytes(data))
    index["entries"]["loss_scaler/scale"][3] = zlib.crc32(data[offset:offset + length])
    (version / "nxd_smp_index.json").write_text(json.dumps(index))
    record = json.loads((version / "COMPLETE.json").read_text())
    for name in (file, "nxd_smp_index.json"):
        record["files"][name] = [len((version / name).read_bytes()), zlib.crc32((version / name).read_bytes())]
    (version / "COMPLETE.json").write_text(json.dumps(record))
    fresh, fresh_opt = fp16_run()
    before, weights = fresh_opt.loss_scaler.state_dict(), params_of(fresh)
    assert any(not torch.equal(v, weights[n]) for n, v in params_of(model).items())  # (a load would show)
    with pytest.raises(CheckpointError, match=r"loss_scaler\['scale'\].*positive"):
        load_checkpoint(tmp_path / "c", model=fresh, optimizer=fresh_opt)
    assert all(torch.equal(v, fresh_opt.loss_scaler.state_dict()[k]) for k, v in before.items())
    assert all(torch.equal(v, weights[n]) for n, v in params_of(fresh).items()), "refused after the model changed"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the eager path on an accelerator)")
def test_a_cuda_run_round_trips_and_its_torch_save_files_read_on_the_cpu(tmp_path):
    """On an accelerator: the state comes to the host to be written and goes back to the device on
    load; user content's tensors come back as CPU tensors of the same dtype and values; and a
    torch.save file of CUDA tensors (a training loop's optimizer file written on a GPU) reads through
    the strict reader as torch.load(map_location="cpu") reads it. In a spawned child: CUDA set up in
    this process would break the forked ranks of the tests after it."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        pool.apply(assert_cuda_round_trip, (str(tmp_path),))


def assert_cuda_round_trip(where: str) -> None:
    import io

    from nxd_smp.checkpointing.reader import load_bytes

    tmp_path = Path(where)

    def cuda_run(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)).to("cuda", torch.bfloat16)
        opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2,
                             mixed_precision=MixedPrecisionConfig(use_master_weights_in_ckpt=True))
        return model, opt

    model, opt = cuda_run(0)
    for _ in range(2):
        model(torch.randn(4, 8, device="cuda", dtype=torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    extra = {"rng": torch.cuda.get_rng_state(), "t": torch.arange(3.0, device="cuda")}
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt, extra=extra)
    fresh, fresh_opt = cuda_run(1)
    got = load_checkpoint(tmp_path / "c", model=fresh, optimizer=fresh_opt)
    assert all(torch.equal(p, q) and p.is_cuda for p, q in zip(fresh.parameters(), model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(fresh_opt.master_shards, opt.master_shards))
    assert torch.equal(got["rng"], extra["rng"]) and torch.equal(got["t"], extra["t"].cpu())
    buffer = io.BytesIO()
    torch.save(opt.inner_optimizer.state_dict(), buffer)
    ours = load_bytes(buffer.getvalue(), "optimizer.pt")
    theirs = torch.load(io.BytesIO(buffer.getvalue()), map_location="cpu", weights_only=True)
    assert ours["param_groups"] == theirs["param_groups"]
    for i, entry in theirs["state"].items():
        assert all(torch.equal(ours["state"][i][k], v) and ours["state"][i][k].dtype == v.dtype for k, v in entry.items())


def test_a_hidden_checkpoint_name_is_refused_before_anything_is_written(tmp_path):
    """Hidden names in a checkpoint directory are its versions' and its record of saves': a link
    named so could not be recorded, and every later save there would fail at its publish."""
    model, opt = build()
    with pytest.raises(CheckpointError, match="not hidden"):
        save_checkpoint(tmp_path / ".c", model=model, optimizer=opt)
    assert not list(tmp_path.iterdir())
