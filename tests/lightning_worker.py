"""PyTorch Lightning runs for tests/integration/test_lightning.py, launched as its users launch them
(``torchrun --nproc-per-node N -m tests.lightning_worker OUT MODE...``: Lightning's DDP strategy finds
torchrun's environment); one launch runs each MODE in turn, each with its own modules and trainers.
Rank 0 writes what the test compares to its fp32 reference (OUT, torch.save: a dict by MODE).

MODE ``clip``: ``fit`` for STEPS steps with ``gradient_clip_val=CLIP`` and the callback; the final
parameters, fp32 masters and Adam moments, gathered whole. MODE ``resume``: an uninterrupted run, and
a run saved with ``trainer.save_checkpoint`` after HALF steps and resumed with ``fit(ckpt_path=...)``
in a fresh module and trainer; both runs' final parameters and masters. MODE ``no_callback``: the
save and resume without the callback (the refusal it meets). MODE ``chain_first:PATH``: an uninterrupted
run of three epochs, and one epoch saved at PATH; ``chain_next:IN:OUT:EPOCHS``: IN resumed (at this launch's
DP size) up to EPOCHS epochs and saved at OUT; ``refused:IN``: IN resumed into an SGD optimizer (refused),
and whether the model changed. MODE ``xla``: the resume under Lightning's XLA strategy on one XLA device.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

GLOBAL_BATCH, STEPS, HALF, LR, CLIP = 8, 6, 3, 1e-3, 0.1


#: The global batch of the runs that move across DP 2, 1 and 3 (divisible by each).
CHAIN_BATCH = 12


def data(global_batch: int = GLOBAL_BATCH) -> TensorDataset:
    """One epoch of HALF global batches: the save after HALF steps falls at an epoch's end (Lightning
    replays a loader without state from its epoch's start on a resume)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(global_batch * HALF, 12, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).tanh())


def initial_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 1)).to(torch.bfloat16)


def module_class(optimizer_class=torch.optim.AdamW):
    import pytorch_lightning as pl

    from nxd_smp import MixedPrecisionConfig, Zero1Optimizer

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = initial_model()
            self.norms: list[float] = []

        def training_step(self, batch, _):
            x, y = batch
            return (self.net(x.bfloat16()).float() - y).pow(2).mean()

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.norms.append(float(self.optimizers().optimizer.grad_norm))

        def configure_optimizers(self):
            return Zero1Optimizer(self.parameters(), optimizer_class, lr=LR, compile_update=False,
                                  mixed_precision=MixedPrecisionConfig(use_master_weights_in_ckpt=True))

    return Module


def trainer(epochs: int, callback: bool, clip: float | None = None):
    """Lightning's trainer for ``epochs`` epochs of HALF steps (a save after a whole epoch: Lightning
    resumes a run stopped by ``max_steps`` at an epoch's last batch inside that epoch again)."""
    import pytorch_lightning as pl

    from nxd_smp.interop.lightning import Zero1LightningCallback

    world = int(os.environ.get("WORLD_SIZE", "1"))
    return pl.Trainer(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
                      max_epochs=epochs, gradient_clip_val=clip, logger=False, enable_checkpointing=False,
                      use_distributed_sampler=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[Zero1LightningCallback()] if callback else [])


def xla_trainer(epochs: int):
    """Lightning's own XLA strategy on the XLA CPU device: its accelerator counts TPU cores only, so the
    accelerator is told the one PJRT device there is; the strategy (``SingleDeviceXLAStrategy``, with its
    ``XLACheckpointIO``) is Lightning's."""
    import pytorch_lightning as pl
    import torch_xla
    from pytorch_lightning.accelerators import XLAAccelerator
    from pytorch_lightning.strategies import SingleDeviceXLAStrategy

    from nxd_smp.interop.lightning import Zero1LightningCallback

    class XlaCpu(XLAAccelerator):
        @staticmethod
        def is_available() -> bool:
            return True

        @staticmethod
        def auto_device_count() -> int:
            return 1

        @staticmethod
        def parse_devices(devices):
            return 1

        @staticmethod
        def get_parallel_devices(devices):
            return [torch_xla.device()]

    return pl.Trainer(accelerator=XlaCpu(), strategy=SingleDeviceXLAStrategy(device=torch_xla.device()), devices=1,
                      max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[Zero1LightningCallback()])


