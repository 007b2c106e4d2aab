"""The way out to native PyTorch, and back: an nxd_smp checkpoint as the
``torch.distributed.checkpoint`` (DCP) directory a plain torch run saves, and such a
directory loaded into a live model and ``Zero1Optimizer``.

The layout is ``{"model": model_sd, "optim": optim_sd}`` as
``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` returns it for
the same model in fp32 under the same ``torch.optim`` class: model keys are parameter and
buffer FQNs; ``optim`` is ``{"state": {fqn: {"step", "exp_avg", ...}}, "param_groups":
[{every key the torch optimizer writes in its own state_dict(), "params": [fqn, ...]}]}``.

* ``export_torch(checkpoint, out_dir)`` writes it (process-local: it never joins a
  collective, whatever process group exists);
* ``import_torch(dcp_dir, model=, optimizer=)`` loads what a native run saved with
  ``dcp.save({"model": ..., "optim": ...})`` into nxd_smp at its own DP size, reading
  nothing through torch's ``FileSystemReader`` or ``dcp.load`` (they unpickle freely): the
  index through nxd_smp's one DCP index reader (``checkpointing.dcp_index``), every record
  through the strict reader;
* ``export_safetensors(checkpoint, out_file)`` writes the model weights as one
  safetensors file.

Precision decisions, made here once: the exported parameters are the fp32 master weights
where the checkpoint has them, else the saved parameters upcast (with a warning that
precision below their dtype is lost); every other floating entry narrower than fp32
(buffers, frozen parameters, optimizer state of a run without masters) is upcast to fp32,
as ``model.float()`` would hold it; fp32, fp64 and integer entries stay as saved. On import
the native fp32 parameters become the fp32 masters, and the model's parameters those
masters rounded to the parameter dtype.
"""

from __future__ import annotations

import inspect
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta, TensorStorageMetadata

from ..checkpoint import check_args
from ..checkpointing.dcp_index import METADATA_FILE, DcpEntry, read_dcp_index
from ..checkpointing.files import Folder, check_output, local_path, write_output_directory, write_output_file
from ..core.errors import UnsafeFileError
from ..checkpointing.storage import INDEX_FILE, read_record
from ..checkpointing.tools import read_whole_checkpoint
from ..core.dtensors import is_dtensor
from ..optim.rounding import round_ties_away
from ..core.errors import CheckpointError
from ..optim.loading.check import group_hyperparameters
from ..optim.loading.run import full_state, run
from ..optim.loading.staged import Request, Staged, StagedModel, Targets
from ..zero1_optimizer import Zero1Optimizer

__all__ = ["export_torch", "import_torch", "export_safetensors", "model_state_dict_of", "master_state_dict"]

MODEL = "model"
OPTIM = "optim"


def _as_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """A floating tensor narrower than fp32 upcast to fp32 (exact); anything else as it is."""
    if tensor.is_floating_point() and tensor.dtype.itemsize < 4:
        return tensor.float()
    return tensor


