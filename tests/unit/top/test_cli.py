"""The command line: ``python -m nxd_smp inspect|consolidate|export-xla|export-torch|
export-safetensors``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nxd_smp import save_checkpoint
from nxd_smp.cli import main
from tests.checkpoint_scenario import build, train
from tests.distributed import run_python

ROOT = Path(__file__).resolve().parents[3]


def test_inspect_prints_and_fails_cleanly(tmp_path):
    model, opt = build()
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = run_python(["-m", "nxd_smp", "inspect", str(tmp_path / "c")], env=env, timeout=120)
    assert out.returncode == 0 and "model/lin1.weight" in out.stdout and "DP size 1" in out.stdout
    out = run_python(["-m", "nxd_smp", "inspect", str(tmp_path / "none")], env=env, timeout=120)
    assert out.returncode == 2 and "does not exist" in out.stderr


def test_consolidate_inspect_and_export_from_the_command_line(tmp_path, capsys):
    model, opt = build()
    train(model, opt, 1, 0)
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt)
    assert main(["consolidate", str(tmp_path / "c"), str(tmp_path / "plain.pt")]) == 0
    plain = torch.load(tmp_path / "plain.pt", weights_only=False)
    assert torch.equal(plain["model"]["lin1.weight"], model.lin1.weight.detach())
    assert main(["inspect", str(tmp_path / "c"), "--json"]) == 0
    assert '"dp_size_written_at": 1' in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "c"), "--verify"]) == 0
    assert "every file checked" in capsys.readouterr().out
    damaged = next((tmp_path / "c").resolve().glob("__0_*.bin"))
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert main(["inspect", str(tmp_path / "c")]) == 0  # sizes only: the table still prints
    assert main(["inspect", str(tmp_path / "c"), "--verify"]) == 2
    assert "corrupted" in capsys.readouterr().err
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt)  # undo the damage
    # torch_xla's layout cannot hold the model's 0-dim parameter: refused by name, exit 2
    assert main(["export-xla", str(tmp_path / "c"), str(tmp_path / "xla"), "--dp-size", "2"]) == 2
    assert "temperature" in capsys.readouterr().err and not (tmp_path / "xla").exists()


def test_bad_arguments_exit_with_a_message(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["export-xla", str(tmp_path), str(tmp_path / "out")])  # --dp-size missing
    assert info.value.code == 2 and "--dp-size" in capsys.readouterr().err
    assert main(["consolidate", str(tmp_path / "none"), str(tmp_path / "o.pt")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_ways_out_to_native_torch_and_safetensors(tmp_path, capsys):
    from safetensors.torch import load_file

    from nxd_smp.checkpoint import read_checkpoint

    model, opt = build()
    train(model, opt, 1, 0)
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt, save_master_weights=True)
    assert main(["export-torch", str(tmp_path / "c"), str(tmp_path / "dcp")]) == 0
    assert (tmp_path / "dcp" / ".metadata").is_file() and "wrote" in capsys.readouterr().out
    assert main(["export-torch", str(tmp_path / "c"), str(tmp_path / "dcp")]) == 2  # never over an export
    assert "exists" in capsys.readouterr().err
    saved = read_checkpoint(tmp_path / "c")
    assert main(["export-safetensors", str(tmp_path / "c"), str(tmp_path / "w.safetensors")]) == 0
    weights = load_file(tmp_path / "w.safetensors")
    assert weights.keys() == saved["model"].keys()
    assert all(torch.equal(weights[k], v) for k, v in saved["model"].items())
    assert main(["export-safetensors", str(tmp_path / "c"), str(tmp_path / "m.safetensors"), "--masters"]) == 0
    masters = load_file(tmp_path / "m.safetensors")
    assert all(torch.equal(masters[k], v) for k, v in saved["optimizer"]["master_weights"].items())
