"""A checkpoint is data that strangers hand you (DESIGN §5): every loader meets folders crafted
to hurt the process that loads them, and refuses each one cleanly.

The attacker writes a folder of a few KB and knows the formats: nxd_smp's own (format 3: a JSON
index of raw entries, raw data files, the typed-JSON ``nxd_smp_meta.json`` and ``extra.json`` and
a completion record the attacker updates to match, so every integrity check passes), NxD's tag
folders (plain and xser: pickled model, optimizer, ``scheduler.pt`` and ``user_content.pt``
files), a native DCP directory (``import_torch``: a pickled ``.metadata`` and ``torch.save``
records) and torch_xla's per-rank files (``import_xla``). (nxd_smp's pre-release formats 1 and 2
are refused by name, unread: test_checkpoint_safety.py.) Each folder here starts as a healthy
one (built once for the module) with one edit: paths that lead outside the folder (``/dev/zero``,
``../``, absolute paths, symbolic links), a FIFO where a file belongs, sizes, shapes and piece
ranges that claim gigabytes, pickles that allocate by a number they give (``bytearray(n)``,
``torch.Tensor(n)``, an expanded device-tensor rebuild), shared-reference bombs, zip records named
twice, tensors that are expanded, quantized, sparse or on the meta device, optimizer state of the
wrong kind (0-dim moments, no ``step``, a string), and hyperparameters or scheduler state of the
wrong type or with keys that overwrite the live objects' own (``params``, ``optimizer``).

Every load must end in a ``CheckpointError`` that names the offending file and field, and leave
the model, the masters, the inner optimizer's state and groups, the param groups and the
scheduler exactly as they were. What could crash the process (0-dim moments, then a step; two
parses of one zip), block it (a FIFO) or take gigabytes runs in a child process (forked from the
tests' preloaded server: one per test worker, started again after a case that ends it) with a
time limit per case, which measures each
load's peak resident memory: a few KB that claim gigabytes may grow it by 100 MB at most. At DP 2
on gloo, an error no check expects on one rank is a ``CheckpointError`` on both, within seconds.
``python -m nxd_smp inspect`` of a hostile folder is one ``error:`` line and exit code 2.

Each index record is used once, in every reader: an index may list one record many times for a few
bytes a listing, and a reader that counts, allocates or installs per listing grows by what the listings
claim, not by what the folder holds. Each reader meets an index that repeats a record:

* DCP (``import_torch``): one ``ChunkStorageMetadata`` listed 300,000 times by pickle's memo (about
  600 KB of ``.metadata``: the old reader counted each listing, then allocated the tensor and a mask of
  the sum, about a gigabyte, before it found the overlap; measured in the child), two chunks at one
  offset, chunks that overlap, and shapes whose size arithmetic overflows;
* nxd_smp's own folders (``load_checkpoint``, ``inspect_checkpoint``): a key given twice in a JSON
  object of the index, the metadata, ``extra.json`` and the completion record (``json.loads`` keeps the
  last value silently), a parameter's piece listed twice, a ``{"$tensor": key}`` referred to twice;
* NxD's tag folders, plain and xser, and NxD Training's state-dict tags: a parameter number listed twice
  in a param group's ``params`` or in two groups, one record (one tensor, overlapping views of one
  storage, one xser tensor id, two xser tensor files that are one file) for two moments;
* torch_xla's per-rank files (``import_xla``): a parameter number listed twice, one file listed twice
  or under two names;
* the strict reader under each of them: a zip record named twice, a shared-reference bomb.

A healthy folder of each kind, and each crafting helper with its record listed once, still loads; at DP
2 on gloo a repeated record in rank 1's folder alone (``import_torch``, ``import_xla``: the entry
points that read the path each rank is given) is a ``CheckpointError`` on both ranks within seconds.

The exports' refusals (outputs that must never be overwritten or written through a link) are
tested with the CLI's outputs, not here.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import traceback
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from nxd_smp import CheckpointError
from nxd_smp.checkpointing.dcp_index import read_metadata
from nxd_smp.checkpointing.files import Folder
from tests.crafted import (
    RANK_FILE,
    TAG,
    XserReference,
    index_of,
    native_run,
    reseal,
    save_native,
    save_xser,
    trained_run,
    write_nxd_tag,
)
from tests.distributed import run_python, run_ranks
from tests.hostile_worker import (
    assert_unchanged,
    changes,
    each_rank_loads_its_own,
    live,
    load,
    one_rank_fails_unexpectedly,
    snapshot,
)

ROOT = Path(__file__).resolve().parents[2]
META, EXTRA, INDEX = "nxd_smp_meta.json", "extra.json", "nxd_smp_index.json"  # nxd_smp's format 3
SCHEDULER_FILE, USER_CONTENT_FILE = "scheduler.pt", "user_content.pt"  # NxD's tag folders
DCP_INDEX = ".metadata"  # import_torch's pickled index
NATIVE_FILES = (DCP_INDEX, "__0_0.distcp")  # import_torch: the index or the data file holding the record
GROWTH_LIMIT_MIB = 100
CASE_LIMIT_S = 10  # a load of these folders takes well under a second


# ---------------------------------------------------------------- healthy folders (the formats: tests/crafted.py)
@dataclass
class Healthy:
    """The healthy folders every hostile one starts from, and what they hold."""

    root: Path
    native: tuple[dict, dict]  # the native run's model and optimizer state dicts
    weights: dict[str, dict[str, torch.Tensor]]  # by source: the model weights a load installs


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> Healthy:
    """One trained run saved in every format read: ``nxd_smp`` (format 3, as nxd_smp writes it),
    ``nxd`` and ``xser`` (NxD's tag folders, optimizer files from ``export_xla``), ``xla`` (those
    files alone) and ``torch`` (a native fp32 run's DCP directory)."""
    from nxd_smp.interop.torch_xla import export_xla

    root = tmp_path_factory.mktemp("healthy")
    model, opt, scheduler = trained_run(root)
    (xla_file,) = export_xla(root / "nxd_smp" / "ckpt", root / "xla", dp_size=1)
    optim_state = torch.load(xla_file, weights_only=True)
    for layout in ("nxd", "xser"):
        write_nxd_tag(root / layout, model.state_dict(), optim_state, scheduler.state_dict(), xser=layout == "xser")
    msd, osd = native_run(root)

    ours = {k: v.clone() for k, v in model.state_dict().items()}
    weights = {"nxd_smp": ours, "nxd": ours, "xser": ours, "torch": {k: v.to(torch.bfloat16) for k, v in msd.items()}}
    return Healthy(root, (msd, osd), weights)


def copy_of(healthy: Healthy, source: str, where: Path) -> Path:
    """A copy of the healthy ``source`` folder under ``where``: the path its loader takes."""
    shutil.copytree(healthy.root / source, where / source, symlinks=True)
    if source == "nxd_smp":
        return where / source / "ckpt"
    if source in ("nxd", "xser"):
        return where / source / TAG
    return where / source


# ---------------------------------------------------------------- crafting: nxd_smp's format 3
def edit_json(path: Path, name: str, edit: Callable) -> None:
    """Rewrite the JSON file ``name`` of the checkpoint ``path`` with ``edit`` applied to its parsed
    (still encoded: tuples as ``{"$tuple": [...]}``) value in place, resealed."""
    version = path.resolve()
    value = json.loads((version / name).read_text())
    edit(value)
    (version / name).write_text(json.dumps(value))
    reseal(version, name)


def json_edit(name: str, edit: Callable) -> Callable:
    return lambda path, healthy: edit_json(path, name, edit)


def entry(key: str, **fields: Any) -> Callable:
    """An index edit: ``key``'s entry ``[file, offset, length, crc32, dtype, shape]`` with ``fields``
    changed."""
    names = ("file", "offset", "length", "crc32", "dtype", "shape")

    def edit(index) -> None:
        found = index["entries"][key]
        for field, value in fields.items():
            found[names.index(field)] = value
    return json_edit(INDEX, edit)


def set_entry(path: Path, key: str, tensor: torch.Tensor) -> None:
    """The index entry ``key`` becomes ``tensor``: its bytes appended to ``__0_0.bin``, the entry
    pointing at them with their CRC-32, everything resealed (only the loader's checks of the value
    itself stand in the way)."""
    version = path.resolve()
    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    with open(version / "__0_0.bin", "ab") as f:
        offset = f.tell()
        f.write(data)
    index = json.loads((version / INDEX).read_text())
    index["entries"][key] = ["__0_0.bin", offset, len(data), zlib.crc32(data), str(tensor.dtype).removeprefix("torch."),
                             list(tensor.shape)]
    (version / INDEX).write_text(json.dumps(index))
    reseal(version, INDEX, "__0_0.bin")


def drop_entries(path: Path, which: Callable[[str], bool]) -> None:
    """The index entries whose keys ``which`` picks removed from the index (their bytes stay)."""
    def edit(index) -> None:
        for key in [k for k in index["entries"] if which(k)]:
            del index["entries"][key]
    edit_json(path, INDEX, edit)


def steps(value: float) -> Callable:
    """Every bucket's ``step`` (its first parameter's 0-dim entry) set to ``value``."""
    def craft(path: Path, healthy: Healthy) -> None:
        index = json.loads((path.resolve() / INDEX).read_text())["entries"]
        for key in [k for k in index if k.endswith("/step")]:
            set_entry(path, key, torch.tensor(value, dtype=torch.float32))
    return craft


def hyper(group: int, **values: Any) -> Callable:
    """The metadata: param group ``group``'s hyperparameters with ``values`` (encoded) set."""
    return json_edit(META, lambda meta: meta["optimizer"]["groups"][group]["hyper"].update(values))


def scheduler_values(**values: Any) -> Callable:
    """``extra.json``: the scheduler's saved state with ``values`` (encoded) set."""
    return json_edit(EXTRA, lambda saved: saved["objects"]["scheduler"].update(values))


def zero_dim_moments(path: Path, healthy: Healthy) -> None:
    """``exp_avg`` saved as 0-dim state, like ``step``: its pieces gone, a 0-dim entry per
    parameter, the metadata listing it among the scalars."""
    drop_entries(path, lambda key: "/exp_avg/" in key)
    found = [k for k in json.loads((path.resolve() / INDEX).read_text())["entries"] if k.endswith("/step")]
    for key in found:
        set_entry(path, key.removesuffix("step") + "exp_avg", torch.tensor(0.0))
    edit_json(path, META, lambda meta: meta["optimizer"].update(tensor_keys=["exp_avg_sq"],
                                                                scalar_keys=["exp_avg", "step"]))


def no_step(path: Path, healthy: Healthy) -> None:
    """No ``step`` in the optimizer state: its entries gone from the index and the metadata."""
    drop_entries(path, lambda key: key.endswith("/step"))
    edit_json(path, META, lambda meta: meta["optimizer"].update(scalar_keys=[]))


def linked_data_file(path: Path, healthy: Healthy) -> None:
    version = path.resolve()
    moved_outside(version / "__0_0.bin", version.parent.parent / "elsewhere.bin")


def sealed_fifo(name: str) -> Callable:
    """The file ``name`` of the checkpoint a FIFO, the completion record vouching for it (as an
    empty file)."""
    def craft(path: Path, healthy: Healthy) -> None:
        fifo(path.resolve() / name)
        reseal(path.resolve(), name)
    return craft


# ---------------------------------------------------------------- crafting: NxD's tag folders and torch_xla's files
def edit_file(f: Path, edit: Callable) -> None:
    """Rewrite a plain ``torch.save`` file with ``edit`` applied to its value in place."""
    value = torch.load(f, weights_only=True)
    edit(value)
    torch.save(value, f)


def edit_nxd(tag: Path, kind: str, edit: Callable) -> None:
    """Rewrite NxD's ``<kind>/dp_rank_00_tp_rank_00_pp_rank_00.pt`` (plain) with ``edit`` applied."""
    edit_file(tag / kind / RANK_FILE, edit)


def nxd_optim(edit: Callable) -> Callable:
    return lambda tag, healthy: edit_nxd(tag, "optim", edit)


def nxd_scheduler(value_of: Callable) -> Callable:
    """NxD's ``scheduler.pt`` replaced by ``value_of(its state)``."""
    def craft(tag: Path, healthy: Healthy) -> None:
        torch.save(value_of(torch.load(tag / SCHEDULER_FILE, weights_only=True)), tag / SCHEDULER_FILE)
    return craft


def nxd_user_content(value: Any) -> Callable:
    """NxD's ``user_content.pt`` replaced by ``value`` (torch.save pickles what it is given)."""
    return lambda tag, healthy: torch.save(value, tag / USER_CONTENT_FILE)


def xser_tensors(tag: Path) -> Path:
    return tag / "model" / f"{RANK_FILE}.tensors"


def base_state(edit: Callable) -> Callable:
    """An NxD optimizer-file edit: ``edit(entry)`` on every parameter's ``base_state`` entry."""
    def each(state) -> None:
        for found in state["base_state"].values():
            edit(found)
    return each


def overflowing(moment: torch.Tensor) -> torch.Tensor:
    """``moment`` as float64 with one value (1e300) that no fp32 shard holds."""
    out = moment.double().clone()
    out.reshape(-1)[0] = 1e300
    return out


def without_masters(tag: Path) -> None:
    """NxD's optimizer file without master weights (the loader then rebuilds them): the weights
    in the model file are the only source of the parameters."""
    edit_nxd(tag, "optim", lambda state: state.pop("sharded_master_weights"))


def weight(value: torch.Tensor) -> Callable:
    """A crafting step for NxD folders: ``2.bias``, the last of the model's 4 parameters, becomes
    ``value`` (of its shape), with no master weights to contradict it."""
    def craft(tag: Path, healthy: Healthy) -> None:
        without_masters(tag)
        edit_nxd(tag, "model", lambda state: state.__setitem__("2.bias", value))
    return craft


def xser_model(**more: Any) -> Callable:
    """The xser model file written again by ``save_xser`` (its tensors as files, references in
    their place) with ``more`` entries after the weights."""
    return lambda tag, healthy: save_xser({**healthy.weights["xser"], **more}, tag / "model" / RANK_FILE)


# ---------------------------------------------------------------- crafting: import_torch's DCP directory
def edit_index(directory: Path, *edits: Callable) -> None:
    """Rewrite the DCP index of ``directory`` with ``edits`` applied to its ``Metadata``, pickled as
    DCP's ``FileSystemWriter`` pickles it."""
    with Folder.open(directory) as folder:
        metadata = read_metadata(folder)
    for edit in edits:
        edit(metadata)
    (directory / DCP_INDEX).write_bytes(pickle.dumps(metadata))


def index_edit(*edits: Callable) -> Callable:
    return lambda directory, healthy: edit_index(directory, *edits)


def retarget(key: str, **changes: Any) -> Callable:
    """An index edit: ``key``'s storage record (a ``_StorageInfo``) with ``changes``."""
    def edit(metadata) -> None:
        index = index_of(metadata, key)
        metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], **changes)
    return edit


