"""nxd_smp: a ZeRO-1 sharded optimizer with standard mixed precision, compatible with
neuronx-distributed's ``NeuronZero1Optimizer`` and ``mixed_precision_config``.

The names here, the entry modules (``mixed_precision_config``, ``precision_ops``, ``grad_accum``,
``zero1_optimizer``, ``checkpoint``), ``nxd_smp.backend``, ``nxd_smp.core.environment``,
``nxd_smp.optim.topology`` and the ``nxd_smp.interop`` modules the README lists are the public
surface; the rest is internal. ``docs/design.md`` draws the layers.
"""

from . import precision_ops
from .checkpoint import finalize_checkpoint, has_checkpoint, load_checkpoint, save_checkpoint
from .core.errors import CheckpointError, ConfigError
from .interop.nxd import (
    ClippedOptimizer,
    NeuronZero1Optimizer,
    NxDOptimizer,
    initialize_parallel_optimizer,
    neuronx_distributed_config,
    patch_neuronx_distributed,
)
from .mixed_precision_config import MixedPrecisionConfig, OptimizerConfig, Zero1Config
from .optim.loss_scaler import DynamicLossScaler
from .zero1_optimizer import Zero1Optimizer

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ClippedOptimizer",
    "ConfigError",
    "DynamicLossScaler",
    "MixedPrecisionConfig",
    "NeuronZero1Optimizer",
    "NxDOptimizer",
    "OptimizerConfig",
    "Zero1Config",
    "Zero1Optimizer",
    "finalize_checkpoint",
    "has_checkpoint",
    "initialize_parallel_optimizer",
    "load_checkpoint",
    "neuronx_distributed_config",
    "patch_neuronx_distributed",
    "precision_ops",
    "save_checkpoint",
]
