"""The command line: ``python -m nxd_smp inspect|consolidate|export-xla|export-torch|export-safetensors ...``."""

from __future__ import annotations

import argparse
import json
import sys

from .checkpoint import CheckpointError, consolidate, inspect_checkpoint
from .interop.native_torch import export_safetensors, export_torch
from .interop.torch_xla import export_xla



def main(argv: list[str] | None = None, prog: str = "python -m nxd_smp") -> int:
    """The command line: ``inspect``, ``consolidate``, ``export-xla``, ``export-torch`` and
    ``export-safetensors``; returns the exit code."""
    parser = argparse.ArgumentParser(prog=prog, description="Inspect or convert nxd_smp checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="print what a checkpoint holds")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--verify", action="store_true", help="also check the size and CRC-32 of every file")
    p = sub.add_parser("consolidate", help="write a plain per-parameter state dict (torch.save)")
    p.add_argument("path")
    p.add_argument("out")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p = sub.add_parser("export-xla", help="write torch_xla/NxD ZeRO-1 per-rank optimizer files")
    p.add_argument("path")
    p.add_argument("out_dir")
    p.add_argument("--dp-size", type=int, required=True, help="data-parallel size to shard for")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR as a whole")
    p = sub.add_parser("export-torch", help="write a torch.distributed.checkpoint directory in "
                       "get_state_dict(model, optimizer)'s layout, for native PyTorch")
    p.add_argument("path")
    p.add_argument("out_dir")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR as a whole")
    p = sub.add_parser("export-safetensors", help="write the model weights as one safetensors file")
    p.add_argument("path")
    p.add_argument("out_file")
    p.add_argument("--masters", action="store_true", help="the fp32 master weights instead of the saved parameters")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT_FILE")
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            info = inspect_checkpoint(args.path, verify=args.verify)
            if args.json:
                print(json.dumps(info, indent=2, default=str))
                return 0
            opt = info["optimizer"]
            print(f"checkpoint  {info['path']}")
            print(f"on disk     {info['bytes_on_disk'] / 2**20:.1f} MiB ({info['format']})"
                  + (", every file checked" if args.verify else ""))
            print(f"objects     {', '.join(info['stateful']) or 'none'}")
            if opt is None:
                print("optimizer   none")
            else:
                print(f"optimizer   {opt['inner_class']}, written at DP size {opt['dp_size_written_at']}, "
                      f"master weights {'yes' if opt['master_weights'] else 'no'}, "
                      f"state {opt['state_keys']}")
            width = max(len(k) for k in info["tensors"])
            print(f"{'tensor':<{width}}  {'shape':<20} {'dtype':<16} bytes")
            for key, t in info["tensors"].items():
                print(f"{key:<{width}}  {str(tuple(t['shape'])):<20} {t['dtype']:<16} {t['bytes']}")
        elif args.command == "consolidate":
            consolidate(args.path, args.out, overwrite=args.overwrite)
            print(f"wrote {args.out}")
        elif args.command == "export-torch":
            print(f"wrote {export_torch(args.path, args.out_dir, overwrite=args.overwrite)}")
        elif args.command == "export-safetensors":
            out = export_safetensors(args.path, args.out_file, masters=args.masters, overwrite=args.overwrite)
            print(f"wrote {out}")
        else:
            for f in export_xla(args.path, args.out_dir, args.dp_size, overwrite=args.overwrite):
                print(f"wrote {f}")
    except Exception as e:  # a bad path, a bad checkpoint, a missing package: one line, never a traceback
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    return 0


def _one_line(error: Exception) -> str:
    """The error's message on one line, with its type's name where the message alone may not
    say what went wrong (anything but our refusals, a missing file, a missing package)."""
    text = " ".join(str(error).split())
    if isinstance(error, (CheckpointError, FileNotFoundError, ImportError)):
        return text
    return f"{type(error).__name__}: {text}"


if __name__ == "__main__":
    sys.exit(main())
