"""PyTorch Lightning with a nxd_smp optimizer: one callback (``Zero1LightningCallback``) for its
checkpoints, its gradient clipping and DDP's all-reduce::

    trainer = pytorch_lightning.Trainer(strategy="ddp", devices=2, gradient_clip_val=0.5,
                                        callbacks=[Zero1LightningCallback()])
    trainer.fit(module)                      # configure_optimizers returns a Zero1Optimizer
    trainer.fit(module, ckpt_path="last.ckpt")

* **Checkpoints, at any DP size.** Lightning puts ``optimizer.state_dict()`` of each rank in the
  checkpoint and writes it from rank 0 alone: a ZeRO-1 state is that rank's shard. At each save the
  callback puts the whole state there instead: every parameter's moments and master gathered over the
  data-parallel group through the optimizer's own backend (``RankState.full_state_dict``, one parameter
  at a time, to rank 0's host; torch.distributed or, under ``XLAStrategy``, XLA's collectives), the
  state ``torch``'s ``full_state_dict`` option gives. A resume at any DP size slices each rank's ranges
  from it on arrival.
* **Model and optimizer installed together.** Lightning restores the model before the optimizer
  exists (under DDP it is built afterwards), so a resume that does not fit would leave the model loaded
  and the optimizer not. The callback wraps the strategy's ``load_model_state_dict`` in ``setup``: for a
  checkpoint of this callback's, the model's entries (as the module's ``on_load_checkpoint`` left them)
  are held back and nothing is loaded into the model then; when Lightning loads the optimizer's state,
  the model's entries and the optimizer's state go through nxd_smp's one load pipeline together (read,
  check, every rank's agreement, install; strict as the module's ``strict_loading``): a checkpoint that
  does not fit is refused before the model changes, on every rank.
* **Clipping.** Lightning clips ``.grad``, which fp32 accumulation leaves empty. With
  ``gradient_clip_val`` set the callback makes it the optimizer's clipping (``max_norm``, applied
  inside ``step()`` to the fp32 norm of the whole model); ``gradient_clip_algorithm="value"`` is
  refused (the optimizer clips by norm). Unset, the optimizer clips at its own ``max_norm``.
* **DDP.** Lightning wraps the model in DDP, whose all-reduce would send zeros: it is replaced by
  nothing (``skip_ddp_allreduce``).

Importing this module imports ``pytorch_lightning``; ``import nxd_smp`` does not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytorch_lightning import Callback

from ..core.errors import CheckpointError, ConfigError
from ..optim import rank_state
from ..optim.clip_watch import silence
from ..optim.loading.run import load_together
from ..zero1_optimizer import STATE_LOADED, Zero1Optimizer, zero1_optimizer_of
from .ddp import skip_ddp_allreduce

__all__ = ["Zero1LightningCallback"]

#: What the callback puts in a Lightning checkpoint's ``optimizer_states`` for a nxd_smp optimizer:
#: ``{"format": WHOLE_FORMAT, "state_dict": the whole state}``.
WHOLE_FORMAT = "nxd_smp.lightning_whole/1"

rank_state.add_hint(f"format:{WHOLE_FORMAT}",
                    "It is a Lightning checkpoint's whole optimizer state: resume it with Zero1LightningCallback "
                    "among the trainer's callbacks, which installs it with the model at any DP size.")


class _Pending:
    """What a resume holds back until the optimizer's state is loaded: the model's entries and, per
    optimizer, the whole state; Lightning is handed this in place of each state."""

    def __init__(self, model: Mapping[str, Any], states: dict[int, Any], strict: bool):
        self.model = model
        self.states = states
        self.strict = strict
        self.model_installed = False


class Zero1LightningCallback(Callback):
    """Makes Lightning's checkpoints hold the optimizer's whole state (resumable at any DP size, with the
    model installed together with it), its ``gradient_clip_val`` the optimizer's clipping, and DDP's
    all-reduce nothing (the module's docstring says how).

    Raises:
        TypeError: at the start of ``fit``, none of the trainer's optimizers is a ``Zero1Optimizer``.
        ConfigError: at the start of ``fit``, ``gradient_clip_algorithm="value"``.
        CheckpointError: at a resume, a checkpoint whose state does not fit the model and optimizer (every
            rank refuses, nothing changed), or whose optimizer state is damaged.
    """

    def __init__(self) -> None:
        self._pending: _Pending | None = None
        self._hooks: list[Any] = []
        self._strategy: Any = None

    # ---------------------------------------------------------------- set up
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """The strategy's ``load_model_state_dict`` (what Lightning's restore calls, after the module's own
        ``on_load_checkpoint`` had its say) holds a checkpoint of this callback's back for the optimizer's
        load (``_hold_back``), and loads any other as it does. Wrapped on the instance, for ``fit`` only
        (``validate``, ``test`` and ``predict`` restore the model alone, as Lightning does); ``teardown``
        unwraps it."""
        strategy = trainer.strategy
        if stage != "fit" or "load_model_state_dict" in vars(strategy):
            return
        load = strategy.load_model_state_dict

        def load_model_state_dict(checkpoint: Any, strict: bool = True, **kwargs: Any) -> None:
            if not self._hold_back(checkpoint, strict):
                load(checkpoint, strict=strict, **kwargs)

        strategy.load_model_state_dict = load_model_state_dict
        self._strategy = strategy

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._strategy is not None:
            vars(self._strategy).pop("load_model_state_dict", None)
            self._strategy = None
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._pending = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        optimizers = self._zero1_optimizers(trainer)
        if not optimizers:
            raise TypeError("Zero1LightningCallback needs configure_optimizers to return a nxd_smp Zero1Optimizer; "
                            f"got {[type(o).__name__ for o in trainer.optimizers]}. Drop the callback otherwise.")
        value, algorithm = trainer.gradient_clip_val, trainer.gradient_clip_algorithm
        if value is not None and value > 0:
            if algorithm is not None and str(getattr(algorithm, "value", algorithm)) != "norm":
                raise ConfigError(f"gradient_clip_algorithm={algorithm!r}: nxd_smp's optimizer clips the fp32 norm of "
                                 f"the whole model inside step(); use gradient_clip_algorithm='norm' (the default).")
            for zero1 in optimizers:
                zero1.set_clipping(True, float(value))
        for i, optimizer in enumerate(trainer.optimizers):
            zero1 = zero1_optimizer_of(optimizer)
            if zero1 is None:
                continue
            silence(zero1.managed_params)  # (Lightning's clip_grad_norm_ finds no .grad: the optimizer clips)
            skip_ddp_allreduce(trainer.strategy.model, zero1)
            self._hooks.append(zero1.register_load_state_dict_pre_hook(
                lambda opt, state, i=i: self._install(trainer, opt, state, i)))

    @staticmethod
    def _zero1_optimizers(trainer: Any) -> list[Zero1Optimizer]:
        found = [zero1_optimizer_of(o) for o in trainer.optimizers]
        return [z for z in found if z is not None]

    # ---------------------------------------------------------------- save
    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Every rank: each nxd_smp optimizer's whole state gathered to rank 0's host (the only rank whose
        checkpoint Lightning writes) in place of this rank's ranges."""
        states = checkpoint.get("optimizer_states")
        if not isinstance(states, list):
            return
        for i, optimizer in enumerate(trainer.optimizers[:len(states)]):
            zero1 = zero1_optimizer_of(optimizer)
            if zero1 is None:
                continue
            zero1.adopt_param_changes()
            whole = zero1.rank_state.full_state_dict(keep=trainer.global_rank == 0, cpu=True)
            states[i] = {"format": WHOLE_FORMAT, "state_dict": whole}

    # ---------------------------------------------------------------- resume
    def _hold_back(self, checkpoint: dict[str, Any], strict: bool) -> bool:
        """Lightning restores the model from ``checkpoint``: where its optimizer states are this callback's,
        hold the model's entries (as the module's ``on_load_checkpoint`` left them) and those states back
        for the optimizer's load, handing Lightning the pending install in place of each state, and say so
        (Lightning then loads nothing into the model)."""
        states = checkpoint.get("optimizer_states")
        model = checkpoint.get("state_dict")
        if not isinstance(states, list) or not isinstance(model, Mapping):
            return False
        ours: dict[int, Any] = {}
        for i, state in enumerate(states):
            if isinstance(state, Mapping) and state.get("format") == WHOLE_FORMAT:
                if not isinstance(state.get("state_dict"), Mapping):
                    raise CheckpointError(f"the checkpoint's optimizer_states[{i}] is damaged: its whole state is not "
                                          f"a state dict.")
                ours[i] = state["state_dict"]
        if not ours:
            return False
        self._pending = _Pending(model, ours, strict)
        for i in ours:
            states[i] = self._pending
        return True

    def _install(self, trainer: Any, optimizer: Zero1Optimizer, state: Any, i: int) -> Any:
        """The optimizer's ``load_state_dict`` pre-hook: a held-back state installed with the model's entries
        (the first time: with the first optimizer's state) through the one load pipeline."""
        pending = self._pending
        if state is not pending or pending is None:
            return None
        model = trainer.lightning_module
        load_together(model, optimizer, pending.model if not pending.model_installed else None, pending.states[i],
                      strict=pending.strict, what=f"the Lightning checkpoint's optimizer_states[{i}]")
        pending.model_installed = True
        return STATE_LOADED
