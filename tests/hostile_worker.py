"""The live objects that test_hostile_checkpoints.py loads hostile folders into, every loader by
one name, the snapshot that tells whether a refused load changed anything, and the child
process for the loads that could crash, hang or take gigabytes.

``python -m tests.hostile_worker SPEC RESULTS`` runs the cases that SPEC (JSON: ``{"warmup":
[case], "cases": [case]}``, a case ``{"name", "loader", "path", "limit_s", "step"}``) lists, one
after the other, and appends one JSON line per event to RESULTS, flushed as it happens, so that
the parent learns which case was running when the process died. Each case is the load (after the
warm-up's healthy loads of every loader, so that what the libraries allocate once is not counted)
and its peak resident memory over the resident memory before it, less the library pages it read
back (``_PeakGrowth``); with ``step``, an accepted load is followed by a backward and
``optimizer.step()`` (where 0-dim AdamW moments corrupt memory). Events: ``started``, then
``refused`` or ``accepted`` (and ``stepped`` or ``step_failed``); a case past its ``limit_s`` is
``hung`` (the process then exits with 124).
"""

from __future__ import annotations

import copy
import gc
import json
import math
import os
import resource
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from nxd_smp import CheckpointError, MixedPrecisionConfig, Zero1Optimizer, load_checkpoint
from tests.nxd_layout import HYPER, backward, grads, scheduler_of
from tests.nxd_layout import param_groups as nxd_param_groups
from tests.xla_export_worker import make_model

#: The loaders by name: nxd_smp's own format (3) and NxD's tag folders (plain and xser) load with
#: ``load_checkpoint``; ``torch`` is ``import_torch``, ``xla`` is ``import_xla`` (of the files in
#: a folder), ``read`` is the offline ``read_checkpoint``; ``ballast`` loads nothing and takes
#: 256 MiB (the memory meter's control).
LOADERS = ("nxd_smp", "nxd", "torch", "xla", "read", "ballast")


# ---------------------------------------------------------------- the live objects
def live_sequential(seed: int = 5):
    """The bf16 Linear(7, 13) - Tanh - Linear(13, 6) every healthy folder fits, its Zero1Optimizer
    (AdamW, two groups, several buckets, masters kept) and a StepLR, after one step of their own:
    state, masters and scheduler all differ from any checkpoint's."""
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1)
    opt = Zero1Optimizer(nxd_param_groups(model), torch.optim.AdamW, compile_update=False, bucket_cap_mb=0.0002,
                         mixed_precision=MixedPrecisionConfig(use_master_weights_in_ckpt=True), **HYPER)
    scheduler = scheduler_of(opt)
    step(model, opt, seed)
    scheduler.step()
    return model, opt, scheduler


def live(loader: str):
    """Fresh live objects for ``loader``'s folders: (model, optimizer, scheduler), or Nones
    for ``read`` (an offline tool, no live objects)."""
    if loader not in LOADERS:
        raise ValueError(f"unknown loader {loader!r}")
    if loader in ("read", "ballast"):
        return None, None, None
    return live_sequential()


def step(model, opt, seed: int = 9) -> None:
    """A backward and an optimizer step (what follows a load in training)."""
    backward(model, grads(0, seed, model))
    opt.step()
    opt.zero_grad()


def load(loader: str, path: str | os.PathLike, model, opt, scheduler) -> Any:
    """Load the folder ``path`` with ``loader`` (``LOADERS``)."""
    path = Path(path)
    if loader in ("nxd_smp", "nxd"):
        return load_checkpoint(path, model=model, optimizer=opt, scheduler=scheduler)
    if loader == "torch":
        from nxd_smp.interop.native_torch import import_torch

        return import_torch(path, model=model, optimizer=opt)
    if loader == "xla":
        from nxd_smp.interop.torch_xla import import_xla

        return import_xla(sorted(path.glob("dp_rank_*_tp_rank_*_pp_rank_*.pt")), model=model, optimizer=opt)
    if loader == "read":
        from nxd_smp.checkpoint import read_checkpoint

        return read_checkpoint(path)
    if loader == "ballast":  # the memory meter's own control: 256 MiB, every page touched
        return bytearray(256 << 20)
    raise ValueError(f"unknown loader {loader!r}")


# ---------------------------------------------------------------- before and after
def snapshot(model, opt, scheduler) -> dict[str, Any]:
    """Everything a load may change, copied: the model's state, the masters, the inner
    optimizer's state and groups, the wrapper's groups (hyperparameters; their parameters
    by identity) and the scheduler's state (its optimizer by identity)."""
    if model is None:
        return {}
    inner = opt.inner_optimizer.state_dict()
    return {
        "model": copy.deepcopy(dict(model.state_dict())),
        "masters": [m.detach().clone() for m in opt.master_shards],
        "inner state": copy.deepcopy(inner["state"]),
        "inner param_groups": copy.deepcopy(inner["param_groups"]),
        "param_groups": [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in opt.param_groups],
        "scheduler": None if scheduler is None else copy.deepcopy(scheduler.state_dict()),
        # by identity
        "params": [list(g["params"]) for g in opt.param_groups],
        "scheduler.optimizer": None if scheduler is None else scheduler.optimizer,
    }


