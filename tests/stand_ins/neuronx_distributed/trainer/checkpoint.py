"""Stand-in for ``neuronx_distributed/trainer/checkpoint.py`` of neuronx-distributed 0.18.0
(Neuron SDK 2.29): like NxD's, it binds ``NeuronZero1Optimizer`` at module level (NxD's
``save_checkpoint`` tests ``isinstance(optimizer, NeuronZero1Optimizer)``) and keeps its io state
in the module global ``g_iostate``, None until NxD's first ``save_checkpoint``; NxD Training and
optimum-neuron read it as ``neuronx_distributed.trainer.checkpoint.g_iostate``. NxD's own
functions and io state raise here. NxD cannot be installed here."""

from __future__ import annotations

from typing import Any

from neuronx_distributed.optimizer import NeuronZero1Optimizer  # noqa: F401  (bound at module level, as NxD's)
from neuronx_distributed.trainer.optimizer import NxDOptimizer  # noqa: F401

g_iostate = None


class CheckpointIOState:
    """NxD's io state of asynchronous saves and tag removals."""

    def __init__(self, async_save: bool = False):
        raise RuntimeError("stand-in: NxD's own CheckpointIOState was built")


def save_checkpoint(checkpoint_dir_str: str, tag: str, model: Any = None, optimizer: Any = None, scheduler: Any = None,
                    user_content: Any = None, num_workers: int = 8, use_xser: bool = False,
                    num_kept_ckpts: int | None = None, async_save: bool = False, zero1_optimizer: bool = False,
                    use_zero1_dcp: bool = False, avoid_saving_lower_precision_weights: bool = False) -> None:
    raise RuntimeError("stand-in: NxD's own save_checkpoint ran")


def load_checkpoint(path: str, tag: str | None = None, model: Any = None, optimizer: Any = None, scheduler: Any = None,
                    num_workers: int = 8, strict: bool = True, use_zero1_dcp: bool = False) -> Any:
    raise RuntimeError("stand-in: NxD's own load_checkpoint ran")


def has_checkpoint(checkpoint_dir_str: str) -> bool:
    raise RuntimeError("stand-in: NxD's own has_checkpoint ran")


def finalize_checkpoint() -> None:
    raise RuntimeError("stand-in: NxD's own finalize_checkpoint ran")
