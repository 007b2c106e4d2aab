"""The strict reader (``nxd_smp.checkpointing.reader`` and its ``unpickler``): every pickled file
nxd_smp reads goes through one zip parse and one allow-listed unpickler per kind of file.

Each attack below is built with real pickling (``zipfile`` for the archive, pickle opcodes or a
``__reduce__`` for the pickle) and must end in a ``CheckpointError`` naming the file. The oracle:
what ``torch.save`` and ``torch.distributed.checkpoint`` really write reads back equal to what
torch's own loaders read (``torch.load(weights_only=True)``, ``pickle.loads``).
"""

from __future__ import annotations

import io
import pickle
import resource
import struct
import warnings
import zipfile
from collections import OrderedDict
from typing import Any

import pytest
import torch

from nxd_smp import CheckpointError
from nxd_smp.checkpointing.files import Folder
from nxd_smp.checkpointing.reader import load_bytes, load_file, load_pickle
from nxd_smp.checkpointing.unpickler import XserReference
from tests.crafted import Reduces, archive, bomb

SOURCE = "hostile.pt"


def saved(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def float_storage(key: str, numel: int) -> bytes:
    """Pickle opcodes pushing ``torch._utils._rebuild_tensor_v2`` of a float32 storage ``key`` of
    ``numel`` elements, viewed as a 1-d tensor of all of it."""
    return (b"ctorch._utils\n_rebuild_tensor_v2\n(" + b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\n"
            + b"X" + struct.pack("<I", len(key)) + key.encode() + b"X\x03\x00\x00\x00cpu"
            + b"J" + struct.pack("<i", numel) + b"tQ" + b"K\x00J" + struct.pack("<i", numel) + b"\x85K\x01\x85\x89"
            + b"ccollections\nOrderedDict\n)Rt" + b"R")


def assert_refused(data: bytes, *, kind: str = "state_dict", match: str = "") -> str:
    with pytest.raises(CheckpointError, match=SOURCE.replace(".", r"\.")) as error:
        load_bytes(data, SOURCE, kind=kind)
    assert match in str(error.value), str(error.value)
    return str(error.value)


# ---------------------------------------------------------------- what a pickle asks to build
def test_a_device_tensor_rebuilt_from_an_expanded_one_is_refused():
    """1.6 KB asking for ``_rebuild_device_tensor_from_cpu_tensor(zeros(1).expand(2**28))``: torch
    admits it and copies the expanded view into a new gigabyte. The reader reads the device
    tensors torch.save writes for XLA tensors (torch_xla's optimizer state) as their CPU tensor,
    checked like any other, and never copies."""
    rebuild = torch._utils._rebuild_device_tensor_from_cpu_tensor
    data = saved(Reduces(rebuild, torch.zeros(1).expand(2**28), torch.float32, "cpu", False))
    assert len(data) < 4096
    assert_refused(data, match="expanded")
    assert_refused(saved({"x": torch.zeros(1).expand(2**28)}), match="x asks for an expanded tensor")
    assert_refused(saved({"x": Reduces(rebuild, torch.zeros(4), torch.float64, "xla:0", False)}), match="at x")
    healthy = saved({"x": Reduces(rebuild, torch.arange(6.0)[::2], torch.float32, "cpu", True)})
    same(load_bytes(healthy, SOURCE), torch.load(io.BytesIO(healthy), weights_only=True))


@pytest.mark.parametrize("opcode", [b"\x81", b"R"], ids=["NEWOBJ", "REDUCE"])
def test_torch_tensor_of_a_number_is_refused(opcode):
    """``torch.Tensor(n)``: ``n`` elements of uninitialised heap memory in the model."""
    data = archive(b"\x80\x02ctorch\nTensor\nJ\x00\x00\x00\x20\x85" + opcode + b".")
    assert_refused(data, match="torch.Tensor")


def test_bytearray_of_a_number_is_refused():
    assert_refused(archive(b"\x80\x02c__builtin__\nbytearray\nJ\x00\x00\x00\x40\x85R."), match="bytearray")
    assert_refused(saved({"x": Reduces(bytearray, 2**31)}), match="bytearray")
    assert_refused(saved({"x": Reduces(bytes, 2**31)}), match="bytes")
    assert_refused(saved({"x": Reduces(torch.FloatStorage, 2**28)}), match="FloatStorage")


def test_an_unknown_storage_type_or_reference_is_refused():
    good = b"\x80\x02" + float_storage("0", 2) + b"."
    assert load_bytes(archive(good, {"0": bytes(8)}), SOURCE).tolist() == [0.0, 0.0]
    assert_refused(archive(good.replace(b"torch\nFloatStorage", b"torch\nQInt8Storage"), {"0": bytes(8)}),
            match="QInt8Storage")
    assert_refused(archive(good.replace(b"ctorch\nFloatStorage\n", b"ctorch\nfloat32\n"), {"0": bytes(8)}),
            match="no torch.save storage")
    assert_refused(archive(good.replace(b"X\x07\x00\x00\x00storage", b"X\x07\x00\x00\x00sTorage"), {"0": bytes(8)}),
            match="no torch.save storage")


def test_an_xser_reference_is_read_only_in_the_xser_kind():
    xser = b"\x80\x02ctorch_xla.utils.serialization\nTensorReference\n)\x81}X\x03\x00\x00\x00tidK\x07sb."
    assert_refused(archive(xser), match="TensorReference")
    reference = load_bytes(archive(xser), SOURCE, kind="xser")
    assert type(reference) is XserReference and reference.tid == 7
    assert_refused(archive(xser.replace(b"K\x07", b"X\x01\x00\x00\x007")), kind="xser", match="id")
    assert_refused(archive(xser.replace(b"tid", b"TID")), kind="xser", match="state")
    with pytest.raises(CheckpointError, match="TensorReference"):
        load_pickle(xser, SOURCE)


def test_state_is_set_only_where_torch_save_sets_it():
    """``BUILD``: an OrderedDict's ``_metadata`` only; never a tensor's state (``set_`` to any size)."""
    tensor_state = b"\x80\x02" + float_storage("0", 2) + b"(K\x00K\x00tb."
    assert_refused(archive(tensor_state, {"0": bytes(8)}), match="state of a Tensor")
    other = b"\x80\x02ccollections\nOrderedDict\n)R}X\x04\x00\x00\x00evilK\x01sb."
    assert_refused(archive(other), match="state of a OrderedDict")
    assert_refused(archive(b"\x80\x02]}X\x01\x00\x00\x00aK\x01sb."), match="state of a list")


def test_a_memo_index_the_file_gives_allocates_nothing():
    """The C unpickler sizes its memo by the largest index a file names: nine bytes, gigabytes."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert load_pickle(b"\x80\x02Nr\xff\xff\xff\x7f.", SOURCE) is None
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB


# ---------------------------------------------------------------- the archive itself
def test_records_of_one_name_twice_are_refused():
    pickled = b"\x80\x02" + float_storage("0", 2) + b"."
    assert_refused(archive(pickled, {"0": bytes(8)}, extra=[("archive/data/0", bytes(4096))]), match="two records")
    assert_refused(archive(pickled, {"0": bytes(8)}, extra=[("archive/data.pkl", b"\x80\x02N.")]), match="two records")
    assert_refused(archive(pickled, {"0": bytes(8)}, extra=[("other/data.pkl", b"\x80\x02N.")]), match="data.pkl")


def test_a_compressed_record_is_refused():
    pickled = b"\x80\x02" + float_storage("0", 2) + b"."
    assert_refused(archive(pickled, {"0": bytes(8)}, compress="archive/data/0"), match="compressed")


def test_records_that_overlap_are_refused():
    """A second record whose local header and bytes lie inside the first one's bytes: the check
    and the read see different bytes for one storage."""
    inner = zipfile.ZipInfo("archive/data/1")
    inner.file_size = inner.compress_size = 8
    inner.CRC = zipfile.crc32(bytes(8))
    embedded = inner.FileHeader() + bytes(8)
    pickled = b"\x80\x02(" + float_storage("0", len(embedded) // 4) + float_storage("1", 2) + b"t."
    data = bytearray(archive(pickled, {"0": embedded + bytes(-len(embedded) % 4), "1": bytes(8)}))
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as z:
        start = z.getinfo("archive/data/0").header_offset
    host = data.index(embedded, start)  # the copy inside data/0's bytes
    entry = data.index(b"PK\x01\x02")
    while not data[entry + 46:].startswith(b"archive/data/1"):
        entry = data.index(b"PK\x01\x02", entry + 4)
    data[entry + 42:entry + 46] = struct.pack("<I", host)
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as z:  # (zipfile itself reads it without complaint)
        assert z.read("archive/data/1") == bytes(8)
    assert_refused(bytes(data), match="overlap")


@pytest.mark.parametrize("held", [4, 12, 16], ids=["smaller", "larger by one float", "twice"])
def test_a_record_must_hold_exactly_the_storages_bytes(held):
    pickled = b"\x80\x02" + float_storage("0", 2) + b"."
    assert_refused(archive(pickled, {"0": bytes(held)}), match="claims 8 bytes")
    assert_refused(archive(pickled), match="no record")


def test_a_tensor_must_lie_inside_its_storage():
    pickled = b"\x80\x02" + float_storage("0", 2).replace(b"\x85K\x01\x85", b"\x85K\x02\x85") + b"."
    assert_refused(archive(pickled, {"0": bytes(8)}), match="past its end")


def test_a_record_past_the_file_or_damaged_is_refused(tmp_path):
    data = saved({"w": torch.ones(64)})
    with pytest.raises(CheckpointError, match="hostile.pt"):
        load_bytes(data[: len(data) // 2], SOURCE)
    flipped = bytearray(data)
    flipped[data.index(struct.pack("<f", 1.0) * 4)] ^= 1  # the CRC-32 of the record no longer matches
    with pytest.raises(CheckpointError, match="CRC"):
        load_bytes(bytes(flipped), SOURCE)
    (tmp_path / "x.pt").write_bytes(data)
    with Folder.open(tmp_path) as folder:
        assert torch.equal(load_file(folder, "x.pt")["w"], torch.ones(64))


# ---------------------------------------------------------------- metadata as a tree
@pytest.mark.parametrize("kind", ["state_dict", "xser", "dcp_metadata"])
def test_a_shared_reference_bomb_is_refused_in_every_kind(kind):
    if kind == "dcp_metadata":
        with pytest.raises(CheckpointError, match="hostile.pt.*2\\*\\*30"):
            load_pickle(pickle.dumps(bomb()), SOURCE)
    else:
        assert_refused(saved(bomb()), kind=kind, match="2**30")


def test_sharing_as_real_files_do_is_admitted():
    """torch's param groups share one ``betas`` tuple, a model shares a tied weight."""
    betas = (0.9, 0.999)
    shared = torch.ones(3)
    value = {"param_groups": [{"betas": betas, "params": [i]} for i in range(200)], "a": shared, "b": shared}
    got = load_bytes(saved(value), SOURCE)
    assert got["param_groups"][5]["betas"] == betas and got["a"] is got["b"]


def test_nesting_and_cycles_are_refused():
    deep: list = []
    for _ in range(80):
        deep = [deep]
    assert_refused(saved(deep), match="64 deep")
    cycle: list = []
    cycle.append(cycle)
    assert_refused(saved(cycle), match="contains itself")


# ---------------------------------------------------------------- the oracle: what torch writes
def same(a: Any, b: Any, where: str = "") -> None:
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.storage_offset(), a.requires_grad) == (
            b.dtype, b.shape, b.stride(), b.storage_offset(), b.requires_grad), where
        assert a.untyped_storage().nbytes() == b.untyped_storage().nbytes(), where
        assert bytes(a.untyped_storage()) == bytes(b.untyped_storage()), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), where
        for key in a:
            same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}/{i}")
    else:
        assert a == b or (a != a and b != b), (where, a, b)