def loader(global_batch: int = GLOBAL_BATCH) -> DataLoader:
    """This rank's part of each global batch, in order (Lightning's own distributed sampler is off: the
    global batch of step s is rows [s * global_batch, (s + 1) * global_batch), at any DP size)."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    per_rank = global_batch // world
    x, y = data(global_batch).tensors
    rows = [s * global_batch + rank * per_rank + i for s in range(len(x) // global_batch) for i in range(per_rank)]
    return DataLoader(TensorDataset(x[rows], y[rows]), batch_size=per_rank, shuffle=False)


def gathered_state(module) -> dict:
    """The parameters, and per parameter its fp32 master and moments, whole (every rank's range joined)."""
    from nxd_smp.core.flat_shard import FlatShard

    opt = module.optimizers().optimizer
    names = [n for n, _ in module.net.named_parameters()]
    pieces = {}
    for number, entry in opt.state_dict()["state"].items():
        pieces[names[number]] = {k: (v.start, v.local.clone()) for k, v in entry.items() if isinstance(v, FlatShard)}
    everyone = [pieces]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, pieces)
    whole = {}
    for name, p in module.net.named_parameters():
        for key in everyone[0][name]:
            flat = torch.zeros(p.numel())
            for rank_pieces in everyone:
                start, local = rank_pieces[name][key]
                flat[start:start + local.numel()] = local
            whole[f"{name}/{key}"] = flat.view(p.shape)
    return {"params": {n: p.detach().clone() for n, p in module.net.named_parameters()}, "state": whole}


