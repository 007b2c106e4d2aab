"""Bounded walks and removals: no walk or removal of a folder recurses on its depth or holds a
descriptor per level (a tree planted 5,000 deep is left below the cap with one warning, nothing
outside the root is reached through a link in it); nothing after a save's publish makes the save
fail; and no value handed in to load (a state dict in memory, a checkpoint's small files) is walked
by a recursion on its depth: a list nested 100,000 deep is a ``CheckpointError`` and changes nothing.
"""

from __future__ import annotations

import errno
import json
import os
import warnings
from pathlib import Path

import pytest
import torch

from nxd_smp import CheckpointError, finalize_checkpoint, load_checkpoint, save_checkpoint
from nxd_smp.checkpoint import has_checkpoint, load_full_optimizer_state, remove_checkpoint
from nxd_smp.checkpointing.files import MAX_TREE_DEPTH, Folder
from nxd_smp.optim.loading.check import check_scheduler_state, fingerprint
from tests.checkpoint_scenario import build, train
from tests.crafted import reseal

DEPTH = 5000  # the planted tree's levels: far past the recursion limit and the descriptors a level each would take
VICTIM = b"the victim's own bytes"
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def nested(levels: int) -> list:
    value: list = []
    for _ in range(levels):
        value = [value]
    return value


# ---------------------------------------------------------------- planting and clearing a deep tree
class Chain:
    """A chain of folders ``d/d/...`` ``DEPTH`` deep, made once for the module (through descriptors: its path is
    longer than the system's; and slowly: a folder costs the system more the deeper it is), with links to the
    victim's folder and file at its bottom. ``plant`` moves it into a folder (one rename) and adds the same
    links near its top; ``take_back`` moves back what a test left of it: a removal bounded by the cap leaves
    every folder of the chain above the cap, emptied of its links, in place."""

    def __init__(self, home: Path, outside: Path):
        self.home, self.outside = home, outside

    def plant(self, folder: Path) -> None:
        if not (self.home / "chain").exists():
            self._make()
        os.rename(self.home / "chain", folder / "deep")
        fd = os.open(folder / "deep" / "d", _DIR)
        try:
            self._links(fd)
        finally:
            os.close(fd)

    def take_back(self, folder: Path) -> None:
        os.rename(folder / "deep", self.home / "chain")

    def _links(self, fd: int) -> None:
        for name, target in (("out", self.outside), ("victim", self.outside / "victim")):
            if not os.path.lexists(f"/proc/self/fd/{fd}/{name}"):
                os.symlink(target, name, dir_fd=fd)

    def _make(self) -> None:
        fd = os.open(self.home, _DIR)
        try:
            for level in range(DEPTH):
                name = "chain" if level == 0 else "d"
                os.mkdir(name, dir_fd=fd)
                sub = os.open(name, _DIR, dir_fd=fd)
                os.close(fd)
                fd = sub
            self._links(fd)
        finally:
            os.close(fd)


def clear(path: Path) -> None:
    """Remove ``path`` however deep it goes, two descriptors at a time: each folder's entries are moved up
    into ``path`` before it goes (so pytest's own clean-up, a recursion, never meets the planted tree)."""
    if not os.path.lexists(path):
        return
    if not path.is_dir() or path.is_symlink():
        path.unlink()
        return
    top, moved = os.open(path, _DIR), 0
    try:
        while names := os.listdir(top):
            for name in names:
                if not os.path.isdir(f"/proc/self/fd/{top}/{name}") or os.path.islink(f"/proc/self/fd/{top}/{name}"):
                    os.unlink(name, dir_fd=top)
                    continue
                sub = os.open(name, _DIR, dir_fd=top)
                try:
                    for child in os.listdir(sub):
                        moved += 1
                        os.rename(child, f".up-{moved}", src_dir_fd=sub, dst_dir_fd=top)
                finally:
                    os.close(sub)
                os.rmdir(name, dir_fd=top)
    finally:
        os.close(top)
    os.rmdir(path)


@pytest.fixture(scope="module")
def victim(tmp_path_factory):
    """The victim's folder, outside every checkpoint root, holding the victim's file."""
    outside = tmp_path_factory.mktemp("outside")
    (outside / "victim").write_bytes(VICTIM)
    return outside


@pytest.fixture(scope="module")
def chain(tmp_path_factory, victim):
    home = tmp_path_factory.mktemp("chain")
    yield Chain(home, victim)
    clear(home)


@pytest.fixture
def room(tmp_path, victim):
    """(the checkpoint directory, the victim's folder); whatever the test leaves in it is cleared."""
    yield tmp_path / "run", victim
    clear(tmp_path / "run")


def victim_intact(outside: Path) -> bool:
    return sorted(os.listdir(outside)) == ["victim"] and (outside / "victim").read_bytes() == VICTIM


