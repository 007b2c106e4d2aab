"""Run a function on N XLA CPU replicas with real in-graph collectives (docs/trainium.md,
"Multi-replica XLA on the CPU").

``run_replicas(n, "module:function", *args)`` starts a child process with
``PJRT_DEVICE=CPU CPU_NUM_DEVICES=n XLA_THREAD_POOL_SIZE>=n PJRT_CPU_ASYNC_CLIENT=0``; the
child calls ``torch_xla.launch``, which runs one thread per replica, and each replica calls
``function(rank, world_size, *args)`` and returns something ``torch.save`` can write. The
parent kills the child's process group if it outlives ``timeout``, so a hang fails the test
instead of blocking the suite. ``torch_xla.launch`` starts the replicas' process itself, forked
here from the child that has imported torch_xla already (a spawned one imported it again: ~8 s).

Inside a replica, ``sync()`` replaces ``torch_xla.sync()``: all replicas wait at one barrier
first, so none reaches a collective more than XLA:CPU's ~15 s after the others (compile
skew aborts the process). nxd_smp itself gives every collective on the XLA CPU device a
channel id, which is how XLA:CPU matches the replicas of one collective.

``torch_xla.sync()`` compiles a new graph in the calling thread, then hands its execution to
torch_xla's threads; the compiled programs are cached per process, keyed by the graph and not by
the device. With ``compile_in_turn`` (the tests' default) the replicas sync one at a time, so the
first compiles each program and the others find it in the cache: every rank still traces and
runs its own graph, and a rank whose graph differed would compile its own. Compiling at once,
each replica compiled every program again (a four-replica child spent most of its time there).
The benchmarks sync at once, as processes of their own would.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
_barrier: threading.Barrier | None = None
_barrier_lock = threading.Lock()
#: Replicas are threads of one process and share torch's global RNG: hold this lock
#: around code that seeds and draws from it (building a model), or the draws interleave.
serial = threading.Lock()
_compiling = threading.Lock()
_in_turn = False


def replica_env(n: int) -> dict[str, str]:
    """The environment a process running ``n`` XLA CPU replicas needs."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_USE_BF16", "XLA_DOWNCAST_BF16")}
    env.update(
        PJRT_DEVICE="CPU",
        CPU_NUM_DEVICES=str(n),
        XLA_THREAD_POOL_SIZE=str(max(n, os.cpu_count() or 1) + 2),
        PJRT_CPU_ASYNC_CLIENT="0",
        PYTHONPATH=str(ROOT),
    )
    return env


def run_replicas(n: int, target: str, *args: Any, timeout: float = 600, compile_in_turn: bool = True) -> list[Any]:
    """``target(rank, n, *args)`` on ``n`` XLA CPU replicas; the per-rank results. With
    ``compile_in_turn`` the replicas' ``sync()`` compiles each program once for all of them."""
    with tempfile.TemporaryDirectory() as out_dir:
        torch.save({"target": target, "args": args, "in_turn": compile_in_turn}, Path(out_dir) / "job.pt")
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.xla_replicas", out_dir, str(n)],
            cwd=ROOT, env=replica_env(n), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            raise AssertionError(f"{n} XLA replicas ran past {timeout} s (a hang?):\n{output[-4000:]}") from None
        saved = [
            torch.load(f, weights_only=False) if (f := Path(out_dir) / f"{rank}.pt").exists() else None
            for rank in range(n)
        ]
        errors = [f"replica {rank}:\n{s['error']}" for rank, s in enumerate(saved) if s and "error" in s]
        first = [e for e in errors if "BrokenBarrierError" not in e] or errors
        if first or proc.returncode != 0 or None in saved:
            raise AssertionError(
                f"{n} XLA replicas failed (exit {proc.returncode}):\n"
                + ("\n".join(first[:2]) if first else output[-6000:])
            )
        return [s["result"] for s in saved]


def sync() -> None:
    """``torch_xla.sync()`` once every replica is ready to run the same graph (one replica at a
    time with ``compile_in_turn``: see the module's docstring)."""
    import torch_xla

    _barrier.wait()
    if _in_turn:
        with _compiling:
            torch_xla.sync()
    else:
        torch_xla.sync()


