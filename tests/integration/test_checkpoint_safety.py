"""A checkpoint is data a stranger hands you: loading it never runs code from it, through
any entry point, and the offline tools never join a collective.

The exploit is an object whose unpickling calls ``os.mkdir(marker)``, written into each pickled
file nxd_smp still reads (the healthy file edited, so everything else about it is as its tool
writes it): NxD's tag folders (the model, optimizer, ``scheduler.pt`` and ``user_content.pt``
files and xser's tensor files, plain and xser), NxD Training's state-dict tags, ``import_xla``'s
rank files, ``import_torch``'s ``.metadata`` and its records, and a training loop's optimizer file
(``read_reference``, which accelerate's load hook calls; the Trainer's ``optimizer.pt`` is read by
the Trainer itself). Each goes through its real entry point and must be refused with a
CheckpointError naming the file and what it asked for (``posix.mkdir``), create nothing, and
change nothing in the live model, optimizer and scheduler (or the dicts to fill).

nxd_smp's own format (3) holds no pickle: code in the caller's content is refused when it is
saved, a pickle planted in its typed JSON is refused as a tag nxd_smp never writes (by loads and
by the offline tools alike, in process and on the command line), and a folder whose completion
record says format 1 or 2 (the pre-release formats, whose index and small files were pickles) is
refused by name with nothing of it read.
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nxd_smp import CheckpointError, Zero1Optimizer, load_checkpoint, save_checkpoint
from nxd_smp.checkpoint import consolidate, inspect_checkpoint, read_checkpoint
from nxd_smp.checkpointing.dcp_index import read_metadata
from nxd_smp.checkpointing.files import Folder
from nxd_smp.interop.torch_xla import export_xla, import_xla
from tests.crafted import RANK_FILE, TAG, Exploit, index_of, native_run, reseal, save_xser, trained_run, write_nxd_tag
from tests.distributed import run_python, run_ranks
from tests.hostile_worker import changes, live_sequential, snapshot

ROOT = Path(__file__).resolve().parents[2]


class Counter:
    """A user's own class in a file: harmless, but torch's rule is to allow it by name."""

    def __init__(self, n: int = 0):
        self.n = n


class HoldsAnExploit:
    """A stateful object (a sampler, say) whose state holds the exploit."""

    def __init__(self, marker: str):
        self.marker = marker

    def state_dict(self):
        return {"position": 3, "payload": Exploit(self.marker)}

    def load_state_dict(self, state):
        raise AssertionError("never reached")


def torch_saved(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "the_exploit_ran"
    yield str(path)
    assert not os.path.lexists(path), "code from the checkpoint ran"


# ---------------------------------------------------------------- the healthy folders
@dataclass
class Sources:
    """One trained run saved as every tool writes it, under ``root``: ``nxd_smp`` (format 3),
    ``nxd`` and ``xser`` (NxD's tag folders ``<layout>/tag_2``), ``state_dicts`` (NxD Training's
    call shape: ``state_dicts/tag_2``), ``xla`` (``export_xla`` at DP 2), ``torch`` (a native fp32
    run's DCP directory); and the weights and the DP-1 optimizer file NxD's folders hold."""

    root: Path
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Sources:
    root = tmp_path_factory.mktemp("sources")
    model, opt, scheduler = trained_run(root)
    export_xla(root / "nxd_smp" / "ckpt", root / "xla", dp_size=2)
    (one_rank,) = export_xla(root / "nxd_smp" / "ckpt", root / "xla_dp1", dp_size=1)
    optim_state = torch.load(one_rank, weights_only=True)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    for layout in ("nxd", "xser"):
        write_nxd_tag(root / layout, weights, optim_state, scheduler.state_dict(), xser=layout == "xser")
    save_checkpoint(root / "state_dicts", TAG, model.state_dict(), opt.state_dict(), scheduler, {"step": 2})
    native_run(root)
    return Sources(root, weights, optim_state)


def copy_of(sources: Sources, source: str, where: Path) -> Path:
    """A copy of the healthy ``source`` under ``where``: the path its entry point takes."""
    shutil.copytree(sources.root / source, where / source, symlinks=True)
    return {"nxd_smp": where / source / "ckpt", "nxd": where / source / TAG, "xser": where / source / TAG,
            "state_dicts": where / source / TAG}.get(source, where / source)


# ---------------------------------------------------------------- planting the exploit
def pickle_in_json(path: Path, name: str, marker: str) -> None:
    """The exploit's pickle planted in nxd_smp's typed-JSON file ``name`` as a ``$pickle`` value
    (a tag nxd_smp never writes), the completion record resealed."""
    version = path.resolve()
    value = json.loads((version / name).read_text())
    payload = {"$pickle": base64.b64encode(pickle.dumps(Exploit(marker))).decode()}
    if name == "extra.json":
        value["extra"]["note"] = payload
    else:
        value["optimizer"]["groups"][0]["hyper"]["note"] = payload
    (version / name).write_text(json.dumps(value))
    reseal(version, name)


def native_record(directory: Path, marker: str) -> None:
    """``import_torch``'s record of param group 0's ``lr`` (a ``torch.save`` record in the data file)
    replaced by the exploit's: appended to the data file, the index pointing at it."""
    data_file = directory / "__0_0.distcp"
    record = torch_saved(Exploit(marker))
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(record)
    with Folder.open(directory) as folder:
        metadata = read_metadata(folder)
    index = index_of(metadata, "optim.param_groups.0.lr")
    info = metadata.storage_data[index]
    info.offset, info.length = offset, len(record)
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))