@pytest.fixture
def descriptors(monkeypatch):
    """The most descriptors this process held at once while a walk went on: sampled at each ``os.close``
    (a walk closes a level's descriptor once it is done with it, so the deepest point is sampled)."""
    peak = {"before": len(os.listdir("/proc/self/fd")), "max": 0}
    close = os.close

    def sampled(fd):
        peak["max"] = max(peak["max"], len(os.listdir("/proc/self/fd")))
        return close(fd)

    monkeypatch.setattr(os, "close", sampled)
    return peak


def save_tag(kind: str, root: Path, tag: str, model, opt, **kwargs) -> None:
    """A save of ``tag`` into the directory ``root``: nxd_smp's format ("smp", a link to a version) or NxD
    Training's state dicts ("nxd", a tag folder)."""
    if kind == "smp":
        save_checkpoint(root, tag, model, opt, user_content={"tag": tag}, **kwargs)
    else:
        plain = torch.optim.AdamW(model.parameters(), lr=1e-3)
        save_checkpoint(root, tag, model=model.state_dict(), optimizer=plain.state_dict(),
                        user_content={"tag": tag}, **kwargs)


def loaded_tag(kind: str, path: Path):
    model, opt = build(seed=3)
    if kind == "smp":
        return load_checkpoint(path, model=model, optimizer=opt)["tag"]
    return load_checkpoint(path, model={}, optimizer=None)["tag"]


def warned(records, *words: str) -> list[str]:
    return [str(r.message) for r in records if all(w in str(r.message) for w in words)]


# ---------------------------------------------------------------- removals
@pytest.mark.parametrize("kind", ["smp", "nxd"])
def test_retention_leaves_a_planted_deep_tree_below_the_cap_with_one_warning(room, chain, descriptors, kind):
    root, outside = room
    model, opt = build()
    train(model, opt, 1, 0)
    save_tag(kind, root, "t1", model, opt, num_kept_ckpts=1)
    folder = (root / "t1").resolve()  # nxd_smp's version, or NxD's tag folder
    chain.plant(folder)
    descriptors["before"] = len(os.listdir("/proc/self/fd"))
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        save_tag(kind, root, "t2", model, opt, num_kept_ckpts=1)  # retention removes t1
    assert descriptors["max"] <= descriptors["before"] + MAX_TREE_DEPTH + 16, descriptors
    assert len(warned(records, folder.name, "left in place", f"{MAX_TREE_DEPTH} levels down")) == 1, \
        [str(r.message) for r in records]
    assert victim_intact(outside), "a link in the planted tree was followed"
    assert not has_checkpoint(root / "t1") and loaded_tag(kind, root) == "t2"
    assert os.listdir(folder) == ["deep"]  # what is left: the chain below the cap, nothing complete-looking
    chain.take_back(folder)


@pytest.mark.parametrize("kind", ["smp", "nxd"])
def test_remove_checkpoint_of_a_deep_tree_is_bounded_and_leaves_nothing_complete(room, chain, descriptors, kind):
    root, outside = room
    model, opt = build()
    save_tag(kind, root, "t1", model, opt)
    folder = (root / "t1").resolve()
    chain.plant(folder)
    descriptors["before"] = len(os.listdir("/proc/self/fd"))
    with pytest.warns(UserWarning, match=f"{folder.name} was removed in part; left in place"):
        remove_checkpoint(root / "t1")
    assert descriptors["max"] <= descriptors["before"] + MAX_TREE_DEPTH + 16, descriptors
    assert victim_intact(outside)
    assert not has_checkpoint(root / "t1") and not has_checkpoint(root)
    assert os.listdir(folder) == ["deep"]
    if kind == "smp":  # the version itself, named directly, is not a checkpoint either
        with pytest.raises(CheckpointError, match="incomplete"):
            loaded_tag(kind, folder)
    chain.take_back(folder)


def test_a_tree_walk_follows_no_link_and_goes_no_deeper_than_the_cap(room, chain):
    root, outside = room
    (root / "v").mkdir(parents=True)
    chain.plant(root / "v")
    with Folder.open(root) as folder, folder.sub("v") as v:
        with pytest.warns(UserWarning, match="leaves out"):
            assert v.tree_size() == 0  # links neither counted nor followed
        with pytest.warns(UserWarning, match="synced in part"):
            v.fsync_tree()
    assert victim_intact(outside)
    chain.take_back(root / "v")


# ---------------------------------------------------------------- nothing after the publish fails a save
@pytest.mark.parametrize("kind", ["smp", "nxd"])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("error", [OSError(errno.EIO, "Input/output error"), RecursionError("maximum recursion depth")],
                         ids=["OSError", "RecursionError"])
