"""A checkpoint is data a stranger hands you: loading it never runs code from it, through
any entry point, and the offline tools never join a collective.

The exploit is an object whose unpickling calls ``os.mkdir(marker)``: saved by nxd_smp itself
as the caller's content (every integrity check passes), or written over one of a
checkpoint's pickled files (with the completion record updated to match). Loading must
refuse it with a CheckpointError naming the file and what it asked for, create nothing,
and change nothing in the live model and optimizer.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nxd_smp import CheckpointError, MixedPrecisionConfig, Zero1Optimizer, load_checkpoint, save_checkpoint
from nxd_smp.checkpoint import consolidate, inspect_checkpoint, read_checkpoint
from nxd_smp.interop.torch_xla import export_xla, import_xla
from tests.distributed import run_ranks
from tests.previous_format import to_format_2
from tests.oracle import batch, loss_fn, make_model, param_groups

ROOT = Path(__file__).resolve().parents[1]


class Exploit:
    """Unpickling it creates the directory ``marker``: the code a crafted file would run."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


class Counter:
    """A user's own class in ``extra``: harmless, but torch's rule is to allow it by name."""

    def __init__(self, n: int = 0):
        self.n = n


class HoldsAnExploit:
    """A stateful object (a sampler, say) whose state holds the exploit."""

    def __init__(self, marker: str):
        self.marker = marker

    def state_dict(self):
        return {"position": 3, "payload": Exploit(self.marker)}

    def load_state_dict(self, state):
        raise AssertionError("never reached")


def build(seed=0):
    model = make_model(seed)
    opt = Zero1Optimizer(param_groups(model, lr_a=1e-2, lr_b=3e-2), torch.optim.SGD, momentum=0.9,
                         mixed_precision=MixedPrecisionConfig(use_master_weights_in_ckpt=True), bucket_cap_mb=0.0004)
    for m in range(2):
        loss_fn(model, *batch(0, 0, 0, m)).backward()
    opt.step()
    return model, opt


def snapshot(model, opt):
    return [p.detach().clone() for p in model.parameters()] + [m.clone() for m in opt.master_shards]


def unchanged(before, model, opt) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, snapshot(model, opt)))


def overwrite(checkpoint: Path, name: str, data: bytes) -> None:
    """Replace one file of a checkpoint and update its completion record to match (the
    integrity checks then pass: only the loader's refusal stands between it and the code)."""
    version = checkpoint.resolve()
    (version / name).write_bytes(data)
    record_path = version / "COMPLETE.json"
    record = json.loads(record_path.read_text())
    record["files"][name] = [len(data), zlib.crc32(data)]
    record_path.write_text(json.dumps(record))


