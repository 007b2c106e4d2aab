"""The Hugging Face ``Trainer`` with a nxd_smp optimizer at DP > 1, as its users launch it:
``torchrun --nproc-per-node 2 tests/trainer_dp_worker.py OUT`` (gloo on the CPU), or the same
run at DP 1 with ``python tests/trainer_dp_worker.py OUT`` (the global batch kept by gradient
accumulation). Each rank writes its parameters and fp32 masters to ``OUT/rank<r>.pt``. With
``SKIP_DDP_ALLREDUCE=1`` the callback gets the trainer and DDP's all-reduce is replaced by
nothing; without it the bytes DDP all-reduces are counted.

Under torchrun the Trainer moves the model to ``cpu:0`` (accelerate's device), which copies
every parameter after the optimizer was built: the optimizer takes the copies back.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

os.environ["USE_TORCH_XLA"] = "0"  # else the Trainer asks for the xla backend

import torch  # noqa: E402

from tests.loops_worker import LR, make_model, markov_data  # noqa: E402

STEPS, PER_DEVICE = 3, 2


def main(out: str) -> None:
    from transformers import Trainer, TrainingArguments

    import nxd_smp
    from nxd_smp.hf_trainer import Zero1TrainerCallback

    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = TrainingArguments(  # first: it initialises torch.distributed, which the optimizer needs
        output_dir=str(Path(out) / "trainer"), per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=2 // world, max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant",
        report_to="none", save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, max_grad_norm=1.0,
        dataloader_drop_last=True,
    )
    model = make_model(torch.bfloat16)
    optimizer = nxd_smp.Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=LR, betas=(0.9, 0.95),
                                       weight_decay=0.0)
    data = [{"input_ids": t, "labels": t} for t in markov_data(PER_DEVICE * 2 * STEPS, seed=1)]
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, None))
    skip = os.environ.get("SKIP_DDP_ALLREDUCE") == "1"
    trainer.add_callback(Zero1TrainerCallback(trainer if skip else None))
    sent = count_ddp_bytes(trainer) if world > 1 and not skip else []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "masters": [m.clone() for m in optimizer.master_shards],
                "world": world, "device": str(trainer.args.device), "ddp_bytes": sent, "steps": STEPS},
               Path(out) / f"rank{rank}.pt")


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


if __name__ == "__main__":
    main(sys.argv[1])
