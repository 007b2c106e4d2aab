"""Child processes forked from a server that imported torch, nxd_smp and the frameworks once
(``tests/rank_preload.py``): a fresh interpreter cost ~3 s before its first line (~7 s with the
Trainer), and that was most of the suite's time.

* ``run_ranks(n, fn, *args)``: ``fn`` on ``n`` gloo ranks, each rank's result returned;
  ``start_method="spawn"`` gives fresh interpreters where a measurement needs them (the memory
  benchmarks).
* ``run_python(args)``: what ``python ARGS`` does (``[-u] -c CODE``, ``-m MODULE`` or a script,
  then its arguments), as ``subprocess.run`` returns it: the program runs as ``__main__`` with the
  interpreter's ``sys.argv``, ``sys.path`` (``PYTHONPATH`` included), working directory,
  environment and random seeds of its own, and ends as an interpreter does (non-daemon threads
  joined, ``atexit`` run, the exit code).
* ``run_launched(n, args)``: ``torchrun --standalone --nproc-per-node n ARGS``: the program on ``n``
  ranks, each with the environment torchrun gives its workers (rank 0 hosts the store), the others
  stopped when one fails, their outputs in rank order.

Every child gets the environment of the call, and what the server read at import stays the
server's: a call that sets such a variable otherwise (``READ_AT_IMPORT``: ``USE_TORCH_XLA``, which
transformers reads, torch's and the interpreter's settings) is refused, and is a fresh
interpreter's job (``subprocess``). What else a fork cannot give is the same for every child of
the server: the modules it imported are imported already, ``hash`` of a string is the server's
(``PYTHONHASHSEED`` is read at start), and the interpreter's finalization after ``atexit``
(module teardown, C++ destructors: where an exit can abort with gloo's threads still up,
pytorch/pytorch#190489) does not run. Where the point of a test is the launcher itself
(``torchrun``'s rendezvous and exit, the README's launch lines) or a fresh interpreter (what an
import pulls in), it starts one; tests/integration/test_forked_programs.py compares the two."""

from __future__ import annotations

import datetime
import io
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

#: Variables the server's imports read, by name or prefix (transformers decides on torch_xla, torch
#: reads its logging, dynamo's and inductor's settings, the interpreter its PYTHON* flags): a
#: program whose call sets one otherwise than the server had it needs an interpreter of its own.
READ_AT_IMPORT = ("USE_TORCH_XLA", "TORCH_", "TORCHINDUCTOR_", "TORCHDYNAMO_", "PYTORCH_", "HF_", "TRANSFORMERS_",
                  "ACCELERATE_", "PYTHON")
#: ... but for these: applied by the child itself (the path, ``-u``), read only where they are used
#: (gloo's and NCCL's at a group's creation, inductor's cache folder at a compile: a process that
#: compiled has it set, one that did not has not), or the server's own (tests/rank_preload.py).
TAKEN_IN_THE_CHILD = {"PYTHONPATH", "PYTHONUNBUFFERED", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHINDUCTOR_CACHE_DIR",
                      "PYTORCH_NVML_BASED_CUDA_CHECK"}
REFUSED = 86  # a child's exit code when the call's environment differs in what the server read


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


def _read_at_import(name: str) -> bool:
    return name.startswith(READ_AT_IMPORT) and name not in TAKEN_IN_THE_CHILD


def _parse(args: Sequence[str]) -> tuple[str, str, list[str], bool]:
    """``python``'s own arguments: ``[-u] (-c CODE | -m MODULE | SCRIPT) ARGS...`` as (kind, target,
    the program's arguments, unbuffered)."""
    args, unbuffered = list(args), False
    while args and args[0] == "-u":
        args, unbuffered = args[1:], True
    if not args or (args[0].startswith("-") and args[0] not in ("-c", "-m")) or (args[0] in ("-c", "-m")
                                                                                 and len(args) < 2):
        raise ValueError(f"run_python takes [-u] (-c CODE | -m MODULE | SCRIPT) [ARGS...], not {args[:2]}")
    if args[0] in ("-c", "-m"):
        return args[0], args[1], args[2:], unbuffered
    return "script", args[0], args[1:], unbuffered