def main(out: str, *modes: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    results = {mode: run(mode) for mode in modes}
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(results, out)


def run(mode: str) -> dict:
    Module = module_class()
    result: dict = {}
    if mode == "clip":
        module = Module()
        trainer(STEPS // HALF, True, CLIP).fit(module, loader())
        opt = module.optimizers().optimizer
        result = {**gathered_state(module), "max_norm": opt.max_norm, "clipping": opt.grad_clipping,
                  "norms": module.norms}
    elif mode in ("resume", "no_callback"):
        callback = mode == "resume"
        uninterrupted = Module()
        trainer(STEPS // HALF, callback).fit(uninterrupted, loader())
        result["uninterrupted"] = gathered_state(uninterrupted)
        folder = tempfile.mkdtemp() if not dist.is_initialized() or dist.get_rank() == 0 else None
        if dist.is_initialized():
            shared = [folder]
            dist.broadcast_object_list(shared, src=0)
            folder = shared[0]
        path = os.path.join(folder, "half.ckpt")
        first = Module()
        half = trainer(1, callback)
        half.fit(first, loader())
        half.save_checkpoint(path)
        resumed = perturbed(Module())
        try:
            trainer(STEPS // HALF, callback).fit(resumed, loader(), ckpt_path=path)
            result["resumed"] = gathered_state(resumed)
        except Exception as e:  # noqa: BLE001 - the refusal is what the test reads
            result["refused"] = f"{type(e).__name__}: {e}"
    elif mode.startswith("chain_first:"):  # the uninterrupted run, and its first epoch saved
        path = mode.split(":", 1)[1]
        uninterrupted = Module()
        trainer(3, True).fit(uninterrupted, loader(CHAIN_BATCH))
        result["uninterrupted"] = gathered_state(uninterrupted)
        first = Module()
        half = trainer(1, True)
        half.fit(first, loader(CHAIN_BATCH))
        half.save_checkpoint(path)
        result["saved"] = gathered_state(first)
    elif mode.startswith("chain_next:"):  # resume IN for one more epoch (EPOCHS in all), save OUT
        _, src, out, epochs = mode.split(":")
        resumed = perturbed(Module())
        resuming = trainer(int(epochs), True)
        resuming.fit(resumed, loader(CHAIN_BATCH), ckpt_path=src)
        resuming.save_checkpoint(out)
        result["resumed"] = gathered_state(resumed)
    elif mode == "xla":  # one XLA device, under Lightning's own XLA strategy
        uninterrupted = Module()
        xla_trainer(2).fit(uninterrupted, loader())
        path = os.path.join(tempfile.mkdtemp(), "half.ckpt")
        half = xla_trainer(1)
        half.fit(Module(), loader())
        half.save_checkpoint(path)
        resumed = perturbed(Module())
        xla_trainer(2).fit(resumed, loader(), ckpt_path=path)
        saved = torch.load(path, weights_only=True)["optimizer_states"][0]
        opts = [m.optimizers().optimizer for m in (uninterrupted, resumed)]
        result = {"format": saved["format"], "saved keys": sorted(saved["state_dict"]["state"][0]),
                  "strategy": type(half.strategy).__name__,
                  "params": [{n: p.detach().cpu() for n, p in m.net.named_parameters()} for m in (uninterrupted, resumed)],
                  "masters": [[t.detach().cpu() for t in o.master_shards] for o in opts]}
    elif mode.startswith("renamed:"):  # IN into a module that keeps its net as `body`, renamed on load
        src = mode.split(":", 1)[1]

        class Renamed(Module):
            def __init__(self) -> None:
                super().__init__()
                self.body = self.net
                del self.net

            def training_step(self, batch, _):
                x, y = batch
                return (self.body(x.bfloat16()).float() - y).pow(2).mean()

            def on_train_batch_end(self, outputs, batch, batch_idx):
                pass

            def on_load_checkpoint(self, checkpoint):  # (the module's own migration of the saved keys)
                checkpoint["state_dict"] = {k.replace("net.", "body.", 1): v for k, v in checkpoint["state_dict"].items()}

        module = perturbed(Renamed())
        trainer(2, True).fit(module, loader(CHAIN_BATCH), ckpt_path=src)
        result["renamed"] = {n: p.detach().clone() for n, p in module.body.named_parameters()}
    elif mode.startswith("validate:"):  # validate(ckpt_path=IN) restores the model alone, as Lightning does
        src = mode.split(":", 1)[1]

        class Validated(Module):
            def validation_step(self, batch, _):
                return self.training_step(batch, _)

        module = perturbed(Validated())
        trainer(1, True).validate(module, loader(CHAIN_BATCH), ckpt_path=src, verbose=False)
        saved = torch.load(src, weights_only=True)["state_dict"]
        result["model restored"] = all(torch.equal(p, saved[f"net.{n}"]) for n, p in module.net.named_parameters())
    elif mode.startswith("refused:"):  # IN into an SGD optimizer: refused before the model changes
        src = mode.split(":", 1)[1]
        other = perturbed(module_class(torch.optim.SGD)())
        before = {n: p.detach().clone() for n, p in other.net.named_parameters()}
        try:
            trainer(2, True).fit(other, loader(CHAIN_BATCH), ckpt_path=src)
            result["refused"] = None
        except Exception as e:  # noqa: BLE001 - the refusal is what the test reads
            result["refused"] = f"{type(e).__name__}: {e}"
        result["model unchanged"] = all(torch.equal(p, before[n]) for n, p in other.net.named_parameters())
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return result


def perturbed(module):
    """``module`` with every weight moved: what a resume installs must come from the checkpoint."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.5)
    return module


if __name__ == "__main__":
    main(*sys.argv[1:])
    # Every rank past its last collective before any closes its gloo connections, then the group
    # destroyed before the interpreter exits: exiting with gloo's threads up can abort the exit
    # ("terminate called without an active exception", pytorch/pytorch#190489; tests/trainer_dp_worker.py).
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
