"""DDP around a model whose gradients a nxd_smp optimizer reduces itself: its all-reduce replaced by
nothing (``skip_ddp_allreduce``), for the training loops that wrap the model in DDP on their own (the
Hugging Face Trainer, Lightning).

Under fp32 accumulation the optimizer's hooks take each gradient into its buffers before DDP's
all-reduce runs, so DDP would send zeros: a full bf16 gradient's traffic per step. A DDP
communication hook that returns the bucket as it is takes that away.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..core.errors import ConfigError
from ..zero1_optimizer import zero1_optimizer_of


def _return_bucket(state, bucket):  # (DDP checks the annotations: none, or dist.GradBucket)
    """A DDP communication hook that communicates nothing: the bucket comes back as it is."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


_SKIPPED: weakref.WeakSet = weakref.WeakSet()  # the DDP modules given the hook (DDP takes one)


def skip_ddp_allreduce(model: Any, optimizer: Any = None) -> bool:
    """Stop DDP from all-reducing ``.grad`` of ``model`` (a ``DistributedDataParallel``), whose
    gradients a nxd_smp optimizer reduces itself: DDP would send zeros. Returns whether the hook
    is on (a model that is not DDP is left alone). Call it before the first backward; a second
    call for the same model does nothing.

    Raises:
        ValueError: ``optimizer`` (a nxd_smp optimizer, or one holding it) is given and does not
            manage every parameter of ``model`` that takes a gradient: DDP's all-reduce is
            those parameters' only reduction.
    """
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return False
    if optimizer is not None:
        managed = {id(p) for p in zero1_optimizer_of(optimizer).managed_params}
        others = [n for n, p in model.module.named_parameters() if p.requires_grad and id(p) not in managed]
        if others:
            raise ConfigError(f"the optimizer does not manage {others[:8]}: their gradients need DDP's all-reduce; "
                             f"keep it, or give the optimizer every parameter that takes a gradient.")
    if model not in _SKIPPED:
        model.register_comm_hook(None, _return_bucket)
        _SKIPPED.add(model)
    return True