def native_index(directory: Path, marker: str) -> None:
    """``import_torch``'s ``.metadata``: DCP's index with the exploit as its planner data."""
    with Folder.open(directory) as folder:
        metadata = read_metadata(folder)
    metadata.planner_data = Exploit(marker)
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))


def xser_file(kind: str) -> Callable[[Path, str, Sources], None]:
    """xser's ``kind`` file (``model`` or ``optim``) written again as NxD writes it (each tensor a file,
    a reference in its place), the exploit beside the references."""
    def plant(tag: Path, marker: str, sources: Sources) -> None:
        value = dict(sources.weights) if kind == "model" else dict(sources.optimizer)
        save_xser({**value, "note": Exploit(marker)}, tag / kind / RANK_FILE)
    return plant


def reference_file(folder: Path, marker: str, sources: Sources) -> None:
    """A training loop's ``optimizer.bin`` beside the nxd_smp checkpoint, claiming to be nxd_smp's
    reference to it."""
    from nxd_smp.interop.loop_checkpoints import REFERENCE_FORMAT

    (folder / "optimizer.bin").write_bytes(torch_saved({"format": REFERENCE_FORMAT, "note": Exploit(marker)}))


def loop_folder(sources: Sources, where: Path) -> Path:
    """A training loop's checkpoint folder: the nxd_smp checkpoint ``nxd_smp`` in it."""
    return copy_of(sources, "nxd_smp", where).parent


def load_tag(path: Path, model, opt, scheduler) -> Any:
    return load_checkpoint(path, model=model, optimizer=opt, scheduler=scheduler)


def load_state_dict_tag(path: Path, model, opt, scheduler) -> Any:
    """NxD Training's call shape: the root and the tag."""
    return load_checkpoint(path.parent, path.name, model=model, optimizer=opt, scheduler=scheduler)


def load_xla_files(directory: Path, model, opt, scheduler) -> Any:
    return import_xla(sorted(directory.glob("dp_rank_*.pt")), model=model, optimizer=opt)


def load_native(directory: Path, model, opt, scheduler) -> Any:
    from nxd_smp.interop.native_torch import import_torch

    return import_torch(directory, model=model, optimizer=opt)


