"""One rank of a run on "nodes" that share no disk, launched by ``torchrun`` (tests/integration/
test_object_storage.py): it trains, saves to S3, and goes on (``save``), or resumes from S3 at
whatever world size it was launched with and goes on (``resume``); rank 0 writes the parameters it
ends with to ``OUT``. Twelve micro-batches per step over all ranks, so the run is the same at
world sizes 1, 2, 3, 4 and 6.

    torchrun ... tests/s3_nodes_worker.py save|resume s3://bucket/prefix OUT
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from nxd_smp import finalize_checkpoint, load_checkpoint, save_checkpoint
from tests.checkpoint_scenario import build, params_of, train

GLOBAL_MICRO = 12  # (tests/checkpoint_scenario.py's 6 does not divide among 4 ranks)


def main() -> None:
    mode, url, out = sys.argv[1:4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if mode == "save":
        model, opt = build(seed=0)
        train(model, opt, 3, 0, rank, world, GLOBAL_MICRO)
        save_checkpoint(url, "step_3", model, opt, user_content={"step": 3, "world": world}, async_save=True)
        train(model, opt, 2, 3, rank, world, GLOBAL_MICRO)
        finalize_checkpoint()
    else:
        model, opt = build(seed=5)  # everything must come from the checkpoint
        saved = load_checkpoint(url, model=model, optimizer=opt)
        train(model, opt, 2, saved["step"], rank, world, GLOBAL_MICRO)
    if rank == 0:
        torch.save(params_of(model), out)
    print(f"rank {rank} of {world} in {os.getcwd()}: {mode} done", flush=True)
    dist.barrier()  # (every rank done)
    # Out without tearing the groups down: under a multi-node torchrun (the agent's shared store) torch 2.13's
    # gloo teardown at times aborts a rank ("terminate called without an active exception") after its work is
    # done, and the other node's agent then waits out its exit barrier. What this run checks is written above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
