"""Child processes forked from a server that imported torch, nxd_smp and the frameworks once
(``tests/rank_preload.py``): a fresh interpreter cost ~3 s before its first line (~7 s with the
Trainer), and that was most of the suite's time.

* ``run_ranks(n, fn, *args)``: ``fn`` on ``n`` gloo ranks, each rank's result returned;
  ``start_method="spawn"`` gives fresh interpreters where a measurement needs them (the memory
  benchmarks).
* ``run_python(args)``: what ``python ARGS`` does (``-c CODE``, ``-m MODULE`` or a script, then
  its arguments), as ``subprocess.run`` returns it: the program runs as ``__main__`` with the
  interpreter's ``sys.argv``, ``sys.path`` (``PYTHONPATH`` included), working directory and
  environment, and ends as an interpreter does (non-daemon threads joined, ``atexit`` run).
* ``run_launched(n, args)``: the same program on ``n`` ranks, each with the environment
  ``torchrun --standalone --nproc-per-node n`` gives its workers (rank 0 hosts the store), the
  others stopped when one fails, their outputs in rank order.

Every child gets the environment of the call. What the server read at import stays the
server's: a call that sets ``USE_TORCH_XLA`` otherwise, or needs torch_xla imported under
another environment, is a fresh interpreter's job (``subprocess``). Where the point of a test
is the launcher itself (``torchrun``'s own rendezvous, the README's launch lines) or a fresh
interpreter (what an import pulls in, memory), it starts one."""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: Variables the server's imports read (transformers decides on torch_xla when it is imported).
READ_AT_IMPORT = {"USE_TORCH_XLA": "0"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _take_environment(env: dict[str, str]) -> None:
    """The call's environment in a forked child, and the thread count it asks for (OpenMP read
    ``OMP_NUM_THREADS`` when the server loaded it, so setting the variable alone does nothing)."""
    os.environ.clear()
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple, env: dict) -> None:
    _take_environment(env)
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


