"""The Hugging Face ``Trainer`` with a nxd_smp optimizer: one callback for clipping and for
the ``grad_norm`` the Trainer logs.

The Trainer clips and measures ``grad_norm`` with ``clip_grad_norm_(model.parameters())``
before ``optimizer.step()``. Under standard mixed precision the gradients live in the
optimizer's fp32 ``main_grad`` buffers, not in ``.grad``, so that call sees none: it logs 0
and clips nothing, while the optimizer clips inside ``step()`` with its own ``max_norm``.
Training itself is right without this callback; the callback makes the Trainer's
``max_grad_norm`` the one that applies and puts the optimizer's norm in the logs::

    trainer = Trainer(model, args, train_dataset=data, optimizers=(optimizer, None),
                      callbacks=[Zero1TrainerCallback()])

At DP > 1 the Trainer wraps the model in DDP, whose all-reduce of ``.grad`` finds the
gradients already taken by the optimizer's hooks: it sends zeros, a full bf16 gradient's traffic
per step. Give the callback the trainer and it replaces that all-reduce with nothing (a DDP
communication hook that returns the bucket as it is)::

    trainer = Trainer(model, args, train_dataset=data, optimizers=(optimizer, None))
    trainer.add_callback(Zero1TrainerCallback(trainer))

Given the trainer, the callback also makes the Trainer's checkpoints hold every rank's state.
The Trainer writes ``checkpoint-N/optimizer.pt`` from rank 0 only (on XLA every rank calls
``state_dict()`` and the master writes), and on resume hands that one file to every rank. So
when the Trainer is about to save (``on_step_end``/``on_epoch_end`` with ``should_save``, before
its own files and its rotation of old checkpoints), every rank writes the nxd_smp checkpoint
``checkpoint-N/nxd_smp`` (``loop_checkpoints``) and ``optimizer.pt`` becomes a reference
to it. On ``resume_from_checkpoint`` the optimizer's ``load_state_dict(reference)`` loads that
checkpoint first, at this DP size, from ``TrainingArguments.output_dir/checkpoint-<step>``
(a ``load_state_dict`` pre-hook of the callback's).

Importing this module imports ``transformers``; ``import nxd_smp`` does not.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer import OPTIMIZER_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..core.errors import ConfigError
from ..checkpointing.files import local_path, write_output_file
from ..optim.clip_watch import silence
from ..zero1_optimizer import STATE_LOADED, Zero1Optimizer, zero1_optimizer_of
from .ddp import skip_ddp_allreduce
from .loop_checkpoints import checkpoint_reference, is_reference, load_beside, save_beside

__all__ = ["Zero1TrainerCallback", "skip_ddp_allreduce"]


class Zero1TrainerCallback(TrainerCallback):
    """Makes a ``Trainer``'s clipping and logged ``grad_norm`` those of its nxd_smp optimizer.

    * At the start of training the optimizer's clipping is set from
      ``TrainingArguments.max_grad_norm`` (``0`` or ``None``: off), so the Trainer's setting
      governs, as it does with any torch optimizer (a warning says when that changes the
      ``max_norm`` the optimizer was built with).
    * At each log the Trainer's ``grad_norm`` (0: it saw no ``.grad``) is replaced, in what its
      printer and ``report_to`` integrations log and in ``state.log_history``, by the optimizer's fp32
      norm of the last step before clipping (given the ``trainer``, a small callback of its own runs first at
      each log; without it, only the callbacks added after this one see the norm). (So the warning a ``clip_grad_norm_`` without ``.grad``
      gives, ``nxd_smp.optim.clip_watch``, is not given for this Trainer.)

    * Given the ``trainer`` (``trainer.add_callback(Zero1TrainerCallback(trainer))``), at the
      start of training DDP's all-reduce of ``.grad`` is replaced by nothing
      (``skip_ddp_allreduce(trainer.model_wrapped)``): the optimizer reduces the gradients.
    * Given the ``trainer``, its checkpoints (``save_steps``, ``save_strategy``) hold every
      rank's optimizer state and, with ``use_master_weights_in_ckpt``, the fp32 masters, in
      ``checkpoint-N/nxd_smp``; ``resume_from_checkpoint`` loads them at any DP size (the
      module's docstring says how). Without it, at DP > 1 a Trainer that saves is refused at
      the start of training: its ``optimizer.pt`` would hold rank 0's shard only.

    Raises:
        TypeError: the Trainer's optimizer is not a nxd_smp ``Zero1Optimizer`` (pass
            ``optimizers=(Zero1Optimizer(...), None)``): here given the trainer, else at the
            start of training.
        ValueError: at the start of training, at DP > 1, a Trainer that saves checkpoints and
            a callback without the trainer; given the trainer, a Trainer that saves checkpoints into
            an ``output_dir`` that is a URL (``s3://...``, a ``ConfigError``): object storage is not
            supported yet.
    """

    def __init__(self, trainer: Any = None) -> None:
        self._optimizer: Zero1Optimizer | None = None
        self._trainer = trainer
        self._saved_step: int | None = None  # the step whose nxd_smp checkpoint was written
        self._warned_late = False
        if trainer is not None:
            zero1 = zero1_optimizer_of(getattr(trainer, "optimizer", None))
            if zero1 is None:
                raise TypeError(
                    f"Zero1TrainerCallback(trainer) needs the Trainer's optimizer to be a nxd_smp Zero1Optimizer, "
                    f"got {type(getattr(trainer, 'optimizer', None)).__name__}; pass "
                    f"optimizers=(Zero1Optimizer(...), None) to the Trainer."
                )
            zero1.register_load_state_dict_pre_hook(self._load_beside)
            # the norm goes into the logs first, before the printer and the report_to integrations (callbacks
            # the Trainer added before this one); this one stays where it is added, after DefaultFlowCallback,
            # whose decisions (should_save) it reads
            trainer.callback_handler.callbacks.insert(0, _NormFirst(self))

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        zero1 = zero1_optimizer_of(optimizer)  # (accelerate and NxD's wrapper hold it in .optimizer)
        if zero1 is None:
            raise TypeError(
                f"Zero1TrainerCallback needs the Trainer's optimizer to be a nxd_smp Zero1Optimizer, "
                f"got {type(optimizer).__name__}; pass optimizers=(Zero1Optimizer(...), None) to the "
                f"Trainer, or drop the callback."
            )
        self._optimizer = zero1
        silence(zero1.managed_params)  # (the Trainer's clip_grad_norm_ finds no .grad: the callback stands in)
        max_grad_norm = args.max_grad_norm
        clip = max_grad_norm is not None and max_grad_norm > 0
        if (clip, max_grad_norm if clip else zero1.max_norm) != (zero1.grad_clipping, zero1.max_norm):
            warnings.warn(
                f"Zero1TrainerCallback: the optimizer now clips as TrainingArguments says "
                f"(max_grad_norm={max_grad_norm}); it was built with grad_clipping="
                f"{zero1.grad_clipping}, max_norm={zero1.max_norm}.",
                stacklevel=2,
            )
        zero1.set_clipping(clip, float(max_grad_norm) if clip else None)
        if self._trainer is not None:  # (the Trainer wraps the model before this call)
            skip_ddp_allreduce(getattr(self._trainer, "model_wrapped", None), zero1)
        saving = getattr(args, "save_strategy", "no") != "no" and not getattr(args, "save_only_model", False)
        if self._trainer is not None and saving:  # (refused now, not at the first save, hours in)
            self._checkpoint_folder(args, state.global_step)
        if self._trainer is not None and saving and getattr(state, "is_hyper_param_search", False):
            raise ConfigError(
                "Zero1TrainerCallback(trainer) writes nxd_smp's checkpoint into output_dir/checkpoint-N, and a "
                "hyperparameter search saves into a folder per trial: search with save_strategy='no'."
            )
        if self._trainer is None and zero1.world_size > 1 and saving:
            raise ConfigError(
                f"at DP {zero1.world_size} the Trainer's checkpoints keep rank 0's optimizer shard only: give the "
                f"callback the trainer, trainer.add_callback(Zero1TrainerCallback(trainer)), and every rank's state is "
                f"saved beside them (or set save_strategy='no')."
            )

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_folder(self, args: Any, step: int) -> Path:
        """``output_dir/checkpoint-<step>``, the Trainer's own name (``output_dir`` a local path: ``local_path``)."""
        return local_path(args.output_dir, "TrainingArguments.output_dir") / f"{PREFIX_CHECKPOINT_DIR}-{step}"

    def _save_beside(self, args: Any, state: Any) -> bool:
        """Write every rank's state to ``checkpoint-<step>/nxd_smp`` unless done for this step;
        whether it was written now."""
        if self._trainer is None or args.save_only_model or self._saved_step == state.global_step:
            return False
        save_beside(self._checkpoint_folder(args, state.global_step), self._trainer.model, self._trainer.optimizer)
        self._saved_step = state.global_step
        return True

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if control.should_save:  # (set by DefaultFlowCallback, which runs first)
            self._save_beside(args, state)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if control.should_save:
            self._save_beside(args, state)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """A save decided after ``on_step_end`` (``save_strategy="best"``, or a callback after this
        one): nxd_smp's files come after the Trainer's, and ``optimizer.pt`` is replaced by the
        reference to them."""
        if not self._save_beside(args, state):
            return
        if not self._warned_late:
            self._warned_late = True
            warnings.warn(
                "Zero1TrainerCallback: the Trainer decided to save after on_step_end (save_strategy='best'?), so "
                "nxd_smp's checkpoint was written after the Trainer's files and after its rotation of old "
                "checkpoints: a crash in between leaves the newest checkpoint without it.",
                stacklevel=2,
            )
        file = self._checkpoint_folder(args, state.global_step) / OPTIMIZER_NAME
        if args.should_save and file.exists():
            reference = self._trainer.optimizer.state_dict()
            write_output_file(file, lambda f: torch.save(reference, f), overwrite=True)

    def _load_beside(self, optimizer: Zero1Optimizer, state_dict: Any) -> Any:
        """The optimizer's load pre-hook: the Trainer hands every rank ``optimizer.pt``; a
        reference loads the nxd_smp checkpoint beside it, and the optimizer then loads nothing
        more."""
        if not is_reference(state_dict):
            return None
        held = checkpoint_reference(optimizer)
        if held is None or held["id"] != state_dict.get("id"):
            trainer = self._trainer
            load_beside(self._checkpoint_folder(trainer.args, trainer.state.global_step), trainer.model, optimizer,
                        state_dict, where=f"The callback looks for it where the Trainer saved it: resume from a "
                                          f"checkpoint inside TrainingArguments.output_dir ({trainer.args.output_dir}), "
                                          f"copied there whole (cp -a: hidden entries and links included).")
        return STATE_LOADED

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.log_norm(state, logs)

    def log_norm(self, state: Any, logs: dict[str, Any] | None) -> None:
        """The optimizer's norm of the last step in ``logs`` and the history's last entry (the same value
        again where it is already there)."""
        if logs is None or "grad_norm" not in logs or self._optimizer is None or self._optimizer.grad_norm is None:
            return
        value = float(self._optimizer.grad_norm)  # a host sync, at logging time only
        logs["grad_norm"] = value
        last = state.log_history[-1] if state.log_history else None
        if last is not None and last.get("step") == state.global_step and "grad_norm" in last:
            last["grad_norm"] = value


class _NormFirst(TrainerCallback):
    """The first callback at each log: the ``Zero1TrainerCallback``'s norm, before anything prints or reports."""

    def __init__(self, owner: Zero1TrainerCallback) -> None:
        self._owner = owner

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self._owner.log_norm(state, logs)
