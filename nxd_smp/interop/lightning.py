"""PyTorch Lightning with a nxd_smp optimizer: one callback (``Zero1LightningCallback``) for its
checkpoints, its gradient clipping and DDP's all-reduce::

    trainer = pytorch_lightning.Trainer(strategy="ddp", devices=2, gradient_clip_val=0.5,
                                        callbacks=[Zero1LightningCallback()])
    trainer.fit(module)                      # configure_optimizers returns a Zero1Optimizer
    trainer.fit(module, ckpt_path="last.ckpt")

* **Checkpoints.** Lightning puts ``optimizer.state_dict()`` of each rank in the checkpoint and
  writes it from rank 0 alone: a ZeRO-1 state is that rank's shard. At each save the callback
  gathers every rank's state dict to rank 0 (on the host, pickled as plain tensors) into the
  checkpoint's ``optimizer_states``; at ``fit(ckpt_path=...)`` each rank takes its own back before
  Lightning hands it to ``load_state_dict`` (the one load pipeline: checked, agreed on, installed).
  Rank 0 holds every rank's optimizer state while Lightning writes, as its single file does. The
  resume is at the same DP size; ``nxd_smp.save_checkpoint`` or torch's DCP move across sizes.
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

import torch
import torch.distributed as dist
from pytorch_lightning import Callback
from torch.utils._pytree import tree_map_only

from ..core.errors import CheckpointError, ConfigError
from ..optim.clip_watch import silence
from ..zero1_optimizer import Zero1Optimizer, zero1_optimizer_of
from .ddp import skip_ddp_allreduce

__all__ = ["Zero1LightningCallback"]

#: What the callback puts in a Lightning checkpoint's ``optimizer_states`` for a nxd_smp optimizer.
RANKS_FORMAT = "nxd_smp.lightning_ranks/1"


class Zero1LightningCallback(Callback):
    """Makes Lightning's checkpoints hold every rank's optimizer state, its ``gradient_clip_val`` the
    optimizer's clipping, and DDP's all-reduce nothing (the module's docstring says how).

    Raises:
        TypeError: at the start of ``fit``, none of the trainer's optimizers is a ``Zero1Optimizer``.
        ValueError: at the start of ``fit``, ``gradient_clip_algorithm="value"``.
        CheckpointError: at a resume, a checkpoint saved at another DP size, or its ranks' states damaged.
    """

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
        for zero1 in optimizers:
            silence(zero1.managed_params)  # (Lightning's clip_grad_norm_ finds no .grad: the optimizer clips)
            skip_ddp_allreduce(trainer.strategy.model, zero1)

    @staticmethod
    def _zero1_optimizers(trainer: Any) -> list[Zero1Optimizer]:
        found = [zero1_optimizer_of(o) for o in trainer.optimizers]
        return [z for z in found if z is not None]

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get("optimizer_states")
        if not isinstance(states, list):
            return
        for i, optimizer in enumerate(trainer.optimizers[:len(states)]):
            if zero1_optimizer_of(optimizer) is None:
                continue
            local = tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), states[i])  # (FlatShards stay)
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
                dist.gather_object(local, gathered, dst=0)
            else:
                gathered = [local]
            states[i] = {"format": RANKS_FORMAT, "ranks": gathered}

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get("optimizer_states")
        if not isinstance(states, list):
            return
        for i, state in enumerate(states):
            if not (isinstance(state, Mapping) and state.get("format") == RANKS_FORMAT):
                continue
            ranks = state.get("ranks")
            if not isinstance(ranks, list) or not all(isinstance(r, Mapping) for r in ranks):
                raise CheckpointError(f"the checkpoint's optimizer_states[{i}] is damaged: its ranks' states are not "
                                      f"a list of state dicts.")
            if len(ranks) != trainer.world_size:
                raise CheckpointError(
                    f"the checkpoint holds the optimizer states of {len(ranks)} ranks and this run has "
                    f"{trainer.world_size}: a Lightning checkpoint resumes at the DP size it was saved at. To change "
                    f"it, save with nxd_smp.save_checkpoint (or torch's dcp.save of get_optimizer_state_dict) and "
                    f"load that at the new size.")
            states[i] = ranks[trainer.global_rank]