def test_a_failing_retention_after_the_publish_is_a_warning(room, monkeypatch, kind, async_save, error):
    root, _ = room
    model, opt = build()
    save_tag(kind, root, "t1", model, opt, num_kept_ckpts=1)

    def broken(self, name):
        raise error

    monkeypatch.setattr(Folder, "remove_tree", broken)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        save_tag(kind, root, "t2", model, opt, num_kept_ckpts=1, async_save=async_save)
        finalize_checkpoint()  # (raises an asynchronous save's failure)
    monkeypatch.undo()
    assert warned(records, "the save is in place", "t1", type(error).__name__), [str(r.message) for r in records]
    assert loaded_tag(kind, root) == "t2" and loaded_tag(kind, root / "t2") == "t2"
    assert not has_checkpoint(root / "t1")  # what was left looks complete nowhere


# ---------------------------------------------------------------- values nested deep
def snapshot(opt) -> tuple:
    sd = opt.state_dict()
    groups = [{k: v for k, v in g.items()} for g in sd["param_groups"]]
    tensors = {(k, f): getattr(v, "local", v).clone() for k, entry in sd["state"].items() for f, v in entry.items()}
    return groups, tensors


def unchanged(opt, before: tuple) -> bool:
    groups, tensors = snapshot(opt)
    return groups == before[0] and tensors.keys() == before[1].keys() and all(
        torch.equal(t, before[1][k]) for k, t in tensors.items())


def refused_without_recursion(call, *names: str) -> None:
    with pytest.raises(CheckpointError) as caught:
        call()
    assert "Recursion" not in str(caught.value) and all(n in str(caught.value) for n in names), caught.value


@pytest.mark.parametrize("key", ["lr", "betas", "initial_lr"])
def test_a_hyperparameter_nested_100000_deep_is_refused_by_load_state_dict(key):
    model, opt = build()
    train(model, opt, 1, 0)
    before = snapshot(opt)
    sd = opt.state_dict()
    sd["param_groups"] = [dict(g) for g in sd["param_groups"]]
    sd["param_groups"][0][key] = (0.9, nested(100_000)) if key == "betas" else nested(100_000)
    refused_without_recursion(lambda: opt.load_state_dict(sd), repr(key))
    assert unchanged(opt, before)


@pytest.mark.parametrize("key", ["lr", "betas", "initial_lr"])
def test_a_hyperparameter_nested_100000_deep_is_refused_by_load_full_optimizer_state(key):
    model, opt = build()
    train(model, opt, 1, 0)
    before = snapshot(opt)
    state = {n: {"exp_avg": torch.zeros_like(p, dtype=torch.float32), "exp_avg_sq": torch.zeros_like(p, dtype=torch.float32),
                 "step": torch.tensor(1.0)} for n, p in model.named_parameters() if p.requires_grad}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    groups[1][key] = (nested(100_000), 0.9) if key == "betas" else nested(100_000)
    refused_without_recursion(lambda: load_full_optimizer_state(model, opt, state, groups), repr(key))
    assert unchanged(opt, before)


def test_a_scheduler_state_nested_100000_deep_is_refused():
    model, opt = build()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    saved = dict(scheduler.state_dict(), base_lrs=nested(100_000))
    refused_without_recursion(lambda: check_scheduler_state(saved, scheduler, "the state"), "'base_lrs'")
    refused_without_recursion(lambda: fingerprint([saved]), "deep")  # the digest the ranks compare


@pytest.mark.parametrize("levels", [150, 100_000])
def test_a_checkpoints_scheduler_state_nested_deep_is_refused_and_changes_nothing(tmp_path, levels):
    """Past the JSON parser's own limit (100,000) or within it and past the typed JSON's (150)."""
    model, opt = build()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    train(model, opt, 1, 0)
    scheduler.step()
    save_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt, scheduler=scheduler)
    version = (tmp_path / "ckpt").resolve()
    small = json.loads((version / "extra.json").read_text())
    small["objects"]["scheduler"]["base_lrs"] = "DEEP"
    text = json.dumps(small).replace('"DEEP"', "[" * levels + "]" * levels)
    (version / "extra.json").chmod(0o644)
    (version / "extra.json").write_text(text)
    reseal(version, "extra.json")
    fresh, fresh_opt = build(seed=4)
    fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=2)
    before, before_scheduler = snapshot(fresh_opt), fresh_scheduler.state_dict()
    with pytest.raises(CheckpointError, match="extra.json"):
        load_checkpoint(tmp_path / "ckpt", model=fresh, optimizer=fresh_opt, scheduler=fresh_scheduler)
    assert unchanged(fresh_opt, before) and fresh_scheduler.state_dict() == before_scheduler


def test_a_state_dict_nested_100000_deep_is_refused_by_a_save_before_anything_is_written(tmp_path):
    model, _ = build()
    optimizer = {"state": {}, "param_groups": [{"params": [], "lr": 0.1, "x": nested(100_000)}]}
    with pytest.raises(TypeError, match="deep"):
        save_checkpoint(tmp_path, "t1", model=model.state_dict(), optimizer=optimizer)
    assert not (tmp_path / "t1").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".t1")]
