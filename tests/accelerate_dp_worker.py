"""accelerate's ``save_state`` / ``load_state`` with a nxd_smp optimizer, in the loop
docs/training_loops.md shows (the optimizer and the data prepared, not the model), launched as
its users launch it: ``torchrun --nproc-per-node 2 tests/accelerate_dp_worker.py OUT``.

Each scenario builds a fresh model, optimizer and Accelerator, and each rank writes what it
ended with to ``OUT/<scenario>/rank<r>.pt``:

* ``full``: 6 steps, ``save_state`` after step 3, with ``register_accelerate_hooks``;
* ``resumed``: ``load_state`` of that folder, then steps 4 to 6 (the first 3 batches skipped);
* ``without_hooks``: ``load_state`` of that folder without the hooks (refused on every rank,
  the state when accelerate hands over ``optimizer.bin`` kept, to compare);
* ``saved_without_hooks`` / ``loaded_without_hooks``: accelerate alone keeps the main process's
  shard only: the load is refused on rank 1, naming the hooks.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

os.environ["USE_TORCH_XLA"] = "0"  # else accelerate asks for the xla backend

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.loops_worker import LR, make_model, markov_data  # noqa: E402

STEPS, SAVE_AT, BATCH = 6, 3, 2


def run(out: Path, state_dir: Path, *, save: bool = False, load: bool = False, hooks: bool = True) -> dict:
    from accelerate import Accelerator

    import nxd_smp
    from nxd_smp.interop.accelerate import register_accelerate_hooks

    accelerator = Accelerator(cpu=True)
    model = make_model(torch.bfloat16).to(accelerator.device)
    optimizer = nxd_smp.Zero1Optimizer(
        model.parameters(), torch.optim.AdamW, lr=LR, betas=(0.9, 0.95), weight_decay=0.0, max_norm=1.0,
        mixed_precision=nxd_smp.MixedPrecisionConfig(use_master_weights_in_ckpt=True))
    loader = torch.utils.data.DataLoader(markov_data(BATCH * accelerator.num_processes * STEPS, seed=1),
                                         batch_size=BATCH)
    optimizer, loader = accelerator.prepare(optimizer, loader)
    if hooks:
        register_accelerate_hooks(accelerator, model, optimizer)
    at_load: dict = {}

    def snapshot(opt, state_dict):  # accelerate hands over optimizer.bin: the state before the load
        at_load.update(masters=[m.clone() for m in opt.master_shards],
                       params={n: p.detach().clone() for n, p in model.named_parameters()})

    optimizer.optimizer.register_load_state_dict_pre_hook(snapshot, prepend=True)
    error, start = None, 0
    if load:
        try:
            accelerator.load_state(str(state_dir))
            start = SAVE_AT
        except Exception as e:  # noqa: BLE001 - a refused load is a result
            error = f"{type(e).__name__}: {e}"
    if error is None:
        batches = accelerator.skip_first_batches(loader, start) if start else loader
        for step, tokens in enumerate(batches, start=start):
            accelerator.backward(model(input_ids=tokens, labels=tokens).loss)
            optimizer.step()
            optimizer.zero_grad()
            if save and step + 1 == SAVE_AT:
                accelerator.save_state(str(state_dir))
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "masters": [m.clone() for m in optimizer.optimizer.master_shards], "at_load": at_load, "error": error}


def main(out: str) -> None:
    out_dir = Path(out)
    state, plain = out_dir / "state", out_dir / "plain_state"
    scenarios = {
        "full": lambda: run(out_dir, state, save=True),
        "resumed": lambda: run(out_dir, state, load=True),
        "without_hooks": lambda: run(out_dir, state, load=True, hooks=False),
        "saved_without_hooks": lambda: run(out_dir, plain, save=True, hooks=False),
        "loaded_without_hooks": lambda: run(out_dir, plain, load=True, hooks=False),
    }
    rank = int(os.environ.get("RANK", "0"))
    for name, scenario in scenarios.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = scenario()
        (out_dir / name).mkdir(parents=True, exist_ok=True)
        torch.save(result, out_dir / name / f"rank{rank}.pt")
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    # (exiting with gloo's threads still up can abort the interpreter's exit: pytorch/pytorch#190489)
    if dist.is_initialized():
        dist.destroy_process_group()
