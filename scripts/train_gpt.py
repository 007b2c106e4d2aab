#!/usr/bin/env python
"""Train a small GPT on the standard library's Python sources with nxd_smp.

Byte-level tokens, a fixed train/validation split by file, an NxD-style config
(``neuronx_distributed_config``) from ``--config FILE.json`` or flags, ZeRO-1 with standard
mixed precision by default. Shows a progress bar with loss and tokens/s, evaluates the
validation loss every ``--eval-every`` steps, checkpoints every ``--ckpt-every`` steps
into ``OUT/ckpt/step_<N>`` (saved in the background, the newest ``--keep-ckpts`` kept, the LR
schedule with them; ``--resume`` continues from the newest), writes metrics as JSON lines
and ends with a summary.

    python scripts/train_gpt.py                          # XLA CPU device if torch_xla is there, else
                                                         # torch.accelerator's device, else the CPU
    python scripts/train_gpt.py --device accelerator     # CUDA, or Trainium's neuron under TorchNeuron
    python scripts/train_gpt.py --device cpu --steps 50
    torchrun --standalone --nproc-per-node 1 scripts/train_gpt.py --device xla   # as on Trainium
    torchrun --nproc-per-node 2 scripts/train_gpt.py --device cpu   # data parallel, gloo on CPU
    python scripts/train_gpt.py --config my_nxd_config.json --resume
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import nxd_smp  # noqa: E402
from gpt_lib import GPT, GPTConfig, batches, evaluate, load_corpus  # noqa: E402

MODES = ("smp", "fp32", "bf16", "bf16_sr")


@dataclass
class RunConfig:
    steps: int = 300
    batch: int = 16
    micro_batches: int = 1
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.1
    seed: int = 0
    model: GPTConfig = field(default_factory=GPTConfig)
    mode: str = "smp"  # smp | fp32 | bf16 (no master weights) | bf16_sr (bf16 + stochastic rounding)
    nxd: dict[str, Any] | None = None  # an NxD config dict; overrides ``mode``'s optimizer settings
    device: str = "auto"
    eval_every: int = 100
    eval_iters: int = 10
    ckpt_every: int = 0
    keep_ckpts: int = 2
    async_save: bool = True
    out: str = "runs/gpt"
    resume: bool = False
    progress: bool = True
    corpus_bytes: int = 8 << 20


def _xla_accelerator() -> bool:
    """PJRT_DEVICE names a real accelerator (NEURON, CUDA, TPU), not the XLA CPU device."""
    return os.environ.get("PJRT_DEVICE", "CPU").upper() != "CPU"


def wants_xla(choice: str, world_size: int) -> bool:
    """Whether this run trains on an XLA device: ``--device xla``, or ``auto`` with torch_xla
    installed. Several processes on the XLA CPU device each see a world of one (their
    collectives cannot meet), so there ``auto`` falls back to the CPU."""
    if choice in ("cpu", "accelerator"):
        return False
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        if choice == "xla":
            raise SystemExit("--device xla needs torch_xla (pip install -e '.[xla]')")
        return False
    if world_size > 1 and not _xla_accelerator():
        if choice == "xla":
            raise SystemExit("processes on the XLA CPU device cannot run collectives together; use "
                             "--device cpu, or one process (XLA replicas: tests/xla_replicas.py)")
        return False
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    return True


def eager_device(choice: str) -> torch.device:
    """The device of a run that is not on XLA: ``--device cpu``, else the current accelerator
    (``torch.accelerator``: CUDA, or Trainium's ``neuron`` under TorchNeuron; under torchrun the local
    rank's), the CPU when there is none (``auto``) or refused (``--device accelerator``)."""
    accelerator = None if choice == "cpu" else torch.accelerator.current_accelerator(check_available=True)
    if accelerator is None and choice == "accelerator":
        raise SystemExit("--device accelerator: torch.accelerator reports no accelerator here; use --device cpu")
    if accelerator is None:
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", 0))  # under torchrun: this process's device
    torch.accelerator.set_device_index(index)
    return torch.device(accelerator.type, index)


def process_group_backend(device: torch.device) -> str:
    """The process group for ``device``: torch's default backend for its type (gloo on the CPU)."""
    default_for = getattr(dist, "get_default_backend_for_device", None)
    return "gloo" if device.type == "cpu" or default_for is None else default_for(device)


def init_distributed(choice: str) -> None:
    """Under torchrun, the process group an NxD script creates: ``xla`` when training on an
    XLA device (one process included, as on Trainium), else the eager device's (gloo on the CPU)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return  # not launched by torchrun: one process, no process group
    if wants_xla(choice, int(os.environ["WORLD_SIZE"])):
        import torch_xla.distributed.xla_backend  # noqa: F401  (registers the "xla" backend)

        dist.init_process_group("xla", init_method="xla://")
    else:
        dist.init_process_group(process_group_backend(eager_device(choice)))


def nxd_config_for(cfg: RunConfig) -> dict[str, Any]:
    if cfg.nxd is not None:
        return nxd_smp.neuronx_distributed_config(
            optimizer_config=cfg.nxd.get("optimizer_config"),
            mixed_precision_config=cfg.nxd.get("mixed_precision_config"),
            **{k: v for k, v in cfg.nxd.items() if k not in ("optimizer_config", "mixed_precision_config")},
        )
    smp = cfg.mode in ("smp", "fp32")
    return nxd_smp.neuronx_distributed_config(
        optimizer_config={"zero_one_enabled": True, "grad_clipping": True, "max_grad_norm": 1.0},
        mixed_precision_config={"use_master_weights": smp, "use_fp32_grad_acc": smp},
    )


def run(cfg: RunConfig) -> dict[str, Any]:
    """Train; returns the summary (also written to ``out/summary.json`` on rank 0)."""
    if cfg.mode not in MODES:
        raise SystemExit(f"--mode must be one of {MODES}, got {cfg.mode!r}")
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    nxd = nxd_config_for(cfg)  # before the device: it sets the Neuron SR variable
    device = __import__("torch_xla").device() if wants_xla(cfg.device, world_size) else eager_device(cfg.device)
    on_xla = device.type == "xla"
    sync = __import__("torch_xla").sync if on_xla else (lambda: None)

    train_tokens, val_tokens, corpus = load_corpus(cfg.corpus_bytes)
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model)
    model = model.to(torch.float32 if cfg.mode == "fp32" else torch.bfloat16).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    extra_kwargs = {"stochastic_rounding": True, "sr_seed": cfg.seed} if cfg.mode == "bf16_sr" else {}
    if extra_kwargs:
        opt_cfg, mp_cfg = nxd["optimizer_config"], nxd["mixed_precision_config"]
        optimizer = nxd_smp.Zero1Optimizer(
            groups, torch.optim.AdamW, lr=cfg.lr, betas=(0.9, 0.95),
            mixed_precision=nxd_smp.MixedPrecisionConfig(**mp_cfg),
            grad_clipping=opt_cfg["grad_clipping"], max_norm=opt_cfg["max_grad_norm"], **extra_kwargs,
        )
    else:
        optimizer = nxd_smp.initialize_parallel_optimizer(nxd, torch.optim.AdamW, groups, lr=cfg.lr, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / cfg.warmup) * max(0.1, 1 - s / max(cfg.steps, 1))
    )

    out = Path(cfg.out)
    ckpt = out / "ckpt"
    start = 0
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    if world_size > 1:
        dist.barrier()
    if cfg.resume and os.path.lexists(ckpt):  # the newest complete checkpoint in it
        start = nxd_smp.load_checkpoint(ckpt, model=model, optimizer=optimizer, scheduler=schedule)["step"]
    metrics = open(out / "metrics.jsonl", "a") if rank == 0 else None

    if cfg.batch % world_size:
        raise SystemExit(f"--batch {cfg.batch} (global) must divide by the {world_size} ranks")
    # Every rank draws the same global batch and keeps its slice, so DP=N sees the data DP=1 sees.
    data = batches(train_tokens, cfg.batch, cfg.model.seq, seed=cfg.seed * 1000 + 7919 * start)
    per_rank = cfg.batch // world_size
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    tokens_per_step = cfg.batch * cfg.model.seq * cfg.micro_batches
    bar = None
    if rank == 0 and cfg.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc=f"gpt {cfg.mode}", unit="step", dynamic_ncols=True)
    losses, val_loss, t0, seen = [], None, time.perf_counter(), 0
    for step in range(start, cfg.steps):
        total = torch.zeros((), device=device)
        for _ in range(cfg.micro_batches):
            x, y = next(data)
            loss = model.loss(x[mine].to(device), y[mine].to(device)) / cfg.micro_batches
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        sync()
        if world_size > 1:
            dist.all_reduce(total)
            total /= world_size
        train_loss = float(total)
        losses.append(train_loss)
        seen += tokens_per_step
        tokens_per_s = seen / (time.perf_counter() - t0)
        record = {"step": step + 1, "loss": train_loss, "lr": schedule.get_last_lr()[0],
                  "grad_norm": float(optimizer.grad_norm), "tokens_per_s": tokens_per_s}
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            val_loss = evaluate(model, val_tokens, device, cfg.batch, cfg.eval_iters)
            record["val_loss"] = val_loss
        if cfg.ckpt_every and ((step + 1) % cfg.ckpt_every == 0 or step + 1 == cfg.steps):
            nxd_smp.save_checkpoint(ckpt / f"step_{step + 1}", model=model, optimizer=optimizer,
                                    scheduler=schedule, extra={"step": step + 1},
                                    async_save=cfg.async_save, num_kept_ckpts=cfg.keep_ckpts)
        if metrics is not None:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        if bar is not None:
            bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tokens_per_s:,.0f}",
                            **({"val": f"{val_loss:.3f}"} if val_loss is not None else {}))
            bar.update(1)
    nxd_smp.finalize_checkpoint()  # the save still in the background, if any
    if bar is not None:
        bar.close()
    if metrics is not None:
        metrics.close()
    summary = {
        "mode": cfg.mode,
        "device": str(device),
        "dp_size": world_size,
        "process_group": dist.get_backend() if dist.is_initialized() else None,
        "steps": cfg.steps,
        "params": sum(p.numel() for p in model.parameters()),
        "final_train_loss": sum(losses[-10:]) / max(1, len(losses[-10:])) if losses else None,
        "final_val_loss": val_loss,
        "tokens_per_s": seen / (time.perf_counter() - t0) if seen else None,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "checkpoint": str(ckpt) if cfg.ckpt_every else None,
        "metrics": str(out / "metrics.jsonl"),
        "corpus": corpus,
        "config": {**asdict(cfg), "nxd": nxd},
    }
    if rank == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def parse_args(argv=None) -> RunConfig:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = RunConfig()
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per micro-batch over all ranks")
    p.add_argument("--micro-batches", type=int, default=d.micro_batches)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--layers", type=int, default=d.model.layers)
    p.add_argument("--width", type=int, default=d.model.width)
    p.add_argument("--heads", type=int, default=d.model.heads)
    p.add_argument("--seq", type=int, default=d.model.seq)
    p.add_argument("--mode", choices=MODES, default=d.mode,
                   help="smp (default), fp32, bf16 (no master weights), bf16_sr (bf16 + stochastic rounding)")
    p.add_argument("--config", type=Path, help="a JSON file with an NxD config (optimizer_config, mixed_precision_config, ...)")
    p.add_argument("--device", choices=["auto", "cpu", "accelerator", "xla"], default=d.device)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-iters", type=int, default=d.eval_iters)
    p.add_argument("--ckpt-every", type=int, default=100, help="0: no checkpoints (default 100)")
    p.add_argument("--out", default=d.out)
    p.add_argument("--keep-ckpts", type=int, default=d.keep_ckpts, help="checkpoints kept (default 2)")
    p.add_argument("--sync-save", action="store_true", help="save checkpoints in the foreground")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in OUT/ckpt")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    for name in ("steps", "batch", "micro_batches", "eval_every", "eval_iters"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.lr <= 0 or a.ckpt_every < 0 or a.keep_ckpts < 1:
        p.error("--lr must be > 0, --ckpt-every >= 0 and --keep-ckpts >= 1")
    nxd = None
    if a.config is not None:
        try:
            nxd = json.loads(a.config.read_text())
        except (OSError, json.JSONDecodeError) as e:
            p.error(f"cannot read --config {a.config}: {e}")
    try:
        model = GPTConfig(layers=a.layers, width=a.width, heads=a.heads, seq=a.seq)
    except ValueError as e:
        p.error(str(e))
    return RunConfig(steps=a.steps, batch=a.batch, micro_batches=a.micro_batches, lr=a.lr, seed=a.seed,
                     model=model, mode=a.mode, nxd=nxd, device=a.device, eval_every=a.eval_every,
                     eval_iters=a.eval_iters, ckpt_every=a.ckpt_every, keep_ckpts=a.keep_ckpts,
                     async_save=not a.sync_save, out=a.out, resume=a.resume,
                     progress=not a.no_progress)


def main(argv=None) -> None:
    cfg = parse_args(argv)
    init_distributed(cfg.device)
    try:
        summary = run(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"\nfinal train loss {summary['final_train_loss']:.4f}   val loss {summary['final_val_loss']:.4f}   "
              f"{summary['tokens_per_s']:,.0f} tokens/s   peak RSS {summary['peak_rss_mib']:.0f} MiB")
        print(f"{summary['params'] / 1e6:.2f}M params on {summary['device']} (DP={summary['dp_size']}, "
              f"process group {summary['process_group'] or 'none'}), "
              f"metrics {summary['metrics']}, checkpoint {summary['checkpoint']}")


if __name__ == "__main__":
    main()