def claim(key: str, shape: tuple[int, ...], dtype: Any = None) -> Callable:
    """An index edit: ``key`` claims to be a tensor of ``shape`` (and ``dtype``: anything, a string
    say) in one chunk."""
    def edit(metadata) -> None:
        old = metadata.state_dict_metadata[key]
        properties = old.properties if dtype is None else dataclasses.replace(old.properties, dtype=dtype)
        size = torch.Size(shape)
        metadata.state_dict_metadata[key] = TensorStorageMetadata(
            properties, size, [ChunkStorageMetadata(torch.Size([0] * len(shape)), size)])
    return edit


def resave_native(directory: Path, healthy: Healthy, edit: Callable) -> None:
    """The native run saved again into ``directory`` with ``edit(model_sd, optim_sd)`` applied to copies."""
    msd, osd = copy.deepcopy(healthy.native)
    edit(msd, osd)
    shutil.rmtree(directory)
    save_native(directory, msd, osd)


def native_edit(edit: Callable) -> Callable:
    return lambda directory, healthy: resave_native(directory, healthy, edit)


def native_state(edit: Callable) -> Callable:
    """The native run saved again with ``edit(entry)`` on every parameter's optimizer state."""
    def each(msd, osd) -> None:
        for found in osd["state"].values():
            edit(found)
    return native_edit(each)


def expanded_group_entry(directory: Path, healthy: Healthy) -> None:
    """Param group 0's ``lr`` as a tensor entry of 2**28 elements whose record (appended to the
    data file) is a stride-0 expanded tensor: 1.5 KB on disk."""
    record = io.BytesIO()
    torch.save(torch.zeros(1).expand(2**28), record)
    data_file = directory / "__0_0.distcp"
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(record.getvalue())
    key, size = "optim.param_groups.0.lr", torch.Size([2**28])

    def edit(metadata) -> None:
        del metadata.storage_data[index_of(metadata, key)]
        metadata.state_dict_metadata[key] = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), size, [ChunkStorageMetadata(torch.Size([0]), size)])
        metadata.storage_data[MetadataIndex(key, torch.Size([0]), 0)] = _StorageInfo(
            "__0_0.distcp", offset, len(record.getvalue()))
    edit_index(directory, edit)


def dot_dot_record(directory: Path, healthy: Healthy) -> None:
    """``model.0.bias`` read from ``../outside.distcp``: a copy of its own data file, so offset and
    length match and only the path is wrong."""
    shutil.copy(directory / "__0_0.distcp", directory.parent / "outside.distcp")
    edit_index(directory, retarget("model.0.bias", relative_path="../outside.distcp"))


def absolute_record(directory: Path, healthy: Healthy) -> None:
    """``model.0.bias`` read by an absolute path from a ``torch.save`` file outside the folder,
    which holds a tensor of its shape and dtype."""
    outside = directory.parent / "lin1_bias.pt"
    torch.save(torch.full((13,), 7.0), outside)
    edit_index(directory, retarget("model.0.bias", relative_path=str(outside), offset=0,
                                   length=outside.stat().st_size))


# ---------------------------------------------------------------- crafting: any folder
def moved_outside(path: Path, outside: Path) -> None:
    """``path`` moved to ``outside`` and a symbolic link to it left in its place."""
    os.replace(path, outside)
    os.symlink(outside, path)


def fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


class Allocates:
    """Unpickles as ``bytearray(n)``: a few bytes in the file, ``n`` in memory (``bytearray`` is
    on torch's ``weights_only`` allow-list)."""

    def __init__(self, n: int):
        self.n = n

    def __reduce__(self):
        return (bytearray, (self.n,))


def duplicate_record(file: Path) -> None:
    """A second zip record under the name of ``file``'s largest data record (its pickle if it holds
    no tensor), 4 KiB of other bytes: one parser sizes one record and another reads the other."""
    import zipfile

    with zipfile.ZipFile(file) as z:
        records = [r for r in z.infolist() if "/data/" in r.filename] or [r for r in z.infolist()
                                                                           if r.filename.endswith("/data.pkl")]
        name = max(records, key=lambda r: r.file_size).filename
    with warnings.catch_warnings(), zipfile.ZipFile(file, "a", zipfile.ZIP_STORED) as z:
        warnings.simplefilter("ignore", UserWarning)  # (zipfile warns of the duplicate name: the point)
        z.writestr(name, bytes(4096))


def device_rebuild() -> Any:
    """torch's ``_rebuild_device_tensor_from_cpu_tensor`` of a stride-0 view of 2**28 elements: a
    few bytes, then a gigabyte when torch copies it."""
    from tests.crafted import Reduces

    return Reduces(torch._utils._rebuild_device_tensor_from_cpu_tensor, torch.zeros(1).expand(2**28),
                   torch.float32, "cpu", False)


def tensor_of_a_number(file: Path) -> None:
    """``file`` replaced by a torch.save archive of ``{"2.bias": torch.Tensor(2**29)}`` by NEWOBJ:
    2 GiB of uninitialised heap memory as a weight (torch's pickler never writes it; a hand does)."""
    from tests.crafted import archive

    file.write_bytes(archive(b"\x80\x02}(X\x06\x00\x00\x002.biasctorch\nTensor\nJ\x00\x00\x00\x20\x85\x81u."))


def bomb(levels: int) -> list:
    """``x = [x, x]`` ``levels`` deep: a few hundred bytes of pickle, 2**levels paths."""
    from tests.crafted import bomb as shared

    return shared(levels)


#: The beginnings of the problems a judge reports (``names_problems``, the memory test).
UNNAMED, GREW = "it names none of the files", "the peak resident memory grew"


@dataclass(frozen=True)
class Attack:
    """One hostile folder: the healthy ``source`` it starts from, the ``craft`` applied to the
    copy (``craft(path, healthy)``), the ``loader`` that meets it, and what the refusal names: one
    of ``files`` (basenames) and ``field`` (None where the file itself is the problem)."""

    source: str
    craft: Callable[[Path, Healthy], None]
    files: tuple[str, ...]
    field: str | None
    loader: str = ""

    def load_with(self) -> str:
        return self.loader or {"xser": "nxd"}.get(self.source, self.source)