def torch_saved(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "the_exploit_ran"
    yield str(path)
    assert not path.exists(), "code from the checkpoint ran"


@pytest.fixture
def crafted(tmp_path, marker):
    """Checkpoints of the previous format (2, whose small files and index were pickles) that would
    run code, by each pickled file replaced. (Format 3 holds no pickle: an object in ``extra`` or a
    stateful object's state is refused when it is saved.)"""
    model, opt = build()
    made = {}
    for name, data in ((".metadata", pickle.dumps(Exploit(marker))),
                       ("nxd_smp_meta.pt", torch_saved({"format": Exploit(marker)})),
                       ("extra.pt", torch_saved(Exploit(marker))),
                       ("extra", torch_saved({"extra": {"step": 1, "note": Exploit(marker)}, "objects": {}})),
                       ("stateful", torch_saved({"extra": None, "objects": {"sampler": {"s": Exploit(marker)}}}))):
        made[name] = tmp_path / f"replaced{name.replace('.', '_')}"
        save_checkpoint(made[name], model=model, optimizer=opt)
        to_format_2(made[name])
        overwrite(made[name], name if name.startswith(".") or name.endswith(".pt") else "extra.pt", data)
    return made


def test_code_in_user_content_is_refused_when_it_is_saved(tmp_path, marker):
    model, opt = build()
    with pytest.raises(TypeError, match="Exploit.*never a pickle"):
        save_checkpoint(tmp_path / "extra", model=model, optimizer=opt, extra={"step": 1, "note": Exploit(marker)})
    with pytest.raises(TypeError, match="sampler.state_dict.*Exploit"):
        save_checkpoint(tmp_path / "stateful", model=model, optimizer=opt, stateful={"sampler": HoldsAnExploit(marker)})
    assert not list(tmp_path.iterdir())


REFUSED_FILE = {"extra": "extra.pt", "stateful": "extra.pt", ".metadata": ".metadata",
                "nxd_smp_meta.pt": "nxd_smp_meta.pt", "extra.pt": "extra.pt"}
KINDS = sorted(REFUSED_FILE)


def assert_refused(error: BaseException, kind: str) -> None:
    text = str(error)
    assert REFUSED_FILE[kind] in text and "mkdir" in text, text


@pytest.mark.parametrize("kind", KINDS)
def test_load_checkpoint_refuses_and_changes_nothing(crafted, kind):
    model, opt = build(seed=3)
    before = snapshot(model, opt)
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(crafted[kind], model=model, optimizer=opt,
                        stateful={"sampler": HoldsAnExploit("x")} if kind == "stateful" else None)
    assert_refused(refused.value, kind)
    assert unchanged(before, model, opt)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tool", ["inspect", "read", "consolidate"])
def test_the_offline_tools_refuse(crafted, kind, tool, tmp_path):
    with pytest.raises(CheckpointError) as refused:
        if tool == "inspect":
            inspect_checkpoint(crafted[kind])
        elif tool == "read":
            read_checkpoint(crafted[kind])
        else:
            consolidate(crafted[kind], tmp_path / "out.pt")
    assert_refused(refused.value, kind)
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("command", ["inspect", "consolidate"])
def test_the_command_line_refuses(crafted, command, tmp_path):
    args = [str(crafted[".metadata"])] + ([str(tmp_path / "out.pt")] if command == "consolidate" else [])
    proc = subprocess.run([sys.executable, "-m", "nxd_smp", command, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and ".metadata" in proc.stderr and "mkdir" in proc.stderr, proc.stderr


def test_torch_xla_import_refuses_a_crafted_rank_file(tmp_path, marker):
    files = [tmp_path / f"dp_rank_{r:02d}_tp_rank_00_pp_rank_00.pt" for r in range(2)]
    for r, f in enumerate(files):
        state = {"momentum_buffer": Exploit(marker) if r == 1 else torch.zeros(4)}
        torch.save({"param_groups": [{"lr": 0.1, "params": [0]}], "base_state": {0: state},
                    "shape_info": {0: torch.Size([8])}}, f)
    fresh, fresh_opt = build(seed=3)
    before = snapshot(fresh, fresh_opt)
    with pytest.raises(CheckpointError, match="dp_rank_01.*mkdir"):
        import_xla(files, model=fresh, optimizer=fresh_opt)
    assert unchanged(before, fresh, fresh_opt)


def test_a_format_1_index_is_read_by_the_restricted_unpickler_too(tmp_path, marker):
    """Format-1 checkpoints (DCP's FileSystemWriter files) load without torch's readers,
    which unpickle the index freely and byte entries with weights_only=False."""
    from tests.test_checkpoint import write_format_1

    model, opt = build()
    path = write_format_1(tmp_path, model, opt)
    overwrite(path, ".metadata", pickle.dumps(Exploit(marker)))
    fresh, fresh_opt = build(seed=3)
    with pytest.raises(CheckpointError, match=r"\.metadata.*mkdir"):
        load_checkpoint(path, model=fresh, optimizer=fresh_opt)


def test_a_users_own_class_is_refused_even_where_torch_would_allow_it(tmp_path):
    """torch.load(weights_only=True) admits a class once allowed with add_safe_globals; nxd_smp's
    reader admits what a state dict is and nothing a process-wide list adds (round two): format 3
    refuses the object when it is saved, and a format-2 file holding one is refused on load."""
    model, opt = build()
    with pytest.raises(TypeError, match="Counter"):
        save_checkpoint(tmp_path / "c", model=model, optimizer=opt, extra={"counter": Counter(7)})
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt)
    to_format_2(tmp_path / "c")
    overwrite(tmp_path / "c", "extra.pt", torch_saved({"extra": {"counter": Counter(7)}, "objects": {}}))
    with torch.serialization.safe_globals([Counter]), pytest.raises(CheckpointError, match="extra.pt.*Counter"):
        load_checkpoint(tmp_path / "c", model=model, optimizer=opt)


# ---------------------------------------------------------------- offline tools are process-local
def one_rank_uses_the_tools(rank: int, world: int, path: str, out: str) -> dict:
    """Rank 0 calls every offline tool while rank 1 waits at a barrier (as users of torch's
    ZeroRedundancyOptimizer consolidate on one rank). A tool that joined a collective would
    leave rank 1 waiting past the barrier's timeout."""
    from datetime import timedelta

    done = {}
    if rank == 0:
        done["inspect"] = inspect_checkpoint(path)["optimizer"]["dp_size_written_at"]
        done["read"] = sorted(read_checkpoint(path)["model"])
        consolidate(path, os.path.join(out, "full.pt"))
        done["export"] = len(export_xla(path, os.path.join(out, "xla"), dp_size=2))
    dist.monitored_barrier(timeout=timedelta(seconds=60))
    return done


def saved_at_dp2(rank: int, world: int, path: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)).to(torch.bfloat16)
    opt = Zero1Optimizer(model.parameters(), torch.optim.SGD, momentum=0.9, lr=0.1)
    model(torch.ones(2, 6, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    save_checkpoint(path, model=model, optimizer=opt)


def test_one_rank_runs_the_offline_tools_while_the_other_waits(tmp_path):
    path = str(tmp_path / "c")
    run_ranks(2, saved_at_dp2, path)
    done = run_ranks(2, one_rank_uses_the_tools, path, str(tmp_path))
    assert done[0]["inspect"] == 2 and done[0]["export"] == 2 and "0.weight" in done[0]["read"]
    assert (tmp_path / "full.pt").exists() and done[1] == {}