class _Accelerator:
    """What ``register_accelerate_hooks`` uses of accelerate's ``Accelerator``: its prepared
    optimizers and its state hooks (kept here, for the test to call as ``load_state`` would)."""

    def __init__(self, optimizer) -> None:
        self._optimizers = [optimizer]
        self.hooks: dict[str, Callable] = {}

    def register_save_state_pre_hook(self, hook: Callable) -> Callable:
        self.hooks["save"] = hook
        return hook

    def register_load_state_pre_hook(self, hook: Callable) -> Callable:
        self.hooks["load"] = hook
        return hook


def load_state(folder: Path, model, opt, scheduler) -> Any:
    """accelerate's ``load_state(folder)`` as far as nxd_smp takes part: its load hook."""
    from nxd_smp.interop.accelerate import register_accelerate_hooks

    accelerator = _Accelerator(opt)
    register_accelerate_hooks(accelerator, model, opt)
    return accelerator.hooks["load"]([model], str(folder))


@dataclass(frozen=True)
class Planted:
    """The exploit in one file: the healthy ``source`` copied (``copy``), ``plant(copy, marker,
    sources)`` writing it, ``load(copy, model, optimizer, scheduler)`` the entry point that meets it,
    ``file`` what the refusal names."""

    source: str
    plant: Callable[[Path, str, Sources], None]
    file: str
    load: Callable[..., Any] = load_tag
    copy: Callable[[Sources, Path], Path] | None = None

    def make(self, sources: Sources, where: Path, marker: str) -> Path:
        path = self.copy(sources, where) if self.copy else copy_of(sources, self.source, where)
        self.plant(path, marker, sources)
        return path


def with_exploit(key: str) -> Callable[[Any, str], Any]:
    """A state dict's edit: ``key`` becomes the exploit (a new key, or one the file has)."""
    return lambda value, marker: {**value, key: Exploit(marker)}


def in_file(name: str, edit: Callable[[Any, str], Any]) -> Callable[[Path, str, Sources], None]:
    """The ``torch.save`` file ``name`` of the copy saved again as ``edit(its value, marker)``."""
    def plant(path: Path, marker: str, sources: Sources) -> None:
        torch.save(edit(torch.load(path / name, weights_only=True), marker), path / name)
    return plant


def in_base_state(value: Any, marker: str) -> Any:
    """A torch_xla optimizer file's edit: parameter 0's ``exp_avg`` becomes the exploit."""
    value["base_state"][0]["exp_avg"] = Exploit(marker)
    return value


MODEL, OPTIM, RANK1 = f"model/{RANK_FILE}", f"optim/{RANK_FILE}", "dp_rank_01_tp_rank_00_pp_rank_00.pt"
PLANTED = {
    # NxD's tag folders, plain
    "nxd model file": Planted("nxd", in_file(MODEL, with_exploit("2.bias")), RANK_FILE),
    "nxd optimizer file": Planted("nxd", in_file(OPTIM, in_base_state), RANK_FILE),
    "nxd scheduler.pt": Planted("nxd", in_file("scheduler.pt", with_exploit("last_epoch")), "scheduler.pt"),
    "nxd user_content.pt": Planted("nxd", in_file("user_content.pt", with_exploit("note")), "user_content.pt"),
    # NxD's tag folders, xser (references in the .pt, each tensor a file of its own)
    "xser model file": Planted("xser", xser_file("model"), RANK_FILE),
    "xser optimizer file": Planted("xser", xser_file("optim"), RANK_FILE),
    "xser tensor file": Planted("xser", lambda tag, m, s: (tag / f"{MODEL}.tensors" / "tensor_0.pt").write_bytes(
        torch_saved(Exploit(m))), "tensor_0.pt"),
    "xser user_content.pt": Planted("xser", lambda tag, m, s: save_xser({"step": 2, "note": Exploit(m)},
                                                                         tag / "user_content.pt"), "user_content.pt"),
    # NxD Training's state-dict tag, loaded into live objects (into its dicts: a test below)
    "state-dict tag optimizer file": Planted("state_dicts", in_file(OPTIM, with_exploit("note")), RANK_FILE,
                                             load_state_dict_tag),
    "state-dict tag user_content.pt": Planted("state_dicts", in_file("user_content.pt", with_exploit("note")),
                                              "user_content.pt", load_state_dict_tag),
    # import_xla: rank 1's file of two
    "import_xla rank file": Planted("xla", in_file(RANK1, in_base_state), "dp_rank_01", load_xla_files),
    # import_torch: the index and a record
    "import_torch .metadata": Planted("torch", lambda d, m, s: native_index(d, m), ".metadata", load_native),
    "import_torch record": Planted("torch", lambda d, m, s: native_record(d, m), "__0_0.distcp", load_native),
    # a training loop's optimizer file: accelerate's load_state reads it (read_reference)
    "accelerate optimizer.bin": Planted("nxd_smp", reference_file, "optimizer.bin", load_state, loop_folder),
}


