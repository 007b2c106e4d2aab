"""Crafted files shared by the tests that attack the readers (tests/unit/checkpointing/
test_strict_reader.py, tests/integration/test_checkpoint_safety.py and test_hostile_checkpoints.py,
tests/unit/interop/test_nxd_calls.py): objects whose unpickling runs code or calls a function, a
torch.save-shaped archive around any pickle, a shared-reference bomb; and the peers' formats as they
write them (NxD's tag folders, xser files, a native DCP directory), with the edits that keep a
forged file past the integrity checks (a resealed completion record, a DCP index entry); and what
torch.compile raises on a machine without a C++ compiler."""

from __future__ import annotations

import io
import json
import os
import pickle
import stat
import types
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex

TAG = "tag_2"  # (not "step_2": a refusal naming the path would name "step" by accident)
RANK_FILE = "dp_rank_00_tp_rank_00_pp_rank_00.pt"


class Exploit:
    """Unpickling it creates the directory ``marker``: the code a crafted file would run."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


class Reduces:
    """Unpickling it calls ``fn(*args)``."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def archive(pickled: bytes, records: dict[str, bytes] | None = None, *, extra: list[tuple[str, bytes]] = (),
            compress: str | None = None) -> bytes:
    """A torch.save-shaped zip: ``archive/data.pkl`` holding ``pickled``, ``archive/data/<key>``
    for each record, then ``extra`` records as they are (duplicates included); ``compress``: the
    one record written deflated."""
    out = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        warnings.simplefilter("ignore", UserWarning)  # zipfile warns of a duplicate name: that is the point
        entries = [("archive/data.pkl", pickled), ("archive/byteorder", b"little")]
        entries += [(f"archive/data/{k}", v) for k, v in (records or {}).items()] + list(extra)
        for name, data in entries:
            z.writestr(name, data, compress_type=zipfile.ZIP_DEFLATED if name == compress else zipfile.ZIP_STORED)
    return out.getvalue()


def bomb(levels: int = 30) -> list:
    """A list holding the previous level twice, ``levels`` deep: a few hundred bytes, 2**levels leaves."""
    value: list = [1]
    for _ in range(levels):
        value = [value, value]
    return value


# ---------------------------------------------------------------- the peers' formats
class XserReference:
    """Stands for ``torch_xla.utils.serialization.TensorReference`` in an xser file, pickled
    under that name without importing torch_xla (this process stays free of it)."""

    def __init__(self, tid: int):
        self.tid = tid


class _XserPickler(pickle._Pickler):  # the Python pickler: its save_global can be overridden
    def save_global(self, obj, name=None):
        if obj is XserReference:
            self.write(pickle.GLOBAL + b"torch_xla.utils.serialization\nTensorReference\n")
            self.memoize(obj)
        else:
            super().save_global(obj, name)


_XSER_PICKLE = types.SimpleNamespace(__name__="pickle", Pickler=_XserPickler)


def save_xser(data: Any, path: Path) -> None:
    """``data`` as NxD's ``use_xser=True`` writes it: each tensor in ``<path>.tensors/tensor_<i>.pt``
    (numbered as the walk meets them), a reference in its place in ``path``."""
    tensors = Path(f"{path}.tensors")
    tensors.mkdir(parents=True, exist_ok=True)
    info: dict[int, dict[str, Any]] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tid = len(info)
            torch.save(value, tensors / f"tensor_{tid}.pt")
            info[tid] = {"dtype": value.dtype, "shape": value.shape, "expert_model_parallel": False}
            return XserReference(tid)
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v) for v in value)
        return value

    torch.save(walk(data), path, pickle_module=_XSER_PICKLE)
    torch.save(info, f"{path}.info.pt")


def write_nxd_tag(root: Path, model_state, optim_state, scheduler_state, *, xser: bool) -> Path:
    """NxD's tag folder ``root/TAG`` of a ZeRO-1 run at DP 1 (tests/nxd_layout.py's layout)."""
    tag = root / TAG
    (tag / "model").mkdir(parents=True)
    (tag / "optim").mkdir()
    (tag / "checkpoint").write_text("1")
    save = save_xser if xser else torch.save
    save(dict(model_state), tag / "model" / RANK_FILE)
    save(optim_state, tag / "optim" / RANK_FILE)
    torch.save(scheduler_state, tag / "scheduler.pt")
    torch.save({"step": 2}, tag / "user_content.pt")
    (tag / "done").write_text("1")
    return tag


def save_native(directory: Path, model_state, optim_state) -> None:
    """A native DCP directory ``{"model", "optim"}`` as a plain torch run saves it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled", TypedStorage
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory, no_dist=True)


def reseal(version: Path, *names: str) -> None:
    """Make the completion record vouch for the files ``names`` as they are now (a FIFO: as an
    empty file), so that only the loader's own checks stand between them and the live objects."""
    record_path = version / "COMPLETE.json"
    record = json.loads(record_path.read_text())
    for name in names:
        if stat.S_ISFIFO(os.lstat(version / name).st_mode):
            record["files"][name] = [0, 0]
        else:
            data = (version / name).read_bytes()
            record["files"][name] = [len(data), zlib.crc32(data)]
    record_path.write_text(json.dumps(record))


def index_of(metadata, key: str) -> MetadataIndex:
    return next(index for index in metadata.storage_data if index.fqn == key)


# ---------------------------------------------------------------- a machine's failures
def compiler_missing() -> Exception:
    """What torch.compile raises on a machine without a working C++ compiler."""
    from torch._dynamo.exc import BackendCompilerFailed

    return BackendCompilerFailed(lambda *a: None, RuntimeError("InvalidCxxCompiler: no C++ compiler"), None)


# ---------------------------------------------------------------- the healthy runs attacks start from
def trained_run(root: Path):
    """nxd_smp's AdamW over tests/nxd_layout.py's model, two steps with its scheduler, saved in
    nxd_smp's format at ``root/nxd_smp/ckpt`` with master weights; returns (model, optimizer, scheduler)."""
    from nxd_smp import MixedPrecisionConfig, Zero1Optimizer, save_checkpoint
    from tests.hostile_worker import step
    from tests.nxd_layout import HYPER, param_groups, scheduler_of
    from tests.xla_export_worker import make_model

    model = make_model()
    opt = Zero1Optimizer(param_groups(model), torch.optim.AdamW, compile_update=False, bucket_cap_mb=0.0002,
                         mixed_precision=MixedPrecisionConfig(use_master_weights_in_ckpt=True), **HYPER)
    scheduler = scheduler_of(opt)
    for s in range(2):
        step(model, opt, s)
        scheduler.step()
    save_checkpoint(root / "nxd_smp" / "ckpt", model=model, optimizer=opt, scheduler=scheduler, extra={"step": 2})
    return model, opt, scheduler


def native_run(root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same model in fp32 under plain ``torch.optim.AdamW`` (its scheduler made, so its groups hold
    ``initial_lr`` as the live optimizer's do), two steps, saved as a native DCP directory at
    ``root/torch``; returns its model and optimizer state dicts."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.nxd_layout import HYPER, backward, grads, param_groups, scheduler_of
    from tests.xla_export_worker import make_model

    native = make_model().float()
    native_opt = torch.optim.AdamW(param_groups(native), **HYPER)
    scheduler_of(native_opt)
    for s in range(2):
        backward(native, grads(0, s, native))
        native_opt.step()
        native_opt.zero_grad()
    msd, osd = get_state_dict(native, native_opt)
    save_native(root / "torch", msd, osd)
    return msd, osd

