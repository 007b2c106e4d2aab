"""This rank's master shards, and which of them the parameters still agree with.

Under SMP each bucket has an fp32 master shard; without master weights the shard is the
parameter dtype's (on eager devices it is the parameters' own memory). Only what the
optimizer itself wrote is known to equal ``master.to(param dtype)``: a parameter written in
place since (``model.load_state_dict``, a broadcast, ``p.mul_(...)``) is the truth, and its
master is rebuilt from it. torch's in-place version counter (``p._version``) tells which
parameters were written, at no cost per step; writes through ``.data`` are not counted
(``rebuild`` is the call for them).

With remainders (``use_param_remainders``) no fp32 shard is kept between steps: the master
is the bf16 parameter plus an int16 remainder of this rank's shard (``rounding.
split_master``), 2 bytes per parameter sharded instead of 4. ``begin_update`` rebuilds the
fp32 shards for the inner step, ``publish`` splits them again (the parameter rounded to
nearest, ties away from zero: the rounding of this mode) and frees them. A parameter written
from outside gets a zero remainder: its master is its value.

Every operation is element-wise on this rank's shard, with no rank in the graph: the
parameters' shard comes from the backend (``param_shard``), and a per-parameter mask is
built over the whole bucket and cut with ``local_shard``.
"""

from __future__ import annotations

import operator

from collections.abc import Sequence

import torch

from ..core.errors import ConfigError
from ..backend import Backend
from ..core.layout import BucketLayout
from ..core.memory import staggered_empty
from .frozen import bucket_mask
from .precision import PrecisionPlan
from .rounding import join_master, split_master


_VERSION = operator.attrgetter("_version")


