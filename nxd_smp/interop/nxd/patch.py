"""One call that puts nxd_smp under the code that calls NxD: NxD's own trainer, NxD Training
(``neuronx_distributed_training``) and optimum-neuron import NxD's names, some at module level,
and cannot be pointed at another optimizer without being edited.

``patch_neuronx_distributed()`` makes these six of NxD's names nxd_smp's, wherever they are bound:

* ``NeuronZero1Optimizer`` and ``initialize_parallel_optimizer``: the optimizer;
* ``save_checkpoint``, ``load_checkpoint``, ``has_checkpoint``, ``finalize_checkpoint``: NxD's own
  ``save_checkpoint`` writes a per-rank optimizer file only for NxD's classes (or a dict flagged
  ``zero1_optimizer``), so with nxd_smp's optimizer it would keep rank 0's shard alone.

"Wherever they are bound" means NxD's modules and every module already imported that bound NxD's
objects under any name (optimum-neuron's accelerator and optimizer modules, NxD's trainer and
checkpoint modules); a module imported later gets nxd_smp's from NxD's modules. Subclasses of NxD's
optimizer (``NeuronEPZero1Optimizer``, expert parallelism) are left alone.

NxD Training removes old checkpoint tags through NxD's internal io state
(``neuronx_distributed.trainer.checkpoint.g_iostate``, made by NxD's ``save_checkpoint``, which no
longer runs): the patch puts an io state of nxd_smp's there, whose ``submit_remove`` removes the
named tags from the directory of the last save (``checkpoint.remove_checkpoint``, from rank 0),
and whose ``wait_save``/``wait_all`` are ``finalize_checkpoint`` (optimum-neuron waits through it
before an asynchronous save).

NxD stays optional: nothing here imports it at module level.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

import torch.distributed as dist

from ...backend import this_replica
from ...checkpoint import (
    finalize_checkpoint,
    has_checkpoint,
    last_tag_directory,
    load_checkpoint,
    remove_checkpoint,
    save_checkpoint,
)
from .optimizer import NeuronZero1Optimizer
from .wrapper import initialize_parallel_optimizer

#: NxD's name -> (the module of NxD that defines it, nxd_smp's object)
NXD_NAMES: dict[str, tuple[str, Any]] = {
    "NeuronZero1Optimizer": ("neuronx_distributed.optimizer.zero_redundancy_optimizer", NeuronZero1Optimizer),
    "initialize_parallel_optimizer": ("neuronx_distributed.trainer.trainer", initialize_parallel_optimizer),
    "save_checkpoint": ("neuronx_distributed.trainer.checkpoint", save_checkpoint),
    "load_checkpoint": ("neuronx_distributed.trainer.checkpoint", load_checkpoint),
    "has_checkpoint": ("neuronx_distributed.trainer.checkpoint", has_checkpoint),
    "finalize_checkpoint": ("neuronx_distributed.trainer.checkpoint", finalize_checkpoint),
}
_CHECKPOINT_MODULE = "neuronx_distributed.trainer.checkpoint"
# NxD's own objects (kept alive here, so their ids stay theirs) and nxd_smp's for each, found
# at the first call (later calls find nxd_smp's in NxD's modules).
_originals: dict[int, tuple[Any, Any]] = {}


class CheckpointIOState:
    """What NxD Training and optimum-neuron reach for in NxD's ``g_iostate`` once NxD's
    ``save_checkpoint`` is nxd_smp's (which keeps its own save in flight, per rank)."""

    def wait_save(self, async_remove: bool = False) -> None:
        """Wait for this rank's save in flight and raise its error (``finalize_checkpoint``)."""
        finalize_checkpoint()

    def wait_all(self) -> None:
        finalize_checkpoint()

    def wait_remove(self) -> None:
        """Removals happen at once: nothing to wait for."""

    def finalize_shutdown(self) -> None:
        """Nothing runs at interpreter shutdown."""

    def submit_remove(self, num_kept: int | None, async_remove: bool = False,
                      remove_tags: list[str] | None = None) -> None:
        """Remove the tags ``remove_tags`` (NxD Training's ``remove_checkpoint`` passes one)
        from the directory of this rank's last save, on rank 0 only, as NxD does. Without
        tags there is nothing to do: nxd_smp's saves apply ``num_kept_ckpts`` themselves."""
        directory = last_tag_directory()
        if not remove_tags or directory is None or not _first_rank():
            return
        for tag in remove_tags:
            remove_checkpoint(directory / str(tag))


def _first_rank() -> bool:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return this_replica() in (None, 0)


def patch_neuronx_distributed() -> None:
    """Make NxD's ``NeuronZero1Optimizer``, ``initialize_parallel_optimizer``,
    ``save_checkpoint``, ``load_checkpoint``, ``has_checkpoint`` and ``finalize_checkpoint``
    nxd_smp's, in NxD's modules and in every module imported so far that bound them (see the
    module's docstring); give NxD Training's tag removal an io state. Call it once at the top of
    the training script, before building the trainer; calling it again changes nothing.

    Raises:
        ImportError: ``neuronx_distributed`` is not installed (the Neuron SDK's package: PyPI's
            ``neuronx-distributed`` is an empty placeholder).
    """
    modules = {}
    for module_name, _ in NXD_NAMES.values():
        try:
            modules[module_name] = importlib.import_module(module_name)
        except ImportError as e:
            raise ImportError(
                f"patch_neuronx_distributed() needs neuronx-distributed, the Neuron SDK's package (it could not import "
                f"{module_name}: {e}). Install it from the Neuron SDK's package index; PyPI's neuronx-distributed is "
                f"an empty placeholder. Without it, call nxd_smp's functions directly."
            ) from e
    ours = {id(obj): obj for _, obj in NXD_NAMES.values()}
    for name, (module_name, obj) in NXD_NAMES.items():
        theirs = getattr(modules[module_name], name, None)
        if theirs is not None and id(theirs) not in ours:
            _originals[id(theirs)] = (theirs, obj)
    for module in list(sys.modules.values()):
        _rebind(module)
    checkpoint_module = modules[_CHECKPOINT_MODULE]
    if getattr(checkpoint_module, "g_iostate", None) is None:  # (NxD's own, if its save ran before, stays)
        checkpoint_module.g_iostate = CheckpointIOState()


def _rebind(module: Any) -> None:
    """In ``module``, every name bound to one of NxD's originals now names nxd_smp's object."""
    if not isinstance(module, types.ModuleType):
        return
    try:
        items = list(vars(module).items())
    except TypeError:
        return
    for attribute, value in items:
        entry = _originals.get(id(value))
        if entry is not None and entry[0] is value:
            setattr(module, attribute, entry[1])
