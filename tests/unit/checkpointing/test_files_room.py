"""The one filesystem room (``nxd_smp.checkpointing.files``): another user with write access to a shared
checkpoint root swaps folders and plants links while a save runs, and no write or removal lands outside
the folder the save made; reads below the root follow no link.

Each attack runs the save through its real entry point (``save_checkpoint`` in nxd_smp's call shape and
in NxD Training's), with the attacker's move injected at the moment it hurts most: after every rank has
opened the folder it writes into, before any byte is written. The victim's files (outside the root)
must keep their bytes, the save must fail with a ``CheckpointError`` naming the swap (a success would
publish a folder the attacker controls), and the previous checkpoint must still load.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nxd_smp import CheckpointError, load_checkpoint, save_checkpoint
from nxd_smp.checkpointing import save as smp_save
from nxd_smp.checkpointing.files import Folder
from nxd_smp.interop.nxd import state_dicts
from tests.checkpoint_scenario import build, params_of, train

VICTIM = b"the victim's own bytes"


def victims(outside: Path, names: list[str]) -> dict[str, Path]:
    outside.mkdir(exist_ok=True)
    files = {}
    for name in names:
        files[name] = outside / name
        files[name].write_bytes(VICTIM)
    return files


def swap_for_links(folder: Path, outside: Path, names: list[str]) -> None:
    """The attacker's move: the folder renamed away, a folder of links to the victim's files put in its
    place under the same name."""
    os.rename(folder, folder.parent / "moved-away")
    folder.mkdir()
    for name in names:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(outside / name, folder / name)


def test_a_version_swapped_for_links_while_saving_redirects_no_write(tmp_path, monkeypatch):
    root, outside = tmp_path / "root", tmp_path / "outside"
    model, opt = build()
    train(model, opt, 1, 0)
    save_checkpoint(root / "ckpt", model=model, optimizer=opt, extra={"n": 1})
    kept = params_of(model)
    names = ["__0_0.bin", "__0_1.bin", "nxd_smp_index.json", "nxd_smp_meta.json", "extra.json", "COMPLETE.json"]
    files = victims(outside, names)
    write = smp_save.write_tensors

    def attacked(folder, *args, **kwargs):
        (version,) = [p for p in root.iterdir() if p.name.startswith(".ckpt.v-") and p.resolve() != (root / "ckpt").resolve()]
        swap_for_links(version, outside, names)
        return write(folder, *args, **kwargs)

    monkeypatch.setattr(smp_save, "write_tensors", attacked)
    train(model, opt, 1, 1)
    with pytest.raises(CheckpointError, match="moved or replaced"):
        save_checkpoint(root / "ckpt", model=model, optimizer=opt, extra={"n": 2})
    assert all(f.read_bytes() == VICTIM for f in files.values()), "a write went through a planted link"
    monkeypatch.undo()
    fresh, fresh_opt = build(seed=7)
    assert load_checkpoint(root / "ckpt", model=fresh, optimizer=fresh_opt) == {"n": 1}  # the previous one
    assert all(torch.equal(a, kept[n]) for n, a in params_of(fresh).items())
    # what the save wrote went into the folder it made, which the attacker moved
    assert any(p.name.startswith("__0_") for p in (root / "moved-away").iterdir())


def test_a_link_planted_in_the_version_is_not_written_through(tmp_path, monkeypatch):
    root, outside = tmp_path / "root", tmp_path / "outside"
    files = victims(outside, ["__0_0.bin"])
    model, opt = build()
    write = smp_save.write_tensors

    def planted(folder: Folder, *args, **kwargs):
        os.symlink(files["__0_0.bin"], Path(folder.fd_path) / "__0_0.bin")
        return write(folder, *args, **kwargs)

    monkeypatch.setattr(smp_save, "write_tensors", planted)
    with pytest.raises(CheckpointError, match="File exists|__0_0.bin"):
        save_checkpoint(root / "ckpt", model=model, optimizer=opt)
    assert files["__0_0.bin"].read_bytes() == VICTIM
    assert not os.path.lexists(root / "ckpt")


def test_nxd_trainings_state_dict_save_swapped_for_links_redirects_no_write(tmp_path, monkeypatch):
    root, outside = tmp_path / "root", tmp_path / "outside"
    model, opt = build()
    plain = torch.optim.AdamW(model.parameters(), lr=1e-3)
    names = ["model/dp_rank_00_tp_rank_00_pp_rank_00.pt", "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt",
             "nxd_smp_state_dicts.json", "done"]
    outside.mkdir()
    for name in names:
        (outside / name).parent.mkdir(parents=True, exist_ok=True)
        (outside / name).write_bytes(VICTIM)
    write_and_publish = state_dicts.write_and_publish

    def attacked(coordinator, write, publish, **kwargs):
        (staging,) = [p for p in root.iterdir() if p.name.startswith(".t1.partial-")]
        swap_for_links(staging, outside, names)
        return write_and_publish(coordinator, write, publish, **kwargs)

    monkeypatch.setattr(state_dicts, "write_and_publish", attacked)
    with pytest.raises(CheckpointError):
        save_checkpoint(root, "t1", model=model.state_dict(), optimizer=plain.state_dict())
    assert all((outside / name).read_bytes() == VICTIM for name in names), "a write went through a planted link"
    assert not (root / "t1").exists() or not (root / "t1" / "done").exists()


def test_reads_below_the_root_follow_no_link(tmp_path):
    """The user's own path may hold links (resolved once); below it, a link where a folder or a file
    belongs is refused, never followed."""
    real = tmp_path / "real"
    model, opt = build()
    save_checkpoint(real / "ckpt", model=model, optimizer=opt)
    os.symlink(real, tmp_path / "alias")  # the user's own link: fine
    fresh, fresh_opt = build(seed=3)
    load_checkpoint(tmp_path / "alias" / "ckpt", model=fresh, optimizer=fresh_opt)
    version = (real / "ckpt").resolve()
    elsewhere = tmp_path / "elsewhere"
    os.rename(version, elsewhere)
    os.symlink(elsewhere, version)  # the version folder itself a link now
    with pytest.raises(CheckpointError, match="link|not a directory"):
        load_checkpoint(real / "ckpt", model=fresh, optimizer=fresh_opt)
    with Folder.open(tmp_path) as folder:
        with pytest.raises(CheckpointError, match="link"):
            folder.open_file("alias/ckpt")


def test_ranks_making_the_same_directory_at_once_all_get_it(tmp_path):
    """NxD Training's state-dict save: every rank writes ``optim/<its file>`` into one staging folder, so
    the ranks make ``optim`` at the same moment; none may fail because another made it first (a link
    planted there is still refused: ``sub`` never follows one)."""
    import threading

    (tmp_path / "root").mkdir()
    for attempt in range(20):
        start = threading.Barrier(4)
        errors: list[BaseException] = []

        def make() -> None:
            with Folder.open(tmp_path / "root") as root:
                start.wait()
                try:
                    root.makedirs(f"run{attempt}/optim").close()
                except BaseException as e:  # noqa: BLE001 - reported to the test
                    errors.append(e)

        threads = [threading.Thread(target=make) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [], errors
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "root" / "linked").symlink_to(tmp_path / "elsewhere")
    with Folder.open(tmp_path / "root") as root, pytest.raises(CheckpointError, match="link"):
        root.makedirs("linked/optim")
