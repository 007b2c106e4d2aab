"""Memory per parameter as a slope (docs/design.md, "How performance is measured"): peak resident
bytes at two model sizes, each in processes of its own, difference over difference.

A slope says something only where the two sizes differ by more than the meter's noise: peak RSS
moves by allocator arenas and whole pages (a few MiB) whatever the model, so over a few thousand
parameters it came out 0 or negative, and a ratio against it inf. The benchmarks therefore refuse
sizes closer than ``MIN_PARAMS`` apart, before they run, instead of dividing by noise.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

#: The least difference in parameters between the two sizes: at 1M parameters even 1 byte per
#: parameter is a MiB, above the meter's noise.
MIN_PARAMS = 1 << 20


def rss_bytes(field: str) -> int:
    """``VmRSS`` or ``VmHWM`` (the peak) of this process, in bytes (Linux's /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def check_sizes(small_params: int, large_params: int) -> None:
    """Raise unless the two model sizes are far enough apart for a slope.

    Raises:
        ValueError: naming the sizes and the fix.
    """
    if large_params - small_params < MIN_PARAMS:
        raise ValueError(
            f"the two model sizes differ by {large_params - small_params:,} parameters ({small_params:,} and "
            f"{large_params:,}), which peak RSS cannot resolve (its noise is a few MiB); choose sizes at least "
            f"{MIN_PARAMS:,} parameters apart (a larger --params, --width or second --layers)."
        )


def check_depths(parser: argparse.ArgumentParser, width: int, depths: Sequence[int]) -> None:
    """``parser.error`` unless the benchmarks' MLPs at the two ``depths`` (layers of a ``width`` x
    ``width`` weight and a bias) are far enough apart for a slope (``check_sizes``)."""
    try:
        check_sizes(*(depth * (width * width + width) for depth in depths))
    except ValueError as e:
        parser.error(str(e))


def slope(small_bytes: int, small_params: int, large_bytes: int, large_params: int, per: int = 1) -> float:
    """Bytes per parameter (and per rank: ``per``) between the two sizes.

    Raises:
        ValueError: the sizes are too close (``check_sizes``).
    """
    check_sizes(small_params, large_params)
    return (large_bytes - small_bytes) / (large_params - small_params) / per
