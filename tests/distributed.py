"""Run a function on N gloo ranks on this machine and collect what each rank returns.

The ranks fork from a server that imported torch and nxd_smp once (``tests/rank_preload.py``):
spawning a fresh interpreter per rank cost ~6 s of imports and inductor's CPU probe, most of the
suite's time in its multi-rank tests. ``start_method="spawn"`` gives fresh interpreters where a
measurement needs them (the memory benchmarks). Either way each rank gets the environment of the
call (a forked rank would otherwise keep the server's)."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple, env: dict) -> None:
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    dist.init_process_group(  # a collective that hangs fails after 5 minutes instead of 30
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        result = fn(rank, world_size, *args)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()
    torch.save({"result": result}, os.path.join(out_dir, f"{rank}.pt"))


multiprocessing.set_forkserver_preload(["tests.rank_preload"])


def run_ranks(world_size: int, fn: Callable, *args: Any, start_method: str = "forkserver") -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks (forked from the preloaded
    server, or ``start_method="spawn"``: fresh interpreters); returns the per-rank results. ``fn``
    must be importable (module level)."""
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(
                _entry,
                args=(world_size, _free_port(), out_dir, fn, args, dict(os.environ)),
                nprocs=world_size,
                join=True,
                start_method=start_method,
            )
        except mp.ProcessRaisedException as e:
            raise AssertionError(f"a rank failed:\n{e}") from None
        results = []
        for rank in range(world_size):
            saved = torch.load(os.path.join(out_dir, f"{rank}.pt"), weights_only=False)
            if "error" in saved:
                raise AssertionError(f"rank {rank} failed:\n{saved['error']}")
            results.append(saved["result"])
        return results