def make(attack: Attack, healthy: Healthy, where: Path) -> Path:
    path = copy_of(healthy, attack.source, where)
    attack.craft(path, healthy)
    return path


# ---------------------------------------------------------------- the attacks
ZERO_DIM = {  # 0-dim AdamW moments, then a step: memory corruption if accepted (a child process)
    "nxd_smp": Attack("nxd_smp", zero_dim_moments, (META, INDEX), "exp_avg"),
    "nxd": Attack("nxd", nxd_optim(base_state(lambda e: e.__setitem__("exp_avg", torch.tensor(0.0)))),
                  (RANK_FILE,), "exp_avg"),
    "xla": Attack("xla", lambda d, h: edit_file(d / RANK_FILE, base_state(
        lambda e: e.__setitem__("exp_avg", torch.tensor(0.0)))), (RANK_FILE,), "exp_avg"),
    "torch": Attack("torch", native_state(lambda e: e.__setitem__("exp_avg", torch.tensor(0.0))),
                    NATIVE_FILES, "exp_avg"),
}

TWO_PARSES = {  # a record name twice in the zip: heap bytes as weights, a step past a buffer (a child process)
    "nxd optimizer file": Attack("nxd", lambda tag, h: duplicate_record(tag / "optim" / RANK_FILE), (RANK_FILE,), None),
    "nxd model file": Attack("nxd", lambda tag, h: duplicate_record(tag / "model" / RANK_FILE), (RANK_FILE,), None),
    "nxd user_content.pt": Attack("nxd", lambda tag, h: duplicate_record(tag / USER_CONTENT_FILE),
                                  (USER_CONTENT_FILE,), None),
    "nxd xser tensor_3.pt": Attack("xser", lambda tag, h: duplicate_record(xser_tensors(tag) / "tensor_3.pt"),
                                   ("tensor_3.pt",), None),
    "xla rank file": Attack("xla", lambda d, h: duplicate_record(d / RANK_FILE), (RANK_FILE,), None),
}

FIFOS = {  # a FIFO where a file belongs: opening it blocks forever (a child process)
    "nxd_smp __0_0.bin": Attack("nxd_smp", sealed_fifo("__0_0.bin"), ("__0_0.bin",), None),
    "nxd_smp nxd_smp_meta.json": Attack("nxd_smp", sealed_fifo(META), (META,), None),
    "nxd_smp nxd_smp_index.json": Attack("nxd_smp", sealed_fifo(INDEX), (INDEX,), None),
    "nxd scheduler.pt": Attack("nxd", lambda tag, h: fifo(tag / SCHEDULER_FILE), (SCHEDULER_FILE,), None),
    "nxd xser tensor_3.pt": Attack("xser", lambda tag, h: fifo(xser_tensors(tag) / "tensor_3.pt"),
                                   ("tensor_3.pt",), None),
    "torch __0_0.distcp": Attack("torch", lambda d, h: fifo(d / "__0_0.distcp"), ("__0_0.distcp",), None),
    "torch .metadata": Attack("torch", lambda d, h: fifo(d / DCP_INDEX), (DCP_INDEX,), None),
}

OUTSIDE = {  # every path resolved inside the folder: nothing absolute, no "..", no link leading out
    "nxd_smp /dev/zero": Attack("nxd_smp", entry("model/0.bias", file="/dev/zero"), (INDEX,), "0.bias"),
    "nxd_smp ../outside.bin": Attack("nxd_smp", entry("model/0.bias", file="../outside.bin"), (INDEX,), "0.bias"),
    "nxd_smp linked __0_0.bin": Attack("nxd_smp", linked_data_file, ("__0_0.bin",), None),
    "nxd_smp linked extra.json": Attack("nxd_smp", lambda p, h: moved_outside(
        p.resolve() / EXTRA, p.resolve().parent.parent / "elsewhere.json"), (EXTRA,), None),
    "nxd linked user_content.pt": Attack("nxd", lambda tag, h: moved_outside(
        tag / USER_CONTENT_FILE, tag.parent.parent / "elsewhere.pt"), (USER_CONTENT_FILE,), None),
    "nxd xser linked tensor_3.pt": Attack("xser", lambda tag, h: moved_outside(
        xser_tensors(tag) / "tensor_3.pt", tag.parent.parent / "elsewhere.pt"), ("tensor_3.pt",), None),
    "nxd xser linked .tensors": Attack("xser", lambda tag, h: moved_outside(
        xser_tensors(tag), tag.parent.parent / "elsewhere.tensors"), (RANK_FILE,), None),
    "torch /dev/zero": Attack("torch", index_edit(retarget("model.0.bias", relative_path="/dev/zero")),
                              (DCP_INDEX,), "0.bias"),
    "torch ../outside.distcp": Attack("torch", dot_dot_record, (DCP_INDEX,), "0.bias"),
    "torch absolute relative_path": Attack("torch", absolute_record, (DCP_INDEX,), "0.bias"),
    "torch linked __0_0.distcp": Attack("torch", lambda d, h: moved_outside(
        d / "__0_0.distcp", d.parent / "elsewhere.distcp"), ("__0_0.distcp",), None),
}

MEMORY = {  # a few KB that claim gigabytes (a child process measures the peak)
    "read: an index entry of 2**28 elements on /dev/zero": Attack("nxd_smp", entry(
        "model/0.bias", file="/dev/zero", length=2**30, dtype="float32", shape=[2**28]), (INDEX,), "0.bias",
        loader="read"),
    "nxd_smp: a piece range (0, 2**28)": Attack("nxd_smp", json_edit(META, lambda meta: meta["optimizer"][
        "pieces"].__setitem__("0.bias", [[0, 2**28]])), (META,), "0.bias"),
    "nxd_smp: a tensor of 2**28 elements in extra.json": Attack("nxd_smp", lambda p, h: (
        set_entry(p, "small/0", torch.zeros(4)), entry("small/0", shape=[2**28])(p, h),
        edit_json(p, EXTRA, lambda saved: saved["extra"].__setitem__("blob", {"$tensor": "small/0"}))),
        (INDEX,), "small/0"),
    "nxd: stride-0 expanded base_state": Attack("nxd", nxd_optim(
        lambda state: state["base_state"][0].__setitem__("exp_avg", torch.zeros(1).expand(13, 2**24))),
        (RANK_FILE,), "exp_avg"),
    "nxd: torch.Tensor(2**29) by NEWOBJ as a weight": Attack("nxd", lambda tag, h: tensor_of_a_number(
        tag / "model" / RANK_FILE), (RANK_FILE,), "2.bias"),
    "nxd: bytearray(2**31) in user_content.pt": Attack("nxd", nxd_user_content(
        {"step": 2, "blob": Allocates(2**31)}), (USER_CONTENT_FILE,), "bytearray"),
    "nxd: a device-tensor rebuild in user_content.pt": Attack("nxd", nxd_user_content(
        {"step": device_rebuild()}), (USER_CONTENT_FILE,), "step"),
    "nxd: a device-tensor rebuild in scheduler.pt": Attack("nxd", nxd_scheduler(
        lambda state: {**state, "last_epoch": device_rebuild()}), (SCHEDULER_FILE,), "last_epoch"),
    "nxd: a shared-reference bomb in scheduler.pt": Attack("nxd", nxd_scheduler(
        lambda state: {**state, "bomb": bomb(40)}), (SCHEDULER_FILE,), None),
    "nxd xser: bytearray(2**31) in the model file": Attack("xser", xser_model(blob=Allocates(2**31)),
                                                           (RANK_FILE,), "bytearray"),
    "nxd xser: a device-tensor rebuild as a tensor file": Attack("xser", lambda tag, h: torch.save(
        device_rebuild(), xser_tensors(tag) / "tensor_3.pt"), ("tensor_3.pt",), "expanded"),
    "xla: a device-tensor rebuild as exp_avg": Attack("xla", lambda d, h: edit_file(d / RANK_FILE, base_state(
        lambda e: e.__setitem__("exp_avg", device_rebuild()))), (RANK_FILE,), "exp_avg"),
    "torch: a record length of 2 GiB": Attack("torch", index_edit(retarget("model.0.weight", length=2**31)),
                                              NATIVE_FILES, "0.weight"),
    "torch: an expanded tensor as lr": Attack("torch", expanded_group_entry, NATIVE_FILES, "lr"),
    "torch: an index entry of 2**28 elements": Attack("torch", index_edit(claim("model.0.bias", (2**28,))),
                                                      NATIVE_FILES, "0.bias"),
}

REFUSED_LATE = {  # refused before only after the live objects changed
    "nxd_smp: hyper not a dict": Attack("nxd_smp", json_edit(
        META, lambda meta: meta["optimizer"]["groups"][0].__setitem__("hyper", 7)), (META,), "hyper"),
    "nxd_smp: scheduler state 7": Attack("nxd_smp", json_edit(
        EXTRA, lambda saved: saved["objects"].__setitem__("scheduler", 7)), (EXTRA,), "scheduler"),
    "nxd: scheduler state 7": Attack("nxd", nxd_scheduler(lambda state: 7), (SCHEDULER_FILE,), "scheduler"),
    "nxd_smp: no step": Attack("nxd_smp", no_step, (META, INDEX), "step"),
    "nxd: no step": Attack("nxd", nxd_optim(base_state(lambda e: e.pop("step"))), (RANK_FILE,), "step"),
    "xla: no step": Attack("xla", lambda d, h: edit_file(d / RANK_FILE, base_state(lambda e: e.pop("step"))),
                           (RANK_FILE,), "step"),
    "torch: no step": Attack("torch", native_state(lambda e: e.pop("step")), NATIVE_FILES, "step"),
    "nxd: a quantized weight": Attack("nxd", weight(torch.quantize_per_tensor(torch.ones(6), 0.1, 0, torch.qint8)),
                                      (RANK_FILE,), "2.bias"),
    "nxd: a meta-device weight": Attack("nxd", weight(torch.empty(6, device="meta")), (RANK_FILE,), "2.bias"),
    "nxd: a sparse exp_avg": Attack("nxd", nxd_optim(base_state(
        lambda e: e.__setitem__("exp_avg", e["exp_avg"].to_sparse()))), (RANK_FILE,), "exp_avg"),
}

