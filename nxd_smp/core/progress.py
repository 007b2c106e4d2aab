"""Progress shown on long work (checkpoint saves and loads): each phase logged, and a tqdm
bar on rank 0 when asked for (or when the logger is at INFO)."""

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
