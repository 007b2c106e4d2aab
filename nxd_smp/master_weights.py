"""This rank's master shards, and which of them the parameters still agree with.

Under SMP each bucket has an fp32 master shard; without master weights the shard is the
parameter dtype's (on eager devices it is the parameters' own memory). Only what the
optimizer itself wrote is known to equal ``master.to(param dtype)``: a parameter written in
place since (``model.load_state_dict``, a broadcast, ``p.mul_(...)``) is the truth, and its
master is rebuilt from it. torch's in-place version counter (``p._version``) tells which
parameters were written, at no cost per step; writes through ``.data`` are not counted
(``rebuild`` is the call for them).

Every operation is element-wise on this rank's shard, with no rank in the graph: the
parameters' shard comes from the backend (``param_shard``), and a per-parameter mask is
built over the whole bucket and cut with ``local_shard``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .backend import Backend
from .layout import BucketLayout
from .placement import staggered_empty

__all__ = ["MasterWeights"]


class MasterWeights:
    """The master shard of every bucket (``shards``) over ``params`` laid out by ``layouts``.

    Args:
        params: the managed parameters in layout order, already placed by ``backend``.
        shard_dtype: the master dtype for a parameter dtype (fp32 under SMP).
        alias: the master shard is the parameters' own shard (no master weights on a
            backend whose ``param_shard`` is the parameters' memory).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        layouts: Sequence[BucketLayout],
        backend: Backend,
        shard_dtype: Callable[[torch.dtype], torch.dtype],
        alias: bool,
    ):
        self._params = list(params)
        self._layouts = list(layouts)
        self._backend = backend
        self.alias = alias
        self.shards: list[torch.Tensor] = []
        with torch.no_grad():
            for b, layout in enumerate(layouts):
                current = backend.param_shard(b)
                if alias:
                    self.shards.append(current)
                    continue
                dtype = shard_dtype(params[layout.param_indices[0]].dtype)
                self.shards.append(staggered_empty(current.numel(), dtype, backend.device, "master").copy_(current))
        self.record_versions()

    def record_versions(self) -> None:
        """What the parameters hold now is what the masters say (the optimizer wrote it)."""
        self._versions = [p._version for p in self._params]

    def changed(self) -> list[int]:
        """Parameters written in place since ``record_versions``."""
        self._backend.check_param_storage()
        return [i for i, p in enumerate(self._params) if p._version != self._versions[i]]

    def publish(self) -> None:
        """The parameters become the masters (cast, gathered on every rank)."""
        self._backend.publish(self.shards)
        self.record_versions()

    @torch.no_grad()
    def load(self, shards: Sequence[torch.Tensor]) -> None:
        """Set the masters (same shapes as ``shards``) and publish them into the parameters."""
        if len(shards) != len(self.shards) or any(
            tuple(a.shape) != tuple(b.shape) for a, b in zip(shards, self.shards)
        ):
            raise ValueError("master shards do not match this optimizer's layout.")
        for master, saved in zip(self.shards, shards):
            master.copy_(saved)
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
        device = self._backend.device
        parts = [torch.full((n,), m, dtype=torch.bool, device=device) for n, m in zip(layout.numels, members)]
        parts.append(torch.zeros(layout.padded_numel - layout.numel, dtype=torch.bool, device=device))
        return torch.cat(parts)
