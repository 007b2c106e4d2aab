#!/usr/bin/env python
"""The memory torch's ``get_optimizer_state_dict(full_state_dict=True, cpu_offload=True)`` needs over a
Zero1Optimizer, per rank, as a slope over two model sizes.

Under ``cpu_offload`` nxd_smp gathers each parameter's whole state (``exp_avg``, ``exp_avg_sq``, and with
``use_master_weights_in_ckpt`` the fp32 ``master``) over the data-parallel group one parameter at a time
and keeps it on rank 0's host alone; the other ranks take part in every gather and keep nothing (torch
hands them ``{}``). What that should cost: rank 0 grows by the result, 3 fp32 tensors = 12 bytes per
parameter; any other rank by a few times the largest parameter, whatever the model.

DP=2 over gloo on CPU, a stack of bf16 ``nn.Linear(width, width)`` at two depths. Each pair of ranks is
spawned afresh (each size ``--repeats`` times): the model, ``Zero1Optimizer(AdamW, lr=1e-3,
MixedPrecisionConfig(use_master_weights_in_ckpt=True))``, one step (forward, backward on a small random
batch, ``step()``, ``zero_grad()``), then the call. Its memory per rank: the peak RSS during the call
(psutil, sampled every ``--sample-ms`` by a background thread from just before the call to just after)
minus the RSS just before it, median over the repeats; beside it, the kernel's own peak (``VmHWM`` after
resetting it through ``/proc/self/clear_refs`` just before the call), which no sampling interval can miss.
The per-parameter figure is a slope (docs/design.md, "How performance is measured"): (increase at the
large size - increase at the small) / (parameters large - parameters small), so that what the call costs
whatever the model (imports, torch's bookkeeping, allocator arenas) is not counted as per-parameter memory.
The ranks run with ``MALLOC_MMAP_THRESHOLD_=65536`` (as ``bench_step.py``'s): every large free goes back
to the OS at once, so the RSS before the call holds no freed pages the call could reuse unseen.

    python scripts/bench_full_state.py --out docs/bench_full_state.json    # 4 and 16 layers of 1024
    python scripts/bench_full_state.py --layers 1 2 --repeats 1             # a quick look
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from memory_slope import check_depths, rss_bytes, slope  # noqa: E402

WORLD = 2
MIB = 2**20
#: bytes per parameter rank 0 keeps: exp_avg, exp_avg_sq and the master, fp32 each
RESULT_BYTES_PER_PARAM = 12


class Sampler:
    """The process's RSS (psutil) every ``interval`` seconds on a thread of its own, between ``start``
    and ``stop``."""

    def __init__(self, interval: float):
        import psutil

        self._process = psutil.Process()
        self._interval = interval
        self._stop = threading.Event()
        self.samples: list[int] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        return self._process.memory_info().rss

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.rss())
            time.sleep(self._interval)

    def start(self) -> None:
        self._thread.start()
        while not self.samples:  # sampling before the call starts
            time.sleep(self._interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def reset_peak() -> bool:
    """Reset this process's ``VmHWM`` to its current RSS (Linux's ``/proc/self/clear_refs``, 5); False
    where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def tensor_bytes(obj) -> int:
    """Bytes of every tensor in a nested state dict, each storage once."""
    seen, total, stack = set(), 0, [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            key = o.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += o.untyped_storage().nbytes()
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return total


def measure(rank: int, cfg: dict) -> dict:
    """One rank: model, optimizer, one step, then the call under the meters."""
    import nxd_smp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    torch.manual_seed(0)
    width = cfg["width"]
    model = nn.Sequential(*[nn.Linear(width, width, dtype=torch.bfloat16) for _ in range(cfg["layers"])])
    params = sum(p.numel() for p in model.parameters())
    opt = nxd_smp.Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3,
                                 mixed_precision=nxd_smp.MixedPrecisionConfig(use_master_weights_in_ckpt=True),
                                 bucket_cap_mb=cfg["bucket_cap_mb"], compile_update=False)
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(cfg["batch"], width, generator=g).to(torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    del x
    gc.collect()
    buckets = [layout.padded_numel for layout in opt.bucket_layouts]
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)

    dist.barrier()
    sampler = Sampler(cfg["sample_ms"] / 1e3)
    sampler.start()
    before = sampler.rss()
    hwm_reset = reset_peak()
    t = time.perf_counter()
    state = get_optimizer_state_dict(model, opt, options=options)
    seconds = time.perf_counter() - t
    hwm = rss_bytes("VmHWM")
    after = sampler.rss()
    sampler.stop()
    peak = max([after, *sampler.samples])

    entries = state.get("state", {}) if state else {}
    keys = sorted({k for entry in entries.values() for k, v in entry.items() if isinstance(v, torch.Tensor)
                   and v.dim() > 0})
    result = {
        "rank": rank, "params": params, "layers": cfg["layers"],
        "increase_bytes": peak - before, "hwm_increase_bytes": hwm - before if hwm_reset else None,
        "held_after_bytes": after - before, "rss_before_bytes": before, "seconds": seconds,
        "samples": len(sampler.samples), "result_tensor_bytes": tensor_bytes(state),
        "result_empty": not state, "result_params": len(entries), "result_keys": keys,
        "bucket_padded_numel": buckets, "largest_param_numel": max(p.numel() for p in model.parameters()),
    }
    del state
    dist.barrier()
    return result


