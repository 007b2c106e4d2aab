"""The command line: ``python -m nxd_smp inspect|consolidate|export-xla|export-torch|export-safetensors ...``.

Every line it prints (the table, ``wrote ...``, ``error: ...``, warnings) holds strings from a
checkpoint, which may be crafted: their control characters and bidirectional overrides are
printed escaped (``_printable``), so nothing from a checkpoint can drive the terminal (clear it,
retitle it, write the clipboard, forge a line). ``--json`` is escaped by ``json.dumps`` itself
(ASCII only).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings

from .checkpoint import CheckpointError, consolidate, inspect_checkpoint
from .core.errors import ConfigError
from .interop.native_torch import export_safetensors, export_torch
from .interop.torch_xla import export_xla

#: What a terminal acts on instead of showing: C0 controls (newline and tab too: one value, one
#: line), DEL, C1 controls (0x9b is CSI on some terminals), and the Unicode bidirectional
#: embeddings, overrides and isolates that reorder what is shown.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _printable(text: object) -> str:
    """``text`` with every character a terminal would act on written as its escape (``\\x1b``,
    ``\\u202e``)."""
    return _UNPRINTABLE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                            else f"\\u{ord(m.group()):04x}", str(text))


def _say(text: object = "", *, file=None) -> None:
    """Print one line of output, escaped (``_printable``)."""
    print(_printable(text), file=file if file is not None else sys.stdout)


def _checkpoints(paths: list[str]) -> str | list[str]:
    """An export's checkpoint argument from PATH [PATH ...]: one path, or a DTensor model's coordinates."""
    return paths[0] if len(paths) == 1 else paths


def _warn(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings (their messages name checkpoint contents) as one escaped line on stderr."""
    _say(f"warning: {' '.join(str(message).split())}", file=sys.stderr)


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
    p.add_argument("path", nargs="+", help="a checkpoint, or a DTensor model's checkpoints of every "
                   "tensor-parallel coordinate in rank order (joined into whole tensors)")
    p.add_argument("out_dir")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR as a whole")
    p = sub.add_parser("export-safetensors", help="write the model weights as one safetensors file")
    p.add_argument("path", nargs="+", help="a checkpoint, or a DTensor model's checkpoints of every "
                   "tensor-parallel coordinate in rank order (joined into whole tensors)")
    p.add_argument("out_file")
    p.add_argument("--masters", action="store_true", help="the fp32 master weights instead of the saved parameters")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT_FILE")
    args = parser.parse_args(argv)
    with warnings.catch_warnings():
        warnings.showwarning = _warn
        try:
            _run(args)
        except Exception as e:  # a bad path, a bad checkpoint, a missing package: one line, never a traceback
            _say(f"error: {_one_line(e)}", file=sys.stderr)
            return 2
    return 0


def _run(args: argparse.Namespace) -> None:
    """The command ``args`` names; every line through ``_say``."""
    if args.command == "inspect":
        info = inspect_checkpoint(args.path, verify=args.verify)
        if args.json:
            print(json.dumps(info, indent=2, default=str))  # (ensure_ascii: every control escaped)
            return
        opt = info["optimizer"]
        _say(f"checkpoint  {info['path']}")
        _say(f"on disk     {info['bytes_on_disk'] / 2**20:.1f} MiB ({info['format']})"
             + (", every file checked" if args.verify else ""))
        _say(f"objects     {', '.join(info['stateful']) or 'none'}")
        if opt is None:
            _say("optimizer   none")
        else:
            _say(f"optimizer   {opt['inner_class']}, written at DP size {opt['dp_size_written_at']}, "
                 f"master weights {'yes' if opt['master_weights'] else 'no'}, "
                 f"state {opt['state_keys']}")
        keys = {_printable(key): t for key, t in info["tensors"].items()}  # (escaped first: the widths)
        width = max((len(k) for k in keys), default=6)
        _say(f"{'tensor':<{width}}  {'shape':<20} {'dtype':<16} bytes")
        for key, t in keys.items():
            _say(f"{key:<{width}}  {str(tuple(t['shape'])):<20} {t['dtype']:<16} {t['bytes']}")
    elif args.command == "consolidate":
        consolidate(args.path, args.out, overwrite=args.overwrite)
        _say(f"wrote {args.out}")
    elif args.command == "export-torch":
        _say(f"wrote {export_torch(_checkpoints(args.path), args.out_dir, overwrite=args.overwrite)}")
    elif args.command == "export-safetensors":
        written = export_safetensors(_checkpoints(args.path), args.out_file, masters=args.masters,
                                     overwrite=args.overwrite)
        _say(f"wrote {written}")
    else:
        for f in export_xla(args.path, args.out_dir, args.dp_size, overwrite=args.overwrite):
            _say(f"wrote {f}")


def _one_line(error: Exception) -> str:
    """The error's message on one line, with its type's name where the message alone may not
    say what went wrong (anything but our refusals of a checkpoint or a value, such as a URL given
    as a path, a missing file, a missing package)."""
    text = " ".join(str(error).split())
    if isinstance(error, (CheckpointError, ConfigError, FileNotFoundError, ImportError)):
        return text
    return f"{type(error).__name__}: {text}"


if __name__ == "__main__":
    sys.exit(main())