def assert_refused(error: BaseException, file: str, asked: str = "posix.mkdir") -> None:
    text = str(error)
    assert file in text and asked in text, text


# ---------------------------------------------------------------- the pickled files still read
@pytest.mark.parametrize("name", sorted(PLANTED))
def test_every_pickled_file_refuses_the_exploit_and_changes_nothing(sources, tmp_path, marker, name):
    case = PLANTED[name]
    path = case.make(sources, tmp_path, marker)
    model, opt, scheduler = live_sequential()
    before = snapshot(model, opt, scheduler)
    with pytest.raises(CheckpointError) as refused:
        case.load(path, model, opt, scheduler)
    assert_refused(refused.value, case.file)
    assert not changes(before, model, opt, scheduler)


def test_the_crafting_keeps_every_folder_loadable(sources, tmp_path):
    """The control: each entry point loads its healthy folder, the xser files written again as the
    plants write them included (so each refusal above is the loader's); and the exploit runs where
    a loader unpickles freely (so it is a real one)."""
    cases = [(source, load, lambda path: None) for source, load in (
        ("nxd", load_tag), ("state_dicts", load_state_dict_tag), ("xla", load_xla_files), ("torch", load_native))]
    cases.append(("xser", load_tag, lambda tag: (save_xser(dict(sources.weights), tag / MODEL),
                                                 save_xser(dict(sources.optimizer), tag / OPTIM))))
    for source, load, rewrite in cases:
        path = copy_of(sources, source, tmp_path / source)
        rewrite(path)
        model, opt, scheduler = live_sequential()
        before = snapshot(model, opt, scheduler)
        load(path, model, opt, scheduler)
        assert changes(before, model, opt, scheduler), f"{source}: the load changed nothing"
    ran = tmp_path / "ran"
    torch.load(io.BytesIO(torch_saved({"note": Exploit(str(ran))})), weights_only=False)
    assert ran.is_dir()


def test_nxd_trainings_dicts_to_fill_stay_empty(sources, tmp_path, marker):
    """NxD Training resumes with ``load_checkpoint(dir, tag, model={}, optimizer={})``: a state-dict
    tag's planted file is refused, the dicts untouched."""
    for name in ("state-dict tag optimizer file", "state-dict tag user_content.pt"):
        path = PLANTED[name].make(sources, tmp_path / name.replace(" ", "_"), marker)
        model_sd: dict = {}
        optimizer_sd: dict = {}
        with pytest.raises(CheckpointError) as refused:
            load_checkpoint(path.parent, path.name, model=model_sd, optimizer=optimizer_sd)
        assert_refused(refused.value, PLANTED[name].file)
        assert model_sd == {} and optimizer_sd == {}