def wait_for_device() -> None:
    """Wait until this replica's device has run what it was given (for timing). Only this
    replica's device: ``xm.wait_device_ops()`` waits for every device, and a replica waiting
    for another one's collective while that one waits to dispatch its graph deadlocks."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops(torch_xla._XLAC._xla_real_devices([str(torch_xla.device())]))


def barrier() -> None:
    """Wait for every replica (no graph)."""
    _barrier.wait()


def _replica(index: int, out_dir: str, n: int) -> None:
    import traceback

    import torch_xla.runtime as xr

    global _barrier, _in_turn
    job = torch.load(Path(out_dir) / "job.pt", weights_only=False)
    with _barrier_lock:
        if _barrier is None:
            _barrier = threading.Barrier(n, timeout=300)
            _in_turn = job["in_turn"]
    module, name = job["target"].split(":")
    fn = getattr(importlib.import_module(module), name)
    rank = xr.global_ordinal()
    assert rank == index, (rank, index)
    try:
        result = {"result": fn(rank, n, *job["args"])}
    except BaseException:  # noqa: BLE001 - reported to the parent, then re-raised
        result = {"error": traceback.format_exc()}
        _barrier.abort()  # free the others: they would wait for this replica forever
        torch.save(result, Path(out_dir) / f"{rank}.pt")
        raise
    torch.save(result, Path(out_dir) / f"{rank}.pt")


def main(out_dir: str, n: int) -> None:
    import torch_xla

    # by its importable name, so that the replicas and the code they run share one barrier
    from tests import xla_replicas

    torch_xla.launch(xla_replicas._replica, args=(out_dir, n), start_method="fork")


def split_torch_xla_collectives_per_tensor() -> None:
    """The one change XLA:CPU replicas force on torch_xla's optimizer at DP > 1: its coalesced
    collectives as single-tensor torch_xla ops with a channel id, in order. XLA:CPU meets the
    replicas of a collective by its channel id, and torch-xla 2.9's coalesced forms cannot
    carry one (``xm.reduce_scatter`` with a list drops it; ``xm.all_reduce`` has none), so
    they are split per tensor (NXD_FACTS.md). Only that module's ``xm`` is replaced, by a
    stand-in that delegates the rest. Used by scripts/bench_xla.py and tests/nxd_layout.py."""
    import types

    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.zero_redundancy_optimizer as zero

    from nxd_smp.backend.xla import _next_channel_id, _xla_cpu

    def in_order(op, tensor):
        """``op(tensor, channel_id)`` after the previous collective, with a channel id of its own."""
        last = getattr(_xla_cpu, "last", None)
        if last is not None:
            xm.optimization_barrier_([tensor, last])
        out = op(tensor, _next_channel_id())
        _xla_cpu.last = out.reshape(-1)[:1]
        return out

    def reduce_scatter(reduce_type, input, scale, scatter_dim, shard_count, groups=None, output=None,
                       pin_layout=True, **_):
        assert output is None
        tensors = input if isinstance(input, list) else [input]
        out = [in_order(lambda x, c: xm.reduce_scatter(reduce_type, x, scale, scatter_dim, shard_count, groups=groups,
                                                       pin_layout=False, channel_id=c), t) for t in tensors]
        return out if isinstance(input, list) else out[0]

    def reduce_scatter_bucketized(reduce_type, input_list, scale, scatter_dim, shard_count, groups=None,
                                  output=None, pin_layout=False, bucket_cap_mb=0, **_):
        return reduce_scatter(reduce_type, list(input_list), scale, scatter_dim, shard_count, groups)

    def all_gather(value, dim=0, groups=None, output=None, pin_layout=True, **_):
        assert output is None
        tensors = value if isinstance(value, list) else [value]
        out = [in_order(lambda x, c: xm.all_gather(x, dim, groups=groups, pin_layout=False, channel_id=c), t)
               for t in tensors]
        return out if isinstance(value, list) else out[0]

    def all_gather_bucketized(input_list, dim=0, groups=None, output=None, pin_layout=False, bucket_cap_mb=0, **_):
        return all_gather(list(input_list), dim, groups)

    def all_reduce(reduce_type, inputs, scale=1.0, groups=None, pin_layout=True):
        assert reduce_type == xm.REDUCE_SUM
        tensors = inputs if isinstance(inputs, list) else [inputs]
        out = []
        for t in tensors:
            gathered = in_order(lambda x, c: xm.all_gather(x, 0, groups=groups, pin_layout=False, channel_id=c),
                                t.reshape(1, -1))
            out.append(gathered.sum(dim=0).view(t.shape) * scale)
        if isinstance(inputs, list):
            for t, r in zip(inputs, out):
                t.copy_(r)
            return inputs
        return out[0]

    stand_in = types.SimpleNamespace(**{k: getattr(xm, k) for k in dir(xm) if not k.startswith("__")})
    stand_in.reduce_scatter, stand_in.reduce_scatter_bucketized = reduce_scatter, reduce_scatter_bucketized
    stand_in.all_gather, stand_in.all_gather_bucketized, stand_in.all_reduce = (
        all_gather, all_gather_bucketized, all_reduce)
    zero.xm = stand_in


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