def adamw_after_steps() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.1}])
    for _ in range(3):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
    return opt.state_dict()


def real_values() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    model[2].to(torch.bfloat16)
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    return {
        "model state dict (mixed dtypes, bf16, _metadata)": model.state_dict(),
        "AdamW after steps": adamw_after_steps(),
        "tuples and plain values": (1, 2.5, "s", None, True, float("inf"), (3, (4,)), [b"bytes", "\u00e9"], {1, 2}),
        "0-dim, empty, fp16, int, bool, float8": [torch.tensor(3.5), torch.empty(0, 3), torch.ones(2, dtype=torch.half),
                                                  torch.arange(5), torch.tensor([True, False]),
                                                  torch.ones(3, dtype=torch.float8_e4m3fn)],
        "non-contiguous and views of one storage": {"t": base.t(), "col": base[:, 2], "whole": base,
                                                    "slice": base[1:3, ::2]},
        "parameter": {"p": torch.nn.Parameter(torch.randn(3)), "frozen": torch.nn.Parameter(torch.ones(2), False)},
        "size and dtype": {"size": torch.Size([2, 3]), "dtype": torch.bfloat16},
        "ordered dict": OrderedDict([("b", 1), ("a", torch.zeros(2))]),
    }


@pytest.mark.parametrize("name", list(real_values()))
def test_what_torch_save_writes_reads_as_torch_load_reads_it(name):
    data = saved(real_values()[name])
    ours, torchs = load_bytes(data, SOURCE), torch.load(io.BytesIO(data), weights_only=True)
    same(ours, torchs)