_BY_IDENTITY = ("params", "scheduler.optimizer")


def differences(before: Any, after: Any, where: str = "") -> list[str]:
    """Where ``after`` differs from ``before`` (tensors: dtype, shape, layout and values)."""
    if isinstance(before, torch.Tensor) or isinstance(after, torch.Tensor):
        try:
            same = (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)
                    and (before.dtype, before.shape, before.layout, before.device)
                    == (after.dtype, after.shape, after.layout, after.device)
                    and torch.equal(before, after))
        except Exception:  # noqa: BLE001 - a tensor torch cannot compare is not the one we had
            same = False
        return [] if same else [where]
    if isinstance(before, Mapping) and isinstance(after, Mapping):
        if set(before) != set(after):
            return [f"{where} (keys {sorted(map(str, before))} -> {sorted(map(str, after))})"]
        return [d for k in before for d in differences(before[k], after[k], f"{where}/{k}")]
    if isinstance(before, (list, tuple)) and isinstance(after, (list, tuple)):
        if type(before) is not type(after) or len(before) != len(after):
            return [where]
        return [d for i, (x, y) in enumerate(zip(before, after)) for d in differences(x, y, f"{where}[{i}]")]
    if type(before) is not type(after):
        return [f"{where} ({type(before).__name__} -> {type(after).__name__})"]
    if isinstance(before, float) and math.isnan(before) and math.isnan(after):
        return []
    return [] if before == after else [f"{where} ({before!r} -> {after!r})"]


def changes(before: dict[str, Any], model, opt, scheduler) -> list[str]:
    """What differs between ``before`` (a ``snapshot``) and the live objects now."""
    if model is None:
        return []
    try:
        after = snapshot(model, opt, scheduler)
    except Exception as e:  # noqa: BLE001 - objects left unable to report their state have changed
        return [f"the snapshot itself failed: {type(e).__name__}: {e}"]
    found = []
    for key in before:
        if key in _BY_IDENTITY:
            same = (before[key] is after[key] if not isinstance(before[key], list) else
                    len(before[key]) == len(after[key])
                    and all(len(a) == len(b) and all(x is y for x, y in zip(a, b))
                            for a, b in zip(before[key], after[key])))
            found += [] if same else [f"{key} (identity)"]
        else:
            found += differences(before[key], after[key], key)
    return found


def assert_unchanged(before: dict[str, Any], model, opt, scheduler) -> None:
    found = changes(before, model, opt, scheduler)
    assert not found, f"the refused load changed the live objects: {found[:10]}"