BAD_VALUES = {  # accepted before, or refused with a raw error instead of a CheckpointError
    # hyperparameters
    "nxd_smp: params in hyper": Attack("nxd_smp", hyper(0, params=["0.weight", "2.weight"]), (META,), "params"),
    "nxd_smp: lr a string": Attack("nxd_smp", hyper(0, lr="0.01"), (META,), "lr"),
    "nxd_smp: lr a tensor": Attack("nxd_smp", lambda p, h: (set_entry(p, "small/0", torch.zeros(4)), hyper(
        0, lr={"$tensor": "small/0"})(p, h)), (META,), "lr"),
    "nxd_smp: betas (1.0, 0.999)": Attack("nxd_smp", hyper(0, betas={"$tuple": [1.0, 0.999]}), (META,), "betas"),
    "nxd_smp: lr NaN": Attack("nxd_smp", hyper(0, lr={"$float": "nan"}), (META,), "lr"),
    "nxd_smp: eps -1": Attack("nxd_smp", hyper(1, eps=-1.0), (META,), "eps"),
    "nxd: lr an expanded tensor": Attack("nxd", nxd_optim(lambda state: state["param_groups"][0].__setitem__(
        "lr", torch.zeros(1).expand(2**28))), (RANK_FILE,), "lr"),
    "torch: lr a string": Attack("torch", native_edit(lambda msd, osd: osd["param_groups"][0].update(lr="0.01")),
                                 NATIVE_FILES, "lr"),
    # the optimizer's state
    "nxd_smp: step NaN": Attack("nxd_smp", steps(float("nan")), (INDEX, "__0_0.bin"), "step"),
    "nxd_smp: step -1": Attack("nxd_smp", steps(-1.0), (INDEX, "__0_0.bin"), "step"),
    "nxd_smp: step 1.5": Attack("nxd_smp", steps(1.5), (INDEX, "__0_0.bin"), "step"),
    "nxd: exp_avg a string": Attack("nxd", nxd_optim(base_state(lambda e: e.__setitem__("exp_avg", "x"))),
                                    (RANK_FILE,), "exp_avg"),
    "xla: exp_avg a string": Attack("xla", lambda d, h: edit_file(d / RANK_FILE, base_state(
        lambda e: e.__setitem__("exp_avg", "x"))), (RANK_FILE,), "exp_avg"),
    # a value that does not narrow into its fp32 shard (it became inf there, silently)
    "nxd: a float64 moment of 1e300": Attack("nxd", nxd_optim(base_state(lambda e: e.__setitem__(
        "exp_avg", overflowing(e["exp_avg"])))), (RANK_FILE,), "exp_avg"),
    "xla: a float64 moment of 1e300": Attack("xla", lambda d, h: edit_file(d / RANK_FILE, base_state(
        lambda e: e.__setitem__("exp_avg", overflowing(e["exp_avg"])))), (RANK_FILE,), "exp_avg"),
    "torch: a float64 moment of 1e300": Attack("torch", native_state(lambda e: e.__setitem__(
        "exp_avg", overflowing(e["exp_avg"]))), NATIVE_FILES, "exp_avg"),
    # the scheduler
    "nxd_smp: scheduler gamma NaN": Attack("nxd_smp", scheduler_values(gamma={"$float": "nan"}), (EXTRA,), "gamma"),
    "nxd_smp: scheduler step_size 0": Attack("nxd_smp", scheduler_values(step_size=0), (EXTRA,), "step_size"),
    "nxd_smp: scheduler with an optimizer": Attack("nxd_smp", scheduler_values(optimizer={"lr": 1.0}), (EXTRA,),
                                                   "optimizer"),
    "nxd: scheduler state with an optimizer": Attack("nxd", nxd_scheduler(
        lambda state: {**state, "optimizer": {"lr": 1.0}}), (SCHEDULER_FILE,), "optimizer"),
    # the weights
    "nxd: a float64 weight of 1e300": Attack("nxd", weight(torch.full((6,), 1e300, dtype=torch.float64)),
                                            (RANK_FILE,), "2.bias"),
    "nxd: an int64 weight": Attack("nxd", weight(torch.full((6,), 7, dtype=torch.int64)), (RANK_FILE,), "2.bias"),
    "nxd: a complex weight": Attack("nxd", weight(torch.full((6,), 1 + 2j, dtype=torch.complex64)),
                                    (RANK_FILE,), "2.bias"),
    # indexes: shapes, dtypes, lengths, overlaps
    "nxd_smp: a negative shape in the index": Attack("nxd_smp", entry("model/0.bias", shape=[-13]), (INDEX,),
                                                     "0.bias"),
    "read: a negative shape in the index": Attack("nxd_smp", entry("model/0.bias", shape=[-13]), (INDEX,), "0.bias",
                                                  loader="read"),
    "nxd_smp: a negative shape in the metadata": Attack("nxd_smp", json_edit(META, lambda meta: meta["model"][
        "0.bias"].__setitem__("shape", [-13])), (META,), "0.bias"),
    "torch: a negative shape in the index": Attack("torch", index_edit(claim("model.0.bias", (-13,))),
                                                   NATIVE_FILES, "0.bias"),
    "nxd_smp: a dtype that is no dtype": Attack("nxd_smp", entry("model/0.bias", dtype="object"), (INDEX,), "0.bias"),
    "torch: a dtype that is a string": Attack("torch", index_edit(claim("model.0.bias", (13,), "float32")),
                                              NATIVE_FILES, "0.bias"),
    "nxd_smp: a length that is not the tensor's": Attack("nxd_smp", lambda p, h: entry(
        "model/0.bias", length=json.loads((p.resolve() / INDEX).read_text())["entries"]["model/0.bias"][2] + 4)(p, h),
        (INDEX,), "0.bias"),
    "nxd_smp: overlapping entries": Attack("nxd_smp", lambda p, h: entry("model/0.bias", offset=json.loads(
        (p.resolve() / INDEX).read_text())["entries"]["model/0.weight"][1])(p, h), (INDEX,), "0.bias"),
    "nxd_smp: one file under two names, overlapping": Attack("nxd_smp", lambda p, h: entry(
        "model/0.bias", file="./__0_0.bin", offset=json.loads((p.resolve() / INDEX).read_text())["entries"][
            "model/0.weight"][1])(p, h), (INDEX,), "0.bias"),
    # typed JSON: encodings nxd_smp never writes
    "nxd_smp: an unknown tag": Attack("nxd_smp", json_edit(EXTRA, lambda saved: saved["extra"].__setitem__(
        "x", {"$pickle": "gASVAAAAAAAAAAA="})), (EXTRA,), "x"),
    "nxd_smp: extra refers to a model entry": Attack("nxd_smp", json_edit(EXTRA, lambda saved: saved[
        "extra"].__setitem__("w", {"$tensor": "model/0.bias"})), (EXTRA,), "model/0.bias"),
    "nxd_smp: a tensor referred to twice": Attack("nxd_smp", lambda p, h: (
        set_entry(p, "small/0", torch.zeros(4)), edit_json(p, EXTRA, lambda saved: saved["extra"].update(
            a={"$tensor": "small/0"}, b={"$tensor": "small/0"}))), (EXTRA,), "small/0"),
    "nxd_smp: a float that is a list": Attack("nxd_smp", json_edit(EXTRA, lambda saved: saved["extra"].__setitem__(
        "f", {"$float": [1]})), (EXTRA,), "'f'"),
    "nxd_smp: bytes that are a number": Attack("nxd_smp", json_edit(EXTRA, lambda saved: saved["extra"].__setitem__(
        "b", {"$bytes": 5})), (EXTRA,), "'b'"),
    "nxd_smp: JSON nested 100000 deep": Attack("nxd_smp", lambda p, h: (
        (p.resolve() / EXTRA).write_text('{"extra": ' + "[" * 100000 + "]" * 100000 + ', "objects": {}}'),
        reseal(p.resolve(), EXTRA)), (EXTRA,), None),
}

CLI = {  # python -m nxd_smp inspect: one error line, exit code 2
    "a negative shape in the index": BAD_VALUES["read: a negative shape in the index"],
    "hyper not a dict": REFUSED_LATE["nxd_smp: hyper not a dict"],
    "a dtype that is no dtype's name": Attack("nxd_smp", entry("model/0.bias", dtype="float32x"), (INDEX,), "0.bias"),
}


# ---------------------------------------------------------------- judging a refusal
def without(root: Path, message: str) -> str:
    """``message`` with the test's temporary directory left out: a name in the path (a test's
    own) must not pass for the field the refusal should name."""
    for prefix in {str(root.resolve()), str(root)}:
        message = message.replace(prefix, "<tmp>")
    return message


def names_problems(message: str, attack: Attack) -> list[str]:
    problems = []
    if not any(f in message for f in attack.files):
        problems.append(f"{UNNAMED} {list(attack.files)}")
    if attack.field is not None and attack.field not in message:
        problems.append(f"it does not name {attack.field!r}")
    return problems


def judge(problems: list[str], attack: Attack) -> None:
    """Fail on ``problems``."""
    assert not problems, problems


def assert_names(message: str, attack: Attack) -> None:
    judge([f"{p}: {message}" for p in names_problems(message, attack)], attack)


def assert_refused(attack: Attack, healthy: Healthy, tmp_path: Path) -> None:
    """The crafted folder is refused with a CheckpointError naming its file and field, and the
    live objects are as they were (every way it is not, reported at once)."""
    path = make(attack, healthy, tmp_path / "hostile")
    model, opt, scheduler = live(attack.load_with())
    before = snapshot(model, opt, scheduler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (a folder without masters warns once loaded)
            load(attack.load_with(), path, model, opt, scheduler)
        error = None
    except Exception as e:  # noqa: BLE001 - judged below
        error = e
    message = without(tmp_path, str(error))
    if error is None:
        problems = ["the load was accepted"]
    elif not isinstance(error, CheckpointError):
        problems = [f"refused with {type(error).__name__}, not a CheckpointError: {message}"]
    else:
        problems = [f"{p}: {message}" for p in names_problems(message, attack)]
    found = changes(before, model, opt, scheduler)
    problems += [f"the live objects changed: {found[:8]}"] if found else []
    judge(problems, attack)


COMPLETE = "COMPLETE.json"  # nxd_smp's completion record
DATA_FILE = "__0_0.distcp"  # the native DCP directory's one data file
REPEATS = 300_000  # listings of one chunk in the memory case: about 600 KB of pickle (2 bytes a listing)
CHUNK_ELEMENTS = 3_400  # float32 elements of that chunk (a 14 KB record): 1.02 * 10**9 elements claimed in all


# ---------------------------------------------------------------- crafting: a record listed twice (DCP)
def appended(directory: Path, tensor: torch.Tensor) -> tuple[int, int]:
    """``tensor``'s ``torch.save`` record (as DCP's ``FileSystemWriter`` writes one per chunk) appended
    to the data file of ``directory``: its offset and length."""
    record = io.BytesIO()
    torch.save(tensor.clone(), record)
    with open(directory / DATA_FILE, "ab") as f:
        offset = f.tell()
        f.write(record.getvalue())
    return offset, len(record.getvalue())


def tensor_entry(key: str, size: tuple[int, ...], chunks: list[ChunkStorageMetadata],
                 records: dict[tuple[int, ...], tuple[int, int]]) -> Callable:
    """An index edit: ``key`` a tensor of ``size`` listing ``chunks`` (objects, listed as given), its
    storage records ``{chunk offsets: (offset, length) in the data file}`` in place of its own."""
    def edit(metadata) -> None:
        old = metadata.state_dict_metadata[key]
        for index in [index for index in metadata.storage_data if index.fqn == key]:
            del metadata.storage_data[index]
        metadata.state_dict_metadata[key] = TensorStorageMetadata(old.properties, torch.Size(size), chunks)
        for i, (offsets, (offset, length)) in enumerate(records.items()):
            metadata.storage_data[MetadataIndex(key, torch.Size(offsets), i)] = _StorageInfo(DATA_FILE, offset, length)
    return edit


def chunk(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))


