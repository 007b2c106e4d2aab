"""The outputs (``consolidate``, ``export_xla``, ``export_torch``, ``export_safetensors``, in
Python and on the command line) never replace anything unasked and never write through a link:
files, directories and links (dangling, or pointing outside) planted at the target and at the
staging names earlier releases used; bad output paths a clean error; a failed or raced write
leaves the target as it was (``nxd_smp.checkpointing.files``' output writers alone).

The oracle for "nothing changed" is a snapshot of the whole test directory, taken without
following links, before and after.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nxd_smp import CheckpointError, MixedPrecisionConfig, Zero1Optimizer, save_checkpoint
from nxd_smp.checkpoint import consolidate
from nxd_smp.checkpointing.files import write_output_directory, write_output_file


def write_file(out, write, *, overwrite):
    return write_output_file(out, write, overwrite=overwrite)


def write_directory(out, fill, *, overwrite):
    """``write_output_directory`` with ``fill`` given the staging folder as a ``Path`` (its descriptor's)."""
    return write_output_directory(out, lambda staging: fill(Path(staging)), overwrite=overwrite)
from nxd_smp.cli import main
from nxd_smp.interop.native_torch import export_safetensors, export_torch
from nxd_smp.interop.torch_xla import export_xla
from tests.distributed import run_python

ROOT = Path(__file__).resolve().parents[3]
KINDS = ["consolidate", "export-xla", "export-torch", "export-safetensors"]
DIRECTORY_OUTPUTS = {"export-xla", "export-torch"}
XLA_FILES = [f"dp_rank_{r:02d}_tp_rank_00_pp_rank_00.pt" for r in range(2)]
VICTIM = b"a file outside, never to be written\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A small checkpoint (bf16, masters saved, one AdamW step): no 0-dim parameter, so every
    output accepts it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)).to(torch.bfloat16)
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, compile_update=False,
                         mixed_precision=MixedPrecisionConfig(use_master_weights_in_ckpt=True))
    model(torch.ones(2, 5, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    path = tmp_path_factory.mktemp("export_safety") / "ckpt"
    save_checkpoint(path, model=model, optimizer=opt)
    return path


# ---------------------------------------------------------------------------- helpers
def snapshot(path: Path):
    """What is at ``path``, links not followed: None, ("link", target), ("file", bytes) or
    ("dir", {name: snapshot})."""
    if not os.path.lexists(path):
        return None
    if path.is_symlink():
        return ("link", os.readlink(path))
    if path.is_dir():
        return ("dir", {p.name: snapshot(p) for p in path.iterdir()})
    return ("file", path.read_bytes())


def api(kind: str):
    """The Python function behind command ``kind``, called as ``f(ckpt, out, overwrite=)``."""
    return {"consolidate": consolidate, "export-xla": lambda c, o, **kw: export_xla(c, o, 2, **kw),
            "export-torch": export_torch, "export-safetensors": export_safetensors}[kind]


def run(kind: str, via: str, ckpt: Path, out: Path, capsys, overwrite: bool = False) -> str | None:
    """Write output ``kind`` of ``ckpt`` at ``out``; the refusal's message, or None if written.
    ``via="cli"``: through ``main``, which must answer 0, or 2 with one ``error:`` line."""
    if via == "cli":
        args = [kind, str(ckpt), str(out)] + (["--dp-size", "2"] if kind == "export-xla" else [])
        rc = main(args + (["--overwrite"] if overwrite else []))
        err = capsys.readouterr().err
        assert rc in (0, 2) and "Traceback" not in err, err
        if rc == 0:
            return None
        assert err.startswith("error: ") and err.count("\n") == 1, err
        return err
    try:
        api(kind)(ckpt, out, overwrite=overwrite)
    except CheckpointError as e:
        return str(e)
    return None


def assert_written(kind: str, out: Path) -> None:
    """A real (not linked) output of ``kind`` at ``out`` that its reader loads."""
    assert not out.is_symlink()
    if kind == "consolidate":
        assert out.is_file() and "model" in torch.load(out, weights_only=True)
    elif kind == "export-xla":
        assert sorted(p.name for p in out.iterdir()) == XLA_FILES
        assert all(not (out / f).is_symlink() and "base_state" in torch.load(out / f, weights_only=True)
                   for f in XLA_FILES)
    elif kind == "export-torch":
        assert out.is_dir() and (out / ".metadata").is_file()
    else:
        from safetensors.torch import load_file

        assert out.is_file() and "0.weight" in load_file(out)


def assert_no_staging_left(parent: Path, expected: set[str]) -> None:
    assert {p.name for p in parent.iterdir()} == expected


@pytest.fixture
def place(tmp_path):
    """``work/`` (the output's parent) and ``outside/`` (what links point at: a file)."""
    (tmp_path / "work").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "victim").write_bytes(VICTIM)
    return tmp_path / "work", tmp_path / "outside"


def out_name(kind: str) -> str:
    return {"consolidate": "out.pt", "export-safetensors": "out.safetensors"}.get(kind, "out")


# ---------------------------------------------------------------------------- planted targets
PLANTED = ["file", "directory", "dangling link", "link to a file outside", "link to a directory outside"]


def plant(what: str, out: Path, outside: Path) -> None:
    if what == "file":
        out.write_bytes(b"mine")
    elif what == "directory":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    elif what == "dangling link":
        out.symlink_to(outside / "absent")
    elif what == "link to a file outside":
        out.symlink_to(outside / "victim")
    else:
        out.symlink_to(outside)


@pytest.mark.parametrize("via", ["api", "cli"])
@pytest.mark.parametrize("what", PLANTED)
@pytest.mark.parametrize("kind", KINDS)
def test_what_is_at_the_target_is_refused_then_replaced_with_overwrite_never_written_through(
        ckpt, place, kind, what, via, capsys):
    work, outside = place
    out = work / out_name(kind)
    plant(what, out, outside)
    before = snapshot(work.parent)
    refused = run(kind, via, ckpt, out, capsys)
    file_over_directory = what == "directory" and kind not in DIRECTORY_OUTPUTS
    assert refused is not None and str(out) in refused
    assert ("is a directory" if file_over_directory else "overwrite=True (--overwrite)") in refused
    assert snapshot(work.parent) == before  # nothing changed, nothing left behind

    refused = run(kind, via, ckpt, out, capsys, overwrite=True)
    if file_over_directory:  # a file never replaces a directory
        assert refused is not None and "is a directory" in refused
        assert snapshot(work.parent) == before
        return
    assert refused is None
    assert_written(kind, out)  # the link itself replaced, never followed
    assert snapshot(outside) == before[1]["outside"]
    assert not (outside / "absent").exists() and (outside / "victim").read_bytes() == VICTIM
    assert_no_staging_left(work, {out.name})


@pytest.mark.parametrize("via", ["api", "cli"])
@pytest.mark.parametrize("kind", KINDS)
def test_links_planted_at_the_old_staging_names_are_never_written_through(ckpt, place, kind, via, capsys):
    """Earlier releases staged at ``.OUT.partial`` (consolidate), ``.OUT.partial-<pid>``
    (export_torch, export_safetensors) and wrote export_xla's files into an existing
    ``out_dir``, following links planted there."""
    work, outside = place
    out = work / out_name(kind)
    planted = [work / f".{out.name}.partial", work / f".{out.name}.partial-{os.getpid()}"]
    for link in planted:
        link.symlink_to(outside / "victim")
    if kind == "export-xla":
        out.mkdir()
        (out / XLA_FILES[0]).symlink_to(outside / "victim")
        assert run(kind, via, ckpt, out, capsys) is not None  # a directory that is not empty
    assert run(kind, via, ckpt, out, capsys, overwrite=kind == "export-xla") is None
    assert_written(kind, out)
    assert (outside / "victim").read_bytes() == VICTIM and [p.name for p in outside.iterdir()] == ["victim"]
    assert all(os.readlink(link) == str(outside / "victim") for link in planted)
    assert_no_staging_left(work, {out.name} | {link.name for link in planted})


@pytest.mark.parametrize("kind", KINDS)
def test_free_targets_are_written_and_a_linked_parent_is_followed(ckpt, place, kind, capsys):
    """Absent targets (missing parents made), an empty directory for a directory output, and a
    parent reached through a link (only the last component is never followed)."""
    work, outside = place
    out = work / "new" / "deeper" / out_name(kind)
    assert run(kind, "api", ckpt, out, capsys) is None
    assert_written(kind, out)
    assert_no_staging_left(out.parent, {out.name})
    (work / "linked").symlink_to(outside)
    assert run(kind, "cli", ckpt, work / "linked" / out_name(kind), capsys) is None
    assert_written(kind, outside / out_name(kind))
    if kind in DIRECTORY_OUTPUTS:
        (work / "empty").mkdir()
        assert run(kind, "api", ckpt, work / "empty", capsys) is None
        assert_written(kind, work / "empty")


@pytest.mark.parametrize("kind", KINDS)
def test_bad_output_paths_are_a_clean_error(ckpt, place, kind, capsys):
    work, _ = place
    (work / "file.txt").write_text("x")
    before = snapshot(work)
    for bad in [work / "file.txt" / "out", work / "file.txt" / "sub" / "out", Path("")]:
        err = run(kind, "cli", ckpt, bad, capsys)
        assert err is not None, bad
    assert "not a directory" in run(kind, "cli", ckpt, work / "file.txt" / "out", capsys)
    assert snapshot(work) == before
    with pytest.raises(TypeError, match="overwrite"):
        api(kind)(ckpt, work / "o", overwrite="yes")
    with pytest.raises(TypeError, match="path"):
        api(kind)(ckpt, 3)
    assert snapshot(work) == before


def test_the_command_line_process_ends_in_one_error_line_not_a_traceback(ckpt, place):
    work, outside = place
    (work / "file.txt").write_text("x")
    (work / "dangling").symlink_to(outside / "absent")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    calls = [("export-torch", work / "dangling"), ("consolidate", work / "file.txt" / "out")]
    procs = [run_python(["-m", "nxd_smp", kind, str(ckpt), str(out)], env=env, timeout=120) for kind, out in calls]
    stderr = "".join(proc.stderr for proc in procs)
    assert [proc.returncode for proc in procs] == [2, 2], [(proc.stdout, proc.stderr) for proc in procs]
    assert "Traceback" not in stderr
    assert [line.startswith("error: ") for line in stderr.splitlines()] == [True, True], stderr
    assert not (outside / "absent").exists()


# ---------------------------------------------------------------------------- the writers alone
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_failed_write_leaves_the_target_and_no_staging(place, overwrite):
    work, _ = place
    (work / "f").write_bytes(b"old")
    (work / "d").mkdir()
    (work / "d" / "keep").write_bytes(b"old")
    before = snapshot(work)

    def fail(_):
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_file(work / ("f" if overwrite else "new"), fail, overwrite=overwrite)
    with pytest.raises(RuntimeError, match="disk full"):
        write_directory(work / ("d" if overwrite else "new"), fail, overwrite=overwrite)
    assert snapshot(work) == before


@pytest.mark.parametrize("what", PLANTED)
def test_a_target_that_appears_while_writing_is_not_replaced(place, what):
    """The check before writing passed; the publish itself must not clobber."""
    work, outside = place
    for out, writer in [(work / "f", write_file), (work / "d", write_directory)]:
        def appear(_, out=out):
            plant(what, out, outside)

        with pytest.raises(CheckpointError, match="appeared|taken"):
            writer(out, appear, overwrite=False)
        assert snapshot(out) == snapshot_of_planted(what, outside)
    assert snapshot(outside / "victim") == ("file", VICTIM) and not (outside / "absent").exists()
    assert {p.name for p in work.iterdir()} == {"f", "d"}


def snapshot_of_planted(what: str, outside: Path):
    return {"file": ("file", b"mine"), "directory": ("dir", {"keep.txt": ("file", b"mine")}),
            "dangling link": ("link", str(outside / "absent")),
            "link to a file outside": ("link", str(outside / "victim")),
            "link to a directory outside": ("link", str(outside))}[what]


def test_overwrite_replaces_a_directory_whole_and_a_link_itself(place):
    work, outside = place
    (work / "d").mkdir()
    (work / "d" / "old").write_bytes(b"old")
    write_directory(work / "d", lambda staging: (staging / "new").write_bytes(b"new"), overwrite=True)
    assert snapshot(work / "d") == ("dir", {"new": ("file", b"new")})
    (work / "l").symlink_to(outside)
    write_directory(work / "l", lambda staging: (staging / "new").write_bytes(b"new"), overwrite=True)
    assert snapshot(work / "l") == ("dir", {"new": ("file", b"new")})
    assert snapshot(outside) == ("dir", {"victim": ("file", VICTIM)})
    assert {p.name for p in work.iterdir()} == {"d", "l"}
    mask = os.umask(0)
    os.umask(mask)
    assert (work / "d").stat().st_mode & 0o777 == 0o777 & ~mask  # not mkdtemp's 0o700
    write_file(work / "f", lambda f: f.write(b"x"), overwrite=False)
    assert (work / "f").stat().st_mode & 0o777 == 0o666 & ~mask  # not mkstemp's 0o600