def _fresh_state(kind: str, target: str, cwd: str, env: dict[str, str], base_path: tuple, unbuffered: bool) -> None:
    """What a new interpreter would start the program with, in the forked child: the call's working
    directory and environment, ``sys.path``, unbuffered output with ``-u``, its own random seeds
    (ranks of one launch draw differently, as separate interpreters do), and no parent process."""
    import importlib
    import random
    from multiprocessing import process

    os.chdir(cwd)
    _take_environment(env)
    first = {"-c": "", "-m": os.getcwd()}[kind] if kind != "script" else os.path.dirname(os.path.realpath(target))
    sys.path[:] = [first, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p], *base_path]
    importlib.invalidate_caches()
    if unbuffered:
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)
    random.seed()
    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    process.current_process().name, process._parent_process = "MainProcess", None


def _why_not_here(env: dict[str, str]) -> str | None:
    """In the forked child: why this server cannot run a program whose call has ``env`` (``None``:
    it can). A variable its imports read must have the value they started from, or the one they
    set themselves."""
    preload = sys.modules.get("tests.rank_preload")
    if preload is None:
        return "the fork server did not import tests.rank_preload: run pytest from the repository's root"
    differ = sorted(k for k in set(env) | set(os.environ) if _read_at_import(k)
                    and env.get(k) not in (os.environ.get(k), preload.ENVIRONMENT.get(k)))
    if not differ:
        return None
    return (f"the call sets {', '.join(f'{k}={env.get(k)!r}' for k in differ)}, which the server's imports read as "
            f"{', '.join(f'{k}={os.environ.get(k)!r}' for k in differ)}: run this program in an interpreter of its "
            "own (subprocess)")