def repeated_chunk(times: int, elements: int) -> Callable:
    """``model.0.bias`` as one chunk of ``elements`` float32 zeros (its own record) listed ``times``
    times: one ``ChunkStorageMetadata`` object, which pickle writes once and then refers to by its memo
    (a few bytes a listing); the shape claims every listing's elements."""
    def craft(directory: Path, healthy: Healthy) -> None:
        record = appended(directory, torch.zeros(elements))
        one = chunk((0,), (elements,))
        edit_index(directory, tensor_entry("model.0.bias", (elements * times,), [one] * times, {(0,): record}))
    return craft


def bias_in_chunks(*spans: tuple[int, int], size: int = 13, second_object: bool = False) -> Callable:
    """``model.0.bias`` (13 elements) of ``size`` elements in chunks ``(start, length)``, each chunk
    listed once with a record of the healthy bias's elements there; ``second_object``: the spans
    repeat one offset as two chunk objects, one record."""
    def craft(directory: Path, healthy: Healthy) -> None:
        bias = healthy.native[0]["0.bias"]
        chunks = [chunk((start,), (length,)) for start, length in spans]
        records = {(start,): appended(directory, torch.cat([bias, bias])[start:start + length])
                   for start, length in spans}
        edit_index(directory, tensor_entry("model.0.bias", (size,), chunks, records))
    return craft


def claimed_shape(shape: tuple[int, ...]) -> Callable:
    """``model.0.bias`` claims ``shape`` in one chunk over its own record."""
    def edit(metadata) -> None:
        old = metadata.state_dict_metadata["model.0.bias"]
        size = torch.Size(shape)
        metadata.state_dict_metadata["model.0.bias"] = TensorStorageMetadata(
            old.properties, size, [ChunkStorageMetadata(torch.Size([0] * len(shape)), size)])
        info = metadata.storage_data.pop(next(i for i in metadata.storage_data if i.fqn == "model.0.bias"))
        metadata.storage_data[MetadataIndex("model.0.bias", torch.Size([0] * len(shape)), 0)] = info
    return lambda directory, healthy: edit_index(directory, edit)


def record_named_twice(directory: Path, healthy: Healthy) -> None:
    """``model.0.bias``'s record replaced by one whose zip holds its data record under one name twice."""
    path = directory.parent / "bias.pt"
    torch.save(healthy.native[0]["0.bias"].clone(), path)
    duplicate_record(path)
    data = path.read_bytes()
    with open(directory / DATA_FILE, "ab") as f:
        offset = f.tell()
        f.write(data)
    edit_index(directory, tensor_entry("model.0.bias", (13,), [chunk((0,), (13,))], {(0,): (offset, len(data))}))


def bomb_in_index(directory: Path, healthy: Healthy) -> None:
    """The index's planner data holding ``x = [x, x]`` forty deep: a few hundred bytes, 2**40 paths."""
    def edit(metadata) -> None:
        metadata.planner_data["bomb"] = bomb(40)
    edit_index(directory, edit)


# ---------------------------------------------------------------- crafting: a record listed twice (nxd_smp's JSON files)
def key_twice(name: str, where: Callable[[Any], dict], key: str, first: Any, *, twice: bool = True) -> Callable:
    """The JSON file ``name`` of an nxd_smp checkpoint with ``key`` of the object ``where(value)`` given
    twice: ``first`` (another value: a record elsewhere, a size of gigabytes) and then its own value,
    which ``json.loads`` keeps (so nothing else about the file is wrong); the completion record resealed
    (the completion record itself written as it is). ``twice=False``: the file written again the same
    way with the key once (the control)."""
    def craft(path: Path, healthy: Healthy) -> None:
        version = path.resolve()
        value = json.loads((version / name).read_text())
        target = where(value)
        marker = f"{key}\u0000twice"
        if twice:
            items = dict(target)
            target.clear()
            target.update({marker: first, **items})
        (version / name).write_text(json.dumps(value).replace(json.dumps(marker), json.dumps(key), 1))
        if name != COMPLETE:
            reseal(version, name)
    return craft


def index_key_twice() -> Callable:
    """The index lists ``model/0.bias`` twice: first at ``/dev/zero``, claiming 2**28 elements, then as
    it is (the value ``json.loads`` keeps)."""
    return key_twice(INDEX, lambda index: index["entries"], "model/0.bias",
                     first=["/dev/zero", 0, 2**30, 0, "float32", [2**28]])


# ---------------------------------------------------------------- crafting: a record listed twice (NxD's and torch_xla's files)
def groups_edit(edit: Callable[[list[list[int]]], None]) -> Callable:
    """An optimizer-file edit: ``edit`` on the param groups' ``params`` lists."""
    return lambda state: edit([group["params"] for group in state["param_groups"]])


def number_twice_in_a_group(params: list[list[int]]) -> None:
    params[0][1] = params[0][0]  # [0, 1] -> [0, 0]


def number_in_two_groups(params: list[list[int]]) -> None:
    params[1][0] = params[0][1]  # [[0, 1], [2, 3]] -> [[0, 1], [1, 3]]


def one_tensor_for_two_moments(state) -> None:
    """``exp_avg`` of parameter 0 is its ``exp_avg_sq`` (one tensor: torch.save writes one storage)."""
    state["base_state"][0]["exp_avg"] = state["base_state"][0]["exp_avg_sq"]


def one_storage_for_two_moments(state) -> None:
    """``exp_avg`` of parameter 0 a view of its ``exp_avg_sq``'s storage (another tensor, one record)."""
    moment = state["base_state"][0]["exp_avg_sq"]
    state["base_state"][0]["exp_avg"] = moment.view(moment.shape)


def xser_optimizer(healthy: Healthy, tag: Path, tids: tuple[int, int], link: bool = False) -> None:
    """NxD's xser optimizer file written again from the healthy state, parameter 0's ``exp_avg`` and
    ``exp_avg_sq`` given as references to the tensor ids ``tids`` (two reference objects, as NxD writes
    one per place a tensor is), whose files hold ``exp_avg_sq``; ``link``: the second id's file a hard
    link of the first's."""
    state = torch.load(healthy.root / "xla" / RANK_FILE, weights_only=True)
    path = tag / "optim" / RANK_FILE
    tensors = Path(f"{path}.tensors")
    shutil.rmtree(tensors)
    entry = state["base_state"][0]
    moment = entry["exp_avg_sq"]
    entry["exp_avg"], entry["exp_avg_sq"] = XserReference(tids[0]), XserReference(tids[1])
    save_xser(state, path)  # (the other tensors: files of their own)
    torch.save(moment.clone(), tensors / f"tensor_{tids[0]}.pt")
    if tids[1] != tids[0]:
        if link:
            os.link(tensors / f"tensor_{tids[0]}.pt", tensors / f"tensor_{tids[1]}.pt")
        else:
            torch.save(moment.clone(), tensors / f"tensor_{tids[1]}.pt")


def rank_files(healthy: Healthy, directory: Path, second: str | None) -> None:
    """``directory`` holding torch_xla's files of the healthy run at DP 2 (``export_xla``): rank 0's,
    and as rank 1's its own (``second`` None), a hard link of rank 0's (``"link"``) or a copy of rank
    0's (``"copy"``)."""
    from nxd_smp.interop.torch_xla import export_xla

    for old in directory.glob("dp_rank_*"):
        old.unlink()
    written = export_xla(healthy.root / "nxd_smp" / "ckpt", directory.parent / "dp2", dp_size=2)
    first, rank1 = directory / written[0].name, directory / written[1].name
    shutil.copy(written[0], first)
    if second is None:
        shutil.copy(written[1], rank1)
    elif second == "link":
        os.link(first, rank1)
    else:
        shutil.copy(first, rank1)


# ---------------------------------------------------------------- the attacks: a record listed twice
RECORD_MEMORY_CASE = f"torch: one chunk listed {REPEATS:,} times"
RECORD_MEMORY = Attack("torch", repeated_chunk(REPEATS, CHUNK_ELEMENTS), (DCP_INDEX,), "0.bias")

