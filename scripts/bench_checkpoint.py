#!/usr/bin/env python
"""Checkpoint throughput: save_checkpoint / load_checkpoint against torch.save / torch.load,
and how long an asynchronous save holds up training, at two model sizes.

A bf16 model with a trained Zero1Optimizer (AdamW, fp32 master weights saved), DP=1. The
baseline is what a user of torch alone does: ``torch.save({"model": model.state_dict(),
"optimizer": optimizer.state_dict()})`` into one file, followed by an fsync (a checkpoint that
may be lost to a crash is not a checkpoint; ``save_checkpoint`` fsyncs too), and to load,
``torch.load(weights_only=True)`` then ``model.load_state_dict`` and
``optimizer.load_state_dict``, so both sides end with the state in the live model and
optimizer. Loads are measured cold (every file's pages dropped from the page cache with
``posix_fadvise(POSIX_FADV_DONTNEED)`` after an fsync: what a restart reads) and warm (read
again at once). Every measurement alternates with its baseline in one process; MB/s = bytes
on disk / seconds (median of ``--repeats``). nxd_smp's load includes its checks (file sizes,
CRC-32 of every tensor). ``async_save=True`` is timed twice: until the call returns (what the
training loop waits for: copying the state to host memory) and until
``finalize_checkpoint()`` returns.

Beside torch, each size is measured against the limit of the disk for the same work: a verified raw
write of the same number of bytes (one thread writing 64 MiB chunks from memory, a CRC-32 of each
chunk, one fsync) and its read back into preallocated memory (the same chunks, each CRC checked), cold
and warm, alternating with the rest. The read is timed twice: into memory already written once (the
issue's limit), and into memory just allocated with ``torch.empty``, whose pages the kernel maps in
as the read first writes them, as it does for the state a load stages (the load keeps the old state
until the new one is installed, so it cannot read into the old one's pages). ``save_checkpoint`` and ``load_checkpoint`` do that work and more
(their files, index and metadata, the checks): their MB/s over the raw one says how much of a save's
and a load's time is not the disk's.

With ``--url s3://bucket/prefix`` the checkpoint goes to object storage (boto3's chain: set
``AWS_ENDPOINT_URL`` for a server other than AWS), measured against the limit for the same bytes: a raw
boto3 upload of as many bytes (s3transfer's managed ``upload_fileobj`` from memory: parts in parallel)
and their download (``download_fileobj`` into memory), alternating with the save and the (cold: no
cache on this side) load, every repeat. The goal is 0.8x of raw boto3 both ways.

    python scripts/bench_checkpoint.py --out docs/bench_checkpoint.json   # 50M and 100M parameters
    python scripts/bench_checkpoint.py --params 2e6 4e6 --repeats 1        # a quick look
    python scripts/bench_checkpoint.py --url s3://bench/run --params 5e6 10e6 --out docs/bench_checkpoint_s3.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch
import torch.nn as nn

import nxd_smp

#: save at 1.2x torch or better, load (cold and warm) at 1.0x or better, as the median of several runs; save
#: and load (cold and warm) at 0.8x of the verified raw write and read of the same bytes or better.
TARGETS = {"save_ratio": 1.2, "load_ratio": 1.0, "async_blocking_fraction": 0.1, "limit_ratio": 0.8}
#: The raw baseline's chunk: what one write and one CRC cover.
CHUNK = 64 * 2**20


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def build(params: float, width: int):
    layers = max(1, round(params / (width * width + width)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, dtype=torch.bfloat16) for _ in range(layers)])
    mp = nxd_smp.MixedPrecisionConfig(use_master_weights_in_ckpt=True)
    opt = nxd_smp.Zero1Optimizer(model.parameters(), torch.optim.AdamW, mixed_precision=mp, lr=1e-4,
                                 compile_update=False)
    model(torch.randn(2, width, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    return model, opt


def drop_from_page_cache(path: Path) -> None:
    """Flush ``path`` (a file, or every file under a directory) to disk and drop its pages
    from the page cache, so that the next read comes from the disk."""
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_write(path: Path, data: memoryview) -> list[int]:
    """``data`` written to ``path`` in ``CHUNK``-byte chunks by one thread, a CRC-32 of each, then one
    fsync: the disk's limit for a verified save of that many bytes. Returns the CRCs."""
    crcs = []
    with open(path, "wb", buffering=0) as f:
        for start in range(0, len(data), CHUNK):
            chunk = data[start:start + CHUNK]
            crcs.append(zlib.crc32(chunk))
            f.write(chunk)
        os.fsync(f.fileno())
    return crcs