def test_read_reference_refuses_the_exploit(sources, tmp_path, marker):
    from nxd_smp.interop.loop_checkpoints import read_reference

    folder = PLANTED["accelerate optimizer.bin"].make(sources, tmp_path, marker)
    with pytest.raises(CheckpointError) as refused:
        read_reference(folder / "optimizer.bin")
    assert_refused(refused.value, "optimizer.bin")


def test_a_users_own_class_is_refused_even_where_torch_would_allow_it(sources, tmp_path):
    """torch.load(weights_only=True) admits a class once allowed with add_safe_globals; nxd_smp's
    reader admits what a state dict is and nothing a process-wide list adds (round two): nxd_smp's
    own format refuses the object when it is saved, and NxD's user_content.pt holding one is refused
    on load."""
    model, opt, scheduler = live_sequential()
    with pytest.raises(TypeError, match="Counter"):
        save_checkpoint(tmp_path / "c", model=model, optimizer=opt, extra={"counter": Counter(7)})
    assert not os.path.lexists(tmp_path / "c")
    tag = copy_of(sources, "nxd", tmp_path)
    (tag / "user_content.pt").write_bytes(torch_saved({"step": 2, "counter": Counter(7)}))
    before = snapshot(model, opt, scheduler)
    with torch.serialization.safe_globals([Counter]):
        assert torch.load(tag / "user_content.pt", weights_only=True)["counter"].n == 7  # torch allows it
        with pytest.raises(CheckpointError, match="user_content.pt.*Counter"):
            load_tag(tag, model, opt, scheduler)
    assert not changes(before, model, opt, scheduler)


# ---------------------------------------------------------------- nxd_smp's own format: no pickle
def test_code_in_user_content_is_refused_when_it_is_saved(tmp_path, marker):
    model, opt, _ = live_sequential()
    with pytest.raises(TypeError, match="Exploit.*never a pickle"):
        save_checkpoint(tmp_path / "extra", model=model, optimizer=opt, extra={"step": 1, "note": Exploit(marker)})
    with pytest.raises(TypeError, match="sampler.state_dict.*Exploit"):
        save_checkpoint(tmp_path / "stateful", model=model, optimizer=opt, stateful={"sampler": HoldsAnExploit(marker)})
    # NxD Training's call shape writes torch.save files: what the strict reader would refuse at the load is
    # refused at the save, before anything is written
    with pytest.raises(TypeError, match="nothing was saved.*user_content"):
        save_checkpoint(tmp_path / "run", "t1", model=model.state_dict(), optimizer=opt.state_dict(),
                        user_content={"step": 1, "note": Exploit(marker)})
    assert not list(tmp_path.iterdir()) and not os.path.exists(marker)


IN_JSON = ("extra.json", "nxd_smp_meta.json")


@pytest.fixture
def pickled_json(sources, tmp_path, marker) -> dict[str, Path]:
    """nxd_smp checkpoints with the exploit's pickle in one typed-JSON file each (resealed)."""
    made = {}
    for name in IN_JSON:
        made[name] = copy_of(sources, "nxd_smp", tmp_path / name)
        pickle_in_json(made[name], name, marker)
    return made


@pytest.mark.parametrize("name", IN_JSON)
def test_a_pickle_in_typed_json_is_refused_by_the_load_and_changes_nothing(pickled_json, name):
    model, opt, scheduler = live_sequential()
    before = snapshot(model, opt, scheduler)
    with pytest.raises(CheckpointError) as refused:
        load_tag(pickled_json[name], model, opt, scheduler)
    assert_refused(refused.value, name, "$pickle")
    assert not changes(before, model, opt, scheduler)


