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
the kernel runs and put back before the publication, the same for every kernel. Their step counters
stand still, as torch's per-parameter ones do (``step_counters``): once parameters have stepped at
different steps, each shard goes to the inner optimizer as one view per run of parameters with equal
counters, with those counters, and runs of frozen parameters are left out of its step; on XLA the shard
goes whole, with one counter per element.

It also keeps the wrapper's param groups and the inner optimizer's in step: the wrapper's
are the truth before a step (LR schedulers act on them), and what the inner step adds or
changes shows on the wrapper after it (as torch's and torch_xla's ZeRO do).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..backend import Backend
from ..core.layout import BucketLayout
from .compiled_adamw import CompiledAdamW
from .frozen import FrozenElements
from .masters import MasterWeights
from .rounding import stochastic_round
from .state_fit import is_moment, zero_state
from .step_counters import StepCounters


def copy_group_settings(sources: Sequence[dict[str, Any]], targets: Sequence[dict[str, Any]]) -> None:
    """Every key but ``params`` and ``param_names`` of each source param group into its target group."""
    for source, target in zip(sources, targets):
        for key, value in source.items():
            if key not in ("params", "param_names"):  # (the wrapper's names, not the shards')
                target[key] = value


def takes_element_counters(inner: torch.optim.Optimizer) -> bool:
    """Whether ``inner`` corrects each element by its own ``step`` when its counter holds one value per
    element of the shard: torch's Adam and AdamW with their single-tensor kernel, which in its
    ``capturable`` form (the step sets it for that step) uses ``step`` only in elementwise arithmetic
    on the device (``step_counters``)."""
    return type(inner) in (torch.optim.Adam, torch.optim.AdamW) and not any(
        group.get("fused") or group.get("foreach") or group.get("differentiable") for group in inner.param_groups)


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
        layouts: the buckets (their pieces in this rank's shard: each parameter's own step counters,
            ``step_counters``); None keeps one counter per shard.
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
        layouts: Sequence[BucketLayout] | None = None,
    ):
        self.inner = inner
        self.shards = list(shards)
        host_slices = backend is None or backend.host_rank_slices
        self.counters = StepCounters(
            layouts or [], 0 if backend is None else backend.rank, lambda b: self.inner.state.get(self.shards[b], {}),
            enabled=layouts is not None and (host_slices or takes_element_counters(inner)),
            elementwise=not host_slices)
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

    @property
    def compiling_norm(self) -> bool:
        """Whether the gradient norm's compiled kernel runs beside the compiled update."""
        return self.compiling and self.compiled.with_norm

    def update(self, grads: list[torch.Tensor], coef: torch.Tensor | float | None, found_inf: torch.Tensor | None,
               inner_args: dict[str, Any], wrapper_groups: Sequence[dict[str, Any]],
               frozen: FrozenElements | None = None) -> None:
        """The step: the wrapper's hyperparameters in, one step of the masters with ``grads *
        coef`` (nothing where ``found_inf``), the masters published into every rank's parameters,
        the inner step's hyperparameters back out to the wrapper. The elements of ``frozen``
        parameters (their masters, states and parameters) are put back before the publication,
        whichever kernel ran."""
        self.pull_hyperparameters(wrapper_groups)
        self.counters.track(() if frozen is None else frozen.frozen)
        if inner_args or self.counters.split or not self._compiled_update(grads, coef, found_inf, frozen):
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
            self._run(grads, inner_args, found_inf)  # the fused kernels skip and undo ``step`` themselves
            self.inner.found_inf = None
            return
        before = self._snapshot() if found_inf is not None else None
        if self.stochastic_rounding:
            widened = self._widen()
            grads = [g.float() for g in grads]
        if coef is not None:
            torch._foreach_mul_(grads, coef)
        self._run(grads, inner_args, found_inf)
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

    def _run(self, grads: list[torch.Tensor], inner_args: dict[str, Any], found_inf: torch.Tensor | None) -> None:
        if self.counters.split and not self.counters.elementwise:
            self._run_by_runs(grads, inner_args, found_inf)
            return
        # elementwise (XLA, once split): each shard's ``step`` one value per element, for this step
        swapped = self._element_counters() if self.counters.split else []
        made_capturable = [g for g in self.inner.param_groups if not g.get("capturable")] if swapped else []
        for group in made_capturable:
            group["capturable"] = True  # (the kernel's form that reads ``step`` on the device)
        for shard, grad in zip(self.shards, grads):
            shard.grad = grad
        try:
            self.inner.step(**inner_args)
        finally:
            for group in made_capturable:
                group["capturable"] = False
            for state, key, value in swapped:
                state[key] = value
            for shard in self.shards:
                shard.grad = None
        if self.counters.split:
            self.counters.advance_elsewhere(set(), found_inf)

    def _element_counters(self) -> list[tuple[dict[str, Any], str, Any]]:
        """Each shard's counters replaced by one value per element (``StepCounters.element_counter``);
        returns what to put back (state, key, the bucket's counter)."""
        swapped = []
        for b, shard in enumerate(self.shards):
            state = self.inner.state.get(shard, {})
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and not is_moment(key, value):
                    per_element = self.counters.element_counter(b, key, shard.device)
                    if per_element is not None:
                        swapped.append((state, key, value))
                        state[key] = per_element
        return swapped

    def _run_by_runs(self, grads: list[torch.Tensor], inner_args: dict[str, Any],
                     found_inf: torch.Tensor | None) -> None:
        """The inner step over one view of each shard per run whose history steps now (``step_counters``):
        each with its history's counters and views of the bucket's moments as its state (a history
        without counters yet, of a class that makes its state at the first step, gets none: the
        class makes it, and its moments are copied into the bucket's). Runs of frozen parameters are
        not in the step."""
        counters, inner = self.counters, self.inner
        position = {id(shard): b for b, shard in enumerate(self.shards)}
        originals = [group["params"] for group in inner.param_groups]
        placed: list[tuple[int, Any, torch.Tensor]] = []  # (bucket, run, view)
        try:
            for group in inner.param_groups:
                views = []
                for shard in group["params"]:
                    b = position[id(shard)]
                    moments = {k: v for k, v in inner.state.get(shard, {}).items() if is_moment(k, v)}
                    for run in counters.runs(b):
                        if not counters.steps_now(run.history):
                            continue
                        view = shard[run.start:run.end]
                        view.grad = grads[b][run.start:run.end]
                        kept = counters.counters(run.history)
                        if kept is not None:
                            inner.state[view] = {**{k: v.clone() if isinstance(v, torch.Tensor) else v
                                                    for k, v in kept.items()},
                                                 **{k: v[run.start:run.end] for k, v in moments.items()}}
                        views.append(view)
                        placed.append((b, run, view))
                group["params"] = views
            inner.step(**inner_args)
        finally:
            for group, params in zip(inner.param_groups, originals):
                group["params"] = params
            stepped = [(b, run, inner.state.pop(view, {})) for b, run, view in placed]
            for _, _, view in placed:
                view.grad = None
        for b, run, state in stepped:
            if state:
                self._keep_run_state(b, run, state)
        counters.advance_elsewhere({run.history for _, run, _ in placed}, found_inf)

    def _keep_run_state(self, b: int, run: Any, state: dict[str, Any]) -> None:
        """A run's state after the step: its counters its history's, its moments in the bucket's (made
        where the step created them: zeros elsewhere, the value of a fresh state)."""
        shard = self.shards[b]
        bucket = self.inner.state[shard]
        numel = shard.numel()
        for key, value in state.items():
            if not is_moment(key, value):
                continue
            flat = bucket.get(key)
            if not is_moment(key, flat):
                flat = bucket[key] = torch.zeros(numel, dtype=value.dtype, device=value.device)
            part = flat[run.start:run.end]
            if part.data_ptr() != value.data_ptr():
                part.copy_(value)
        counters = {k: v for k, v in state.items() if not is_moment(k, v)}
        self.counters.record(run.history, counters)
        for key, value in counters.items():  # (the bucket's keys are the state's keys: a first step made them)
            bucket.setdefault(key, value.detach().clone() if isinstance(value, torch.Tensor) else value)

    def state_tensors(self) -> list[torch.Tensor]:
        """The shards and every tensor of the inner optimizer's state."""
        out = list(self.shards)
        for shard in self.shards:
            out.extend(v for v in self.inner.state.get(shard, {}).values() if isinstance(v, torch.Tensor))
        return out + self.counters.tensors()

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
