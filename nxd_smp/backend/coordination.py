"""Host-side coordination of a data-parallel group: what checkpoints need to agree on a
version, gather the ranks' file lists and share one outcome.

Which one a launch gets is the backend's choice (``EagerBackend`` / ``XlaBackend``):

* ``LocalCoordinator``: a group of one;
* ``ProcessGroupCoordinator``: torch.distributed is initialised (gloo, nccl or the ``xla``
  backend): a gloo group over the same ranks, made for checkpoints at their first use (by
  those ranks only), so the background writer never shares a communicator with training;
* ``ThreadCoordinator``: XLA replicas that are threads of this process (the XLA CPU device,
  ``torch_xla.launch``/``xmp.spawn``), where there is no torch.distributed and
  ``xm.rendezvous`` hangs (it is an all-gather without a channel id): a barrier and a slot
  per rank in memory;
* ``RendezvousCoordinator``: XLA replicas in separate processes without torch.distributed
  (``xmp.spawn`` on Neuron): ``xm.rendezvous``, as NxD coordinates its checkpoints. It uses
  the device, so only the replica's own thread may call it.

Payloads are JSON values (strings, numbers, lists, dicts with string keys, None), the same
under every coordinator.
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from ..core.errors import ConfigError, CoordinationError


#: How long a rank waits for the others at one exchange (torch.distributed's default).
TIMEOUT_S = 1800.0


def _json(obj: Any) -> Any:
    """``obj`` as it arrives on another rank (a JSON round trip): the same under every
    coordinator, and a payload that JSON cannot carry fails on every launch alike."""
    return json.loads(json.dumps(obj))


class Coordinator(ABC):
    """The ranks of one group exchanging small JSON values on the host.

    Attributes:
        rank, size: this rank's index in the group and the group's size.
        works_off_thread: a thread other than the rank's own (the background writer of an
            asynchronous save) may call it.
    """

    rank: int
    size: int
    works_off_thread: bool = True

    @abstractmethod
    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order; every rank of the group calls it."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        return self.all_gather(obj if self.rank == src else None)[src]

    def barrier(self) -> None:
        self.all_gather(None)


def coordination_backend() -> str | None:
    """The torch.distributed backend of the host-side coordination: gloo where torch has it (a CPU
    group, whatever device the training uses), else None (the default group's backend)."""
    return "gloo" if dist.is_gloo_available() else None


class LocalCoordinator(Coordinator):
    """A group of one rank."""

    rank, size = 0, 1

    def all_gather(self, obj: Any) -> list[Any]:
        return [_json(obj)]


class ProcessGroupCoordinator(Coordinator):
    """Over a host-side group of the given global ranks, created when first used: gloo, or where
    this torch has no gloo (a device build without it) the default group's backend, whose object
    collectives go through the current accelerator."""

    def __init__(self, ranks: Sequence[int]):
        self.ranks = sorted(ranks)
        me = dist.get_rank()
        if me not in self.ranks:
            raise ConfigError(f"this process (global rank {me}) is not in the group {self.ranks}.")
        self.rank, self.size = self.ranks.index(me), len(self.ranks)
        self._group: dist.ProcessGroup | None = None

    def _gloo(self) -> dist.ProcessGroup:
        if self._group is None:
            # The original ``new_group`` (torch_xla replaces ``dist.new_group`` with a version
            # that drops ``use_local_synchronization``): only the group's ranks call it.
            from torch.distributed import distributed_c10d

            self._group = distributed_c10d.new_group(self.ranks, backend=coordination_backend(),
                                                     use_local_synchronization=True)
        return self._group

    def all_gather(self, obj: Any) -> list[Any]:
        if self.size == 1:
            return [_json(obj)]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, json.dumps(obj), group=self._gloo())
        return [json.loads(s) for s in out]


class _Exchange:
    """One slot per rank and a barrier: what the replica threads of one group share."""

    def __init__(self, size: int):
        self.barrier = threading.Barrier(size)
        self.slots: list[Any] = [None] * size


_exchanges: dict[tuple[int, ...], _Exchange] = {}
_exchanges_lock = threading.Lock()


class ThreadCoordinator(Coordinator):
    """XLA replicas that are threads of this process, group ``ranks`` (global ordinals)."""

    def __init__(self, ranks: Sequence[int], rank: int, timeout: float = TIMEOUT_S):
        self.ranks = tuple(ranks)
        self.rank, self.size = rank, len(self.ranks)
        self.timeout = timeout
        with _exchanges_lock:
            self._exchange = _exchanges.setdefault(self.ranks, _Exchange(self.size))

    def all_gather(self, obj: Any) -> list[Any]:
        exchange = self._exchange
        try:
            exchange.slots[self.rank] = _json(obj)
            exchange.barrier.wait(self.timeout)
            out = list(exchange.slots)
            exchange.barrier.wait(self.timeout)  # nobody writes the next round's slots before all read
        except threading.BrokenBarrierError:
            exchange.barrier.reset()
            raise CoordinationError(
                f"replica {self.ranks[self.rank]} waited {self.timeout:.0f} s for the replicas "
                f"{list(self.ranks)} to reach the same checkpoint step; one of them failed or "
                f"did not call it. Every replica of the group calls save_checkpoint/load_checkpoint."
            ) from None
        return out


class RendezvousCoordinator(Coordinator):
    """``xm.rendezvous`` over the replica group ``ranks`` (global ordinals)."""

    works_off_thread = False

    def __init__(self, ranks: Sequence[int], rank: int):
        self.ranks = list(ranks)
        self.rank, self.size = rank, len(self.ranks)
        self._round = 0

    def all_gather(self, obj: Any) -> list[Any]:
        import torch_xla.core.xla_model as xm

        self._round += 1
        payloads = xm.rendezvous(f"nxd_smp.checkpoint.{self._round}", json.dumps(obj).encode(), self.ranks)
        return [json.loads(bytes(p).decode()) for p in payloads]
