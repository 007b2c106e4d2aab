"""Stand-in for ``optimum/neuron/models/training/modeling_utils.py`` of optimum-neuron 0.4.6.dev4:
its save of a training model through ``import neuronx_distributed``. Before an asynchronous save,
``_wait_previous_async_save`` waits through NxD's io state (``neuronx_distributed.trainer.
checkpoint.g_iostate``, when there is one) and touches ``<tag folder>/done``; ``save_pretrained``
calls ``neuronx_distributed.trainer.save_checkpoint(dir, tag="shards", ...)`` and rank 0 then
writes the consolidation metadata ``shards/mp_metadata_pp_rank_{pp}.json`` at once (while an
asynchronous save may still be writing). The model's config files are left out. optimum-neuron
cannot be installed here."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import neuronx_distributed
import torch
import torch.distributed as dist
from neuronx_distributed.parallel_layers.parallel_state import (
    get_data_parallel_rank,
    get_pipeline_model_parallel_rank,
    get_tensor_model_parallel_rank,
)

MODEL_PARALLEL_SHARDS_DIR_NAME = "shards"


def _global_ordinal() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _wait_previous_async_save(checkpoint_dir: Path | None = None) -> None:
    g_iostate = neuronx_distributed.trainer.checkpoint.g_iostate
    if g_iostate is not None:
        g_iostate.wait_save(async_remove=True)
        if checkpoint_dir is not None and _global_ordinal() == 0:
            checkpoint_dir.mkdir(parents=True, exist_ok=True)
            (checkpoint_dir / "done").touch(exist_ok=True)


def create_parameter_metadata(model: torch.nn.Module) -> dict[str, Any]:
    """What consolidating the shards needs to know of each parameter (optimum-neuron's holds the
    tensor-parallel layout as well)."""
    return {"parameters": {name: {"shape": list(p.shape), "dtype": str(p.dtype)}
                           for name, p in model.named_parameters()}}


def save_pretrained(model: torch.nn.Module, save_directory: str | os.PathLike, optimizer: Any = None,
                    async_save: bool = False, use_xser: bool = False, num_workers: int = 8) -> None:
    """The training model's ``save_pretrained`` (a method there): the sharded checkpoint, then
    the metadata."""
    save_directory = Path(save_directory)
    os.makedirs(save_directory, exist_ok=True)
    if async_save:
        _wait_previous_async_save(save_directory / MODEL_PARALLEL_SHARDS_DIR_NAME)
    neuronx_distributed.trainer.save_checkpoint(
        save_directory.as_posix(),
        tag=MODEL_PARALLEL_SHARDS_DIR_NAME,
        model=model,
        optimizer=optimizer,
        use_xser=use_xser,
        async_save=async_save,
        num_workers=num_workers,
    )
    if get_data_parallel_rank() == 0 and get_tensor_model_parallel_rank() == 0:
        metadata = create_parameter_metadata(model)
        pp_rank = get_pipeline_model_parallel_rank()
        path = save_directory / MODEL_PARALLEL_SHARDS_DIR_NAME / f"mp_metadata_pp_rank_{pp_rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            f.write(json.dumps(metadata, indent=4))
