"""Progress shown on long work (checkpoint saves and loads): each phase logged, and a tqdm
bar on rank 0 when asked for (or when the logger is at INFO); for the bytes a save writes (to
disk, or uploads to object storage), a bar in bytes."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager


@contextmanager
def phases(
    enabled: bool | None, rank: int, names: Sequence[str], desc: str, log: logging.Logger
) -> Iterator[Callable[[str], None]]:
    """Yields ``advance(name)``, which logs each phase on ``log`` and, on rank 0 when
    ``enabled`` (None: ``log`` is at INFO or below), moves a tqdm bar of ``len(names)`` steps."""
    if enabled is None:
        enabled = log.isEnabledFor(logging.INFO)
    bar = None
    if enabled and rank == 0:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(names), desc=desc, unit="step")

    def advance(name: str) -> None:
        log.info("%s: %s", desc, name)
        if bar is not None:
            bar.set_postfix_str(name)
            bar.update(1)

    try:
        yield advance
    finally:
        if bar is not None:
            bar.close()


@contextmanager
def transfer(
    enabled: bool | None, rank: int, total: int, desc: str, log: logging.Logger
) -> Iterator[Callable[[int], None]]:
    """Yields ``moved(n)``, told of every ``n`` bytes moved (from any thread), which moves a tqdm bar of
    ``total`` bytes on rank 0 when ``enabled`` (None: ``log`` is at INFO or below); the start and the end
    are logged."""
    if enabled is None:
        enabled = log.isEnabledFor(logging.INFO)
    bar = None
    if enabled and rank == 0:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024)
    log.info("%s: %d bytes", desc, total)
    try:
        yield (lambda n: bar.update(n)) if bar is not None else (lambda n: None)
    finally:
        if bar is not None:
            bar.close()
        log.info("%s: done", desc)