def _worker(rank: int, port: int, cfg: dict, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300))
    try:
        result = measure(rank, cfg)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))


def run_pair(cfg: dict) -> list[dict]:
    """Both ranks of one size in freshly spawned interpreters; their results, by rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(port, cfg, out_dir), nprocs=WORLD, join=True, start_method="spawn")
        return [json.loads(Path(out_dir, f"{rank}.json").read_text()) for rank in range(WORLD)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=1024, help="Linear layer width (default 1024)")
    p.add_argument("--layers", type=int, nargs=2, default=[4, 16], help="the two depths of the slope (default 4 16)")
    p.add_argument("--repeats", type=int, default=3, help="fresh pairs of ranks per size; the median is reported")
    p.add_argument("--batch", type=int, default=4, help="rows of the random batch of the one step")
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="the optimizer's bucket size (default: its own)")
    p.add_argument("--sample-ms", type=float, default=1.0, help="the RSS sampling interval (default 1 ms)")
    p.add_argument("--out", type=Path, default=Path("bench_results/bench_full_state.json"))
    args = p.parse_args()
    if args.width < 1 or min(args.layers) < 1 or args.repeats < 1 or args.batch < 1 or args.sample_ms <= 0:
        p.error("--width, --layers, --repeats, --batch and --sample-ms must be positive")
    if args.layers[0] >= args.layers[1]:
        p.error("--layers takes the smaller depth first")
    check_depths(p, args.width, args.layers)
    # read by glibc when each spawned rank starts (see the docstring)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")

    runs: dict[int, list[list[dict]]] = {}
    for layers in args.layers:
        cfg = {"width": args.width, "layers": layers, "batch": args.batch, "bucket_cap_mb": args.bucket_cap_mb,
               "sample_ms": args.sample_ms}
        runs[layers] = []
        for i in range(args.repeats):
            pair = run_pair(cfg)
            runs[layers].append(pair)
            print(f"  {layers} layers, run {i + 1}: " + ", ".join(
                f"rank {r['rank']} +{r['increase_bytes'] / MIB:.1f} MiB" for r in pair), flush=True)

    def med(layers: int, rank: int, key: str) -> float:
        values = [pair[rank][key] for pair in runs[layers]]
        return float("nan") if None in values else statistics.median(values)

    small, large = args.layers
    n_small, n_large = runs[small][0][0]["params"], runs[large][0][0]["params"]
    per_rank = []
    for rank in range(WORLD):
        first = {layers: runs[layers][0][rank] for layers in args.layers}
        row = {"rank": rank}
        for key in ("increase_bytes", "hwm_increase_bytes", "held_after_bytes", "seconds"):
            row[key] = {str(layers): med(layers, rank, key) for layers in args.layers}
        row["increase_range_bytes"] = {str(layers): [min(pr[rank]["increase_bytes"] for pr in runs[layers]),
                                                     max(pr[rank]["increase_bytes"] for pr in runs[layers])]
                                       for layers in args.layers}
        for key, name in (("increase_bytes", "slope_bytes_per_param"),
                          ("hwm_increase_bytes", "hwm_slope_bytes_per_param"),
                          ("held_after_bytes", "held_slope_bytes_per_param")):
            row[name] = slope(row[key][str(small)], n_small, row[key][str(large)], n_large)
        row["result_tensor_bytes"] = {str(layers): first[layers]["result_tensor_bytes"] for layers in args.layers}
        row["result_params"] = {str(layers): first[layers]["result_params"] for layers in args.layers}
        row["result_keys"] = first[large]["result_keys"]
        row["result_empty"] = all(pr[rank]["result_empty"] for layers in args.layers for pr in runs[layers])
        per_rank.append(row)
    bucket_bytes = {str(layers): 4 * max(runs[layers][0][0]["bucket_padded_numel"]) for layers in args.layers}
    buckets = {str(layers): len(runs[layers][0][0]["bucket_padded_numel"]) for layers in args.layers}
    param_bytes = 4 * runs[large][0][0]["largest_param_numel"]
    samples = min(pr[r]["samples"] for layers in args.layers for pr in runs[layers] for r in range(WORLD))

    def mib(b: float) -> str:
        return f"{b / MIB:.1f}"

    report = [
        f"get_optimizer_state_dict(full_state_dict=True, cpu_offload=True) over Zero1Optimizer (AdamW, fp32 masters "
        f"in the state), DP={WORLD} over gloo on {os.cpu_count()} CPU cores, bf16 Linear({args.width}, {args.width}) "
        f"x {small} and x {large} ({n_small / 1e6:.2f}M and {n_large / 1e6:.2f}M parameters), "
        f"torch {torch.__version__}",
        f"increase = peak RSS during the call (sampled every {args.sample_ms:g} ms, >= {samples} samples a call) - RSS "
        f"just before; VmHWM = the kernel's peak, reset just before the call; medians of {args.repeats} fresh pairs of "
        f"ranks per size",
        "",
        f"| rank | keeps at {large} layers | increase MiB, {small} / {large} layers (min-max) | slope bytes/param | "
        f"VmHWM increase MiB, {small} / {large} | VmHWM slope | held after the call MiB, {small} / {large} | "
        f"call s, {small} / {large} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in per_rank:
        inc, hwm, held, secs, rng = (row[k] for k in ("increase_bytes", "hwm_increase_bytes", "held_after_bytes",
                                                      "seconds", "increase_range_bytes"))
        keeps = (f"{row['result_params'][str(large)]} params x {'/'.join(row['result_keys'])}, "
                 f"{mib(row['result_tensor_bytes'][str(large)])} MiB" if not row["result_empty"] else "{}")
        report.append(
            f"| {row['rank']} | {keeps} | "
            f"{mib(inc[str(small)])} ({mib(rng[str(small)][0])}-{mib(rng[str(small)][1])}) / "
            f"{mib(inc[str(large)])} ({mib(rng[str(large)][0])}-{mib(rng[str(large)][1])}) | "
            f"{row['slope_bytes_per_param']:.2f} | {mib(hwm[str(small)])} / {mib(hwm[str(large)])} | "
            f"{row['hwm_slope_bytes_per_param']:.2f} | {mib(held[str(small)])} / {mib(held[str(large)])} | "
            f"{secs[str(small)]:.2f} / {secs[str(large)]:.2f} |")
    report += [
        "",
        f"expected slope: rank 0 {RESULT_BYTES_PER_PARAM} (the result, 3 fp32 tensors per parameter), the other "
        f"ranks 0 (a few times the largest parameter, whatever the model)",
        f"largest bucket (padded_numel x 4 bytes): {mib(bucket_bytes[str(small)])} MiB at {small} layers "
        f"({buckets[str(small)]} bucket(s)), {mib(bucket_bytes[str(large)])} MiB at {large} layers "
        f"({buckets[str(large)]} bucket(s)); largest parameter in fp32: {mib(param_bytes)} MiB",
    ]
    print("\n".join(report))
    summary = {
        "command": " ".join(sys.argv),
        "report": report,
        "ranks": per_rank,
        "params": {str(small): n_small, str(large): n_large},
        "largest_bucket_bytes": bucket_bytes,
        "buckets": buckets,
        "largest_param_fp32_bytes": param_bytes,
        "expected_slope_bytes_per_param": {"0": RESULT_BYTES_PER_PARAM, "other": 0},
        "runs": {str(layers): pairs for layers, pairs in runs.items()},
        "world_size": WORLD,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