@cache
def _interpreter_path() -> tuple[str, ...]:
    """``sys.path`` of a fresh interpreter, less its first entry and ``PYTHONPATH``'s."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                         env=env, capture_output=True, text=True, check=True, timeout=60)
    return tuple(json.loads(out.stdout))


def _as_python(args: Sequence[str], cwd: str, env: dict[str, str], out: str, err: str, base_path: tuple) -> None:
    """Run in the forked child: ``python ARGS`` from here to the interpreter's exit."""
    import atexit
    import builtins
    import importlib
    import runpy
    import threading
    import types

    code = 1
    try:
        for fd, path in ((1, out), (2, err)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        os.chdir(cwd)
        _take_environment(env)
        args = list(args)
        while args and args[0] == "-u":  # (unbuffered: the output goes to files either way)
            args.pop(0)
        kind, target, rest = (args[0], args[1], args[2:]) if args[0] in ("-c", "-m") else ("script", args[0], args[1:])
        first = {"-c": "", "-m": os.getcwd()}.get(kind, os.path.dirname(os.path.realpath(target)))
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [first, *extra, *base_path]
        importlib.invalidate_caches()
        try:
            if kind == "-c":
                sys.argv = ["-c", *rest]
                main = types.ModuleType("__main__")
                main.__builtins__ = builtins
                sys.modules["__main__"] = main
                exec(compile(target, "<string>", "exec"), main.__dict__)
            elif kind == "-m":
                sys.argv = [target, *rest]  # (runpy puts the module's file first)
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                sys.argv = [target, *rest]
                runpy.run_path(target, run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            error = sys.exception()
            error.__traceback__ = error.__traceback__.tb_next  # (from the program's frames on, as python prints it)
            sys.excepthook(type(error), error, error.__traceback__)
        threading._shutdown()  # what the interpreter does at exit: its threads, then atexit
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream: nothing left to write
                pass
        os._exit(code)


def _checked_env(env: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ if env is None else env)
    for name, value in READ_AT_IMPORT.items():
        if env.get(name, value) != value:
            raise ValueError(f"{name}={env[name]!r}: the server imported its libraries with {name}={value!r}; "
                             "start a fresh interpreter (subprocess) for this program")
    env.setdefault("USE_TORCH_XLA", READ_AT_IMPORT["USE_TORCH_XLA"])
    return env


def _start(args, cwd, env, tmp: str, name: str):
    out, err = os.path.join(tmp, f"{name}.out"), os.path.join(tmp, f"{name}.err")
    child = multiprocessing.get_context("forkserver").Process(
        target=_as_python, args=(list(args), str(cwd or os.getcwd()), env, out, err, _interpreter_path()))
    child.start()
    return child, out, err


def _read(path: str, text: bool):
    data = Path(path).read_bytes() if os.path.exists(path) else b""  # (a child killed before it opened it)
    return data.decode(errors="replace") if text else data


def run_python(args: Sequence[str], *, cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None,
               timeout: float = 600, text: bool = True) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], capture_output=True, ...)``, forked from the
    preloaded server; raises ``subprocess.TimeoutExpired`` (the child killed) past ``timeout``."""
    env = _checked_env(env)
    with tempfile.TemporaryDirectory() as tmp:
        child, out, err = _start(args, cwd, env, tmp, "program")
        child.join(timeout)
        if child.is_alive():
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired([sys.executable, *args], timeout, _read(out, text), _read(err, text))
        return subprocess.CompletedProcess([sys.executable, *args], child.exitcode, _read(out, text), _read(err, text))


def torchrun_env(rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
    """What ``torchrun --standalone --nproc-per-node nproc`` sets for worker ``rank`` (the installed
    torch's agent: tests/integration/test_forked_programs.py compares), with rank 0 hosting the
    rendezvous store instead of the agent."""
    from torch.distributed.launcher.api import LaunchConfig

    signals = getattr(LaunchConfig, "signals_to_handle", None)  # (torch 2.10 and newer pass them on)
    return {**({"TORCHELASTIC_SIGNALS_TO_HANDLE": signals} if signals else {}),
        "LOCAL_RANK": str(rank), "RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }


def run_launched(nproc: int, args: Sequence[str], *, cwd: str | os.PathLike | None = None,
                 env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python ARGS`` on ``nproc`` ranks as torchrun starts them (``OMP_NUM_THREADS=1`` unless the
    call sets it, as torchrun does). As torchrun's agent does, a rank that fails stops the others
    (SIGTERM, then SIGKILL after 30 s), and the launch's return code is the first failed rank's.
    The ranks' outputs are joined in rank order."""
    env = _checked_env(env)
    env.setdefault("OMP_NUM_THREADS", "1")
    port, run_id = _free_port(), f"nxd_smp-tests-{os.getpid()}-{time.monotonic_ns()}"
    with tempfile.TemporaryDirectory() as tmp:
        started = [_start(args, cwd, {**env, **torchrun_env(r, nproc, port, run_id)}, tmp, f"rank{r}")
                   for r in range(nproc)]
        children = [child for child, _, _ in started]
        deadline, timed_out, first_failed, stopping_since = time.monotonic() + timeout, False, None, None
        while any(child.is_alive() for child in children):
            first_failed = first_failed or next((c for c in children if c.exitcode not in (None, 0)), None)
            timed_out = timed_out or time.monotonic() > deadline
            if stopping_since is None and (first_failed or timed_out):
                stopping_since = time.monotonic()
                for child in children:
                    child.terminate()
            elif stopping_since is not None and time.monotonic() > stopping_since + 30:
                for child in children:
                    child.kill()
            time.sleep(0.05)
        first_failed = first_failed or next((c for c in children if c.exitcode != 0), None)
        outputs = [(_read(out, True), _read(err, True)) for _, out, err in started]
        stdout, stderr = "".join(o for o, _ in outputs), "".join(e for _, e in outputs)
        if timed_out:
            raise subprocess.TimeoutExpired(list(args), timeout, stdout, stderr)
        return subprocess.CompletedProcess(list(args), first_failed.exitcode if first_failed else 0, stdout, stderr)