# ---------------------------------------------------------------- the child process
def _peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _status_kib() -> dict[str, int]:
    """This process's ``VmHWM`` (peak resident), ``VmRSS`` and ``RssFile`` (Linux), {} elsewhere."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":")[0]
                if key in ("VmHWM", "VmRSS", "RssFile"):
                    out[key] = int(line.split()[1])
    except OSError:
        pass
    return out


class _PeakGrowth:
    """How much the ``with`` block grew the peak resident memory, less what it grew the
    resident library pages by: the peak is reset to the current memory first
    (``/proc/self/clear_refs``), and pages of shared libraries the kernel evicted on a busy
    machine and the block read back are not the block's allocations. ``exact``: False where the
    peak cannot be reset (then the growth is over the baseline after the warm-up)."""

    def __init__(self, baseline_kib: int):
        self.baseline = baseline_kib

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.exact = True
        except OSError:
            self.exact = False
        self.before = _status_kib()
        return self

    def __exit__(self, *exc):
        after = _status_kib()
        if self.exact and "VmHWM" in after:
            files = max(0, after.get("RssFile", 0) - self.before.get("RssFile", 0))
            self.growth_mib = (after["VmHWM"] - self.before["VmRSS"] - files) / 1024
        else:
            self.growth_mib = (_peak_kib() - self.baseline) / 1024


def _attempt(case: dict[str, Any]):
    """Load ``case``'s folder into fresh live objects: (model, opt, scheduler, outcome), the
    outcome ``{"event": "refused"|"accepted", "type", "message", "changes"}``."""
    model, opt, scheduler = live(case["loader"])
    before = snapshot(model, opt, scheduler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load(case["loader"], case["path"], model, opt, scheduler)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which judges
        return model, opt, scheduler, {"event": "refused", "type": type(e).__name__, "message": str(e),
                                       "checkpoint_error": isinstance(e, CheckpointError),
                                       "traceback": traceback.format_exc()[-3000:],
                                       "changes": changes(before, model, opt, scheduler)}
    return model, opt, scheduler, {"event": "accepted"}


def main(spec_file: str, results_file: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    results = open(results_file, "a", buffering=1)

    def report(case: str, event: str, **more: Any) -> None:
        results.write(json.dumps({"case": case, "event": event, **more}) + "\n")
        results.flush()
        os.fsync(results.fileno())

    for case in spec.get("warmup", []):
        _, _, _, outcome = _attempt(case)
        report(case["name"], "warmup", outcome=outcome.pop("event"), **outcome)
    gc.collect()
    baseline = _peak_kib()
    for case in spec["cases"]:
        name = case["name"]
        report(name, "started")

        def hung(name=name, limit=case["limit_s"]) -> None:
            report(name, "hung", limit_s=limit)
            os._exit(124)

        watchdog = threading.Timer(case["limit_s"], hung)
        watchdog.daemon = True
        watchdog.start()
        gc.collect()  # what an earlier case left in reference cycles (a refusal's traceback) goes first
        start = time.monotonic()
        with _PeakGrowth(baseline) as meter:
            model, opt, scheduler, outcome = _attempt(case)
        outcome["growth_mib"] = meter.growth_mib
        outcome["peak_reset"] = meter.exact
        outcome["seconds"] = time.monotonic() - start
        report(name, outcome.pop("event"), **outcome)
        if case.get("step") and model is not None and outcome.get("type") is None:
            try:  # the accepted state in use: where 0-dim moments corrupt memory
                step(model, opt)
                report(name, "stepped")
            except Exception as e:  # noqa: BLE001 - reported to the parent, which judges
                report(name, "step_failed", type=type(e).__name__, message=str(e))
        watchdog.cancel()
        del model, opt, scheduler
    results.close()


# ---------------------------------------------------------------- DP 2 on gloo
def timed_call(call: Callable[[], Any]) -> dict[str, Any]:
    """``call()`` on this rank: how long it took and what it raised (its type, None for nothing; whether a
    CheckpointError; its message), for a test to read on every rank."""
    start = time.monotonic()
    try:
        call()
        error = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        error = e
    return {"seconds": time.monotonic() - start, "type": None if error is None else type(error).__name__,
            "checkpoint_error": isinstance(error, CheckpointError), "message": "" if error is None else str(error)}


def timed_load(loader: str, path: str, model: Any, opt: Any, scheduler: Any, before: Any) -> dict[str, Any]:
    """One load of ``path`` into the live objects: what it raised (its type, whether a CheckpointError, its
    message), how long it took, and what it changed since ``before`` (``snapshot``)."""
    def quiet_load() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load(loader, path, model, opt, scheduler)

    return {"loader": loader, **timed_call(quiet_load), "changes": changes(before, model, opt, scheduler)}


def one_rank_fails_unexpectedly(rank: int, world: int, folders: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Each folder (healthy) loads at DP 2 while rank 1's ``os.fstat`` (which the one safe open of
    every file a loader reads calls) raises a RuntimeError, an error no check expects. Returns per
    folder what this rank raised, how long the load took, what it changed, and how often the
    sabotage fired. Stops at the first error that is not a CheckpointError (the ranks no longer
    agree on what comes next)."""
    import faulthandler

    faulthandler.dump_traceback_later(120, exit=True)  # a hung collective ends the test, not the suite
    real_load = os.fstat
    out = []
    try:
        for loader, path in folders:
            model, opt, scheduler = live(loader)
            before = snapshot(model, opt, scheduler)
            fired = [0]

            def sabotaged(*args, **kwargs):
                fired[0] += 1
                raise RuntimeError("rank 1's disk failed in a way no check expects")

            os.fstat = sabotaged if rank == 1 else real_load
            try:
                outcome = timed_load(loader, path, model, opt, scheduler, before)
            finally:
                os.fstat = real_load
            out.append({**outcome, "fired": fired[0]})
            if outcome["type"] is not None and not outcome["checkpoint_error"]:
                break
    finally:
        os.fstat = real_load
        faulthandler.cancel_dump_traceback_later()
    return out


if __name__ == "__main__":
    main(*sys.argv[1:3])


def each_rank_loads_its_own(rank: int, world: int, cases: list[tuple[str, list[str]]]) -> list[dict[str, Any]]:
    """Each case's folder for this rank (``paths[rank]``) loaded with its loader at DP ``world``: what this
    rank raised, how long the load took, what it changed. Stops at the first error that is not a
    CheckpointError (the ranks no longer agree on what comes next)."""
    import faulthandler

    faulthandler.dump_traceback_later(120, exit=True)  # a hung collective ends the test, not the suite
    out = []
    try:
        for loader, paths in cases:
            model, opt, scheduler = live(loader)
            outcome = timed_load(loader, paths[rank], model, opt, scheduler, snapshot(model, opt, scheduler))
            out.append(outcome)
            if outcome["type"] is not None and not outcome["checkpoint_error"]:
                break
    finally:
        faulthandler.cancel_dump_traceback_later()
    return out