REPEATED = {  # loaded in this process: none of them claims more than a few KB once each record counts once
    # DCP
    "torch: one chunk listed 3 times": Attack("torch", repeated_chunk(3, 13), (DCP_INDEX,), "0.bias"),
    "torch: two chunk objects at one offset": Attack("torch", bias_in_chunks((0, 13), (0, 13), size=26),
                                                     (DCP_INDEX,), "0.bias"),
    "torch: chunks that overlap": Attack("torch", bias_in_chunks((0, 13), (7, 6), size=19), (DCP_INDEX,), "0.bias"),
    "torch: the shape [2**62, 2**62, 0]": Attack("torch", claimed_shape((2**62, 2**62, 0)), (DCP_INDEX,), "0.bias"),
    "torch: the shape [2**40, 2**40]": Attack("torch", claimed_shape((2**40, 2**40)), (DCP_INDEX,), "0.bias"),
    # nxd_smp's JSON files
    "nxd_smp: an index key twice": Attack("nxd_smp", index_key_twice(), (INDEX,), "model/0.bias"),
    "nxd_smp: a metadata key twice": Attack("nxd_smp", key_twice(META, lambda meta: meta["model"], "0.bias",
                                                                 first={"shape": [2**28], "dtype": "float32"}),
                                            (META,), "0.bias"),
    "nxd_smp: an extra.json key twice": Attack("nxd_smp", key_twice(EXTRA, lambda saved: saved["objects"],
                                                                    "scheduler", first={"step_size": 0}),
                                               (EXTRA,), "scheduler"),
    "nxd_smp: a completion record key twice": Attack("nxd_smp", key_twice(
        COMPLETE, lambda record: record["files"], INDEX, first=[0, 0]), (COMPLETE,), INDEX),
    "nxd_smp: a piece listed twice": Attack("nxd_smp", lambda p, h: edit_json(
        p, META, lambda meta: meta["optimizer"]["pieces"]["0.bias"].append([0, 13])), (META,), "0.bias"),
    "nxd_smp: a tensor entry referred to twice": Attack("nxd_smp", lambda p, h: (
        set_entry(p, "small/0", torch.zeros(4)), edit_json(p, EXTRA, lambda saved: saved["extra"].update(
            a={"$tensor": "small/0"}, b={"$tensor": "small/0"}))), (EXTRA,), "small/0"),
    # NxD's tag folders
    "nxd: a parameter number twice in a group": Attack("nxd", nxd_optim(groups_edit(number_twice_in_a_group)),
                                                       (RANK_FILE,), "params"),
    "nxd: a parameter number in two groups": Attack("nxd", nxd_optim(groups_edit(number_in_two_groups)),
                                                    (RANK_FILE,), "params"),
    "nxd: one tensor for two moments": Attack("nxd", nxd_optim(one_tensor_for_two_moments), (RANK_FILE,),
                                              "exp_avg"),
    "nxd: one storage for two moments": Attack("nxd", nxd_optim(one_storage_for_two_moments), (RANK_FILE,),
                                               "exp_avg"),
    "nxd xser: one tensor id for two moments": Attack("xser", lambda tag, h: xser_optimizer(h, tag, (900, 900)),
                                                      (RANK_FILE,), "exp_avg"),
    "nxd xser: two tensor files that are one file": Attack("xser", lambda tag, h: xser_optimizer(
        h, tag, (900, 901), link=True), ("tensor_901.pt",), "tensor_900.pt"),
    # torch_xla's files
    "xla: a parameter number twice in a group": Attack("xla", lambda d, h: edit_file(
        d / RANK_FILE, groups_edit(number_twice_in_a_group)), (RANK_FILE,), "params"),
    "xla: rank 1's file a hard link of rank 0's": Attack("xla", lambda d, h: rank_files(h, d, "link"),
                                                         ("dp_rank_01_tp_rank_00_pp_rank_00.pt",),
                                                         "dp_rank_00_tp_rank_00_pp_rank_00.pt"),
}

STRICT_READER = {  # a zip record named twice and a shared-reference bomb, under each reader (a child process)
    "torch: a record's zip names one record twice": Attack("torch", record_named_twice, (DATA_FILE,), None),
    "torch: a shared-reference bomb in .metadata": Attack("torch", bomb_in_index, (DCP_INDEX,), None),
    "nxd: the optimizer file names one record twice": Attack("nxd", lambda tag, h: duplicate_record(
        tag / "optim" / RANK_FILE), (RANK_FILE,), None),
    "nxd: a shared-reference bomb in the optimizer file": Attack("nxd", nxd_optim(
        lambda state: state.__setitem__("bomb", bomb(40))), (RANK_FILE,), None),
    "nxd xser: a tensor file names one record twice": Attack("xser", lambda tag, h: duplicate_record(
        xser_tensors(tag) / "tensor_3.pt"), ("tensor_3.pt",), None),
    "xla: the rank file names one record twice": Attack("xla", lambda d, h: duplicate_record(d / RANK_FILE),
                                                        (RANK_FILE,), None),
}

#: Each crafting helper with every record listed once: the folder loads (the refusals are the repetition's).
ONCE = {
    "torch": [bias_in_chunks((0, 13)), bias_in_chunks((0, 7), (7, 6)),
              bias_in_chunks((0, 13), (13, 0), (13, 0))],  # (empty shards, two at one offset: they hold nothing)
    "nxd_smp": [key_twice(INDEX, lambda index: index["entries"], "model/0.bias", None, twice=False),
                key_twice(META, lambda meta: meta["model"], "0.bias", None, twice=False),
                key_twice(EXTRA, lambda saved: saved["objects"], "scheduler", None, twice=False),
                key_twice(COMPLETE, lambda record: record["files"], INDEX, None, twice=False)],
    "nxd": [nxd_optim(groups_edit(lambda params: None))],
    "xser": [lambda tag, h: xser_optimizer(h, tag, (900, 901))],
    "xla": [lambda d, h: edit_file(d / RANK_FILE, groups_edit(lambda params: None)),
            lambda d, h: rank_files(h, d, None)],
}


# ---------------------------------------------------------------- the child processes
def slug(name: str) -> str:
    return re.sub(r"\W+", "_", name).strip("_")


def case_of(name: str, attack: Attack, healthy: Healthy, where: Path, *, then_step: bool) -> dict[str, Any]:
    return {"name": name, "loader": attack.load_with(), "path": str(make(attack, healthy, where / slug(name))),
            "limit_s": CASE_LIMIT_S, "step": then_step}


def _ended(case: dict[str, Any], event: str) -> bool:
    """Whether ``event`` is the last a case has (a stepping case's accepted load goes on to a step)."""
    return event in ({"refused", "hung", "stepped", "step_failed"} if case["step"] else {"refused", "hung", "accepted"})


def run_children(cases: list[dict[str, Any]], where: Path, warmup=()) -> dict[str, dict[str, Any]]:
    """Run ``cases`` through ``tests.hostile_worker`` in one child process, and a fresh one for
    the rest after each case that crashed or hung it. Returns each case's last event (for a case
    that ended the process: ``crashed``/``hung`` with the exit code and the end of stderr), and
    the warm-up's events under ``"warmup"``."""
    results_file = where / "results.jsonl"
    remaining = list(cases)
    events: dict[str, list[dict[str, Any]]] = {}
    final: dict[str, dict[str, Any]] = {}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    while remaining:
        spec = where / "spec.json"
        spec.write_text(json.dumps({"warmup": list(warmup), "cases": remaining}))
        results_file.write_text("")
        try:
            proc = run_python(["-m", "tests.hostile_worker", str(spec), str(results_file)], cwd=ROOT, env=env,
                              timeout=sum(c["limit_s"] for c in remaining) + 60)
            rc, stderr = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, stderr = "timeout", e.stderr
        for line in results_file.read_text().splitlines():
            event = json.loads(line)
            events.setdefault(event["case"], []).append(event)
        started = [c for c in remaining if events.get(c["name"])]
        ended = [c["name"] for c in started if _ended(c, events[c["name"]][-1]["event"])]
        running = [c["name"] for c in started if c["name"] not in ended]
        for name in ended:
            final[name] = events[name][-1]
        for name in running[:1]:  # the case the process died in
            final[name] = {"event": "crashed", "rc": rc, "stderr": (stderr or "")[-3000:],
                           "events": [e["event"] for e in events[name]]}
        if not ended and not running:  # died before the first case: every case fails with it
            final.update({c["name"]: {"event": "crashed", "rc": rc, "stderr": (stderr or "")[-3000:]}
                          for c in remaining})
        remaining = [c for c in remaining if c["name"] not in final]
    final["warmup"] = {"events": events.get("warmup", [])}
    return final


def child_problems(result: dict[str, Any], attack: Attack, root: Path) -> list[str]:
    """What is wrong with a child's outcome for ``attack``: anything but a CheckpointError naming
    the file and field, with the live objects unchanged."""
    event = result["event"]
    if event == "crashed":
        return [f"the process died (exit code {result['rc']}) after {result.get('events')}: {result['stderr']}"]
    if event == "hung":
        return [f"the load did not return within {result['limit_s']} s"]
    if event in ("accepted", "stepped", "step_failed"):
        return [f"the load was accepted ({event}{': ' + result.get('message', '') if event == 'step_failed' else ''})"]
    message = without(root, result["message"])
    problems = [] if result["checkpoint_error"] else [f"refused with {result['type']}, not a CheckpointError"]
    problems += names_problems(message, attack)
    problems += [f"it changed {result['changes'][:6]}"] if result["changes"] else []
    return [f"{p}: {message}" for p in problems]


# -- one child process (per test worker) for the loads that could crash, hang or take gigabytes
CRASHES = {**{f"0-dim moments, {k}": v for k, v in ZERO_DIM.items()}, **{f"fifo, {k}": v for k, v in FIFOS.items()},
           **{f"two parses, {k}": v for k, v in TWO_PARSES.items()}}
STEPPED = "control: a healthy nxd_smp folder, loaded and stepped"
ACCEPTED = "control: a healthy nxd_smp folder, loaded"
DCP_CONTROL = "control: the healthy DCP directory, imported"
BALLAST = "control: 256 MiB taken"


@dataclass
class Children:
    """What the child processes reported: each case's last event (``run_children``), where their
    folders are, and the bytes of each memory case's folder."""

    results: dict[str, dict[str, Any]]
    root: Path
    sizes: dict[str, int]
    record_sizes: dict[str, int]  # the DCP folder listing one chunk many times: its bytes, its index's


@pytest.fixture(scope="module")
def children(healthy, tmp_path_factory) -> Children:
    """The memory cases first (after the warm-up, each measured), then the cases that could crash
    the process (each accepted load followed by a step), in one child process while none crashes."""
    where = tmp_path_factory.mktemp("children")
    memory = [case_of(name, attack, healthy, where, then_step=False) for name, attack in MEMORY.items()]
    sizes = {c["name"]: sum(f.lstat().st_size for f in Path(c["path"]).resolve().parent.rglob("*")) for c in memory}
    warmup = [{"name": "warmup", "loader": loader, "path": str(copy_of(healthy, source, where / f"warm_{loader}")),
               "limit_s": CASE_LIMIT_S, "step": False}
              for loader, source in (("nxd_smp", "nxd_smp"), ("nxd", "nxd"), ("torch", "torch"), ("read", "nxd_smp"))]
    memory.append({"name": ACCEPTED, "loader": "nxd_smp", "path": warmup[0]["path"], "limit_s": CASE_LIMIT_S,
                   "step": False})
    memory.append({"name": BALLAST, "loader": "ballast", "path": "", "limit_s": CASE_LIMIT_S, "step": False})
    crashes = [case_of(name, attack, healthy, where, then_step=True) for name, attack in CRASHES.items()]
    crashes.append({"name": STEPPED, "loader": "nxd_smp", "path": str(copy_of(healthy, "nxd_smp", where / "control")),
                    "limit_s": CASE_LIMIT_S, "step": True})
    # Each record used once: the DCP index listing one chunk many times (measured), its healthy control, and
    # the strict reader's refusals under every reader.
    repeated = case_of(RECORD_MEMORY_CASE, RECORD_MEMORY, healthy, where, then_step=False)
    folder = Path(repeated["path"])
    record_sizes = {"folder": sum(f.lstat().st_size for f in folder.rglob("*")),
                    "index": (folder / DCP_INDEX).lstat().st_size}
    memory += [repeated, {"name": DCP_CONTROL, "loader": "torch", "path": warmup[2]["path"], "limit_s": CASE_LIMIT_S,
                          "step": False}]
    crashes += [case_of(name, attack, healthy, where, then_step=True) for name, attack in STRICT_READER.items()]
    return Children(run_children(memory + crashes, where, warmup), where, sizes, record_sizes)