# ---------------------------------------------------------------------------- export
def export_torch(path: str | os.PathLike | Sequence[str | os.PathLike], out_dir: str | os.PathLike, *,
                 model: nn.Module | None = None, overwrite: bool = False) -> Path:
    """Write the checkpoint at ``path`` as a DCP directory ``out_dir`` holding ``{"model":
    model_sd, "optim": optim_sd}`` in ``get_state_dict(model, optimizer)``'s layout for the
    same model in fp32 under the checkpoint's ``torch.optim`` class.

    A model with DTensor tensor parallelism saves one checkpoint per tensor-parallel coordinate: pass
    them all, in tensor-parallel rank order, as ``path`` (a list). Each split tensor is joined whole along
    the dimension it was sharded on, so the directory holds plain full tensors, which ``dcp.load``
    reshards into any layout (TorchTitan's, FSDP2's, another TP size).

    ``model_sd``: the fp32 master weights for the managed parameters (without saved masters,
    the parameters upcast to fp32, with a ``UserWarning`` that precision was lost); every
    other entry as saved, floating ones narrower than fp32 upcast. ``optim_sd["state"]``:
    per parameter FQN its whole state (``step`` 0-dim, moments shaped like the parameter,
    fp32); parameters without state yet are left out, as torch leaves them out.
    ``optim_sd["param_groups"]``: the saved hyperparameters, completed with the class
    defaults for every key the class writes (``foreach``, ``fused``, ...), ``params`` as
    FQN lists. A checkpoint saved without an optimizer exports ``{"model": model_sd}`` only.

    ``model``: an instance of the saved model (on the meta device is fine; not parallelized), whose own
    ``state_dict()`` names the entries: the masters are swapped in as its parameters and its state-dict
    hooks run over them (``model_state_dict_of``), so a fused parameter (TorchTitan's ``wqkv``, a fused
    SwiGLU's ``w13``) is exported as the pieces its hooks give (``wq``/``wk``/``wv``), in fp32. Needed where
    those hooks rename or split parameters; checked against the saved model state dict (the same keys, and
    each entry rounds to its saved value). The optimizer state stays keyed by parameter FQN, as torch's
    ``get_state_dict`` keys it.

    Written with ``dcp.save(..., no_dist=True)`` into a fresh staging directory beside
    ``out_dir`` (``tempfile.mkdtemp``), moved into place once complete. ``out_dir`` must be
    absent or an empty directory (checked before the checkpoint is read); with
    ``overwrite=True`` whatever is there (a directory, a file or a link, never followed) is
    replaced as a whole. Load it with ``dcp.load`` and ``set_state_dict`` (docs:
    ``docs/native_pytorch.md``).

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ConfigError: ``path`` or ``out_dir`` is a URL (``s3://...``): object storage is not supported yet.
        CheckpointError: ``out_dir`` exists and is not an empty directory (without
            ``overwrite``); the checkpoint is damaged; its inner optimizer class is not a
            ``torch.optim`` class; masters the saved model state dict names otherwise and no
            ``model``, or a ``model`` that is not the one saved.
        TypeError: ``out_dir`` is not a path, ``model`` not a module or ``overwrite`` not a bool.
    """
    _check_model_arg(model)
    out = check_output(out_dir, overwrite=overwrite, directory=True)
    full = read_whole_checkpoint(path)
    opt = full["optimizer"]
    masters = None if opt is None else opt["master_weights"]
    if masters is not None:
        masters = (masters_through_model(model, full["model"], masters, path) if model is not None
                   else check_masters_named_as_saved(full["model"], masters, path))
    managed = set() if opt is None else {name for g in opt["groups"] for name in g["params"]}
    model_sd: dict[str, torch.Tensor] = {}
    upcast: dict[str, torch.dtype] = {}
    for key, value in full["model"].items():
        if masters is not None and key in masters:
            model_sd[key] = masters[key]
            continue
        model_sd[key] = _as_fp32(value)
        if model_sd[key].dtype != value.dtype and (opt is None or key in managed):
            upcast[key] = value.dtype
    if upcast:
        names = sorted(upcast)
        warnings.warn(
            f"{path} holds no fp32 master weights: the exported parameters {names[:8]}"
            + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            + f" are their saved {sorted({str(d) for d in upcast.values()})} values upcast to fp32, so "
            f"precision below that dtype is lost. Save with use_master_weights_in_ckpt=True to keep it.",
            stacklevel=2,
        )
    state: dict[str, Any] = {MODEL: model_sd}
    if opt is not None:
        state[OPTIM] = _torch_optim_state_dict(opt, opt["inner_class"])
    return write_output_directory(out, lambda staging: _save_dcp(state, staging, out), overwrite=overwrite)


