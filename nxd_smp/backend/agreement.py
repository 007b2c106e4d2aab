"""The one cross-rank agreement: every rank learns whether any rank failed, whatever the failure,
so that either every rank goes on (commits a load, installs a state dict) or none does.

Checkpoint loads (every format), ``load_state_dict`` of a rank-local state and the imports from
other tools all end their checks with ``agree``: after it nothing may fail on one rank alone, since
what follows (publishing the master weights) is a collective that a rank refusing alone would
leave the others waiting in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ..core.errors import CheckpointError
from .coordination import Coordinator


def error_text(error: BaseException) -> str:
    """What a rank tells the others of its failure: a refusal's own message, anything else with its
    type's name."""
    return str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"


T = TypeVar("T")


def agree(coordinator: Coordinator, prepare: Callable[[], tuple[T, Callable[[], None] | None]], *,
          what: str = "the checkpoint") -> T:
    """Every rank of ``coordinator``'s group calls it with its own ``prepare``: this rank's reading
    and checking, which returns its result and the undo of what it changed (None: nothing). If
    ``prepare`` raised on any rank, expected or not, every rank raises a ``CheckpointError`` after
    its undo: its own refusal as it is, any other exception of its own wrapped, or the other ranks'
    failures. Else every rank gets its result. ``what``: what was being loaded, named in the errors.

    Any failure is told, ``BaseException`` included: a rank that stops (``KeyboardInterrupt``,
    ``SystemExit``, a test's ``pytest.fail``) tells the others before it goes, so none waits for it
    in the collective that would follow, and it then raises its own exception as it is."""
    result: Any = None
    error: BaseException | None = None
    undo = None
    try:
        result, undo = prepare()
    except BaseException as e:  # noqa: BLE001 - every rank learns of any failure
        error = e
    failures = [f for f in coordinator.all_gather(None if error is None else error_text(error)) if f]
    if error is None and not failures:
        return result
    if undo is not None:
        undo()
    if isinstance(error, CheckpointError) or (error is not None and not isinstance(error, Exception)):
        raise error
    if error is not None:
        raise CheckpointError(f"{what} could not be loaded: {error_text(error)}") from error
    raise CheckpointError(f"another rank could not load {what}, so this one loads nothing either: "
                          + "; ".join(failures))