def raw_read(path: Path, into: memoryview, crcs: list[int]) -> None:
    """``path`` read back into ``into`` (preallocated) in ``CHUNK``-byte chunks, each checked against its
    CRC-32: the disk's limit for a verified load of that many bytes."""
    with open(path, "rb", buffering=0) as f:
        for i, start in enumerate(range(0, len(into), CHUNK)):
            chunk = into[start:start + CHUNK]
            if f.readinto(chunk) != len(chunk) or zlib.crc32(chunk) != crcs[i]:
                raise SystemExit(f"{path}: the raw baseline read back other bytes than it wrote")


def measure(params: float, width: int, repeats: int, root: Path) -> dict:
    model, opt = build(params, width)
    n = sum(q.numel() for q in model.parameters())
    keys = ("save", "torch_save", "raw_write", "load_cold", "torch_load_cold", "raw_read_cold", "raw_fresh_cold",
            "load_warm", "torch_load_warm", "raw_read_warm", "raw_fresh_warm", "async_return", "async_total")
    times: dict[str, list[float]] = {k: [] for k in keys}

    def torch_load() -> None:
        state = torch.load(root / "plain.pt", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])

    for _ in range(repeats):
        t = time.perf_counter()
        nxd_smp.save_checkpoint(root / "ckpt", model=model, optimizer=opt)
        times["save"].append(time.perf_counter() - t)
        ours_bytes = dir_bytes((root / "ckpt").resolve())

        t = time.perf_counter()
        with open(root / "plain.pt", "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        times["torch_save"].append(time.perf_counter() - t)
        base_bytes = (root / "plain.pt").stat().st_size

        data = torch.randint(0, 256, (ours_bytes,), dtype=torch.uint8).numpy().data  # (as many bytes as ours)
        into = memoryview(bytearray(ours_bytes))
        t = time.perf_counter()
        crcs = raw_write(root / "raw.bin", data)
        times["raw_write"].append(time.perf_counter() - t)

        for temperature in ("cold", "warm"):
            if temperature == "cold":
                drop_from_page_cache((root / "ckpt").resolve())
            t = time.perf_counter()
            nxd_smp.load_checkpoint(root / "ckpt", model=model, optimizer=opt)
            times[f"load_{temperature}"].append(time.perf_counter() - t)

            if temperature == "cold":
                drop_from_page_cache(root / "plain.pt")
            t = time.perf_counter()
            torch_load()
            times[f"torch_load_{temperature}"].append(time.perf_counter() - t)

            if temperature == "cold":
                drop_from_page_cache(root / "raw.bin")
            t = time.perf_counter()
            raw_read(root / "raw.bin", into, crcs)
            times[f"raw_read_{temperature}"].append(time.perf_counter() - t)

            fresh = torch.empty(ours_bytes, dtype=torch.uint8)  # (its pages not mapped in yet)
            if temperature == "cold":
                drop_from_page_cache(root / "raw.bin")
            t = time.perf_counter()
            raw_read(root / "raw.bin", fresh.numpy().data, crcs)
            times[f"raw_fresh_{temperature}"].append(time.perf_counter() - t)
            del fresh
        del data, into

        t = time.perf_counter()
        nxd_smp.save_checkpoint(root / "ckpt", model=model, optimizer=opt, async_save=True)
        times["async_return"].append(time.perf_counter() - t)
        nxd_smp.finalize_checkpoint()
        times["async_total"].append(time.perf_counter() - t)
    median = {k: statistics.median(v) for k, v in times.items()}
    mb = 2**20
    result = {
        "params": n,
        "bytes": {"nxd_smp": ours_bytes, "torch_save": base_bytes},
        "save_MBps": {"nxd_smp": ours_bytes / mb / median["save"], "torch_save": base_bytes / mb / median["torch_save"]},
        "load_MBps": {
            "cold": {"nxd_smp": ours_bytes / mb / median["load_cold"], "torch_load": base_bytes / mb / median["torch_load_cold"]},
            "warm": {"nxd_smp": ours_bytes / mb / median["load_warm"], "torch_load": base_bytes / mb / median["torch_load_warm"]},
        },
        "raw_MBps": {"write": ours_bytes / mb / median["raw_write"],
                     "read_cold": ours_bytes / mb / median["raw_read_cold"],
                     "read_warm": ours_bytes / mb / median["raw_read_warm"],
                     "fresh_cold": ours_bytes / mb / median["raw_fresh_cold"],
                     "fresh_warm": ours_bytes / mb / median["raw_fresh_warm"]},
        "async_seconds": {"blocking": median["async_return"], "total": median["async_total"],
                          "sync_save": median["save"]},
        "seconds": times,
    }
    result["save_ratio"] = result["save_MBps"]["nxd_smp"] / result["save_MBps"]["torch_save"]
    for temperature in ("cold", "warm"):
        speeds = result["load_MBps"][temperature]
        result[f"load_ratio_{temperature}"] = speeds["nxd_smp"] / speeds["torch_load"]
    result["async_blocking_fraction"] = median["async_return"] / median["save"]
    # against the limit: the same bytes' verified raw write and read, measured beside them
    result["limit_ratio"] = {"save": median["raw_write"] / median["save"],
                             "load_cold": median["raw_read_cold"] / median["load_cold"],
                             "load_warm": median["raw_read_warm"] / median["load_warm"],
                             "load_cold_fresh": median["raw_fresh_cold"] / median["load_cold"],
                             "load_warm_fresh": median["raw_fresh_warm"] / median["load_warm"]}
    # the spread: each repeat's ratio against the baseline measured beside it
    scale = ours_bytes / base_bytes
    result["ratio_range"] = {
        name: [min(per), max(per)] for name, per in (
            (name, [scale * base / ours for ours, base in zip(times[mine], times[theirs])])
            for name, mine, theirs in (("save", "save", "torch_save"), ("load_cold", "load_cold", "torch_load_cold"),
                                       ("load_warm", "load_warm", "torch_load_warm")))
    }
    result["limit_ratio_range"] = {
        name: [min(per), max(per)] for name, per in (
            (name, [raw / ours for ours, raw in zip(times[mine], times[theirs])])
            for name, mine, theirs in (("save", "save", "raw_write"), ("load_cold", "load_cold", "raw_read_cold"),
                                       ("load_warm", "load_warm", "raw_read_warm")))
    }
    return result


def measure_s3(params: float, width: int, repeats: int, url: str) -> dict:
    """Save and load at ``url`` (S3) against raw boto3 upload and download of as many bytes, alternating."""
    import io

    import boto3

    from nxd_smp.checkpointing.object_io import S3Path

    model, opt = build(params, width)
    n = sum(q.numel() for q in model.parameters())
    root = S3Path.parse(url)
    client = boto3.client("s3")
    times: dict[str, list[float]] = {k: [] for k in ("save", "raw_upload", "load", "raw_download")}
    raw_key = f"{root.key}/raw.bin"
    for _ in range(repeats):
        t = time.perf_counter()
        version = nxd_smp.save_checkpoint(f"{url}/ckpt", model=model, optimizer=opt)
        times["save"].append(time.perf_counter() - t)
        listed = client.get_paginator("list_objects_v2").paginate(Bucket=root.bucket, Prefix=f"{version.key}/")
        ours_bytes = sum(o["Size"] for page in listed for o in page.get("Contents", []))
        data = torch.randint(0, 256, (ours_bytes,), dtype=torch.uint8).numpy().tobytes()  # (as many bytes as ours)
        t = time.perf_counter()
        client.upload_fileobj(io.BytesIO(data), root.bucket, raw_key)
        times["raw_upload"].append(time.perf_counter() - t)
        t = time.perf_counter()
        nxd_smp.load_checkpoint(f"{url}/ckpt", model=model, optimizer=opt)
        times["load"].append(time.perf_counter() - t)
        into = io.BytesIO()
        t = time.perf_counter()
        client.download_fileobj(root.bucket, raw_key, into)
        times["raw_download"].append(time.perf_counter() - t)
        del data, into
    median = {k: statistics.median(v) for k, v in times.items()}
    mb = 2**20
    return {
        "params": n, "bytes": ours_bytes, "url": url,
        "MBps": {"save": ours_bytes / mb / median["save"], "raw_upload": ours_bytes / mb / median["raw_upload"],
                 "load": ours_bytes / mb / median["load"], "raw_download": ours_bytes / mb / median["raw_download"]},
        "limit_ratio": {"save": median["raw_upload"] / median["save"], "load": median["raw_download"] / median["load"]},
        "limit_ratio_range": {
            name: [min(per), max(per)] for name, per in (
                (name, [raw / ours for ours, raw in zip(times[mine], times[theirs])])
                for name, mine, theirs in (("save", "save", "raw_upload"), ("load", "load", "raw_download")))},
        "seconds": times,
    }


def main_s3(args: argparse.Namespace) -> None:
    results = [measure_s3(params, args.width, args.repeats, args.url) for params in args.params]
    report = [f"AdamW states + fp32 master weights, DP=1, at {args.url}, medians of {args.repeats} (MB/s = MiB of "
              f"the version's objects / s); raw: boto3's upload_fileobj / download_fileobj of as many bytes", "",
              "| params | MiB | save MB/s | raw upload MB/s | save / raw (range) | load MB/s | raw download MB/s "
              "| load / raw (range) |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        speed, limit, spread = r["MBps"], r["limit_ratio"], r["limit_ratio_range"]
        report.append(f"| {r['params'] / 1e6:.1f}M | {r['bytes'] / 2**20:.0f} | {speed['save']:.0f} | "
                      f"{speed['raw_upload']:.0f} | {limit['save']:.2f} ({spread['save'][0]:.2f}-{spread['save'][1]:.2f}) "
                      f"| {speed['load']:.0f} | {speed['raw_download']:.0f} | {limit['load']:.2f} "
                      f"({spread['load'][0]:.2f}-{spread['load'][1]:.2f}) |")
    report += ["", f"target: save and load >= {TARGETS['limit_ratio']} of raw boto3"]
    print("\n".join(report))
    summary = {"results": results, "targets": {"limit_ratio": TARGETS["limit_ratio"]}, "command": " ".join(sys.argv),
               "report": report, "limit_ratio": results[-1]["limit_ratio"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, nargs="+", default=[50e6, 101e6], help="approximate parameter counts")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--out", type=Path, default=Path("bench_results/bench_checkpoint.json"))
    p.add_argument("--url", default=None, help="s3://bucket/prefix: measure object storage against raw boto3 instead")
    args = p.parse_args()
    if min(args.params) < 1 or args.width < 1 or args.repeats < 1:
        p.error("--params, --width and --repeats must be positive")
    if args.url is not None:
        if not args.url.startswith("s3://"):
            p.error("--url takes s3://bucket/prefix")
        main_s3(args)
        return

    results = []
    root = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        for params in args.params:
            results.append(measure(params, args.width, args.repeats, root))
            shutil.rmtree(root / (root / "ckpt").resolve().name, ignore_errors=True)
            (root / "ckpt").unlink(missing_ok=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    report = [f"AdamW states + fp32 master weights, DP=1, medians of {args.repeats} (MB/s = MiB on disk / s); "
              f"torch: torch.save/torch.load + load_state_dict into the model and optimizer", "",
              "| params | MiB | save MB/s (torch) | ratio | cold load MB/s (torch) | ratio | warm load MB/s (torch) "
              "| ratio | async: blocks / sync save |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        a, cold, warm = r["async_seconds"], r["load_MBps"]["cold"], r["load_MBps"]["warm"]
        report.append(
            f"| {r['params'] / 1e6:.1f}M | {r['bytes']['nxd_smp'] / 2**20:.0f} | "
            f"{r['save_MBps']['nxd_smp']:.0f} ({r['save_MBps']['torch_save']:.0f}) | {r['save_ratio']:.2f} | "
            f"{cold['nxd_smp']:.0f} ({cold['torch_load']:.0f}) | {r['load_ratio_cold']:.2f} | "
            f"{warm['nxd_smp']:.0f} ({warm['torch_load']:.0f}) | {r['load_ratio_warm']:.2f} | "
            f"{a['blocking']:.2f} s / {a['sync_save']:.2f} s = {r['async_blocking_fraction']:.2f} |")
    report += ["", "against the limit: a verified raw write and read of the same bytes (64 MiB chunks, a CRC-32 "
               "each, one fsync; read back into preallocated memory), MB/s and nxd_smp's ratio to it", "",
               "| params | raw write MB/s | save / raw | raw cold read MB/s (into fresh memory) | cold load / raw "
               "(/ fresh) | raw warm read MB/s (into fresh memory) | warm load / raw (/ fresh) |",
               "|---|---|---|---|---|---|---|"]
    for r in results:
        raw, limit = r["raw_MBps"], r["limit_ratio"]
        report.append(f"| {r['params'] / 1e6:.1f}M | {raw['write']:.0f} | {limit['save']:.2f} | {raw['read_cold']:.0f} "
                      f"({raw['fresh_cold']:.0f}) | {limit['load_cold']:.2f} ({limit['load_cold_fresh']:.2f}) | "
                      f"{raw['read_warm']:.0f} ({raw['fresh_warm']:.0f}) | {limit['load_warm']:.2f} "
                      f"({limit['load_warm_fresh']:.2f}) |")
    report += ["", "each repeat's ratio against the raw limit measured beside it (min-max): "
               + "; ".join(f"{r['params'] / 1e6:.1f}M save {r['limit_ratio_range']['save'][0]:.2f}-"
                           f"{r['limit_ratio_range']['save'][1]:.2f}, cold {r['limit_ratio_range']['load_cold'][0]:.2f}-"
                           f"{r['limit_ratio_range']['load_cold'][1]:.2f}, warm "
                           f"{r['limit_ratio_range']['load_warm'][0]:.2f}-{r['limit_ratio_range']['load_warm'][1]:.2f}"
                           for r in results)]
    report += ["", "each repeat's ratio against the baseline run beside it (min-max): "
               + "; ".join(f"{r['params'] / 1e6:.1f}M save {r['ratio_range']['save'][0]:.2f}-{r['ratio_range']['save'][1]:.2f}, "
                           f"cold {r['ratio_range']['load_cold'][0]:.2f}-{r['ratio_range']['load_cold'][1]:.2f}, "
                           f"warm {r['ratio_range']['load_warm'][0]:.2f}-{r['ratio_range']['load_warm'][1]:.2f}"
                           for r in results),
               "", f"targets: save ratio >= {TARGETS['save_ratio']}, load ratio (cold and warm) >= "
                   f"{TARGETS['load_ratio']}, async blocking <= {TARGETS['async_blocking_fraction']}, save and loads "
                   f">= {TARGETS['limit_ratio']} of the raw limit"]
    print("\n".join(report))
    summary = {
        "results": results,
        "targets": TARGETS,
        "command": " ".join(sys.argv),
        "report": report,
        # the fields the smoke test and readers look at, from the largest size
        "save_ratio": results[-1]["save_ratio"],
        "load_ratio_cold": results[-1]["load_ratio_cold"],
        "load_ratio_warm": results[-1]["load_ratio_warm"],
        "save_MBps": results[-1]["save_MBps"],
        "load_MBps": results[-1]["load_MBps"],
        "async_blocking_fraction": results[-1]["async_blocking_fraction"],
        "limit_ratio": results[-1]["limit_ratio"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
