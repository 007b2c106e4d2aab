"""Each index record is used once (DESIGN §5: a checkpoint is data that strangers hand you; budgets
while parsing): every index nxd_smp reads may list one record many times for a few bytes a listing,
and a reader that counts, allocates or installs per listing grows by what the listings claim, not by
what the folder holds.

Each reader meets an index that repeats a record, through its documented entry point, starting from
test_hostile_checkpoints.py's healthy folders (its crafting, judging and child-process helpers, used
as they are):

* DCP (``import_torch``): one ``ChunkStorageMetadata`` listed 300,000 times by pickle's memo (about
  600 KB of ``.metadata``: the old reader counted each listing, then allocated the tensor and a mask of
  the sum, about a gigabyte, before it found the overlap), two chunks at one offset, chunks that
  overlap, and shapes whose size arithmetic overflows;
* nxd_smp's own folders (``load_checkpoint``, ``inspect_checkpoint``): a key given twice in a JSON
  object of the index, the metadata, ``extra.json`` and the completion record (``json.loads`` keeps
  the last value silently; another reader could take the first), a parameter's piece listed twice, a
  ``{"$tensor": key}`` referred to twice;
* NxD's tag folders, plain and xser, and NxD Training's state-dict tags (``load_checkpoint``): a
  parameter number listed twice in a param group's ``params`` or in two groups, one record (one tensor,
  overlapping views of one storage, one xser tensor id, two xser tensor files that are one file) for
  two moments;
* torch_xla's per-rank files (``import_xla``): a parameter number listed twice, one file listed twice
  or under two names;
* the strict reader under each of them: a zip record named twice, a shared-reference bomb.

Each ends in a ``CheckpointError`` naming the file and the field, with the live objects unchanged; the
DCP repetition is loaded in a child process that measures the peak resident memory (less than 100 MB
of growth). A healthy folder of each kind, and each crafting helper with its record listed once, still
loads. At DP 2 on gloo, a repeated record in rank 1's folder alone (``import_torch``, ``import_xla``:
the entry points that read the path each rank is given) is a ``CheckpointError`` on both ranks, within
seconds, and nothing changes.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

from nxd_smp import CheckpointError
from tests.crafted import RANK_FILE, XserReference, reseal, save_xser
from tests.distributed import run_ranks
from tests.hostile_worker import changes, live, load, snapshot
from tests.integration.test_hostile_checkpoints import (  # noqa: F401 - healthy: the module's fixture
    CASE_LIMIT_S,
    DCP_INDEX,
    EXTRA,
    GROWTH_LIMIT_MIB,
    INDEX,
    META,
    Attack,
    Healthy,
    assert_names,
    assert_refused,
    bomb,
    case_of,
    child_problems,
    copy_of,
    duplicate_record,
    edit_file,
    edit_index,
    edit_json,
    healthy,
    judge,
    make,
    names_problems,
    nxd_optim,
    run_children,
    set_entry,
    without,
    xser_tensors,
)

COMPLETE = "COMPLETE.json"  # nxd_smp's completion record
DATA_FILE = "__0_0.distcp"  # the native DCP directory's one data file
REPEATS = 300_000  # listings of one chunk in the memory case: about 600 KB of pickle (2 bytes a listing)
CHUNK_ELEMENTS = 3_400  # float32 elements of that chunk (a 14 KB record): 1.02 * 10**9 elements claimed in all


# ---------------------------------------------------------------- crafting: DCP
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


# ---------------------------------------------------------------- crafting: nxd_smp's JSON files
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


# ---------------------------------------------------------------- crafting: NxD's and torch_xla's files
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


# ---------------------------------------------------------------- the attacks
MEMORY_CASE = f"torch: one chunk listed {REPEATS:,} times"
MEMORY = Attack("torch", repeated_chunk(REPEATS, CHUNK_ELEMENTS), (DCP_INDEX,), "0.bias")

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


# ---------------------------------------------------------------- the child process
@dataclasses.dataclass
class Children:
    results: dict[str, dict[str, Any]]
    root: Path
    sizes: dict[str, dict[str, int]]


CONTROL = "control: the healthy DCP directory, imported"
BALLAST = "control: 256 MiB taken"


@pytest.fixture(scope="module")
def children(healthy, tmp_path_factory) -> Children:
    """The memory case (after a warm-up import of the healthy DCP directory, measured), its controls,
    and the strict reader's refusals, in one child process while none crashes."""
    where = tmp_path_factory.mktemp("children")
    memory = case_of(MEMORY_CASE, MEMORY, healthy, where, then_step=False)
    folder = Path(memory["path"])
    sizes = {MEMORY_CASE: {"folder": sum(f.lstat().st_size for f in folder.rglob("*")),
                           "index": (folder / DCP_INDEX).lstat().st_size}}
    warm = str(copy_of(healthy, "torch", where / "warm"))
    warmup = [{"name": "warmup", "loader": "torch", "path": warm, "limit_s": CASE_LIMIT_S, "step": False}]
    cases = [memory,
             {"name": CONTROL, "loader": "torch", "path": warm, "limit_s": CASE_LIMIT_S, "step": False},
             {"name": BALLAST, "loader": "ballast", "path": "", "limit_s": CASE_LIMIT_S, "step": False}]
    cases += [case_of(name, attack, healthy, where, then_step=True) for name, attack in STRICT_READER.items()]
    return Children(run_children(cases, where, warmup), where, sizes)