# ---------------------------------------------------------------- the tests
def test_the_crafting_keeps_a_healthy_folder_loadable(healthy, tmp_path):
    """The control: every crafting helper with an edit that changes nothing leaves a folder that
    loads and installs the saved weights; a refusal below is the loader's, not the crafting's."""
    same = lambda *args: None  # noqa: E731
    crafted = [
        ("nxd_smp", lambda p, h: (edit_json(p, INDEX, same), edit_json(p, META, same), edit_json(p, EXTRA, same))),
        ("nxd_smp", lambda p, h: set_entry(p, "model/0.bias", h.weights["nxd_smp"]["0.bias"])),  # (moved)
        ("nxd", lambda tag, h: (edit_nxd(tag, "model", same), edit_nxd(tag, "optim", same),
                                nxd_scheduler(lambda state: state)(tag, h), nxd_user_content({"step": 2})(tag, h))),
        ("nxd", lambda tag, h: without_masters(tag)),  # (the masters are then rebuilt, with a warning)
        ("xser", lambda tag, h: None),  # written by save_xser, forged references and all
        ("xser", xser_model()),  # the model file written again, as the crafting of its attacks does
        ("torch", native_edit(same)),
        ("torch", index_edit(same)),  # the index pickled again, as DCP pickles it
        ("xla", lambda d, h: edit_file(d / RANK_FILE, same)),
    ]
    for i, (source, craft) in enumerate(crafted):
        attack = Attack(source, craft, (), None)
        path = make(attack, healthy, tmp_path / str(i))
        model, opt, scheduler = live(attack.load_with())
        before = snapshot(model, opt, scheduler)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load(attack.load_with(), path, model, opt, scheduler)
        assert changes(before, model, opt, scheduler), f"{source}: the load changed nothing"
        if source in healthy.weights:
            for key, value in healthy.weights[source].items():
                assert torch.equal(model.state_dict()[key], value), (source, key)


def test_the_child_processes_tell_a_healthy_load_from_a_refusal(children):
    """The control of the child processes: a healthy folder is accepted and steps, a healthy DCP
    directory imports; the warm-up loads succeed; the memory meter measures."""
    results = children.results
    assert results[STEPPED]["event"] == "stepped", results[STEPPED]
    assert results[ACCEPTED]["event"] == "accepted", results[ACCEPTED]
    assert results[ACCEPTED]["growth_mib"] < GROWTH_LIMIT_MIB, results[ACCEPTED]
    assert results[DCP_CONTROL]["event"] == "accepted", results[DCP_CONTROL]
    assert results[DCP_CONTROL]["growth_mib"] < GROWTH_LIMIT_MIB, results[DCP_CONTROL]
    assert results[BALLAST]["growth_mib"] >= 200, results[BALLAST]
    warmups = results["warmup"]["events"]
    assert len(warmups) >= 4 and all(e["outcome"] == "accepted" for e in warmups), warmups


@pytest.mark.parametrize("loader", sorted(ZERO_DIM))
def test_zero_dim_moments_are_refused_before_a_step_can_corrupt_memory(children, loader):
    attack = ZERO_DIM[loader]
    judge(child_problems(children.results[f"0-dim moments, {loader}"], attack, children.root), attack)


@pytest.mark.parametrize("case", sorted(TWO_PARSES))
def test_a_zip_record_named_twice_is_refused_before_anything_reads_it(children, case):
    attack = TWO_PARSES[case]
    judge(child_problems(children.results[f"two parses, {case}"], attack, children.root), attack)


@pytest.mark.parametrize("case", sorted(FIFOS))
def test_a_fifo_for_a_file_is_refused_without_blocking(children, case):
    attack = FIFOS[case]
    judge(child_problems(children.results[f"fifo, {case}"], attack, children.root), attack)


@pytest.mark.parametrize("case", sorted(OUTSIDE))
def test_nothing_is_read_from_outside_the_folder(healthy, tmp_path, case):
    assert_refused(OUTSIDE[case], healthy, tmp_path)


@pytest.mark.parametrize("source", ["nxd_smp", "torch"])
def test_a_missing_and_a_present_file_outside_are_refused_alike(healthy, tmp_path, source):
    """A path outside the folder is refused before anything looks at it: the refusal is the same
    whether the file exists (here: too short, which a reader would call truncated) or not, so it
    tells an attacker nothing about which files exist."""
    path = copy_of(healthy, source, tmp_path)
    if source == "nxd_smp":
        index, key = INDEX, "model/0.bias"
        entry(key, file="../elsewhere.bin")(path, healthy)
    else:
        index, key = DCP_INDEX, "model.0.bias"
        edit_index(path, retarget(key, relative_path="../elsewhere.bin"))
    model, opt, scheduler = live(source)
    before = snapshot(model, opt, scheduler)
    refusals = []
    for exists in (False, True):
        if exists:
            (path.resolve().parent / "elsewhere.bin").write_bytes(b"abc")
        with pytest.raises(CheckpointError) as refused:
            load(source, path, model, opt, scheduler)
        refusals.append(without(tmp_path, str(refused.value)))
    missing, present = refusals
    assert missing == present, f"the refusal tells whether the file exists:\n{missing}\n{present}"
    assert index in present and key.removeprefix("model")[1:] in present, present
    assert not any(word in present.lower() for word in ("truncated", "no such file", "missing", "exist")), present
    assert_unchanged(before, model, opt, scheduler)


@pytest.mark.parametrize("case", sorted(MEMORY))
def test_a_folder_of_a_few_kb_allocates_no_gigabytes(children, case):
    result, size = children.results[case], children.sizes[case]
    assert size < 256 << 10, f"the crafted folder holds {size} bytes: not a few KB"
    problems = child_problems(result, MEMORY[case], children.root)
    if "growth_mib" in result and result["growth_mib"] >= GROWTH_LIMIT_MIB:
        problems.append(f"{GREW} by {result['growth_mib']:.0f} MiB "
                        f"(at most {GROWTH_LIMIT_MIB}; peak reset: {result['peak_reset']})")
    judge(problems, MEMORY[case])


@pytest.mark.parametrize("case", sorted(REFUSED_LATE))
def test_a_refused_load_changes_nothing(healthy, tmp_path, case):
    assert_refused(REFUSED_LATE[case], healthy, tmp_path)


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_values_of_the_wrong_kind_are_refused(healthy, tmp_path, case):
    assert_refused(BAD_VALUES[case], healthy, tmp_path)


def test_an_unexpected_error_on_one_rank_is_a_checkpoint_error_on_every_rank(healthy):
    """At DP 2 on gloo, rank 1's safe open raises a RuntimeError (no check expects it) while rank 0
    reads a healthy folder: both ranks raise a CheckpointError within seconds (none waits for the
    other to exit), for each loader, and nothing changes."""
    folders = [("nxd_smp", str(healthy.root / "nxd_smp" / "ckpt")),
               ("nxd", str(healthy.root / "nxd" / TAG)), ("torch", str(healthy.root / "torch"))]
    ranks = run_ranks(2, one_rank_fails_unexpectedly, folders)
    problems = refused_together(ranks, [loader for loader, _ in folders])
    assert not problems, problems


def refused_together(ranks: list[list[dict[str, Any]]], cases: list[str]) -> list[str]:
    """What in each rank's outcomes of ``cases`` (``hostile_worker.timed_load``'s, in order) is not a
    refusal of every rank together: an accepted load, an error that is not a CheckpointError, ranks that
    did not agree within seconds, a changed object, a rank that stopped early."""
    problems = []
    for rank, outcomes in enumerate(ranks):
        for case, outcome in zip(cases, outcomes):
            where = f"rank {rank}, {case}"
            if outcome["type"] is None:
                fired = f" (the sabotage fired {outcome['fired']} times)" if "fired" in outcome else ""
                problems.append(f"{where}: the load was accepted{fired}")
            elif not outcome["checkpoint_error"]:
                problems.append(f"{where}: {outcome['type']}, not a CheckpointError: {outcome['message'][:300]}")
            if "Connection closed" in outcome["message"] or outcome["seconds"] >= 20:
                problems.append(f"{where}: the ranks did not agree ({outcome['seconds']:.1f} s): "
                                f"{outcome['message'][:300]}")
            if outcome["changes"]:
                problems.append(f"{where}: changed {outcome['changes'][:6]}")
        if len(outcomes) < len(cases):
            problems.append(f"rank {rank}: stopped after {[o['loader'] for o in outcomes]}")
    return problems


@pytest.mark.parametrize("case", sorted(CLI))
def test_inspect_refuses_a_hostile_folder_with_one_error_line(healthy, tmp_path, capsys, case):
    from nxd_smp.cli import main

    attack = CLI[case]
    path = make(attack, healthy, tmp_path / "hostile")
    try:
        rc = main(["inspect", str(path)])
    except Exception:  # noqa: BLE001 - the failure this test is about
        pytest.fail(f"inspect ended in a traceback:\n{traceback.format_exc()}")
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error:"), (rc, err)
    assert_names(without(tmp_path, lines[0]), attack)


# ---------------------------------------------------------------- the tests: each record used once
@pytest.mark.parametrize("source", sorted(ONCE))
def test_a_healthy_folder_and_every_record_listed_once_loads(healthy, tmp_path, source):
    """The control: the healthy folder of each kind loads and installs its weights, and so does each
    crafting helper's folder when it lists every record once (the refusals below are the repetition's)."""
    for i, craft in enumerate([lambda path, h: None, *ONCE[source]]):
        path = make(Attack(source, craft, (), None), healthy, tmp_path / str(i))
        loader = {"xser": "nxd"}.get(source, source)
        model, opt, scheduler = live(loader)
        before = snapshot(model, opt, scheduler)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load(loader, path, model, opt, scheduler)
        assert changes(before, model, opt, scheduler), f"{source} #{i}: the load changed nothing"
        if source in healthy.weights:
            for key, value in healthy.weights[source].items():
                assert torch.equal(model.state_dict()[key], value), (source, i, key)