def _as_python(program: tuple, cwd: str, env: dict[str, str], out: str, err: str, base_path: tuple) -> None:
    """Run in the forked child: the ``program`` ``_parse`` read from ``python``'s arguments, from here
    to the interpreter's exit (threads joined,
    then ``atexit``; what finalization does after that, module teardown and C++ destructors, the
    child skips: it ends in ``os._exit``)."""
    import atexit
    import builtins
    import runpy
    import signal
    import threading
    import types

    code = 1
    try:
        for fd, path in ((1, out), (2, err)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        refused = _why_not_here(env)
        if refused:
            print(f"tests/distributed.py refused: {refused}", file=sys.stderr, flush=True)
            code = REFUSED
            return
        kind, target, rest, unbuffered = program
        _fresh_state(kind, target, cwd, env, base_path, unbuffered)
        try:
            if kind == "-c":
                sys.argv = ["-c", *rest]
                main = types.ModuleType("__main__")
                main.__builtins__ = builtins
                sys.modules["__main__"] = main
                exec(compile(target, "<string>", "exec"), main.__dict__)
            elif kind == "-m":  # (runpy's entry for python -m, which puts the module's file first in argv)
                sys.argv = ["-m", *rest]
                sys.modules.pop(target, None)  # (python -m runs it anew as __main__, whatever imported it)
                runpy._run_module_as_main(target, alter_argv=True)
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
        except BaseException as error:  # noqa: BLE001 - reported as python reports it
            frames, ours = error.__traceback__, (__file__, *(("<frozen runpy>", runpy.__file__) if kind == "script" else ()))
            while frames is not None and frames.tb_frame.f_code.co_filename in ours:
                frames = frames.tb_next  # (from where python's own traceback starts)
            sys.excepthook(type(error), error.with_traceback(frames), frames)
            code = -signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1
        threading._shutdown()  # what the interpreter does at exit: its threads, then atexit
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - the harness's own failure, reported
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream: nothing left to write
                pass
        if code == -signal.SIGINT:  # (an interrupted python ends by the signal, as -2)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def _start(args, cwd, env, tmp: str, name: str):
    out, err = os.path.join(tmp, f"{name}.out"), os.path.join(tmp, f"{name}.err")
    child = multiprocessing.get_context("forkserver").Process(
        target=_as_python, args=(_parse(args), str(cwd or os.getcwd()), env, out, err, _interpreter_path()))
    child.start()
    return child, out, err


def _read(path: str, text: bool):
    """What a child wrote to ``path`` (nothing if it was killed before it opened it), as
    ``subprocess.run`` hands it over: bytes, or text in the locale's encoding with newlines
    translated."""
    data = Path(path).read_bytes() if os.path.exists(path) else b""
    return io.TextIOWrapper(io.BytesIO(data)).read() if text else data


def _refusal(child, err: str) -> None:
    if child.exitcode == REFUSED and (message := _read(err, True)).startswith("tests/distributed.py refused"):
        raise ValueError(message.strip())


def _stop(children) -> None:
    for child in children:
        if child.is_alive():
            child.kill()
            child.join()


def run_python(args: Sequence[str], *, cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None,
               timeout: float = 600, text: bool = True) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], capture_output=True, ...)``, forked from the
    preloaded server; raises ``subprocess.TimeoutExpired`` (the child killed) past ``timeout``, and
    ``ValueError`` where the call's environment differs in a variable the server's imports read."""
    env = dict(os.environ if env is None else env)
    command = [sys.executable, *args]
    with tempfile.TemporaryDirectory() as tmp:
        child, out, err = _start(args, cwd, env, tmp, "program")
        try:
            child.join(timeout)
        finally:
            timed_out = child.is_alive()
            _stop([child])  # (past its time, or an interrupted test: no child left behind)
        if timed_out:
            raise subprocess.TimeoutExpired(command, timeout, _read(out, text), _read(err, text))
        _refusal(child, err)
        return subprocess.CompletedProcess(command, child.exitcode, _read(out, text), _read(err, text))


def torchrun_env(rank: int, nproc: int, port: int, run_id: str, error_file: str) -> dict[str, str]:
    """What ``torchrun --standalone --nproc-per-node nproc`` sets for worker ``rank`` (the installed
    torch's agent: tests/integration/test_forked_programs.py compares), with rank 0 hosting the
    rendezvous store instead of the agent."""
    from torch.distributed.launcher.api import LaunchConfig

    signals = getattr(LaunchConfig, "signals_to_handle", None)  # (torch 2.10 and newer pass them on)
    return {**({"TORCHELASTIC_SIGNALS_TO_HANDLE": signals} if signals else {}),
            **({"OMP_NUM_THREADS": "1"} if nproc > 1 else {}),  # (unless the call sets it: see run_launched)
            "LOCAL_RANK": str(rank), "RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1",
            "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "False", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "TORCHELASTIC_ERROR_FILE": error_file}


def run_launched(nproc: int, args: Sequence[str], *, cwd: str | os.PathLike | None = None,
                 env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node nproc ARGS``, its ranks forked from the preloaded
    server with the environment torchrun gives them (``OMP_NUM_THREADS=1`` at more than one rank
    unless the call sets it). As torchrun's agent does, the first rank to fail stops the others
    (SIGTERM, then SIGKILL after 30 s), and the launch exits 1 and names that rank, its exit code
    and the error its ``@record`` entry point wrote. The ranks' outputs are joined in rank order.
    ``subprocess.TimeoutExpired`` past ``timeout``, ``ValueError`` as ``run_python``'s."""
    env = dict(os.environ if env is None else env)
    port, run_id = _free_port(), f"nxd_smp-tests-{os.getpid()}-{time.monotonic_ns()}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    with tempfile.TemporaryDirectory() as tmp:
        errors = [os.path.join(tmp, f"rank{r}.error.json") for r in range(nproc)]
        threads = {k: v for k, v in env.items() if k == "OMP_NUM_THREADS"}  # (the call's, where it sets one)
        started = [_start(["-u", *args], cwd, {**env, **torchrun_env(r, nproc, port, run_id, errors[r]), **threads},
                          tmp, f"rank{r}") for r in range(nproc)]
        children = [child for child, _, _ in started]
        try:
            deadline, timed_out, first_failed, stopping_since = time.monotonic() + timeout, False, None, None
            while any(child.is_alive() for child in children):
                first_failed = first_failed or next((c for c in children if c.exitcode not in (None, 0)), None)
                timed_out = timed_out or time.monotonic() > deadline
                if stopping_since is None and (first_failed or timed_out):
                    stopping_since = time.monotonic()
                    for child in children:
                        child.terminate()
                elif stopping_since is not None and time.monotonic() > stopping_since + 30:
                    _stop(children)
                time.sleep(0.05)
        finally:
            _stop(children)  # (an interrupted test leaves no rank behind)
        for child, _, err in started:
            _refusal(child, err)
        first_failed = first_failed or next((c for c in children if c.exitcode != 0), None)
        outputs = [(_read(out, True), _read(err, True)) for _, out, err in started]
        stdout, stderr = "".join(o for o, _ in outputs), "".join(e for _, e in outputs)
        if timed_out:
            raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
        if first_failed is None:
            return subprocess.CompletedProcess(command, 0, stdout, stderr)
        rank = children.index(first_failed)
        recorded = Path(errors[rank]).read_text() if os.path.exists(errors[rank]) else "(no error file)"
        stderr += f"run_launched: rank {rank} failed first, exit code {first_failed.exitcode}: {recorded}\n"
        return subprocess.CompletedProcess(command, 1, stdout, stderr)
