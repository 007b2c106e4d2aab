"""nxd_smp: a ZeRO-1 sharded optimizer with standard mixed precision, compatible with
neuronx-distributed's ``NeuronZero1Optimizer`` and ``mixed_precision_config``."""

from . import fused_adamw, precision_ops
from .checkpoint import CheckpointError, finalize_checkpoint, has_checkpoint, load_checkpoint, save_checkpoint
from .loss_scaler import DynamicLossScaler
from .mixed_precision_config import ConfigError, MixedPrecisionConfig, OptimizerConfig, Zero1Config
from .nxd_patch import patch_neuronx_distributed
from .trainer import ClippedOptimizer, NxDOptimizer, initialize_parallel_optimizer, neuronx_distributed_config
from .zero1_optimizer import NeuronZero1Optimizer, Zero1Optimizer

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ClippedOptimizer",
    "ConfigError",
    "DynamicLossScaler",
    "finalize_checkpoint",
    "has_checkpoint",
    "MixedPrecisionConfig",
    "NeuronZero1Optimizer",
    "NxDOptimizer",
    "OptimizerConfig",
    "Zero1Config",
    "Zero1Optimizer",
    "initialize_parallel_optimizer",
    "load_checkpoint",
    "neuronx_distributed_config",
    "patch_neuronx_distributed",
    "save_checkpoint",
]
