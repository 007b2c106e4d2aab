"""The inner optimizer's step on the master shards and its publication into the parameters, as one
protocol whatever the kernel.

``InnerStep.update`` runs a ``torch.optim`` optimizer over the flat master shards with gradients
that still carry a coefficient (the clip coefficient, 1/world_size, 1/loss scale), and a
``found_inf`` flag for a step to be skipped (an fp16 overflow on any rank), then publishes the
masters into the parameters (cast, gathered on every rank):

* the compiled one-pass Adam/AdamW (CPU, ``compiled_adamw``) updates, scales and casts straight
  into the parameters' shards, which are then gathered;

* fused kernels (``fused=True``) get the coefficient as ``grad_scale`` (they divide by it
  while reading the gradient, no extra pass) and ``found_inf``, with which they skip the
  update and undo ``step`` themselves;
* every other kernel gets the gradients multiplied in place, and a skipped step is undone
  afterwards: the shards and every state tensor go back to their values before it (state
  the step created goes back to zero), with ``torch.where``, so nothing leaves the device;
* with stochastic rounding (legacy mode, bf16 shards) the update is computed on fp32
  copies of the shards and states and rounded back stochastically.

Parameters frozen at step time (``frozen.FrozenElements``) keep their elements of the shards, of
every shard-shaped state tensor and, on the compiled path, of the parameters' shards: kept before
the kernel runs and put back before the publication, the same for every kernel.

It also keeps the wrapper's param groups and the inner optimizer's in step: the wrapper's
are the truth before a step (LR schedulers act on them), and what the inner step adds or
changes shows on the wrapper after it (as torch's and torch_xla's ZeRO do).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..backend import Backend
from .compiled_adamw import CompiledAdamW
from .frozen import FrozenElements
from .masters import MasterWeights
from .rounding import stochastic_round
from .state_fit import zero_state


def copy_group_settings(sources: Sequence[dict[str, Any]], targets: Sequence[dict[str, Any]]) -> None:
    """Every key but ``params`` and ``param_names`` of each source param group into its target group."""
    for source, target in zip(sources, targets):
        for key, value in source.items():
            if key not in ("params", "param_names"):  # (the wrapper's names, not the shards')
                target[key] = value


class InnerStep:
    """Steps ``inner`` (built over the master shards ``shards``, one per bucket) with scaled
    gradients.

    Args:
        inner: the inner optimizer.
        shards: its parameters, the master shards, in bucket order.
        stochastic_rounding: round the low-precision update stochastically (the precision plan's).
        sr_generator: with ``stochastic_rounding``, the generator of the draws (None: the
            device's default).
        masters, backend: where ``update`` publishes the result (the master weights, and the
            parameters' storage and all-gather); a fused kernel takes the coefficient as
            ``grad_scale`` only where the backend's device does (``fused_grad_scale``), else the
            gradients are scaled before it.
        compiled: the compiled one-pass update standing in for ``inner.step()`` where it runs.
    """

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        shards: Sequence[torch.Tensor],
        *,
        stochastic_rounding: bool = False,
        sr_generator: torch.Generator | None = None,
        masters: MasterWeights | None = None,
        backend: Backend | None = None,
        compiled: CompiledAdamW | None = None,
    ):
        self.inner = inner
        self.shards = list(shards)
        self.masters, self.backend, self.compiled = masters, backend, compiled
        # the fused kernel divides by ``grad_scale`` where its device takes one (else: scaled before)
        takes_grad_scale = backend is None or backend.fused_grad_scale
        self.fused = takes_grad_scale and all(g.get("fused", False) for g in inner.param_groups)
        self.stochastic_rounding = stochastic_rounding
        self._generator = sr_generator

    def create_state(self, numels: Sequence[int]) -> None:
        """The inner optimizer's state before its first step, made now (``numels``: each shard's
        logical size): zeros, where the class steps from them exactly as from no state
        (``state_fit.zero_state``; the compiled update's own, placed as it wants them). So the state
        exists from construction, as torch's distributed state-dict API and checkpoint templates need:
        the same keys before and after the first step. A class without such a start keeps its lazy state."""
        position = {id(shard): b for b, shard in enumerate(self.shards)}
        for group in self.inner.param_groups:
            kinds = zero_state(type(self.inner), {k: v for k, v in group.items() if k != "params"})
            on_device = bool(group.get("fused") or group.get("capturable"))
            for shard in group["params"]:
                numel = numels[position[id(shard)]]
                if self.compiled is not None:
                    self.compiled.create_state(shard, numel)
                elif kinds is not None and not self.inner.state.get(shard):
                    self.inner.state[shard] = {
                        key: torch.zeros(numel, dtype=shard.dtype, device=shard.device) if dtype is None else
                        torch.zeros((), dtype=dtype, device=shard.device if on_device else "cpu")
                        for key, dtype in kinds.items()}

    def pull_hyperparameters(self, wrapper_groups: Sequence[dict[str, Any]]) -> None:
        """The wrapper's param groups are the truth (LR schedulers act on them)."""
        copy_group_settings(wrapper_groups, self.inner.param_groups)

    def push_hyperparameters(self, wrapper_groups: Sequence[dict[str, Any]]) -> None:
        """What the inner step added or changed in its param groups shows on the wrapper."""
        copy_group_settings(self.inner.param_groups, wrapper_groups)

    @property
    def compiling(self) -> bool:
        """Whether the compiled one-pass update runs here (its kernels compile on this machine)."""
        return self.compiled is not None and self.compiled.enabled

    def update(self, grads: list[torch.Tensor], coef: torch.Tensor | float | None, found_inf: torch.Tensor | None,
               inner_args: dict[str, Any], wrapper_groups: Sequence[dict[str, Any]],
               frozen: FrozenElements | None = None) -> None:
        """The step: the wrapper's hyperparameters in, one step of the masters with ``grads *
        coef`` (nothing where ``found_inf``), the masters published into every rank's parameters,
        the inner step's hyperparameters back out to the wrapper. The elements of ``frozen``
        parameters (their masters, states and parameters) are put back before the publication,
        whichever kernel ran."""
        self.pull_hyperparameters(wrapper_groups)
        if inner_args or not self._compiled_update(grads, coef, found_inf, frozen):
            self.masters.begin_update()  # (remainders: the fp32 masters exist from here to publish)
            restore = None if frozen is None else frozen.keep(self._targets)
            self(grads, coef, found_inf, inner_args)
            if restore is not None:
                restore()
            if self.backend is not None:
                self.backend.update_in_place(self.state_tensors())
            self.masters.publish()
        self.push_hyperparameters(wrapper_groups)

    def _targets(self, b: int, **more: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
        """Bucket ``b``'s tensors a step writes: its master shard, every state tensor of it, and
        ``more`` (the compiled path's parameter shard and remainder)."""
        shard = self.shards[b]
        state = self.inner.state.get(shard, {})
        return {"master": shard, **{f"state.{key}": value for key, value in state.items()}, **more}

    def _compiled_update(self, grads, coef, found_inf, frozen: FrozenElements | None) -> bool:
        """The compiled one-pass update (CPU): it writes the cast (with remainders: the split)
        straight into the parameters' shards, which are then gathered. False if it does not run."""
        if self.compiled is None:
            return False
        outs = [self.backend.param_shard(b) for b in range(len(self.shards))]
        remainders = self.masters.remainders
        restore = None if frozen is None else frozen.keep(
            lambda b: self._targets(b, param=outs[b], remainder=None if remainders is None else remainders[b]))
        if not self.compiled.step(grads, outs, coef, found_inf, remainders=remainders):
            return False
        if restore is not None:
            restore()
        self.backend.publish(outs)
        self.masters.record_versions()
        return True

    def __call__(
        self,
        grads: list[torch.Tensor],
        coef: torch.Tensor | float | None,
        found_inf: torch.Tensor | None,
        inner_args: dict[str, Any],
    ) -> None:
        """One step of the shards with ``grads * coef`` (``coef`` None: 1); where
        ``found_inf`` (a 0-dim bool tensor) is true, nothing changes."""
        if self.fused and not self.stochastic_rounding:
            self._set_grad_scale(coef)
            self.inner.found_inf = None if found_inf is None else found_inf.float()
            self._run(grads, inner_args)  # the fused kernels skip and undo ``step`` themselves
            self.inner.found_inf = None
            return
        before = self._snapshot() if found_inf is not None else None
        if self.stochastic_rounding:
            widened = self._widen()
            grads = [g.float() for g in grads]
        if coef is not None:
            torch._foreach_mul_(grads, coef)
        self._run(grads, inner_args)
        if self.stochastic_rounding:
            self._round_back(widened)
        if before is not None:
            self._restore_where(found_inf, before)

    def _set_grad_scale(self, coef: torch.Tensor | float | None) -> None:
        # The fused kernels divide by ``grad_scale`` while they read the gradient.
        if coef is None:
            self.inner.grad_scale = None
        else:
            device = self.shards[0].device
            self.inner.grad_scale = torch.as_tensor(coef, dtype=torch.float32, device=device).reciprocal()

    def _run(self, grads: list[torch.Tensor], inner_args: dict[str, Any]) -> None:
        for shard, grad in zip(self.shards, grads):
            shard.grad = grad
        self.inner.step(**inner_args)
        for shard in self.shards:
            shard.grad = None

    def state_tensors(self) -> list[torch.Tensor]:
        """The shards and every tensor of the inner optimizer's state."""
        out = list(self.shards)
        for shard in self.shards:
            out.extend(v for v in self.inner.state.get(shard, {}).values() if isinstance(v, torch.Tensor))
        return out

    def _snapshot(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        return {id(t): (t, t.detach().clone()) for t in self.state_tensors()}

    def _restore_where(self, found_inf: torch.Tensor, before: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Undo the step where ``found_inf``: old values back; state the step created
        goes back to zero (``step`` counters to 0, buffers to empty)."""
        for t in self.state_tensors():
            skip = found_inf.to(t.device)
            old = before.get(id(t))
            previous = old[1] if old is not None else torch.zeros_like(t)
            t.copy_(torch.where(skip, previous, t))

    def _widen(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Give every bf16 shard and bf16 state tensor fp32 data for the step; returns
        (tensor, its bf16 storage) pairs to round back into."""
        widened = []
        for t in self.state_tensors():
            if t.dtype == torch.bfloat16 and t.dim() > 0:
                widened.append((t, t.data))
                t.data = t.data.float()
        return widened

    def _round_back(self, widened: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for t, storage in widened:
            storage.copy_(stochastic_round(t.data, generator=self._generator))
            t.data = storage
