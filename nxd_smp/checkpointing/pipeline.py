"""The one pipeline every load goes through, whatever its format and entry point: **read** (a
format's reader: bytes to a neutral staged state, ``staged``) -> **check** (``check``: against the
live objects) -> **agree** (``backend.agreement.agree``: a world-wide verdict, and a digest compared
within each data-parallel group) -> **install** (``install``: one transaction).

Formats are registered here by the layer that knows them (``register_format``): nxd_smp's own is
registered below; NxD's tag folders by ``nxd_smp.interop`` when ``nxd_smp`` is imported. Entry points
hand ``run`` a reader and their targets:

* ``load_checkpoint`` (every registered format; rank 0 decides which checkpoint a path means);
* ``Zero1Optimizer.load_state_dict`` (``read_rank_state``: its own rank-local state dict, registered
  with the optimizer here, since a lower layer cannot import this one);
* ``load_full_optimizer_state`` and the imports of other tools' files (``full_state``: whole
  per-parameter tensors: NxD's folders, ``import_xla``, ``import_torch``).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..backend.agreement import agree
from ..core.errors import CheckpointError
from ..optim import rank_state
from ..optim.rank_state import STATE_DICT_FORMAT, layout_signature
from ..optim.state_fit import StateFit, describe, torch_group_problems
from ..zero1_optimizer import Zero1Optimizer
from .check import check, digest
from .files import Folder, entry_kind
from .install import commit, install
from .progress import phases
from .smp_format import open_version, read
from .staged import Pieces, Request, Staged, StagedOptimizer, Targets, Whole, named_pieces
from .versions import COMPLETE_FILE, checkpoint_links, locate, unpublish, version_of

log = logging.getLogger("nxd_smp.checkpoint")

Reader = Callable[[Request], Staged]


# ---------------------------------------------------------------------------- the four stages
def run(read: Reader, targets: Targets, *, what: str, progress: bool | None = False) -> Staged:
    """Read (this rank's part, through ``read``), check, agree (every rank of the job), install; every
    rank calls it. Returns the staged state (its ``extra`` is what ``load_checkpoint`` returns).

    Raises:
        CheckpointError: on every rank, when any rank's read or check refused, or the ranks of a
            data-parallel group would install different values; nothing is changed then.
    """
    backend = targets.backend
    with phases(progress, backend.rank, ["read and check", "install"], f"load {Path(what).name}", log) as advance:

        def prepare() -> tuple[tuple[Staged, Any], Callable[[], None], dict[str, str]]:
            staged = read(targets.request())
            plan = check(staged, targets)
            fingerprints = digest(staged, plan)  # (before the install: nothing after it may fail here)
            return (staged, plan), install(staged, plan, targets), fingerprints

        staged, plan = agree(backend.world_coordinator, prepare, what=what, group=targets.group())
        advance("read and check")
        commit(staged, plan, targets)
        advance("install")
    return staged


# ---------------------------------------------------------------------------- formats
class FolderFormat(ABC):
    """One tool's checkpoint folder layout, as the entry points meet it."""

    #: The tool's name, as errors name it.
    name: str = ""
    #: Whether ``save_state_dicts`` writes the state dicts a caller passes instead of objects.
    writes_state_dicts: bool = False

    @abstractmethod
    def is_folder(self, path: Path) -> bool:
        """Whether ``path`` is a checkpoint of this format, complete or not."""

    @abstractmethod
    def is_complete(self, path: Path) -> bool:
        """Whether ``path`` (``is_folder``) holds a complete checkpoint."""

    @abstractmethod
    def newest(self, directory: Path) -> Path | None:
        """The newest complete checkpoint of this format in ``directory``, None if it holds none."""

    @abstractmethod
    def remove(self, path: Path) -> None:
        """Remove ``path`` so that an interrupted removal never leaves something complete-looking."""

    @abstractmethod
    def locate(self, path: Path) -> Any:
        """Rank 0: the complete checkpoint ``path`` means, as a JSON value every rank's ``reader`` takes."""

    @abstractmethod
    def reader(self, location: Any, targets: Targets, *, verify: bool) -> Reader:
        """The reader of the checkpoint at ``location`` (``locate``'s) for ``targets``."""

    def save_state_dicts(self, folder: Path, *, model: Any, optimizer: Any, scheduler: Any, user_content: Any,
                         backend: Any, async_save: bool, num_kept: int | None) -> Path:
        """Write the state dicts ``model`` and ``optimizer`` into ``folder``; every rank calls it."""
        raise NotImplementedError(f"{self.name} folders are read, not written, by nxd_smp.")


class SmpFormat(FolderFormat):
    """nxd_smp's own checkpoints (``smp_format``, ``versions``): a link to a version directory, a version
    directory, or a directory of links (its newest complete one)."""

    name = "nxd_smp"

    def is_folder(self, path: Path) -> bool:
        try:
            with Folder.open(path.parent) as root:
                return version_of(root, path.name) is not None or root.exists(f"{path.name}/{COMPLETE_FILE}")
        except (OSError, CheckpointError):
            return False

    def is_complete(self, path: Path) -> bool:
        try:
            self.locate(path)
            return True
        except (FileNotFoundError, CheckpointError):
            return False

    def newest(self, directory: Path) -> Path | None:
        try:
            with Folder.open(directory) as root:
                return directory if checkpoint_links(root) else None
        except (OSError, CheckpointError):
            return None

    def remove(self, path: Path) -> None:
        with Folder.open(path.parent) as root:
            unpublish(root, path.name)

    def locate(self, path: Path) -> Any:
        with Folder.open(path.parent) as root:
            where, version = locate(root, path.name)
            return [str(root.path), (f"{path.name}/" if where else "") + version]

    def reader(self, location: Any, targets: Targets, *, verify: bool) -> Reader:
        root_path, version_name = location

        def read_smp(request: Request) -> Staged:
            with Folder.open(root_path) as root, root.sub(version_name) as version:
                return read(open_version(version), request, verify=verify)

        return read_smp


_formats: list[FolderFormat] = [SmpFormat()]


def register_format(folder_format: FolderFormat) -> None:
    """Teach the checkpoint entry points ``folder_format`` (once; a second registration of the same class
    replaces the first). Other tools' formats are asked before nxd_smp's own."""
    _formats[:] = [f for f in _formats if type(f) is not type(folder_format)]
    _formats.insert(len(_formats) - 1, folder_format)


def registered_formats() -> list[FolderFormat]:
    return list(_formats)


def format_named(name: str) -> FolderFormat:
    return next(f for f in _formats if f.name == name)


def locate_checkpoint(path: Path) -> list:
    """Rank 0: which format's checkpoint ``path`` means, and where, as ``[format name, location]``: another
    tool's folder that ``path`` is, or (a directory holding no nxd_smp checkpoint) its newest complete one;
    else nxd_smp's.

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointError: nothing complete there, naming why.
    """
    own = _formats[-1]
    kind = entry_kind(path)
    if kind != "link":
        for folder_format in _formats[:-1]:
            if folder_format.is_folder(path):
                return [folder_format.name, folder_format.locate(path)]
        if kind == "directory" and own.newest(path) is None:
            for folder_format in _formats[:-1]:
                newest = folder_format.newest(path)
                if newest is not None:
                    return [folder_format.name, folder_format.locate(newest)]
    return [own.name, own.locate(path)]


def state_dict_format() -> FolderFormat:
    """The registered format that writes state dicts (NxD's tag folders).

    Raises:
        TypeError: none is registered (``nxd_smp.interop`` was not imported).
    """
    for folder_format in _formats:
        if folder_format.writes_state_dicts:
            return folder_format
    raise TypeError("no checkpoint format for state dicts is registered: import nxd_smp (its interop part registers "
                    "NxD's), or pass the model and optimizer objects.")


# ---------------------------------------------------------------------------- whole per-parameter state
def full_state(state: Any, hyperparameters: Any, masters: Any, *, source: str) -> StagedOptimizer:
    """An optimizer state of whole per-parameter tensors (``{name: {key: tensor or number}}``, one dict of
    hyperparameters per live param group, masters ``{name: tensor}`` or None) as the staged state: what
    NxD's folders, torch_xla's files, DCP imports and ``load_full_optimizer_state`` give. Its structure
    is checked here; its fit, by the check.

    Raises:
        CheckpointError: not ``{name: {key: value}}`` with a list of groups.
    """
    if not isinstance(state, Mapping) or not isinstance(hyperparameters, (list, tuple)) or not (
            masters is None or isinstance(masters, Mapping)) or not all(isinstance(h, Mapping) for h in hyperparameters):
        raise CheckpointError(f"{source}: the optimizer state is not {{name: {{key: tensor}}}} with a list of param "
                              f"groups.")
    staged = {}
    for name, entry in state.items():
        if not isinstance(entry, Mapping):
            staged[name] = entry  # (the check names it)
            continue
        staged[name] = {key: Whole(value) if isinstance(value, torch.Tensor) else value for key, value in entry.items()}
    return StagedOptimizer(
        groups=[{k: v for k, v in h.items() if k not in ("params", "param_names")} for h in hyperparameters],
        state=staged,
        masters=None if masters is None else {name: Whole(value) if isinstance(value, torch.Tensor) else value
                                              for name, value in masters.items()},
        source=source)


# ---------------------------------------------------------------------------- the rank-local state dict
def read_rank_state(targets: Targets, state_dict: Any, request: Request) -> Staged:
    """``Zero1Optimizer.state_dict()``'s dict, from this rank at this DP size and layout, as the staged
    state: each bucket shard's moments as the pieces of its parameters, its 0-dim state as each
    parameter's counters, the master shards as pieces, the param groups' hyperparameters, the loss
    scaler's state.

    Raises:
        CheckpointError: not such a dict, of another rank, layout or DP size, or a state that no shard of
            this optimizer can hold; naming the fix.
    """
    source = "the state dict"
    optimizer = targets.zero1
    if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_DICT_FORMAT:
        found = state_dict.get("format") if isinstance(state_dict, dict) else None
        raise CheckpointError(f"not a Zero1Optimizer state dict (missing format {STATE_DICT_FORMAT!r}); pass what "
                              f"Zero1Optimizer.state_dict() returned."
                              + (rank_state.hint(f"format:{found}") if isinstance(found, str) else ""))
    layouts = optimizer.bucket_layouts
    problems = [f"{key} {describe(state_dict.get(key))} (this optimizer: {mine})"
                for key, mine in (("world_size", optimizer.world_size), ("rank", optimizer.rank))
                if state_dict.get(key) != mine or isinstance(state_dict.get(key), bool)]
    if state_dict.get("layout") != layout_signature(layouts):
        problems.append("bucket layout (parameters, shapes, dtypes, groups or bucket size differ)")
    inner, groups = state_dict.get("inner"), state_dict.get("param_groups")
    if not isinstance(inner, dict) or not isinstance(inner.get("state"), dict) \
            or not isinstance(inner.get("param_groups"), list) or not isinstance(groups, list):
        problems.append("the inner optimizer's state (not a torch.optim state dict)")
    else:
        problems += torch_group_problems(groups, optimizer.param_groups, "param_groups")
        problems += torch_group_problems(inner["param_groups"], optimizer.inner_optimizer.param_groups,
                                         "inner param_groups")
        if not problems:  # (the inner groups' hyperparameters are not installed, the wrapper's are: a file's
            # that no optimizer could hold is refused all the same, as a sign of a crafted file)
            inner_groups = [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]]
            problems += [f"inner {p}" for p in StateFit(type(optimizer.inner_optimizer),
                                                        optimizer.inner_optimizer.param_groups,
                                                        inner_groups).group_problems()]
    masters = state_dict.get("master_weights")
    if masters is not None and (not isinstance(masters, (list, tuple)) or len(masters) != len(layouts) or any(
            not isinstance(m, torch.Tensor) or tuple(m.shape) != (layout.shard_numel,)
            for m, layout in zip(masters, layouts))):
        problems.append("master weight shard shapes")
    if problems:
        raise CheckpointError(
            "this state dict does not fit the optimizer: " + "; ".join(problems) + ". Rank-local state dicts load "
            "only into the same model, DP size and rank; use nxd_smp.checkpoint to change the DP size."
            + (rank_state.hint("another rank") if state_dict.get("rank") != optimizer.rank else ""))
    # each id the inner groups list is one shard of the inner optimizer: the bucket it is
    bucket_of = {id(shard): b for b, shard in enumerate(optimizer.inner_shards)}
    shard_of = {i: bucket_of[id(p)] for saved, live in zip(inner["param_groups"], optimizer.inner_optimizer.param_groups)
                for i, p in zip(saved["params"], live["params"])}
    names = request.optimizer.names
    order = targets.names()  # (in layout order)
    shapes = request.optimizer.shapes
    mine: dict[str, dict[int, tuple[int, int, int]]] = {name: {} for name in names}  # {param_start: (b, at, numel)}
    for b, name, piece in named_pieces(layouts, optimizer.rank, order):
        mine[name][piece.param_start] = (b, piece.shard_start, piece.numel)
    state: dict[str, dict[str, Any]] = {name: {} for name in names}
    bad = []
    for index, entry in inner["state"].items():
        if isinstance(index, bool) or index not in shard_of or not isinstance(entry, Mapping):
            bad.append(f"inner state for shard {describe(index)}, which this optimizer does not have")
            continue
        b = shard_of[index]
        for key, value in entry.items():
            if not isinstance(key, str) or not isinstance(value, torch.Tensor) \
                    or tuple(value.shape) not in ((), (layouts[b].shard_numel,)):
                bad.append(f"inner state of shard {index}: {describe(key)} is "
                           f"{value.dtype if isinstance(value, torch.Tensor) else type(value).__name__}"
                           f"{' of shape ' + str(tuple(value.shape)) if isinstance(value, torch.Tensor) else ''}, "
                           f"neither 0-dim nor the shard's ({layouts[b].shard_numel},)")
                continue
            for i in layouts[b].param_indices:
                name = order[i]
                state[name][key] = Whole(value) if value.dim() == 0 else _pieces(value, shapes[name], mine[name])
    if bad:
        raise CheckpointError(f"{source} does not fit the optimizer: " + "; ".join(bad) + ".")
    staged = StagedOptimizer(groups=[{k: v for k, v in g.items() if k != "params"} for g in groups], state=state,
                             masters=None, scaler=state_dict.get("loss_scaler") if optimizer.loss_scaler else None,
                             source=source)
    if masters is not None:
        staged.masters = {}
        for b, layout in enumerate(layouts):
            for i in layout.param_indices:
                staged.masters[order[i]] = _pieces(masters[b], shapes[order[i]], mine[order[i]])
    return Staged(source=source, optimizer=staged)


def _pieces(shard: torch.Tensor, shape: tuple[int, ...], mine: Mapping[int, tuple[int, int, int]]) -> Pieces:
    """A parameter's part of a shard-shaped tensor: its pieces on this rank, as views."""
    return Pieces(shape, shard.dtype, {start: shard[at:at + numel] for start, (_, at, numel) in mine.items()})


def load_rank_state(optimizer: Zero1Optimizer, state_dict: Any, *, install: bool) -> None:
    """``Zero1Optimizer.load_state_dict`` (``install``: the one pipeline with the rank-local reader; every
    rank calls it) and ``check_state_dict`` (not: read and checked on this rank alone, nothing installed,
    no communication)."""
    targets = Targets(model=None, optimizer=optimizer, objects={}, backend=optimizer.backend,
                      rebuild_masters=False, discard_gradients=False)
    if install:
        run(lambda request: read_rank_state(targets, state_dict, request), targets, what="its state dict")
    else:
        check(read_rank_state(targets, state_dict, targets.request()), targets)


rank_state.register_loader(load_rank_state)
