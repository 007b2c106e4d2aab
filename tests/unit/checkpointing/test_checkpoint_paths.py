"""Paths and links of a checkpoint directory that a stranger crafted: every read through the one
safe open (no link out, no FIFO's wait), links followed only to their own version beside them,
"newest" and retention from the writer's own record (never a time a folder claims), and the
command line printing checkpoint strings escaped."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from nxd_smp import (
    CheckpointError,
    MixedPrecisionConfig,
    Zero1Optimizer,
    load_checkpoint,
    save_checkpoint,
)
from nxd_smp.checkpoint import has_checkpoint, remove_checkpoint
from nxd_smp.checkpointing.versions import COMPLETE_FILE, SAVES_FILE
from nxd_smp.cli import main
from tests.checkpoint_scenario import build, train
from tests.distributed import run_python

ROOT = Path(__file__).resolve().parents[3]


def within(seconds: float, fn):
    """``fn()``'s result, or its exception raised here; fails if it takes longer than ``seconds``
    (a read that waits on a FIFO would hang: it is left behind in a daemon thread)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised in the test's thread
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: a read waits (a FIFO opened blocking?)"
    if "error" in out:
        raise out["error"]
    return out["value"]


def save(path: Path, extra, **kwargs) -> Path:
    model, opt = build()
    train(model, opt, 1, 0)
    save_checkpoint(path, model=model, optimizer=opt, extra=extra, **kwargs)
    return path


def loaded(path: Path):
    model, opt = build(seed=5)
    return load_checkpoint(path, model=model, optimizer=opt)


def tree(path: Path) -> dict[str, bytes]:
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


# ---------------------------------------------------------------- A: every read through the one safe open
def nxd_state_dicts_tag(root: Path) -> Path:
    model, opt = build()
    plain = torch.optim.AdamW(model.parameters(), lr=1e-3)
    save_checkpoint(root, "t1", model=model.state_dict(), optimizer=plain.state_dict())
    return root / "t1"


def test_nxd_state_dicts_record_linked_out_or_a_fifo_is_refused(tmp_path):
    tag = nxd_state_dicts_tag(tmp_path / "run")
    record = tag / "nxd_smp_state_dicts.json"
    assert load_checkpoint(tmp_path / "run", "t1", model={}, optimizer={}) is None  # healthy
    outside = tmp_path / "outside.json"
    outside.write_bytes(record.read_bytes())
    record.unlink()
    record.symlink_to(outside)
    with pytest.raises(CheckpointError, match="is a link; nxd_smp follows no link"):
        load_checkpoint(tmp_path / "run", "t1", model={}, optimizer={})
    record.unlink()
    os.mkfifo(record)
    with pytest.raises(CheckpointError, match="FIFO"):
        within(20, lambda: load_checkpoint(tmp_path / "run", "t1", model={}, optimizer={}))
    record.unlink()
    record.write_bytes(b" " * (65 << 20))  # a small JSON file claiming 65 MiB: refused unread
    with pytest.raises(CheckpointError, match="more than"):
        load_checkpoint(tmp_path / "run", "t1", model={}, optimizer={})


@pytest.mark.parametrize("kind", ["link out", "fifo", "link to a fifo"])
def test_a_versions_completion_record_linked_out_or_a_fifo_never_blocks_nor_loads(tmp_path, kind):
    run = tmp_path / "run"
    save(run / "a", "a")
    version = (run / "a").resolve()
    record = version / COMPLETE_FILE
    outside = tmp_path / "outside"
    outside.mkdir()
    if kind == "link out":
        shutil.copy(record, outside / COMPLETE_FILE)
        record.unlink()
        record.symlink_to(outside / COMPLETE_FILE)
    elif kind == "fifo":
        record.unlink()
        os.mkfifo(record)
    else:
        os.mkfifo(outside / "fifo")
        record.unlink()
        record.symlink_to(outside / "fifo")
    for path in (run / "a", run):
        with pytest.raises(CheckpointError):
            within(20, lambda: loaded(path))
    within(20, lambda: has_checkpoint(run))
    kept = sorted(outside.iterdir())
    within(20, lambda: save(run / "b", "b", num_kept_ckpts=1))  # retention reads no completion record
    assert loaded(run) == "b" and not os.path.lexists(run / "a")  # "a", recorded and older, went
    assert sorted(outside.iterdir()) == kept  # not what its record linked to