@pytest.mark.parametrize("case", sorted(REPEATED))
def test_a_repeated_record_is_refused_and_changes_nothing(healthy, tmp_path, case):
    assert_refused(REPEATED[case], healthy, tmp_path)


def test_one_chunk_listed_300000_times_grows_the_process_by_less_than_100_mb(children):
    """About 600 KB of ``.metadata`` listing one 14 KB chunk 300,000 times, claiming 10**9 elements:
    refused by the index reader before anything is allocated (the old reader allocated the tensor and a
    touched mask of every listing's elements, about a gigabyte, and then found the overlap)."""
    result, sizes = children.results[RECORD_MEMORY_CASE], children.record_sizes
    assert 400 << 10 < sizes["index"] and sizes["folder"] < 1 << 20, sizes
    problems = child_problems(result, RECORD_MEMORY, children.root)
    if "growth_mib" in result and result["growth_mib"] >= GROWTH_LIMIT_MIB:
        problems.append(f"the peak resident memory grew by {result['growth_mib']:.0f} MiB (at most "
                        f"{GROWTH_LIMIT_MIB}; peak reset: {result['peak_reset']})")
    if "listed twice" not in result.get("message", ""):
        problems.append(f"not refused as a chunk listed twice: {result.get('message', '')[:300]}")
    judge(problems, RECORD_MEMORY)


@pytest.mark.parametrize("case", sorted(STRICT_READER))
def test_the_strict_reader_refuses_a_record_named_twice_and_a_bomb_under_every_reader(children, case):
    attack = STRICT_READER[case]
    judge(child_problems(children.results[case], attack, children.root), attack)


def test_inspect_refuses_an_index_that_gives_a_key_twice(healthy, tmp_path):
    from nxd_smp.checkpoint import inspect_checkpoint

    attack = REPEATED["nxd_smp: an index key twice"]
    path = make(attack, healthy, tmp_path / "hostile")
    with pytest.raises(CheckpointError) as refused:
        inspect_checkpoint(path)
    assert_names(without(tmp_path, str(refused.value)), attack)
    assert inspect_checkpoint(copy_of(healthy, "nxd_smp", tmp_path / "healthy"))["tensors"]  # the control


def test_import_xla_refuses_one_file_listed_twice(healthy, tmp_path):
    """Rank 0's file given as rank 1's too: each would fill its own half (the chunk shapes fit), so the
    loader installs rank 0's state twice; the same path, or a copy of it (other bytes on disk: a copy is
    a file of its own, which no reader can tell from rank 1's), the control."""
    from nxd_smp.interop.torch_xla import import_xla

    directory = tmp_path / "xla"
    directory.mkdir()
    rank_files(healthy, directory, "copy")
    first, copy = sorted(directory.glob("dp_rank_*"))
    model, opt, scheduler = live("xla")
    before = snapshot(model, opt, scheduler)
    with pytest.raises(CheckpointError) as refused:
        import_xla([first, first], model=model, optimizer=opt)
    message = without(tmp_path, str(refused.value))
    assert first.name in message and "listed twice" in message, message
    assert not changes(before, model, opt, scheduler)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import_xla([first, copy], model=model, optimizer=opt)
    assert changes(before, model, opt, scheduler)


def test_a_state_dicts_tag_refuses_one_record_for_two_moments(tmp_path):
    """NxD Training's call shape: a tag saved from state dicts, its optimizer file's ``exp_avg_sq`` of
    parameter 0 the same tensor as its ``exp_avg`` (one record, installed as both); the tag as saved,
    the control."""
    from nxd_smp import load_checkpoint, save_checkpoint
    from tests.hostile_worker import step

    model, opt, _ = live("nxd")
    step(model, opt)  # (other state than the live objects' below)
    save_checkpoint(tmp_path, "tag", model=model.state_dict(), optimizer=opt.state_dict(), user_content={"step": 2})
    tag = tmp_path / "tag"
    healthy_copy = tmp_path / "healthy"
    shutil.copytree(tag, healthy_copy / "tag")
    edit_file(tag / "optim" / RANK_FILE, lambda state: state["state"][0].__setitem__(
        "exp_avg_sq", state["state"][0]["exp_avg"]))
    model, opt, scheduler = live("nxd")
    before = snapshot(model, opt, scheduler)
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(tmp_path, "tag", model=model, optimizer=opt)
    assert_names(without(tmp_path, str(refused.value)), Attack("nxd", None, (RANK_FILE,), "exp_avg"))
    assert not changes(before, model, opt, scheduler)
    load_checkpoint(healthy_copy, "tag", model=model, optimizer=opt)
    assert changes(before, model, opt, scheduler)


# ---------------------------------------------------------------- each record used once: DP 2 on gloo
#: Rank 1's folder (or files) repeats a record; rank 0's is healthy. These are the entry points that read
#: the path each rank is given (``load_checkpoint`` reads the folder rank 0 chose, on every rank).
DP2 = ["torch: one chunk listed 3 times", "torch: chunks that overlap", "xla: a parameter number twice in a group",
       "xla: rank 1's file a hard link of rank 0's"]


def test_a_repeated_record_on_one_rank_is_a_checkpoint_error_on_every_rank(healthy, tmp_path):
    """At DP 2 on gloo only rank 1's folder repeats a record (found by the index reader, by the read of the
    records, by the optimizer files' check, by the file check): both ranks raise a CheckpointError within
    seconds (rank 0's from the agreement), and nothing changes on either."""
    cases = []
    for i, name in enumerate(DP2):
        attack = REPEATED[name]
        cases.append((attack.load_with(), [str(copy_of(healthy, attack.source, tmp_path / f"{i}_rank0")),
                                           str(make(attack, healthy, tmp_path / f"{i}_rank1"))]))
    ranks = run_ranks(2, each_rank_loads_its_own, cases)
    problems = refused_together(ranks, DP2)
    for name, outcome in zip(DP2, ranks[1]):
        problems += [f"rank 1, {name}: {p}" for p in names_problems(without(tmp_path, outcome["message"]),
                                                                     REPEATED[name])]
    assert not problems, problems
# ---------------------------------------------------------------- the pickled files themselves
def _torch_saved(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _with_record_cut(data: bytes, suffix: str, keep: int) -> bytes:
    """``data`` (a torch.save archive) with the record ending in ``suffix`` cut to ``keep`` bytes."""
    import zipfile

    source, out = zipfile.ZipFile(io.BytesIO(data)), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for info in source.infolist():
            record = source.read(info.filename)
            archive.writestr(info, record[:keep] if info.filename.endswith(suffix) else record)
    return out.getvalue()


class _SizedCall:
    """Unpickling it calls ``fn(n)``: a few bytes asking for ``n`` elements."""

    def __init__(self, fn, n):
        self.fn, self.n = fn, n

    def __reduce__(self):
        return (self.fn, (self.n,))


@pytest.mark.parametrize("case", ["a storage longer than its record", "torch.Tensor(n)", "bytearray(n)"])
def test_a_pickled_file_cannot_claim_more_than_it_holds(case):
    """torch takes a storage's size from the pickle and its bytes from a record: a record cut
    short would be read past its end (a crash when copied). ``torch.Tensor(n)`` and
    ``bytearray(n)`` are on torch's allow-list and allocate whatever ``n`` says."""
    from nxd_smp.checkpointing.reader import load_bytes

    data = {
        "a storage longer than its record": lambda: _with_record_cut(_torch_saved(torch.ones(1 << 20)), "data/0", 16),
        "torch.Tensor(n)": lambda: _torch_saved({"x": _SizedCall(torch.Tensor, 2**29)}),
        "bytearray(n)": lambda: _torch_saved({"x": _SizedCall(bytearray, 2**31)}),
    }[case]()
    assert len(data) < 4096
    with pytest.raises(CheckpointError, match="user_content.pt"):
        load_bytes(data, "user_content.pt")


@pytest.mark.parametrize("kind", ["state_dict", "dcp_metadata"])
def test_a_file_referring_to_one_container_many_times_is_refused(kind):
    """``x = [x, x]`` forty deep is a few hundred bytes and 2**40 paths: whatever walks it later
    (``inspect --json``, an export, a deep copy) would expand it without bound. Metadata is a
    tree: the reader refuses it by the file's size (round two, class 9)."""
    from nxd_smp.checkpointing.reader import load_bytes, load_pickle

    nested: Any = [torch.zeros(1)] if kind == "state_dict" else [1]
    for _ in range(40):
        nested = [nested, nested]
    with pytest.raises(CheckpointError, match="user_content.pt"):
        if kind == "state_dict":
            load_bytes(_torch_saved(nested), "user_content.pt")
        else:
            load_pickle(pickle.dumps(nested), "user_content.pt")


def test_schedulers_with_infinite_or_nested_state_resume(tmp_path):
    """The scheduler check does not refuse what torch's schedulers really hold:
    ReduceLROnPlateau's infinite ``best``, SequentialLR's nested states (each checked, so an
    ``optimizer`` inside one is refused)."""
    from nxd_smp import MixedPrecisionConfig, Zero1Optimizer, load_checkpoint, save_checkpoint
    from tests.oracle import batch, loss_fn, make_model, param_groups

    model = make_model(0)
    opt = Zero1Optimizer(param_groups(model, lr_a=1e-2, lr_b=3e-2), torch.optim.AdamW, compile_update=False,
                         mixed_precision=MixedPrecisionConfig(use_master_weights_in_ckpt=True))
    lr = torch.optim.lr_scheduler

    def sequential():
        return lr.SequentialLR(opt, [lr.LinearLR(opt), lr.StepLR(opt, 3)], milestones=[2])

    plateau, chain = lr.ReduceLROnPlateau(opt), sequential()
    loss_fn(model, *batch(0, 0, 0, 0)).backward()
    opt.step()
    chain.step()
    save_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt, scheduler=chain, stateful={"plateau": plateau})
    fresh_plateau, fresh_chain = lr.ReduceLROnPlateau(opt), sequential()
    load_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt, scheduler=fresh_chain,
                    stateful={"plateau": fresh_plateau})
    assert fresh_plateau.best == plateau.best == float("inf") and fresh_chain.last_epoch == chain.last_epoch

    state = chain.state_dict()
    state["_schedulers"][0]["optimizer"] = "not the scheduler's"
    with pytest.raises(CheckpointError, match="optimizer"):
        from nxd_smp.optim.loading.check import check_scheduler_state

        check_scheduler_state(state, sequential(), "scheduler.pt")