def check_masters_named_as_saved(model: Mapping[str, torch.Tensor], masters: Mapping[str, torch.Tensor], path: Any
                                 ) -> Mapping[str, torch.Tensor]:
    """The masters are keyed by the parameters' names (``named_parameters``), the model's entries by its
    ``state_dict()`` keys: a model whose state-dict hooks rename or split parameters (TorchTitan's fused
    ``wqkv`` presented as ``wq``/``wk``/``wv``) has masters that no entry is named by, and entries that
    would be written as their saved bf16 values upcast, passing for masters. That is refused, naming both.

    Returns:
        ``masters``, each named by a saved entry.

    Raises:
        CheckpointError: masters under names the model's state dict does not hold.
    """
    unnamed = sorted(set(masters) - set(model))
    if not unnamed:
        return masters
    narrow = sorted(key for key, value in model.items() if key not in masters and value.is_floating_point()
                    and value.element_size() < 4)
    raise CheckpointError(
        f"{path}: the fp32 master weights of {unnamed[:8]}{' and more' if len(unnamed) > 8 else ''} have no entry of "
        f"that name in the saved model state dict, whose "
        + (f"entries {narrow[:8]}{' and more' if len(narrow) > 8 else ''} hold saved low-precision values instead"
           if narrow else "keys differ")
        + ": the model's state-dict hooks rename or split its parameters, and exporting the bf16 values upcast as "
        "masters would be wrong. Pass an instance of the saved model (model=..., on the meta device is fine): its "
        "own state_dict() then names the masters, its hooks run over them.")