@pytest.mark.parametrize("name", IN_JSON)
@pytest.mark.parametrize("tool", ["inspect", "read", "consolidate"])
def test_the_offline_tools_refuse_a_pickle_in_typed_json(pickled_json, name, tool, tmp_path):
    with pytest.raises(CheckpointError) as refused:
        if tool == "inspect":
            inspect_checkpoint(pickled_json[name])
        elif tool == "read":
            read_checkpoint(pickled_json[name])
        else:
            consolidate(pickled_json[name], tmp_path / "out.pt")
    assert_refused(refused.value, name, "$pickle")
    assert not (tmp_path / "out.pt").exists()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return run_python(["-m", "nxd_smp", *args], cwd=ROOT, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("command", ["inspect", "consolidate"])
def test_the_command_line_refuses_a_pickle_in_typed_json(pickled_json, command, tmp_path):
    args = [str(pickled_json["extra.json"])] + ([str(tmp_path / "out.pt")] if command == "consolidate" else [])
    proc = run_cli(command, *args)
    assert proc.returncode == 2 and "extra.json" in proc.stderr and "$pickle" in proc.stderr, proc.stderr
    assert not (tmp_path / "out.pt").exists()


def as_earlier_format(path: Path, fmt: int, marker: str) -> None:
    """The checkpoint ``path`` made to look as format ``fmt`` did: its completion record saying so,
    and listing an ``extra.pt`` (format 2's pickled small file) that holds the exploit."""
    version = path.resolve()
    (version / "extra.pt").write_bytes(torch_saved({"extra": {"note": Exploit(marker)}, "objects": {}}))
    reseal(version, "extra.pt")
    record = json.loads((version / "COMPLETE.json").read_text())
    (version / "COMPLETE.json").write_text(json.dumps({**record, "format": f"nxd_smp.checkpoint/{fmt}"}))


@pytest.mark.parametrize("fmt", [1, 2])
def test_the_pre_release_formats_are_refused_by_name_unread(sources, tmp_path, marker, fmt):
    path = copy_of(sources, "nxd_smp", tmp_path)
    as_earlier_format(path, fmt, marker)
    model, opt, scheduler = live_sequential()
    before = snapshot(model, opt, scheduler)
    with pytest.raises(CheckpointError, match=f"format nxd_smp.checkpoint/{fmt}, from before the first release"):
        load_tag(path, model, opt, scheduler)
    assert not changes(before, model, opt, scheduler)
    if fmt == 2:
        proc = run_cli("inspect", str(path))
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and "nxd_smp.checkpoint/2" in lines[0] \
            and "before the first release" in lines[0], proc.stderr


# ---------------------------------------------------------------- offline tools are process-local
def one_rank_uses_the_tools(rank: int, world: int, path: str, out: str) -> dict:
    """Rank 0 calls every offline tool while rank 1 waits at a barrier (as users of torch's
    ZeroRedundancyOptimizer consolidate on one rank). A tool that joined a collective would
    leave rank 1 waiting past the barrier's timeout."""
    from datetime import timedelta

    done = {}
    if rank == 0:
        done["inspect"] = inspect_checkpoint(path)["optimizer"]["dp_size_written_at"]
        done["read"] = sorted(read_checkpoint(path)["model"])
        consolidate(path, os.path.join(out, "full.pt"))
        done["export"] = len(export_xla(path, os.path.join(out, "xla"), dp_size=2))
    dist.monitored_barrier(timeout=timedelta(seconds=60))
    return done


def saved_at_dp2(rank: int, world: int, path: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)).to(torch.bfloat16)
    opt = Zero1Optimizer(model.parameters(), torch.optim.SGD, momentum=0.9, lr=0.1)
    model(torch.ones(2, 6, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    save_checkpoint(path, model=model, optimizer=opt)


def test_one_rank_runs_the_offline_tools_while_the_other_waits(tmp_path):
    path = str(tmp_path / "c")
    run_ranks(2, saved_at_dp2, path)
    done = run_ranks(2, one_rank_uses_the_tools, path, str(tmp_path))
    assert done[0]["inspect"] == 2 and done[0]["export"] == 2 and "0.weight" in done[0]["read"]
    assert (tmp_path / "full.pt").exists() and done[1] == {}
