"""The Hugging Face ``Trainer`` with a nxd_smp optimizer, as its users launch it: ``torchrun
--nproc-per-node 2 tests/trainer_dp_worker.py OUT [DP1_OUT]`` (gloo on the CPU), or at DP 1 with
``python tests/trainer_dp_worker.py OUT`` (the global batch kept by gradient accumulation), or at
DP 1 on the XLA CPU device with ``USE_TORCH_XLA=1 PJRT_DEVICE=CPU`` (the Trainer's own torch_xla paths: ``xm.save``
of every rank's ``state_dict()``; ``full`` and ``resumed`` only).

One launch runs every scenario of its DP size in turn, each with a fresh model, optimizer and
Trainer (``SCENARIOS``), and each rank writes what each ended with to ``OUT/<scenario>/rank<r>.pt``:
parameters, fp32 masters, and the error a refused resume raised. The scenarios:

* ``full``: 6 steps with ``save_steps=3`` (checkpoints 3 and 6), the callback given the trainer;
* ``resumed``: ``resume_from_checkpoint=True`` from a copy of ``full``'s checkpoint-3, with
  ``save_total_limit=1`` (checkpoint-6 replaces it);
* ``xla_order`` / ``xla_order_resumed``: the same through the Trainer's torch_xla call order
  (``state_dict()`` on every rank after a rendezvous, the master writes), reproduced on gloo;
* ``best`` / ``best_resumed`` (DP 1): ``save_strategy="best"`` (evaluated at step 3), which the
  Trainer decides after ``on_step_end``: the callback writes in ``on_save``, and a resume from
  that checkpoint;
* ``from_dp1`` (DP 2, given DP1_OUT): resumed from the DP 1 launch's checkpoint-3;
* ``missing_shard`` (DP 2): resumed from a copy of checkpoint-3 without one of nxd_smp's files
  (the state when the Trainer hands the optimizer ``optimizer.pt`` is kept, to compare);
* ``ddp_bytes`` (DP 2): 6 steps without saving, the callback without the trainer: DDP keeps
  its all-reduce, and the bytes it sends are counted;
* ``saving_without_the_trainer`` (DP 2): ``save_steps`` with the callback without the trainer.

The Trainer samples in order (``train_sampling_strategy="sequential"``): its shuffled order
depends on the DP size, and the runs at one DP size are the oracle of those at the other.

Under torchrun the Trainer moves the model to ``cpu:0`` (accelerate's device), which copies
every parameter after the optimizer was built: the optimizer takes the copies back.
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from pathlib import Path

ON_XLA = os.environ.get("USE_TORCH_XLA") == "1"  # the Trainer's torch_xla paths, on the XLA CPU device
if not ON_XLA:
    os.environ["USE_TORCH_XLA"] = "0"  # else the Trainer asks for the xla backend

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.loops_worker import LR, make_model, markov_data  # noqa: E402

STEPS, SAVE_AT, PER_DEVICE = 6, 3, 2


def xla_order_trainer():
    """The Trainer with its torch_xla branch of ``_save_optimizer_and_scheduler`` as
    transformers 5.23 writes it (a rendezvous, ``state_dict()`` on every rank, ``xm.save``: the
    master writes), with gloo's barrier for the rendezvous. Loading is the same on both paths:
    every rank reads the files and calls ``load_state_dict``."""
    from transformers import Trainer
    from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

    class XlaOrderTrainer(Trainer):
        def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
            if dist.is_initialized():
                dist.barrier()  # xm.rendezvous("saving_optimizer_states")
            optimizer_state = self.optimizer.state_dict()  # every rank
            scheduler_state = self.lr_scheduler.state_dict()
            if self.args.should_save:  # xm.save writes on the master only
                torch.save(optimizer_state, os.path.join(output_dir, OPTIMIZER_NAME))
                torch.save(scheduler_state, os.path.join(output_dir, SCHEDULER_NAME))

    return XlaOrderTrainer


def train(out: Path, *, resume: bool = False, save: bool = True, save_total_limit: int | None = None,
          xla_order: bool = False, give_trainer: bool = True, count_ddp: bool = False, best: bool = False) -> dict:
    from transformers import Trainer, TrainingArguments

    import nxd_smp
    from nxd_smp.interop.hf_trainer import Zero1TrainerCallback

    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = TrainingArguments(  # first: it initialises torch.distributed, which the optimizer needs
        output_dir=str(out), per_device_train_batch_size=PER_DEVICE, gradient_accumulation_steps=2 // world,
        max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", report_to="none",
        save_strategy=("best" if best else "steps") if save else "no", save_steps=SAVE_AT,
        save_total_limit=save_total_limit, eval_strategy="steps" if best else "no", eval_steps=SAVE_AT,
        metric_for_best_model="runtime" if best else None,  # (the first evaluation is a new best)
        use_cpu=True, seed=0, disable_tqdm=True, max_grad_norm=1.0, dataloader_drop_last=True,
        train_sampling_strategy="sequential",
    )
    model = make_model(torch.bfloat16)
    if ON_XLA:  # the Trainer would move it there: the optimizer is built on the final device
        import torch_xla

        model = model.to(torch_xla.device())
    optimizer = nxd_smp.Zero1Optimizer(
        model.parameters(), torch.optim.AdamW, lr=LR, betas=(0.9, 0.95), weight_decay=0.0,
        mixed_precision=nxd_smp.MixedPrecisionConfig(use_master_weights_in_ckpt=True))
    data = [{"input_ids": t, "labels": t} for t in markov_data(PER_DEVICE * 2 * STEPS, seed=1)]
    trainer = (xla_order_trainer() if xla_order else Trainer)(
        model=model, args=args, train_dataset=data, eval_dataset=data[:2] if best else None,
        optimizers=(optimizer, None))
    trainer.add_callback(Zero1TrainerCallback(trainer if give_trainer else None))
    sent = count_ddp_bytes(trainer) if count_ddp else []
    at_load: dict = {}  # the state when the Trainer hands over optimizer.pt, before nxd_smp loads

    def snapshot(opt, state_dict):
        at_load.update(masters=[m.cpu().clone() for m in opt.master_shards],
                       params={n: p.detach().cpu().clone() for n, p in model.named_parameters()})

    optimizer.register_load_state_dict_pre_hook(snapshot, prepend=True)
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.train(resume_from_checkpoint=resume or None)
        except Exception as e:  # noqa: BLE001 - a refused resume is a result
            error = f"{type(e).__name__}: {e}"
    return {"params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
            "masters": [m.cpu().clone() for m in optimizer.master_shards], "at_load": at_load, "error": error,
            "world": world, "device": str(trainer.args.device), "ddp_bytes": sent, "steps": STEPS,
            "warnings": [str(w.message) for w in caught if "Zero1TrainerCallback" in str(w.message)]}


def count_ddp_bytes(trainer) -> list[int]:
    """Bytes DDP all-reduces per bucket, counted by a hook that does DDP's own all-reduce (the
    Trainer wraps the model in ``train()``: the hook goes on at the start of training)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from transformers import TrainerCallback

    sent: list[int] = []

    def counting(state, bucket):
        sent.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return allreduce_hook(state, bucket)

    class Count(TrainerCallback):
        def on_train_begin(self, *args, **kwargs):
            wrapped = trainer.model_wrapped
            if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
                wrapped.register_comm_hook(None, counting)

    trainer.add_callback(Count())
    return sent


