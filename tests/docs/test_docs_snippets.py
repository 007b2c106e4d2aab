"""The documentation's snippets (the README's quick start and NxD section, every loop of
docs/training_loops.md, the setups of docs/trainium.md) run as they stand, each once in a process
of its own: under ``torchrun`` where the page launches it so, else as ``python -c`` runs it (forked
from the tests' preloaded server, tests/distributed.py). What they compute is checked: a check
written for each snippet runs after it in the same process, against an independent reference
(tests/snippet_reference.py) where the snippet trains."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import run_python

ROOT = Path(__file__).resolve().parents[2]

# The plain-loop reference check: rebuild the snippet's initial model from its seed, train the
# reference on the snippet's own data, compare parameters and the last step's norm.
_TRAINED_LIKE_THE_REFERENCE = '''
from tests.oracle import assert_params_close
from tests.snippet_reference import smp_reference
torch.manual_seed(0)
initial = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)).to(torch.bfloat16)
assert not all(torch.equal(a, b.cpu()) for a, b in zip(initial.parameters(), model.parameters())), "nothing trained"
expected, norms = smp_reference(initial, [list(mb) for mb in STEPS], LOSS, lr=1e-3, max_norm={max_norm})
got = {{n: p.detach().cpu().to(expected[n].dtype) for n, p in {model}.named_parameters()}}
assert_params_close(got, expected, max_ulp={ulp}, max_flip_fraction={flips})
assert abs(float({norm}) - norms[-1]) <= {rel} * norms[-1], (float({norm}), norms[-1])
print("checked")
'''


def trained_like_the_reference(steps: str, loss: str, model: str = "model", norm: str = "opt.grad_norm",
                               ulp: int = 1, flips: float = 0.05, rel: float = 1e-4, max_norm: str = "1.0") -> str:
    return (f"STEPS = {steps}\nLOSS = {loss}\n" + _TRAINED_LIKE_THE_REFERENCE.format(
        model=model, norm=norm, ulp=ulp, flips=flips, rel=rel, max_norm=max_norm))


# Where a snippet's forward rounds its own way in bf16 (a compiled model, DTensor's rowwise bias), the
# parameters cannot match the eager reference's to the last bit: each step's update must (at most 10% of
# a tensor's elements further than half of the run's total lr from the reference's update; an untrained
# model, or one trained at lr/10, leaves 70-100% of them further).
_UPDATED_LIKE_THE_REFERENCE = '''
def _updated_like_the_reference(got, expected, initial, lr, steps):
    for n, e in expected.items():
        ours, theirs = got[n].float() - initial[n].float(), e.float() - initial[n].float()
        far = ((ours - theirs).abs() > 0.5 * steps * lr).float().mean().item()
        assert far <= 0.1, (n, far)
'''

MEAN_OVER_4 = "lambda m, x: m(x.bfloat16()).float().pow(2).mean() / 4"
# accelerate's DataLoader of torch.randn(128, 32), drawn right after the model: 4 steps of 4
# micro-batches of 8 (it divides the loss by gradient_accumulation_steps inside backward)
ACCELERATE_DATA = ("[list(d[i:i + 32].split(8)) for d in [(torch.manual_seed(0), torch.nn.Sequential("
                   "torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)), torch.randn(128, 32))[2]] "
                   "for i in range(0, 128, 32)]")

# The README's section "Coming from NxD, moving to native PyTorch": what each snippet starts
# from (NxD's folder is written here as NxD lays it out, its ZeRO-1 files in torch_xla's layout
# for DP 2 by export_xla), and what it must have done.
NXD_SECTION = "Coming from NxD, moving to native PyTorch"
NXD_CALLS = "NxD's checkpoint calls"
_NXD_FOLDER = '''
import torch, nxd_smp
from pathlib import Path
from nxd_smp.interop.torch_xla import export_xla
torch.manual_seed(1)
theirs = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)).to(torch.bfloat16)
run = nxd_smp.Zero1Optimizer(theirs.parameters(), torch.optim.AdamW, lr=1e-3, max_norm=1.0,
                             mixed_precision=nxd_smp.MixedPrecisionConfig(use_master_weights_in_ckpt=True))
for _ in range(3):
    theirs(torch.randn(8, 32).bfloat16()).float().pow(2).mean().backward()
    run.step()
    run.zero_grad()
nxd_smp.save_checkpoint("theirs", model=theirs, optimizer=run)
tag = Path("nxd_output/step_3")
export_xla("theirs", tag / "optim", dp_size=2)
(tag / "model").mkdir()
torch.save(theirs.state_dict(), tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt")
torch.save({"step": 3}, tag / "user_content.pt")
(tag / "checkpoint").write_text("1")
(tag / "done").write_text("1")
del theirs, run
'''
_SAME_AS_SAVED = '''
from nxd_smp.checkpoint import read_checkpoint
saved = read_checkpoint({path!r})
names = [n for n, _ in {model}.named_parameters()]
{check}
print("checked")
'''


# The DP 2 checkpoint snippets: ``train()`` and ``train(<checkpoint>)`` end alike on each rank
# (parameters and this rank's fp32 masters), and both trained.
RESUMED_LIKE_UNINTERRUPTED = '''
import os
import torch.distributed as dist
from nxd_smp.zero1_optimizer import zero1_optimizer_of
{initial}
assert dist.get_world_size() == 2 and zero1_optimizer_of(opt).world_size == 2
assert not all(torch.equal(a, b) for a, b in zip(initial.parameters(), model.parameters())), "nothing trained"
for (name, a), b in zip(model.named_parameters(), resumed.parameters(), strict=True):
    assert torch.equal(a.detach(), b.detach()), name
for a, b in zip(zero1_optimizer_of(opt).master_shards, zero1_optimizer_of(resumed_opt).master_shards, strict=True):
    assert torch.equal(a, b)
print("checked")
'''


def same_as_saved(path: str, check: str, model: str = "model") -> str:
    return _SAME_AS_SAVED.format(path=path, model=model, check=check)


def readme_snippet(heading: str) -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index(f"## {NXD_SECTION}"):]
    part = section[section.index(f"### {heading}"):]
    return re.search(r"```python\n(.*?)```", part, re.S).group(1)


SETUPS = {
    "An NxD checkpoint folder": _NXD_FOLDER,
    "Out to native PyTorch": "exec(compile(readme_snippet, 'the NxD calls snippet', 'exec'))\n",
}


CHECKS = {
    "Quick start": trained_like_the_reference("data", MEAN_OVER_4)
    + 'import os\nassert os.path.islink("ckpt/step_5") and os.path.isfile("ckpt/step_5/COMPLETE.json")\n',
    "A plain PyTorch loop": trained_like_the_reference("data", MEAN_OVER_4),
    "Hugging Face Trainer": '''
logged = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
assert len(logged) == 2 and min(logged) > 0, logged
assert abs(logged[-1] - float(opt.grad_norm)) <= 1e-6 * logged[-1], (logged, float(opt.grad_norm))
print("checked")
''',
    "accelerate": trained_like_the_reference(ACCELERATE_DATA, MEAN_OVER_4, norm="opt.optimizer.grad_norm"),
    # XLA computes bf16 model code with other roundings than eager: a looser comparison
    "An NxD script on Trainium (or the XLA CPU device)": trained_like_the_reference(
        "data", MEAN_OVER_4, ulp=64, flips=1.0, rel=2e-2),
    "NxD's checkpoint calls": '''
assert user_content == {"step": 3}, user_content
assert sorted(t for t in os.listdir("ckpt") if not t.startswith(".")) == ["step_2", "step_3"]
''' + same_as_saved("ckpt/step_3", "assert all(torch.equal(p, saved['optimizer']['master_weights'][n].bfloat16()) "
                                     "for n, p in model.named_parameters())"),
    "An NxD checkpoint folder": "assert user_content == {'step': 3}\n" + same_as_saved("theirs", '''
for n, p in model.named_parameters():
    assert torch.equal(p, saved["model"][n]), n
nxd_smp.save_checkpoint("ours", model=model, optimizer=opt, save_master_weights=True)
ours = read_checkpoint("ours")["optimizer"]
for n in names:
    assert torch.equal(ours["master_weights"][n], saved["optimizer"]["master_weights"][n]), n
    for key, value in saved["optimizer"]["state"][n].items():
        assert torch.equal(ours["state"][n][key], value), (n, key)
'''),
    "Out to native PyTorch": same_as_saved("ckpt/step_3", '''
from safetensors.torch import load_file
weights = load_file("model.safetensors")
native = opt.state_dict()["state"]
for i, n in enumerate(names):
    assert torch.equal(dict(model.named_parameters())[n].detach(), saved["optimizer"]["master_weights"][n]), n
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(native[i][key], saved["optimizer"]["state"][n][key]), (n, key)
    assert torch.equal(weights[n], saved["model"][n]), n
'''),
    # 4 ranks under torchrun (LAUNCHED): each checks its tensor-parallel pair
    "An NxD Llama-style setup: tensor and sequence parallelism with ZeRO-1": '''
parts = [torch.empty_like(model.norm) for _ in range(TP)]
dist.all_gather(parts, model.norm.detach().contiguous(), group=tp_group)
assert torch.equal(parts[0], parts[1]), "the sequence-parallel weight differs across the TP pair"
assert not torch.equal(model.norm.detach(), torch.ones(64)), "nothing trained"
rows = [torch.empty_like(model.proj) for _ in range(TP)]
dist.all_gather(rows, model.proj.detach().contiguous(), group=tp_group)
assert not torch.equal(rows[0], rows[1])
assert opt.optimizer.sequence_parallel and opt.world_size == 2 and opt.optimizer.tensor_parallel_size == 2
print("checked")
''',
    "XLA_DOWNCAST_BF16 on the XLA CPU device": '''
from nxd_smp.checkpoint import read_checkpoint
assert {m.dtype for m in opt.master_shards} == {torch.float64}
assert {p.dtype for p in model.parameters()} == {torch.float32}
saved = read_checkpoint("ckpt")
assert {t.dtype for t in saved["model"].values()} == {torch.bfloat16}
masters = saved["optimizer"]["master_weights"]
assert {t.dtype for t in masters.values()} == {torch.float32}
for n, p in model.named_parameters():  # the parameters are the masters rounded to bf16
    assert torch.equal(p.detach().cpu(), masters[n].bfloat16().float()), n
''' + trained_like_the_reference("data", MEAN_OVER_4, ulp=64, flips=1.0, rel=2e-2),
    # against the stand-ins (STAND_INS): NxD's own optimizer and checkpoint functions raise there
    "NxD Training, with nxd_smp under it": trained_like_the_reference("data", MEAN_OVER_4, max_norm="float('inf')")
    + '''
import os
assert type(opt) is nxd_smp.NxDOptimizer and nxd.initialize_parallel_optimizer is nxd_smp.initialize_parallel_optimizer
assert user_content == {"global_step": 3} and sorted(os.listdir("ckpt/step=3/optim")) == ["dp_rank_00_tp_rank_00_pp_rank_00.pt"]
assert opt.max_norm is None and not opt.grad_clipping
''',
    "optimum-neuron, with nxd_smp under it": trained_like_the_reference("data", MEAN_OVER_4, norm="grad_norm") + '''
from nxd_smp.checkpoint import read_checkpoint
assert type(opt) is nxd_smp.NeuronZero1Optimizer
masters = read_checkpoint("checkpoint-3/shards")["optimizer"]["master_weights"]
assert all(torch.equal(p, masters[n].bfloat16()) for n, p in model.named_parameters())
''',
    # 2 ranks under torchrun (LAUNCHED): the resumed run is the uninterrupted one on each rank
    "The Trainer at DP > 1, with its checkpoints": RESUMED_LIKE_UNINTERRUPTED.format(initial='''
from transformers import LlamaForCausalLM
torch.manual_seed(0)
initial = LlamaForCausalLM(config).to(torch.bfloat16)
assert os.path.islink("runs/hf_dp/checkpoint-2/nxd_smp") and os.path.isfile("runs/hf_dp/checkpoint-2/optimizer.pt")
'''),
    "accelerate at DP > 1, with save_state and load_state": RESUMED_LIKE_UNINTERRUPTED.format(initial='''
torch.manual_seed(0)
initial = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)).to(torch.bfloat16)
assert os.path.islink("runs/accelerate_dp/step_4/nxd_smp")
'''),
    # docs/native_pytorch.md, 4 ranks under torchrun: the TP pair agrees, every rank has one norm, and the run
    # is the unsharded fp32-master reference's within bf16 drift (DTensor's rowwise bias rounds its own way)
    "Tensor parallelism with ZeRO-1 on DTensor": _UPDATED_LIKE_THE_REFERENCE + '''
import os
from tests.snippet_reference import smp_reference
tp_group = mesh["tp"].get_group()
pair = [torch.empty_like(model[2].bias.to_local()) for _ in range(2)]
dist.all_gather(pair, model[2].bias.to_local().contiguous(), group=tp_group)
assert torch.equal(pair[0], pair[1]), "the replicated bias differs across the TP pair"
norms = [torch.zeros(()) for _ in range(4)]
dist.all_gather(norms, opt.grad_norm.float().reshape(()))
assert all(torch.equal(n, norms[0]) for n in norms)
assert (opt.world_size, opt.tensor_parallel_size) == (2, 2) and os.path.isfile(f"ckpt/step_3/tp{tp}/COMPLETE.json")
torch.manual_seed(0)
initial = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)).to(torch.bfloat16)
data = [[(torch.manual_seed(100 * step + r), torch.randn(8, 32).bfloat16())[1] for r in range(2)] for step in range(3)]
expected, ref_norms = smp_reference(initial, data, lambda m, x: m(x).float().pow(2).mean() / 2, lr=1e-3, max_norm=1.0)
got = {n: p.full_tensor() for n, p in model.named_parameters()}
_updated_like_the_reference(got, expected, dict(initial.named_parameters()), lr=1e-3, steps=3)
assert abs(float(opt.grad_norm) - ref_norms[-1]) <= 2e-2 * ref_norms[-1]
print("checked")
''',
    "Carrying a checkpoint over to DCP": '''
from nxd_smp.checkpoint import read_checkpoint
masters = read_checkpoint("dp_ckpt")["optimizer"]["master_weights"]
for n, p in fp32.named_parameters():
    assert p.dtype == torch.float32 and torch.equal(p.detach(), masters[n]), n
print("checked")
''',
    # 2 ranks under torchrun: refused, and FSDP2 trains
    "FSDP2 instead: the fully sharded form": '''
assert all(float(s["step"]) == 3 for s in opt.state.values())
print("checked")
''',
    # the compiled model's gradients round their own way in bf16: the reference's within drift
    "torch.compile and frozen parameters": _UPDATED_LIKE_THE_REFERENCE + '''
from tests.snippet_reference import smp_reference
torch.manual_seed(0)
initial = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)).to(torch.bfloat16)
expected, norms = smp_reference(initial, data, lambda m, x: m(x.bfloat16()).float().pow(2).mean() / 4, lr=1e-3,
                                max_norm=1.0)
_updated_like_the_reference(dict(model.named_parameters()), expected, dict(initial.named_parameters()), lr=1e-3,
                            steps=3)
assert abs(float(opt.grad_norm) - norms[-1]) <= 1e-2 * norms[-1]
print("checked")
''',
    # 4 ranks under torchrun: TorchTitan's CheckpointManager saved every step, the optimizer stepped 3 times
    "TorchTitan, and torch's distributed state dict": '''
import os
assert sorted(os.listdir("titan_run/checkpoint")) == ["step-1", "step-2", "step-3"]
zero1 = optimizers.optimizers[0]
assert (zero1.world_size, zero1.tensor_parallel_size) == (2, 2)
assert all(float(s["step"]) == 3 for s in zero1.state.values())
print("checked")
''',
    # 2 ranks under torchrun: the resume continued from the checkpoint's state (step 4, then 4 more)
    "PyTorch Lightning": '''
zero1 = resumed.optimizers[0]
assert resumed.global_step == 8 and zero1.world_size == 2 and zero1.max_norm == 0.5
assert all(float(s["step"]) == 8 for s in zero1.state.values())
print("checked")
''',
    "InternEvo's NaiveAMPModel": '''
import torch.nn.functional as F
x = torch.randn(4, 8)
lin0, norm, lin2 = model.model[0], model.model[1], model.model[2]
assert lin0.weight.dtype == lin2.weight.dtype == torch.bfloat16 and norm.weight.dtype == torch.float32
h = F.linear(x.bfloat16(), lin0.weight, lin0.bias)
h = F.layer_norm(h.float(), (8,), norm.weight, norm.bias).bfloat16()
expected = F.linear(h, lin2.weight, lin2.bias).float()
assert torch.equal(model(x), expected)
print("checked")
''',
}


def snippets() -> list[tuple[str, str]]:
    readme = (ROOT / "README.md").read_text()
    quick = readme[readme.index("## Quick start"):]
    quick = quick[: quick.index("\n## ", 4)]
    found = [("Quick start", re.search(r"```python\n(.*?)```", quick, re.S).group(1))]
    nxd = readme[readme.index(f"## {NXD_SECTION}"):]
    nxd = nxd[: nxd.index("\n## ", 4)]
    for heading, body in re.findall(r"^### (.+?)\n(.*?)(?=^### |\Z)", nxd, re.S | re.M):
        for code in re.findall(r"```python\n(.*?)```", body, re.S):
            found.append((heading.strip().replace("`", ""), code))
    for page in ("training_loops.md", "trainium.md", "native_pytorch.md"):
        text = (ROOT / "docs" / page).read_text()
        text = text.split("\n# Reference")[0]  # (native_pytorch.md: the migration guide; the reference after it)
        for heading, body in re.findall(r"^## (.+?)\n(.*?)(?=^## |\Z)", text, re.S | re.M):
            for code in re.findall(r"```python\n(.*?)```", body, re.S):
                found.append((heading.strip().replace("`", ""), code))
    return found


# Snippets that call NxD's names, run with the stand-in packages on the path (tests/stand_ins).
STAND_INS = {"NxD Training, with nxd_smp under it", "optimum-neuron, with nxd_smp under it"}
# Snippets run as a launcher runs them, with how many ranks: each rank prints its check (and
# what PRINTS says the snippet prints).
LAUNCHED = {"An NxD Llama-style setup: tensor and sequence parallelism with ZeRO-1": 4,
            "The Trainer at DP > 1, with its checkpoints": 2,
            "accelerate at DP > 1, with save_state and load_state": 2,
            "Tensor parallelism with ZeRO-1 on DTensor": 4,
            "FSDP2 instead: the fully sharded form": 2,
            "TorchTitan, and torch's distributed state dict": 4,
            "PyTorch Lightning": 2}
PRINTS = {"An NxD Llama-style setup: tensor and sequence parallelism with ZeRO-1": "grad norm",
          "Tensor parallelism with ZeRO-1 on DTensor": "grad norm",
          "FSDP2 instead: the fully sharded form": "refused: the parameters belong to a model sharded by FSDP2"}


def test_every_loop_has_a_snippet_and_a_check():
    headings = [h for h, _ in snippets()]
    assert len(headings) == len(set(headings)) == 21 and set(headings) == set(CHECKS), headings
    assert set(SETUPS) <= set(headings)


def framework_of(code: str) -> str | None:
    """The framework the snippet imports that only the native environment installs (``make test-native``)."""
    return next((m for m in ("torchtitan", "pytorch_lightning") if re.search(rf"^\s*(import|from) {m}\b", code, re.M)),
                None)


def runs_torch_xla(code: str) -> bool:
    """The snippet imports torch_xla (it runs on the XLA CPU device): ``make test`` runs it."""
    return re.search(r"^\s*(import|from) torch_xla\b", code, re.M) is not None


@pytest.mark.parametrize("heading, code", [
    pytest.param(h, c, id=h, marks=[pytest.mark.requires_xla] if runs_torch_xla(c) else []) for h, c in snippets()])
def test_the_snippet_computes_what_it_says(tmp_path, heading, code):
    if framework_of(code):
        pytest.importorskip(framework_of(code))
    path = f"{ROOT / 'tests' / 'stand_ins'}:{ROOT}" if heading in STAND_INS else str(ROOT)
    env = {**os.environ, "PYTHONPATH": path, "USE_TORCH_XLA": "0"}
    setup = SETUPS.get(heading, "")
    if setup:
        setup = f"readme_snippet = {readme_snippet(NXD_CALLS)!r}\n" + setup
        setup = "import os, sys\nsys.stdout = open(os.devnull, 'w')\n" + setup + "sys.stdout = sys.__stdout__\n"
    program = setup + "# ---- the snippet\n" + code + "\n# ---- the test's check\nimport torch\n" + CHECKS[heading]
    ranks = LAUNCHED.get(heading)
    if ranks:  # (the group destroyed before exit, as training_loops.md says: pytorch/pytorch#190489,
        # once every rank is past its last collective: tests/trainer_dp_worker.py; then the interpreter's
        # teardown skipped, where gloo's threads aborted a rank of the FSDP2 snippet after its checks
        # even so, once in a clean clone's run)
        program += ("\nif torch.distributed.is_initialized():\n    torch.distributed.barrier()\n"
                    "    torch.distributed.destroy_process_group()\n"
                    "import os, sys\nsys.stdout.flush()\nsys.stderr.flush()\nos._exit(0)\n")
        (tmp_path / "snippet.py").write_text(program)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                   "snippet.py"]
        env["OMP_NUM_THREADS"] = "1"
        out = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    else:  # python -c, forked from the preloaded server (tests/distributed.py)
        out = run_python(["-c", program], cwd=tmp_path, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    if ranks:
        assert out.stdout.count("checked") == ranks and PRINTS.get(heading, "") in out.stdout, out.stdout
    else:
        assert lines[:-1] and lines[-1] == "checked", out.stdout