def test_a_record_of_saves_linked_out_damaged_or_a_fifo_is_refused_by_name(tmp_path):
    run = tmp_path / "run"
    save(run / "a", "a")
    record = run / SAVES_FILE
    good = record.read_bytes()
    (tmp_path / "elsewhere.json").write_bytes(good)
    for plant in (lambda: record.symlink_to(tmp_path / "elsewhere.json"), lambda: os.mkfifo(record),
                  lambda: record.write_text('{"format": "nxd_smp.saves/1", "sequence": 1, "saves": [["a", "../x"]]}'),
                  lambda: record.write_text("[")):
        record.unlink()
        plant()
        with pytest.raises(CheckpointError, match=SAVES_FILE):
            within(20, lambda: loaded(run))
        with pytest.raises(CheckpointError, match=SAVES_FILE):  # a save refuses it before its swap
            within(20, lambda: save(run / "b", "b"))
        assert loaded(run / "a") == "a" and not os.path.lexists(run / "b")  # by name: loads
    record.unlink()
    record.write_bytes(good)
    assert loaded(run) == "a"


# ---------------------------------------------------------------- B: links followed only to their own version
def test_a_planted_link_to_another_runs_version_is_never_loaded_nor_removed_through(tmp_path):
    run, other = tmp_path / "run", tmp_path / "other"
    save(run / "step_2", 2)
    save(run / "step_3", 3)
    save(other / "step_1", "theirs")  # saved last: the newest by any time a folder holds
    theirs = (other / "step_1").resolve()
    before = tree(theirs)

    def plant(name="step_1"):
        (run / name).unlink(missing_ok=True)
        os.symlink(f"../other/{theirs.name}", run / name)

    plant()
    with pytest.raises(CheckpointError, match="not a version of this checkpoint"):
        loaded(run / "step_1")
    assert not has_checkpoint(run / "step_1")
    assert loaded(run) == 3  # the directory: its own newest
    save(run / "step_4", 4, num_kept_ckpts=1)  # retention
    assert tree(theirs) == before and (run / "step_1").is_symlink() and loaded(run) == 4
    remove_checkpoint(run / "step_1")  # the link goes, never what it points to
    assert not os.path.lexists(run / "step_1") and tree(theirs) == before
    plant()
    save(run / "step_1", 1)  # a save over it replaces the link only
    assert tree(theirs) == before and loaded(run / "step_1") == 1 and loaded(other / "step_1") == "theirs"
    plant("step_9")  # a link under another name, or an absolute one
    with pytest.raises(CheckpointError):
        loaded(run / "step_9")
    (run / "step_9").unlink()
    os.symlink(theirs, run / "step_9")
    with pytest.raises(CheckpointError):
        loaded(run / "step_9")
    save(run / "step_5", 5, num_kept_ckpts=1)
    with pytest.raises(CheckpointError, match="not a checkpoint"):  # not even a link named as one: left alone
        remove_checkpoint(run / "step_9")
    assert tree(theirs) == before and loaded(other) == "theirs"


def test_a_version_that_is_itself_a_link_is_not_followed(tmp_path):
    run, other = tmp_path / "run", tmp_path / "other"
    save(other / "x", "theirs")
    theirs = (other / "x").resolve()
    before = tree(theirs)
    run.mkdir()
    os.symlink(theirs, run / ".x.v-abc123")  # a version name beside the link, but a link out
    os.symlink(".x.v-abc123", run / "x")
    with pytest.raises(CheckpointError):
        loaded(run / "x")
    save(run / "y", "y", num_kept_ckpts=1)  # removes unreferenced versions: never through a link
    remove_checkpoint(run / "x")
    save(run / "x", "x")
    assert tree(theirs) == before and loaded(run) == "x"


# ---------------------------------------------------------------- C: newest from the writer's own record
def plant_copy(run: Path, source: str, name: str, saved_at_ns: int) -> Path:
    """A complete copy of ``run/source`` under the link ``name``, its completion record dated
    ``saved_at_ns``."""
    version = run / f".{name}.v-0123456789ab"
    shutil.copytree((run / source).resolve(), version)
    record = json.loads((version / COMPLETE_FILE).read_text())
    record["saved_at_ns"] = saved_at_ns
    (version / COMPLETE_FILE).write_text(json.dumps(record))
    os.symlink(version.name, run / name)
    return run / name