# ---------------------------------------------------------------- the tests
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
    result, sizes = children.results[MEMORY_CASE], children.sizes[MEMORY_CASE]
    assert 400 << 10 < sizes["index"] and sizes["folder"] < 1 << 20, sizes
    problems = child_problems(result, MEMORY, children.root)
    if "growth_mib" in result and result["growth_mib"] >= GROWTH_LIMIT_MIB:
        problems.append(f"the peak resident memory grew by {result['growth_mib']:.0f} MiB (at most "
                        f"{GROWTH_LIMIT_MIB}; peak reset: {result['peak_reset']})")
    if "listed twice" not in result.get("message", ""):
        problems.append(f"not refused as a chunk listed twice: {result.get('message', '')[:300]}")
    judge(problems, MEMORY)


def test_the_child_process_tells_a_healthy_import_from_a_refusal(children):
    """The memory meter's controls: the healthy DCP directory imports within the limit, 256 MiB taken
    measures as such, and the warm-up import succeeded."""
    results = children.results
    assert results[CONTROL]["event"] == "accepted" and results[CONTROL]["growth_mib"] < GROWTH_LIMIT_MIB, \
        results[CONTROL]
    assert results[BALLAST]["growth_mib"] >= 200, results[BALLAST]
    assert [e["outcome"] for e in results["warmup"]["events"]] == ["accepted"], results["warmup"]


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


# ---------------------------------------------------------------- DP 2 on gloo
def each_rank_loads_its_own(rank: int, world: int, cases: list[tuple[str, list[str]]]) -> list[dict[str, Any]]:
    """Each case's folder for this rank (``paths[rank]``) loaded with its loader at DP ``world``: what this
    rank raised, how long the load took, what it changed. Stops at the first error that is not a
    CheckpointError (the ranks no longer agree on what comes next)."""
    import faulthandler

    faulthandler.dump_traceback_later(120, exit=True)  # a hung collective ends the test, not the suite
    out = []
    try:
        for loader, paths in cases:
            model, opt, scheduler = live(loader)
            before = snapshot(model, opt, scheduler)
            start = time.monotonic()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    load(loader, paths[rank], model, opt, scheduler)
                error = None
            except Exception as e:  # noqa: BLE001 - reported to the test
                error = e
            out.append({"loader": loader, "seconds": time.monotonic() - start,
                        "type": None if error is None else type(error).__name__,
                        "checkpoint_error": isinstance(error, CheckpointError),
                        "message": "" if error is None else str(error),
                        "changes": changes(before, model, opt, scheduler)})
            if error is not None and not isinstance(error, CheckpointError):
                break
    finally:
        faulthandler.cancel_dump_traceback_later()
    return out


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
    problems = []
    for rank, outcomes in enumerate(ranks):
        for name, outcome in zip(DP2, outcomes):
            where = f"rank {rank}, {name}"
            if outcome["type"] is None:
                problems.append(f"{where}: the load was accepted")
            elif not outcome["checkpoint_error"]:
                problems.append(f"{where}: {outcome['type']}, not a CheckpointError: {outcome['message'][:300]}")
            if "Connection closed" in outcome["message"] or outcome["seconds"] >= 20:
                problems.append(f"{where}: the ranks did not agree ({outcome['seconds']:.1f} s)")
            if outcome["changes"]:
                problems.append(f"{where}: changed {outcome['changes'][:6]}")
        if len(outcomes) < len(cases):
            problems.append(f"rank {rank}: stopped after {[o['loader'] for o in outcomes]}")
    for name, outcome in zip(DP2, ranks[1]):
        problems += [f"rank 1, {name}: {p}" for p in names_problems(without(tmp_path, outcome["message"]),
                                                                     REPEATED[name])]
    assert not problems, problems