def test_views_share_their_storage():
    base = torch.arange(12.0).reshape(3, 4)
    got = load_bytes(saved({"whole": base, "col": base[:, 1]}), SOURCE)
    assert got["col"].untyped_storage().data_ptr() == got["whole"].untyped_storage().data_ptr()
    got["whole"][0, 1] = 100.0
    assert got["col"][0] == 100.0


def test_a_dcp_index_reads_as_pickle_reads_it(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.randn(3, 4), "b": torch.zeros(4, dtype=torch.bfloat16)},
             "optim": adamw_after_steps(), "step": 7}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    data = (tmp_path / ".metadata").read_bytes()
    assert load_pickle(data, SOURCE) == pickle.loads(data)
    with Folder.open(tmp_path) as folder:
        assert load_file(folder, ".metadata", kind="dcp_metadata") == pickle.loads(data)


@pytest.mark.parametrize("op", [b"e", b"a", b"s", b"u", b"\x90"], ids=["APPENDS", "APPEND", "SETITEM", "SETITEMS",
                                                                      "ADDITEMS"])
def test_a_container_opcode_on_a_tensor_is_refused(op):
    """APPEND, SETITEM and ADDITEMS call ``append``, ``__setitem__`` and ``add`` on what lies below
    their items: on a tensor, ``add`` broadcasts (a (1, N) plus an (N, 1) tensor is N*N elements from
    a file of 8N floats) and ``__setitem__`` writes; only a list, dict or set may take them."""
    records = {"0": bytes(32), "1": bytes(32)}
    first, second = float_storage("0", 8), float_storage("1", 8)
    body = {b"e": first + b"(" + second + b"e", b"a": first + second + b"a",
            b"s": first + b"K\x00" + second + b"s", b"u": first + b"(K\x00" + second + b"u",
            b"\x90": first + b"(" + second + b"\x90"}[op]
    assert_refused(archive(b"\x80\x04" + body + b".", records), match="on a Tensor")


@pytest.mark.parametrize("metadata", [b"}(X\x00\x00\x00\x00}(X\x07\x00\x00\x00versionX\x01\x00\x00\x00xuu",
                                      b"]K\x01a"], ids=["a string version", "a list"])
def test_a_state_dicts_metadata_is_what_load_state_dict_reads(metadata):
    """``_metadata`` goes to ``model.load_state_dict``, which compares ``version`` with integers:
    a string or a list there would fail inside it, after the ranks agreed."""
    pickled = (b"\x80\x02ccollections\nOrderedDict\n)R}X\t\x00\x00\x00_metadata" + metadata + b"sb.")
    assert_refused(archive(pickled), match="_metadata")
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    same(load_bytes(saved(model.state_dict()), SOURCE), torch.load(io.BytesIO(saved(model.state_dict())),
                                                                  weights_only=True))
    assert load_bytes(saved(model.state_dict()), SOURCE)._metadata == model.state_dict()._metadata