def test_a_planted_checkpoint_dated_in_the_future_neither_becomes_newest_nor_steers_retention(tmp_path):
    run = tmp_path / "run"
    save(run / "step_1", 1, num_kept_ckpts=2)
    save(run / "step_2", 2, num_kept_ckpts=2)
    planted = plant_copy(run, "step_1", "zzz_planted", 2**62)
    save(run / "step_3", 3, num_kept_ckpts=2)
    names = sorted(p.name for p in run.iterdir() if not p.name.startswith("."))
    assert names == ["step_2", "step_3", "zzz_planted"]  # the user's newest two, and the planted one left
    assert loaded(run) == 3 and has_checkpoint(run)
    assert loaded(planted) == 1  # named explicitly, it loads
    save(run / "step_2", 22, num_kept_ckpts=2)  # a name saved again is the newest
    assert loaded(run) == 22
    save(run / "step_4", 4, num_kept_ckpts=1)
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == ["step_4", "zzz_planted"]
    assert loaded(run) == 4


def test_a_directory_without_a_record_loads_its_only_checkpoint_and_refuses_to_guess_among_several(tmp_path):
    run = tmp_path / "run"
    save(run / "step_1", 1)
    (run / SAVES_FILE).unlink()  # as the previous release left it
    assert loaded(run) == 1 and has_checkpoint(run)
    plant_copy(run, "step_1", "step_2", 2**62)
    with pytest.raises(CheckpointError, match="step_1, step_2") as info:
        loaded(run)
    assert "by name" in str(info.value)
    assert has_checkpoint(run)  # there is one: the load says why it does not choose
    save(run / "step_3", 3, num_kept_ckpts=1)  # the first recorded save: retention removes nothing unrecorded
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == ["step_1", "step_2", "step_3"]
    assert loaded(run) == 3
    remove_checkpoint(run / "step_3")  # the record holds none in place: refuses to guess again
    with pytest.raises(CheckpointError, match="record"):
        loaded(run)


def test_a_save_cut_off_after_its_record_was_written_counts_for_nothing(tmp_path, monkeypatch):
    from nxd_smp.checkpointing import versions

    run = tmp_path / "run"
    save(run / "a", "a")

    rename = versions.Folder.rename

    def killed(folder, name, new_name, **kwargs):  # the link's swap, after the record was written
        if ".link-" in name:
            raise OSError("killed before the swap")
        return rename(folder, name, new_name, **kwargs)

    monkeypatch.setattr(versions.Folder, "rename", killed)
    with pytest.raises(CheckpointError, match="killed"):
        save(run / "b", "b")
    monkeypatch.undo()
    assert loaded(run) == "a"
    save(run / "c", "c", num_kept_ckpts=1)
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == ["c"]


# ---------------------------------------------------------------- D: the command line escapes
HOSTILE = ["\x1b[2J", "\x1b]0;title\x07", "\x1b]52;c;ZXZpbA==\x07", "\rOK fake line", "\u202e", "\x9b31m", "\u2066"]
RAW = [b"\x1b", b"\x07", b"\r", b"\xe2\x80\xae", b"\xc2\x9b", b"\xe2\x81\xa6"]


class Hostile(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_parameter("w" + "".join(HOSTILE), nn.Parameter(torch.ones(())))  # a 0-dim one: export refuses it


class Counter:
    def state_dict(self):
        return {"n": 1}

    def load_state_dict(self, state):
        pass


def test_the_command_line_prints_checkpoint_strings_escaped(tmp_path, capfdbinary):
    model = Hostile()
    opt = Zero1Optimizer([{"params": list(model.parameters()), "note": "".join(HOSTILE)}], torch.optim.AdamW,
                         mixed_precision=MixedPrecisionConfig(use_master_weights=False, use_fp32_grad_acc=False,
                                                              use_master_weights_in_ckpt=False),
                         compile_update=False, lr=1e-3)
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt, extra="".join(HOSTILE),
                    stateful={"s" + "".join(HOSTILE): Counter()})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = run_python(["-m", "nxd_smp", "inspect", str(tmp_path / "c")], env=env, timeout=120, text=False)
    assert out.returncode == 0 and b"\\x1b[2J" in out.stdout and b"\\u202e" in out.stdout, out
    printed = [out.stdout + out.stderr]
    assert main(["inspect", str(tmp_path / "c"), "--json"]) == 0
    captured = capfdbinary.readouterr()
    assert b"note" in captured.out
    printed.append(captured.out + captured.err)
    assert main(["export-xla", str(tmp_path / "c"), str(tmp_path / "xla"), "--dp-size", "2"]) == 2  # the error names it
    captured = capfdbinary.readouterr()
    assert captured.err.startswith(b"error: ") and b"\\x1b]0;title\\x07" in captured.err
    printed.append(captured.out + captured.err)
    for text in printed:
        assert not [raw for raw in RAW if raw in text], text