def copy_checkpoint(source: Path, target_dir: Path, drop: str | None = None) -> None:
    """Rank 0 copies ``source`` into ``target_dir`` as users do (``cp -a``: links kept), without
    nxd_smp's file ``drop`` if given; the other ranks wait."""
    if int(os.environ.get("RANK", "0")) == 0:
        target = target_dir / source.name
        shutil.copytree(source, target, symlinks=True)
        if drop is not None:
            (target / "nxd_smp" / drop).unlink()
    if dist.is_initialized():
        dist.barrier()


def main(out: str, dp1_out: str | None = None) -> None:
    out_dir = Path(out)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    checkpoint_3 = out_dir / "full" / f"checkpoint-{SAVE_AT}"
    scenarios = {
        "full": lambda o: train(o),
        "resumed": lambda o: (copy_checkpoint(checkpoint_3, o), train(o, resume=True, save_total_limit=1))[1],
    }
    if world == 1 and not ON_XLA:  # the save decided after on_step_end, and a resume from it
        scenarios["best"] = lambda o: train(o, best=True)
        scenarios["best_resumed"] = lambda o: (copy_checkpoint(out_dir / "best" / f"checkpoint-{SAVE_AT}", o),
                                               train(o, resume=True, best=True))[1]
    if not ON_XLA:  # (on the XLA device the Trainer takes its torch_xla branch itself)
        scenarios["xla_order"] = lambda o: train(o, xla_order=True)
        scenarios["xla_order_resumed"] = lambda o: (
            copy_checkpoint(out_dir / "xla_order" / f"checkpoint-{SAVE_AT}", o), train(o, resume=True, xla_order=True))[1]
    if world > 1:
        if dp1_out is not None:
            scenarios["from_dp1"] = lambda o: (copy_checkpoint(Path(dp1_out) / "full" / f"checkpoint-{SAVE_AT}", o),
                                               train(o, resume=True))[1]
        scenarios["missing_shard"] = lambda o: (copy_checkpoint(checkpoint_3, o, drop=missing_file(checkpoint_3)),
                                                train(o, resume=True))[1]
        scenarios["ddp_bytes"] = lambda o: train(o, save=False, give_trainer=False, count_ddp=True)
        scenarios["saving_without_the_trainer"] = lambda o: train(o, give_trainer=False)
    rank = int(os.environ.get("RANK", "0"))
    for name, run in scenarios.items():
        result = run(out_dir / name)
        torch.save(result, out_dir / name / f"rank{rank}.pt")


def missing_file(checkpoint: Path) -> str:
    """The first file rank 1 wrote into the nxd_smp checkpoint (``__<rank>_<writer>.bin``)."""
    return min(f.name for f in (checkpoint / "nxd_smp").resolve().iterdir() if f.name.startswith("__1_"))


if __name__ == "__main__":
    main(*sys.argv[1:])
    # Every rank past its last collective before any rank closes its gloo connections (a barrier),
    # then the group destroyed before the interpreter exits (exiting with gloo's threads still up
    # can abort the interpreter's exit: pytorch/pytorch#190489; it printed "terminate called
    # without an active exception"). On an error the traceback is printed and the launch fails
    # either way: no barrier there, which would wait for a rank that may never come.
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
