"""The one device decision, made once: where the flat buffers and the parameters live, how
the ranks communicate, who this rank is, and how checkpoints coordinate.

``select_backend(device, group)`` is called when an optimizer is built; everything that
differs between devices goes through the object it returns:

* ``EagerBackend`` (CPU, CUDA): the parameters become views into one flat buffer per
  bucket, filled in place by torch.distributed collectives over a process group;
* ``XlaBackend`` (any XLA device: Trainium, the XLA CPU device): the parameters stay
  apart and rank-free in-graph collectives run over replica groups, whatever form of group
  was passed (None, the default group of ``init_process_group("xla")``, a
  ``dist.new_group``, replica-group lists).

Nothing outside this package asks what device it is on (a kernel choice inside the eager
path, CPU or CUDA, stays next to its kernel). The backend also carries the ranks' host-side
coordination (``coordination``) and the one agreement every load ends with (``agreement``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..core.environment import xla_runtime_started
from .base import Backend, GroupSpec, NormGroupSpec, is_replica_groups
from .eager import EagerBackend
from .xla import XlaBackend

__all__ = ["Backend", "EagerBackend", "XlaBackend", "select_backend"]


def select_backend(device: torch.device, group: GroupSpec = None, *, pin_layout: bool = True) -> Backend:
    """The backend for parameters on ``device`` sharded over ``group``.

    Raises:
        TypeError, ValueError: a group form that does not fit the device or this rank,
            naming the fix.
    """
    if device.type == "xla":
        return XlaBackend(device, group, pin_layout)
    return EagerBackend(device, group)


def group_backends(groups: NormGroupSpec, device: torch.device, *, pin_layout: bool = True) -> list[Backend]:
    """The backends of a tensor-, pipeline- or context-parallel group spec (None, one group in any
    form, or a list of process groups), for the sums over them."""
    if groups is None:
        return []
    if isinstance(groups, dist.ProcessGroup) or is_replica_groups(groups):
        return [select_backend(device, groups, pin_layout=pin_layout)]
    if not isinstance(groups, (list, tuple)):
        raise TypeError(
            f"norm groups must be None, a process group, a list of them, or replica groups (a list "
            f"of lists of ranks), got {type(groups).__name__}."
        )
    return [select_backend(device, g, pin_layout=pin_layout) for g in groups]


def this_replica() -> Any:
    """Which rank of this process is calling: the XLA replica this thread runs (replicas of
    the XLA CPU device are threads of one process), else None. Per-rank host state (the
    checkpoint save in flight) is kept under it."""
    if not xla_runtime_started():
        return None
    import torch_xla.runtime as xr

    return xr.global_ordinal()