def model_state_dict_of(model: nn.Module, values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with ``values`` (by parameter or buffer name, as ``named_parameters`` and
    ``named_buffers`` give them) in place of the model's own tensors: the model's own code, its state-dict
    hooks included, names and cuts them (a fused parameter comes out as the pieces its hooks give). The
    tensors are swapped in for the call only (``torch.nn.utils.stateless``); the model is left as it was."""
    from torch.nn.utils.stateless import _reparametrize_module

    with torch.no_grad(), _reparametrize_module(model, dict(values), tie_weights=True, strict=False):
        return dict(model.state_dict())


def _rounds_to(value: torch.Tensor, saved: torch.Tensor) -> bool:
    """Whether ``value`` (a master, or a piece of one) is what ``saved`` was rounded from: to nearest even
    (a parameter cast from its master), or with ties away from zero (split from its master under
    ``use_param_remainders``)."""
    if torch.equal(value.to(saved.dtype), saved):
        return True
    return saved.dtype == torch.bfloat16 and value.dtype == torch.float32 and torch.equal(
        round_ties_away(value), saved)


def _check_model_arg(model: Any) -> None:
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be an instance of the saved model (an nn.Module, on the meta device is fine), "
                        f"got {type(model).__name__}.")
    if model is not None and any(is_dtensor(p) for p in model.parameters()):
        raise TypeError("model must be the saved model before parallelize_module (plain parameters, on the meta "
                        "device is fine): the export holds whole tensors.")


def masters_through_model(model: nn.Module, saved: Mapping[str, torch.Tensor], masters: Mapping[str, torch.Tensor],
                          path: Any) -> dict[str, torch.Tensor]:
    """The masters under the names ``model``'s own state dict gives them (``model_state_dict_of``: the masters
    as its parameters, the saved entries as its other parameters and its buffers): the entries it makes of
    the masters (each in the masters' dtype where the saved one is narrower), every one checked to round to
    its saved value; the other entries left out.

    Raises:
        CheckpointError: the model's parameters or buffers are not the saved ones (names, shapes), its state
            dict names entries the saved one does not, or an entry it makes from the masters does not round to
            its saved value (another model, or hooks that compute rather than select); each named.
    """
    values: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    parameters = dict(model.named_parameters())
    for name, tensor in list(parameters.items()) + list(model.named_buffers()):
        value = masters.get(name, saved.get(name))
        if value is None:  # (a buffer the state dict leaves out, or names otherwise: checked below)
            if name in parameters:
                problems.append(f"{name}: a parameter neither a master nor a saved entry")
            continue
        if tuple(value.shape) != tuple(tensor.shape):
            problems.append(f"{name}: {tuple(value.shape)} in the checkpoint, {tuple(tensor.shape)} in the model")
            continue
        values[name] = value
    if not problems:
        made = model_state_dict_of(model, values)
        problems += [f"{k}: made by the model, not saved" for k in sorted(set(made) - set(saved))[:8]]
        problems += [f"{k}: saved, not made by the model" for k in sorted(set(saved) - set(made))[:8]]
        problems += [f"{k}: made by the model from none of the saved tensors" for k, v in made.items()
                     if isinstance(v, torch.Tensor) and v.is_meta][:8]
    if not problems:
        differ = [k for k, v in made.items() if v.shape != saved[k].shape or not _rounds_to(v, saved[k])]
        problems += [f"{k}: what the model's state dict makes of the masters does not round to the saved value"
                     for k in differ[:8]]
    if problems:
        raise CheckpointError(f"{path}: the model passed is not the one saved (or its state-dict hooks compute "
                              f"rather than select): " + "; ".join(problems) + ".")
    return {key: value for key, value in made.items() if value.dtype != saved[key].dtype}


def _torch_optim_state_dict(opt: Mapping[str, Any], inner_class: str) -> dict[str, Any]:
    """``get_optimizer_state_dict``'s layout: state by FQN, every group key the class writes."""
    cls = getattr(torch.optim, inner_class, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise CheckpointError(
            f"the checkpoint's inner optimizer is {inner_class!r}, not a torch.optim class, so native "
            f"torch has no state_dict layout for it; export the weights alone with export_safetensors."
        )
    groups = [{**_class_group(cls, g["hyper"]), **g["hyper"], "params": list(g["params"])} for g in opt["groups"]]
    state = {
        name: {key: _as_fp32(value) for key, value in opt["state"][name].items()}
        for g in opt["groups"] for name in g["params"] if opt["state"][name]
    }
    return {"state": state, "param_groups": groups}


def _class_group(cls: type[torch.optim.Optimizer], hyper: Mapping[str, Any]) -> dict[str, Any]:
    """Every key ``cls`` writes into a param group built with ``hyper``, with its value
    there (the class defaults for what ``hyper`` lacks): from a throwaway instance."""
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {key: value for key, value in hyper.items() if key in accepted}
    try:
        probe = cls([torch.zeros(1, requires_grad=True)], **kwargs)
    except (TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(
            f"torch.optim.{cls.__name__} refuses the saved hyperparameters {kwargs}: {e}"
        ) from e
    return {key: value for key, value in probe.param_groups[0].items() if key != "params"}


class _Writer(torch.distributed.checkpoint.FileSystemWriter):
    """DCP's file writer, recording the final directory (not the temporary one it writes
    into) as the checkpoint id in the index."""

    def __init__(self, path: str, final: Path):
        super().__init__(path)
        self._final = final

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self._final, save_id=self.save_id)


def _save_dcp(state: dict[str, Any], staging: str, out: Path) -> None:
    """``dcp.save(state)`` in this process only, into the new directory ``staging`` (a path through its
    descriptor) that will become ``out`` (the checkpoint id the index records)."""
    with warnings.catch_warnings():
        # no_dist=True is the point here, not a fallback; storage() is DCP's own call.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        torch.distributed.checkpoint.save(state, storage_writer=_Writer(staging, out.absolute()), no_dist=True)


def export_safetensors(
    path: str | os.PathLike | Sequence[str | os.PathLike], out_file: str | os.PathLike, *, masters: bool = False,
    model: nn.Module | None = None, overwrite: bool = False,
) -> Path:
    """Write the checkpoint's model weights to one safetensors file ``out_file``: the
    saved parameters (bf16 under SMP) and buffers as they are; with ``masters=True`` the
    fp32 master weights in place of the managed parameters (other entries as saved). A DTensor
    model's checkpoints go in together, in tensor-parallel rank order (``path`` a list), joined into
    whole tensors as ``export_torch`` joins them; one coordinate's alone is refused. ``model``: an instance of
    the saved model (meta device is fine), whose own state dict names the masters where its hooks rename or
    split parameters (``export_torch``'s ``model``).
    Written with ``{"format": "pt"}`` as its metadata into a fresh staging file beside
    ``out_file`` (``tempfile.mkstemp``), moved into place once complete. An existing
    ``out_file`` (a file, or a link, dangling or not) is refused, checked before the
    checkpoint is read, unless ``overwrite=True``: then it is replaced (a link itself, never
    what it points to).

    Returns:
        ``out_file`` as a ``Path``.

    Raises:
        ImportError: the ``safetensors`` package is missing (``pip install safetensors``).
        ConfigError: ``path`` or ``out_file`` is a URL (``s3://...``): object storage is not supported yet.
        CheckpointError: ``masters=True`` and the checkpoint holds no master weights;
            ``out_file`` is a directory, or exists (without ``overwrite``); masters the saved model state
            dict names otherwise and no ``model``, or a ``model`` that is not the one saved.
        TypeError: ``masters`` or ``overwrite`` is not a bool, ``out_file`` not a path.
    """
    if not isinstance(masters, bool) or not isinstance(overwrite, bool):
        raise TypeError(f"masters and overwrite must be True or False, got {masters!r} and {overwrite!r}.")
    _check_model_arg(model)
    if model is not None and not masters:
        raise TypeError("model= names the masters (masters=True); the saved parameters keep their saved names.")
    try:
        from safetensors.torch import save
    except ImportError:
        raise ImportError("export_safetensors needs the safetensors package: pip install safetensors") from None
    out = check_output(out_file, overwrite=overwrite, directory=False)
    full = read_whole_checkpoint(path)
    tensors = dict(full["model"])
    if masters:
        opt = full["optimizer"]
        if opt is None or opt["master_weights"] is None:
            raise CheckpointError(
                f"{path} holds no fp32 master weights; export the saved parameters with masters=False, "
                f"or save with use_master_weights_in_ckpt=True."
            )
        tensors.update(masters_through_model(model, tensors, opt["master_weights"], path) if model is not None
                       else check_masters_named_as_saved(tensors, opt["master_weights"], path))
    tensors = {key: value.contiguous() for key, value in tensors.items()}
    return write_output_file(out, lambda f: f.write(save(tensors, metadata={"format": "pt"})), overwrite=overwrite)


# ---------------------------------------------------------------------------- import
def _native_index(folder: Folder) -> dict[tuple, tuple[str, DcpEntry]]:
    """Every entry of the DCP checkpoint in ``folder`` by its path in the saved state dict
    (``("optim", "state", fqn, "exp_avg")``), with its flat key: the one DCP index reader's
    (``dcp_index.read_dcp_index``), nothing else, each record a DCP ``FileSystemWriter`` record.

    Raises:
        CheckpointError: a missing, refused or damaged index, or one this reader cannot follow.
    """
    if not folder.exists(METADATA_FILE):
        ours = folder.is_file(INDEX_FILE)
        raise CheckpointError(f"{folder.where()} has no .metadata: it is not a torch.distributed.checkpoint directory"
                              + ("; it is an nxd_smp checkpoint, which loads with nxd_smp.load_checkpoint." if ours
                                 else "."))
    try:
        entries = read_dcp_index(folder)
    except UnsafeFileError as e:
        raise CheckpointError(f"the checkpoint at {folder.where()} was refused: {e}") from None
    out: dict[tuple, tuple[str, DcpEntry]] = {}
    for key, entry in entries.items():
        if entry.path is None:
            raise CheckpointError(f"{folder.where()}: entry {key!r} has no path in the index's planner data; save with "
                                  f"DCP's default planner (it flattens the state dict and records each entry's path).")
        out[entry.path] = (key, entry)
    return out


def _read_entry(folder: Folder, key: str, entry: DcpEntry) -> Any:
    """An entry's value: a tensor assembled from its chunks, or a non-tensor object; each record through
    the strict reader (``checkpointing.reader``). The index reader checked the entry (``dcp_index``): its
    chunks are distinct, each within its own record, and add up to the tensor, so the tensor and the mask
    of what its chunks covered are bounded by the folder's size; chunks that overlap leave a gap, and
    are refused here as the mask shows them."""
    where = folder.where(METADATA_FILE)
    try:
        if isinstance(entry.meta, BytesStorageMetadata):
            info = entry.records.get(None)
            if info is None:
                raise CheckpointError(f"{where}: no record for {key!r}.")
            return read_record(folder, info.relative_path, info.offset, info.length, key)
        size, dtype = tuple(entry.meta.size), entry.meta.properties.dtype
        whole = torch.empty(size, dtype=dtype)
        covered = torch.zeros(size, dtype=torch.bool)
        for offsets, sizes, info in entry.chunks:
            piece = read_record(folder, info.relative_path, info.offset, info.length, key)
            if not isinstance(piece, torch.Tensor) or tuple(piece.shape) != sizes or piece.dtype != dtype:
                raise CheckpointError(f"{where}: the record of {key!r} at {offsets} is not the {sizes} {dtype} tensor "
                                      f"its index says.")
            span = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            if bool(covered[span].any()):
                raise CheckpointError(f"{where}: the chunks of {key!r} overlap at {offsets}.")
            whole[span].copy_(piece)
            covered[span] = True
        if not bool(covered.all()):
            raise CheckpointError(f"{where}: the chunks of {key!r} cover {int(covered.sum())} of its {whole.numel()} "
                                  f"elements.")
        return whole
    except UnsafeFileError as e:
        raise CheckpointError(f"the checkpoint at {folder.where()} was refused: {e}") from None
    except CheckpointError:
        raise
    except (OSError, RuntimeError) as e:
        raise CheckpointError(f"the checkpoint at {folder.where()} is damaged or refused: {e}") from e


def import_torch(path: str | os.PathLike, *, model: nn.Module, optimizer: Zero1Optimizer) -> None:
    """Load a native DCP checkpoint ``{"model": model_sd, "optim": optim_sd}`` (what a torch run saves
    with ``dcp.save`` after ``get_state_dict(model, optimizer)``, under DDP, FSDP2 or in one process) into
    ``model`` and ``optimizer`` at the optimizer's own DP size. Every process of the job calls it (the ranks
    agree world-wide) and reads everything itself; the reading communicates with no one.

    The native parameters (fp32) become the master weights and the model's parameters those masters
    rounded to its dtype; buffers and other non-managed entries are cast to the model's dtypes (each must
    convert exactly). The optimizer state is taken by parameter FQN, the hyperparameters from the native
    group holding each of ``optimizer``'s groups (other top-level entries, such as a scheduler's, are not
    read; a loss scaler keeps its state). It runs nxd_smp's one load pipeline: read (the index unpickled
    by the strict reader's DCP-metadata allow-list, every record by its state-dict allow-list), check,
    the ranks' agreement, install; nothing changes unless every rank's check passed.

    Raises:
        ConfigError: ``path`` is a URL (``s3://...``): object storage is not supported yet.
        CheckpointError: no or a refused/damaged index or record; missing or surplus names, shapes that
            differ, groups that do not fit; each named.
    """
    directory = local_path(path, "the DCP directory")
    optimizer = check_args(model, optimizer)  # (a torch optimizer loads with dcp.load and set_state_dict)
    if optimizer is None:
        raise TypeError("import_torch needs the optimizer to load into.")
    if any(is_dtensor(p) for p in optimizer.managed_params):
        raise CheckpointError(
            "import_torch installs whole tensors into a model without DTensors; this model's parameters are "
            "DTensors. Load the weights with dcp.load into model.state_dict() and model.load_state_dict(...), then "
            "build the Zero1Optimizer (its masters from those weights; the optimizer state starts afresh).")
    targets = Targets(model=model, optimizer=optimizer, objects={}, backend=optimizer.backend)
    run(lambda request: _read(directory, model, optimizer, request), targets, what=str(directory))


def _read(directory: Path, model: nn.Module, optimizer: Zero1Optimizer, request: Request) -> Staged:
    """``import_torch``'s reader: the model's entries the live model has, the native optimizer state of
    the managed parameters, each live group's hyperparameters from its native group, the native fp32
    parameters as the masters."""
    with Folder.open(directory) as folder:
        index = _native_index(folder)
        tops = sorted({str(where[0]) for where in index})
        model_entries: dict[str, tuple[str, DcpEntry]] = {}
        state_entries: dict[tuple, tuple[str, DcpEntry]] = {}
        group_entries: dict[tuple, tuple[str, DcpEntry]] = {}
        odd = []
        for where, found in index.items():
            if where[0] == MODEL and len(where) == 2 and isinstance(where[1], str):
                model_entries[where[1]] = found
            elif where[:2] == (OPTIM, "state") and len(where) == 4 and all(isinstance(w, str) for w in where[2:]):
                state_entries[where[2:]] = found
            elif where[:2] == (OPTIM, "param_groups") and len(where) == 4 and type(where[2]) is int \
                    and isinstance(where[3], str):
                group_entries[where[2:]] = found
            elif where[0] in (MODEL, OPTIM):
                odd.append(found[0])
        if odd:
            raise CheckpointError(f"{directory} holds entries outside get_state_dict's layout: {sorted(odd)[:8]}.")
        if not model_entries or not group_entries:
            raise CheckpointError(f"{directory} holds top-level entries {tops}; import_torch needs 'model' and 'optim' "
                                  f"as get_state_dict(model, optimizer) returns them (load the weights alone with "
                                  f"dcp.load and model.load_state_dict).")
        groups: dict[int, dict[str, Any]] = {}
        for (number, key), (flat, entry) in group_entries.items():
            if isinstance(entry.meta, TensorStorageMetadata) and math.prod(entry.meta.size) > 64:
                files = sorted({str(info.relative_path) for info in entry.records.values()})
                raise CheckpointError(f"{directory}: param group {number}'s {key!r} (in {files}) is a tensor of shape "
                                      f"{tuple(entry.meta.size)}; a hyperparameter is a number. Refused.")
            if number > len(group_entries):
                raise CheckpointError(f"{directory}: param group {number} of {len(group_entries)} entries; refused.")
            groups.setdefault(number, {})[key] = _read_entry(folder, flat, entry)
        if sorted(groups) != list(range(len(groups))) or not all(
                isinstance(g.get("params"), list) and all(isinstance(n, str) for n in g["params"]) for g in groups.values()):
            raise CheckpointError(f"{directory}: the param groups are not get_state_dict's (a list, each with its "
                                  f"parameters' FQNs under 'params').")
        names = request.optimizer.names
        native_group = {fqn: number for number, g in groups.items() for fqn in g["params"]}
        hypers = []  # (each live group's from the native group holding its parameters; their fit is the check's)
        for mine, group in zip(request.optimizer.groups, optimizer.param_groups):
            found = sorted({native_group[n] for n in mine if n in native_group})
            if len(found) > 1:
                raise CheckpointError(f"the checkpoint at {directory} does not fit the optimizer: its group of "
                                      f"{mine[:4]} spans the native groups {found}.")
            hypers.append({k: v for k, v in groups[found[0]].items() if k != "params"} if found
                          else group_hyperparameters(group))
        wanted = request.model_keys or set()
        shapes = {key: (tuple(entry.meta.size), entry.meta.properties.dtype)
                  for key, (_, entry) in model_entries.items() if isinstance(entry.meta, TensorStorageMetadata)}
        staged = Staged(source=str(directory), model=StagedModel(
            shapes, {key: _read_entry(folder, flat, entry) for key, (flat, entry) in model_entries.items()
                     if key in wanted and key in shapes}, str(folder.where(METADATA_FILE))))
        # every parameter the file holds state for (one the optimizer does not manage, or a managed one without
        # state where others have it, is the check's to name); none at all (a state not made yet): the
        # parameters its groups list, each without state, so that the check compares them with the live ones
        state: dict[str, dict[str, Any]] = {} if state_entries else {fqn: {} for fqn in native_group}
        managed = set(names)
        for (fqn, key), (flat, entry) in state_entries.items():
            values = state.setdefault(fqn, {})
            if fqn in managed:  # (another's is named by the check, not read)
                values[key] = _read_entry(folder, flat, entry)
        masters = ({name: staged.model.entries[name] for name in names if name in staged.model.entries}
                   if optimizer.mixed_precision.use_master_weights else None)
        staged.optimizer = full_state(state, hypers, masters, source=str(folder.where(METADATA_FILE)))
    return staged


# ---------------------------------------------------------------------------- the live model's masters
def master_state_dict(model: nn.Module, optimizer: Zero1Optimizer) -> dict[str, torch.Tensor]:
    """``model``'s own ``state_dict()`` with the fp32 master weights in place of the parameters the optimizer
    manages: its keys, its state-dict hooks run over the masters (``model_state_dict_of``), so a fused
    parameter comes out as the pieces the model's own state dict gives (TorchTitan's ``wqkv`` as
    ``wq``/``wk``/``wv``, in fp32). A DTensor parameter's master is a DTensor of the parameter's mesh and
    placements, so the hooks treat it as they treat the parameter, and the entries are what the model's own
    state dict holds (DTensors for DTensor parameters). Every rank of the job calls it (the masters are
    gathered over the data-parallel group, one parameter at a time); each rank then holds the model's fp32
    weights, as ``model.float().state_dict()`` would.

    Raises:
        TypeError: ``optimizer`` is not a ``Zero1Optimizer`` (or NxD's wrapper of one) over ``model``.
        CheckpointError: the optimizer keeps no master weights (``use_master_weights=False``): the parameters
            are the weights, in ``model.state_dict()``.
    """
    zero1 = check_args(model, optimizer)
    if zero1 is None:
        raise TypeError("master_state_dict needs the Zero1Optimizer whose masters it gives.")
    if not zero1.mixed_precision.use_master_weights:
        raise CheckpointError("this optimizer keeps no master weights (use_master_weights=False): the parameters are "
                              "the weights; use model.state_dict().")
    zero1.adopt_param_changes()  # (weights written since the last step are the truth, as state_dict() takes them)
    name_of = {id(p): name for name, p in model.named_parameters()}
    missing = [i for i, p in enumerate(zero1.managed_params) if id(p) not in name_of]
    if missing:
        raise TypeError(f"the optimizer manages {len(missing)} parameters that are not model's: pass the model whose "
                        f"parameters it was built with.")
    values: dict[str, torch.Tensor] = {}
    for param, master in zip(zero1.managed_params, zero1.rank_state.gathered_masters()):
        if is_dtensor(param):
            from torch.distributed.tensor import DTensor

            master = DTensor.from_local(master, param.device_mesh, param.placements, run_check=False,
                                        shape=param.shape, stride=param.stride())
        values[name_of[id(param)]] = master
    return model_state_dict_of(model, values)
