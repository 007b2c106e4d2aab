"""Check nxd_smp's eager path on this machine's accelerator (torch.accelerator: CUDA, or Trainium's
``neuron`` under TorchNeuron) against a plain fp32-master reference, and print a table; JSON to --out.

What it runs, each on the accelerator, one process:

* ``step``: three SGD (momentum) and three AdamW steps of a bf16 MLP with global-norm clipping, against
  stock fp32 ``torch.optim`` on fp32 copies of the parameters (the reference steps on the CPU);
* ``prescaled``: the same with the clip coefficient applied to the gradient before the fused kernel,
  as on a device whose fused kernel is not known to take ``grad_scale``;
* ``dtensor``: the model parallelized over a one-rank ``("dp", "tp")`` mesh (``parallelize_module``)
  with ``device_mesh=mesh``;
* ``checkpoint``: ``save_checkpoint`` and ``load_checkpoint`` of that run, parameters and masters equal;
* ``compiled_model``: ``torch.compile(model)`` trained with the optimizer (the inductor backend of the
  device, where it has one).

    python scripts/check_accelerator.py                  # the current accelerator
    python scripts/check_accelerator.py --device cpu     # the same checks on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nxd_smp import MixedPrecisionConfig, Zero1Optimizer, load_checkpoint, save_checkpoint  # noqa: E402

STEPS, LR, MAX_NORM = 3, 1e-2, 0.05


def make_model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16)).to(
        device=device, dtype=torch.bfloat16)


def batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 32, generator=g).bfloat16().to(device), torch.randn(8, 16, generator=g).bfloat16().to(device)


def loss_of(model, x, y) -> torch.Tensor:
    return ((model(x).float() - y.float()) ** 2).mean()


#: The inner optimizers checked: SGD's update is proportional to the gradient, so a wrong clip coefficient
#: shows; AdamW's is not (a tiny gradient difference can move a near-zero moment by a whole step).
OPTIMIZERS = {"SGD": dict(lr=LR, momentum=0.9, weight_decay=0.01), "AdamW": dict(lr=LR)}
#: How far the masters may be from the reference: relative for SGD (fp32 arithmetic in another order), in
#: units of the learning rate for AdamW (the device's fused kernel rounds differently from the CPU's).
TOLERANCE = {"SGD": 1e-5, "AdamW": 0.05}


def reference(device: torch.device, name: str, compiled: bool = False) -> dict[str, torch.Tensor]:
    """Stock fp32 ``torch.optim`` on fp32 copies on the CPU; the bf16 model's gradients computed on ``device``
    (by ``torch.compile(model)`` where ``compiled``)."""
    model = make_model(device)
    masters = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    inner = getattr(torch.optim, name)(list(masters.values()), **OPTIMIZERS[name])
    forward = torch.compile(model) if compiled else model
    for step in range(STEPS):
        model.zero_grad()
        loss_of(forward, *batch(step, device)).backward()
        grads = {n: p.grad.float().cpu() for n, p in model.named_parameters()}
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        coef = torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)
        for n, m in masters.items():
            m.grad = grads[n] * coef
        inner.step()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(masters[n])
    return masters


def train(model, opt, device, steps=STEPS) -> None:
    for step in range(steps):
        loss_of(model, *batch(step, device)).backward()
        opt.step()


def masters_by_name(model, opt) -> dict[str, torch.Tensor]:
    def local_tensor(p: torch.Tensor) -> torch.Tensor:  # (a DTensor's part on this rank)
        return p.to_local() if hasattr(p, "to_local") else p

    index = {id(p): i for i, p in enumerate(opt.managed_params)}
    flat = {}
    for layout, shard in zip(opt.bucket_layouts, opt.master_shards):
        for i, param_index in enumerate(layout.param_indices):
            start, end = layout.param_range(i)
            flat[param_index] = shard[start:end]
    return {n: flat[index[id(p)]].view(local_tensor(p).shape).detach().float().cpu() for n, p in model.named_parameters()}


def error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], name: str) -> float:
    """The largest difference of the masters from the reference: relative (SGD) or in learning rates (AdamW)."""
    if name == "AdamW":
        return max(float((got[n] - want[n]).abs().max()) / LR for n in want)
    return max(float(((got[n] - want[n]).abs() / want[n].abs().clamp_min(1e-3)).max()) for n in want)


def close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], name: str) -> dict:
    err = error(got, want, name)
    assert err <= TOLERANCE[name], f"{name}: masters off the reference by {err:.2e} (tolerance {TOLERANCE[name]})"
    return {f"{name}_err": err}


def run_checks(device: torch.device) -> list[dict]:
    rows = []
    want = {name: reference(device, name) for name in OPTIMIZERS}

    def row(name: str, fn) -> None:
        start = time.perf_counter()
        try:
            detail = fn()
            rows.append({"check": name, "ok": True, **detail, "seconds": round(time.perf_counter() - start, 2)})
        except Exception as e:  # a check that fails is reported, the others still run
            rows.append({"check": name, "ok": False, "error": f"{type(e).__name__}: {e}"[:300]})

    def trained(build=None, **kwargs) -> dict:
        out = {}
        for name in OPTIMIZERS:
            model = make_model(device) if build is None else build()
            opt = Zero1Optimizer(model.parameters(), getattr(torch.optim, name), max_norm=MAX_NORM, **OPTIMIZERS[name],
                                 **kwargs)
            train(model, opt, device)
            out.update(close(masters_by_name(model, opt), want[name], name))
            out.update(fused=opt.inner_optimizer.param_groups[0].get("fused"),
                       grad_scale_in_kernel=opt.backend.fused_grad_scale)
            state.update(model=model, opt=opt)
        return out

    state = {}

    def step():
        return trained()

    def prescaled():
        import nxd_smp.backend.eager as eager

        saved, eager.FUSED_GRAD_SCALE_DEVICES = eager.FUSED_GRAD_SCALE_DEVICES, ()
        try:
            return trained()
        finally:
            eager.FUSED_GRAD_SCALE_DEVICES = saved

    def dtensor():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh(device.type, (1, 1), mesh_dim_names=("dp", "tp"))
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        return trained(lambda: parallelize_module(make_model(device), mesh["tp"], plan), device_mesh=mesh,
                       mixed_precision=MixedPrecisionConfig(use_master_weights_in_ckpt=True))

    def checkpoint():
        model, opt = state["model"], state["opt"]
        with tempfile.TemporaryDirectory() as root:
            save_checkpoint(f"{root}/ckpt", model=model, optimizer=opt)
            before = masters_by_name(model, opt)
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            load_checkpoint(f"{root}/ckpt", model=model, optimizer=opt)
        same_masters = all(torch.equal(before[n], v) for n, v in masters_by_name(model, opt).items())
        same_params = all(torch.equal(params[n], p.detach()) for n, p in model.named_parameters())
        assert same_masters and same_params, f"masters equal: {same_masters}, parameters equal: {same_params}"
        return {}

    def compiled_model():
        model = make_model(device)
        opt = Zero1Optimizer(model.parameters(), torch.optim.SGD, max_norm=MAX_NORM, **OPTIMIZERS["SGD"])
        train(torch.compile(model), opt, device)
        return close(masters_by_name(model, opt), reference(device, "SGD", compiled=True), "SGD")

    row("step", step)
    row("prescaled", prescaled)
    if dist.is_available():
        row("dtensor", dtensor)
        if rows[-1]["ok"]:
            row("checkpoint", checkpoint)
    row("compiled_model", compiled_model)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="accelerator", help="'accelerator' (torch.accelerator's) or a device")
    parser.add_argument("--out", type=Path, help="write the rows and the environment as JSON")
    args = parser.parse_args()
    if args.device == "accelerator":
        device = torch.accelerator.current_accelerator(check_available=True)
        if device is None:
            raise SystemExit("torch.accelerator reports no accelerator here; pass --device cpu")
    else:
        device = torch.device(args.device)
    if dist.is_available() and not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        backend = "gloo" if device.type == "cpu" else dist.get_default_backend_for_device(device)
        dist.init_process_group(backend, rank=0, world_size=1)
    rows = run_checks(device)
    report = [f"nxd_smp on {device} (torch {torch.__version__})", f"{'check':16} {'ok':5} detail"]
    for r in rows:
        detail = {k: v for k, v in r.items() if k not in ("check", "ok", "seconds")}
        report.append(f"{r['check']:16} {str(r['ok']):5} {detail}")
    print("\n".join(report))
    if args.out:
        args.out.write_text(json.dumps({"device": str(device), "torch": torch.__version__,
                                        "device_name": torch.cuda.get_device_name() if device.type == "cuda" else None,
                                        "command": " ".join(sys.argv), "rows": rows, "report": report},
                                       indent=1) + "\n")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
