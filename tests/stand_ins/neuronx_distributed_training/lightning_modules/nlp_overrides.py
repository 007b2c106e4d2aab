"""Stand-in for ``neuronx_distributed_training/lightning_modules/nlp_overrides.py`` of NxD
Training 1.6.0: its ``NLPCheckpointIO`` (a Lightning ``XLACheckpointIO`` there, a plain class
here), which reaches NxD through ``import neuronx_distributed as nxd``: Lightning's checkpoint
dict saved as ``nxd.save_checkpoint(dir, tag, model=<state dict>, optimizer=<state dict>,
user_content=<the rest>, ...)``, loaded by filling empty dicts with ``nxd.load_checkpoint``, and
old tags removed through NxD's io state ``nxd.trainer.checkpoint.g_iostate``. NxD Training cannot
be installed here."""

from __future__ import annotations

import os
from typing import Any

import neuronx_distributed as nxd


class NLPCheckpointIO:
    """NxD Training's checkpoint IO, with Lightning's call shapes."""

    def __init__(self, async_save: bool = False, weight_init_only: bool = False, ptl_version: str = "1.8.6"):
        self._async_save = async_save
        self._weight_init_only = weight_init_only
        self.ptl_version = ptl_version

    def load_checkpoint(self, checkpoint_path: str, load_type_xser: bool = False) -> dict[str, Any]:
        """Lightning's checkpoint dict back: ``state_dict``, ``optimizer_states`` (unless
        ``weight_init_only``) and the saved user content."""
        model_state_dict: dict[str, Any] = {}
        optimizer_state_dict: dict[str, Any] = {}
        checkpoint = nxd.load_checkpoint(
            os.path.dirname(checkpoint_path), os.path.basename(checkpoint_path), model=model_state_dict,
            optimizer=None if self._weight_init_only else optimizer_state_dict)
        if checkpoint is None:
            checkpoint = {}
        checkpoint["state_dict"] = model_state_dict
        checkpoint.setdefault("pytorch-lightning_version", self.ptl_version)
        if not self._weight_init_only:
            checkpoint["optimizer_states"] = [optimizer_state_dict]
        return checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str, save_type_xser: bool = False,
                        storage_options: Any = None) -> None:
        """Save Lightning's checkpoint dict to the tag ``basename(filepath)`` of ``dirname(filepath)``
        (the dict's model and optimizer states are popped from it, as NxD Training does)."""
        if storage_options is not None:
            raise TypeError("storage_options is not supported")
        model = checkpoint.pop("state_dict")
        optimizer_states = checkpoint.pop("optimizer_states")
        if len(optimizer_states) > 1:
            raise RuntimeError("nxd checkpoints hold one optimizer")
        nxd.save_checkpoint(
            os.path.dirname(filepath),
            os.path.basename(filepath),
            model=model,
            optimizer=optimizer_states[0],
            user_content=checkpoint,
            use_xser=save_type_xser,
            async_save=self._async_save,
            zero1_optimizer=checkpoint.get("hyper_parameters", {}).get("cfg", {}).get("wrap_with_zero", False),
        )

    def remove_checkpoint(self, filepath: str) -> None:
        if nxd.trainer.checkpoint.g_iostate is None:
            return
        nxd.trainer.checkpoint.g_iostate.submit_remove(-1, self._async_save, [os.path.basename(filepath)])

    def teardown(self) -> None:
        nxd.finalize_checkpoint()