class MasterWeights:
    """The master shard of every bucket (``shards``) over ``params`` laid out by ``layouts``.

    Args:
        params: the managed parameters in layout order, already placed by ``backend`` (a DTensor's
            local part).
        written_through: the parameters as the user holds them, when ``params`` are their local
            parts: in-place writes are counted on both.
        plan: the precision plan: the master dtype of each parameter dtype (fp32 under SMP), and
            whether each master is kept as the bf16 parameter plus an int16 remainder (then
            ``shards``, what the inner optimizer steps, hold data only between ``begin_update``
            and ``publish``, and ``values()`` rebuilds the fp32 masters).

    Without master weights on a backend whose ``param_shard`` is the parameters' own memory, the
    master shard is that memory (``alias``).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        layouts: Sequence[BucketLayout],
        backend: Backend,
        plan: PrecisionPlan,
        written_through: Sequence[torch.Tensor] | None = None,
    ):
        self._params = list(params)
        # what a user writes in place: the parameters themselves (a DTensor counts its own writes,
        # not its local part's, which ``params`` holds), beside ``params``
        self._written_through = self._params if written_through is None else list(written_through)
        self._layouts = list(layouts)
        self._backend = backend
        self.alias = backend.param_shard_is_storage and not plan.master_weights
        self.shards: list[torch.Tensor] = []
        self.remainders: list[torch.Tensor] | None = None
        with torch.no_grad():
            if plan.remainders:
                # The parameters are exactly their masters: zero remainders.
                self.remainders = [torch.zeros(layout.shard_numel, dtype=torch.int16, device=backend.device)
                                   for layout in layouts]
                self.shards = [self._empty() for _ in layouts]
                self.record_versions()
                return
            for b, layout in enumerate(layouts):
                current = backend.param_shard(b)
                if self.alias:
                    self.shards.append(current)
                    continue
                dtype = plan.master(params[layout.param_indices[0]].dtype)
                self.shards.append(staggered_empty(current.numel(), dtype, backend.device, "master").copy_(current))
        self.record_versions()

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.float32, device=self._backend.device)

    def _join(self, b: int) -> torch.Tensor:
        return join_master(self._backend.param_shard(b), self.remainders[b], self._backend.bitcast)

    def values(self) -> list[torch.Tensor]:
        """The master shards' values (with remainders: rebuilt, new tensors)."""
        if self.remainders is None:
            return list(self.shards)
        with torch.no_grad():
            return [self._join(b) for b in range(len(self._layouts))]

    def begin_update(self) -> None:
        """With remainders: give ``shards`` the fp32 masters for the inner step."""
        if self.remainders is not None:
            with torch.no_grad():
                for b, shard in enumerate(self.shards):
                    shard.data = self._join(b)

    def _read_versions(self) -> list[int] | list[tuple[int, int]]:
        """torch's in-place write counters of the parameters (one per parameter where the user writes the
        tensors held, else the pair: a DTensor and its local part count their own writes). Read at every
        step: one attribute per parameter, no more."""
        if self._written_through is self._params:
            return list(map(_VERSION, self._params))
        return list(zip(map(_VERSION, self._written_through), map(_VERSION, self._params)))

    def record_versions(self) -> None:
        """What the parameters hold now is what the masters say (the optimizer wrote it)."""
        self._versions = self._read_versions()

    def changed(self) -> list[int]:
        """Parameters written in place since ``record_versions``, or whose storage was replaced
        and taken back (``Backend.adopt_param_storage``)."""
        adopted = self._backend.adopt_param_storage()
        versions = self._read_versions()
        if not adopted and versions == self._versions:
            return []  # (every step but one after an outside write)
        adopted = set(adopted)
        return [i for i, (now, then) in enumerate(zip(versions, self._versions)) if i in adopted or now != then]

    def publish(self) -> None:
        """The parameters become the masters (cast, gathered on every rank); with remainders
        the fp32 shards are split into parameters and remainders and freed."""
        if self.remainders is None:
            self._backend.publish(self.shards)
        else:
            self._backend.publish(self._split([shard.data for shard in self.shards]))
            for shard in self.shards:
                shard.data = self._empty()
        self.record_versions()

    @torch.no_grad()
    def _split(self, masters: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The remainders of fp32 ``masters`` kept (in place); their bf16 parameters returned."""
        params = []
        for remainder, master in zip(self.remainders, masters):
            param, low = split_master(master, self._backend.bitcast)
            remainder.copy_(low)
            params.append(param)
        return params

    @torch.no_grad()
    def load(self, shards: Sequence[torch.Tensor]) -> None:
        """Set the masters (same shapes as ``shards``) and publish them into the parameters."""
        if len(shards) != len(self._layouts) or any(
            tuple(a.shape) != (layout.shard_numel,) for a, layout in zip(shards, self._layouts)
        ):
            raise ConfigError("master shards do not match this optimizer's layout.")
        for master, saved in zip(self.shards, shards):
            if self.remainders is None:
                master.copy_(saved)
            else:  # (``publish`` splits it and frees it)
                master.data = saved.to(device=self._backend.device, dtype=torch.float32)
        self.publish()

    def adopt_changes(self) -> None:
        """Rebuild the masters of the parameters written since the optimizer last wrote them,
        where their values differ from what it wrote."""
        changed = self.changed()
        if changed:
            self.rebuild(changed, only_changed_values=True)

    @torch.no_grad()
    def rebuild(self, indices: Sequence[int], only_changed_values: bool) -> None:
        """Masters of parameters ``indices`` from their current values.

        ``only_changed_values``: only where a parameter's value differs from its master
        rounded to the parameter dtype (an unchanged parameter, or an element written with its
        old value, keeps its fp32 master).
        """
        wanted = set(indices)
        for b, layout in enumerate(self._layouts):
            members = [index in wanted for index in layout.param_indices]
            if not any(members) or self.alias:
                continue  # (aliased: the master shard is the parameters' memory itself)
            if self.remainders is not None:
                # The written values are the truth; which element kept its old value cannot be
                # told from 16 bits, so the whole parameter's remainder goes.
                remainder = self.remainders[b]
                if all(members):
                    remainder.zero_()
                else:
                    remainder.masked_fill_(self._backend.local_shard(self._bucket_mask(layout, members)), 0)
                continue
            current = self._backend.param_shard(b)
            master = self.shards[b]
            if only_changed_values:
                take = current != master.to(current.dtype)
            elif all(members):
                master.copy_(current)
                continue
            else:
                take = self._backend.local_shard(self._bucket_mask(layout, members))
            master.copy_(torch.where(take, current.to(master.dtype), master))
        self.record_versions()

    def _bucket_mask(self, layout: BucketLayout, members: Sequence[bool]) -> torch.Tensor:
        """A bool per element of the bucket: whether it belongs to a member parameter."""
        return bucket_mask(layout, members, self._backend.device)
