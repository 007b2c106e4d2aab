"""The ranks' two ways of deciding together, each in one place: rank 0 decides for all (``decide``),
and every rank agrees that each may go on (``agree``).

* ``decide``: rank 0 runs a choice (which checkpoint a path means, the name of a new version, whether
  a save may start) and every rank gets its result, or every rank raises its error (a missing path
  as ``FileNotFoundError``, a wrong argument as ``TypeError``, anything else as ``CheckpointError``).
  One encoding, whatever the coordinator.
* ``agree``: every rank prepares (reads, checks, stages what it can undo) and all learn every rank's
  outcome, world-wide, so that tensor- and pipeline-parallel peers refuse together; and within each
  data-parallel group the ranks compare a digest of what must be equal across the group
  (hyperparameters, step counters, the loss scaler, the scheduler, the checksums of replicated
  tensors), so that ranks that would install different values refuse together instead of training
  their shards with different hyperparameters.
* ``settle``: after ``agree``, every rank does what is left that could still fail (copying the model's
  weights in, through whatever hooks the model has) and all learn every rank's outcome before anything
  collective follows (publishing the master weights): a failure on one rank is every rank's, at once,
  never a rank waiting in a collective that another rank will not join.

Checkpoint loads (every format), ``load_state_dict`` and the imports from other tools end their
checks with ``agree`` and their installs with ``settle``; saves decide with ``decide``. Payloads are
JSON values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from ..core.errors import CheckpointError
from .coordination import Coordinator


def error_text(error: BaseException) -> str:
    """What a rank tells the others of its failure: a refusal's own message, anything else with its
    type's name."""
    return str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"


T = TypeVar("T")

#: The exceptions ``decide`` carries from rank 0 to the others by kind, and the kind of any other.
_KINDS: dict[str, type[Exception]] = {"missing": FileNotFoundError, "type": TypeError, "refused": CheckpointError}


def decide(coordinator: Coordinator, choose: Callable[..., T], *args: Any) -> T:
    """Rank 0 of ``coordinator``'s group runs ``choose(*args)`` (its result a JSON value) and every rank
    returns that result; if it raised, every rank raises: ``FileNotFoundError`` and ``TypeError`` as
    such, anything else as a ``CheckpointError`` with its text. Every rank of the group calls it.
    A rank 0 stopped by a ``BaseException`` tells the others (a refusal) and raises its own."""
    outcome: Any = None
    stop: BaseException | None = None
    if coordinator.rank == 0:
        try:
            outcome = {"value": choose(*args)}
        except FileNotFoundError as e:
            outcome = {"error": "missing", "message": str(e)}
        except TypeError as e:
            outcome = {"error": "type", "message": str(e)}
        except BaseException as e:  # noqa: BLE001 - every rank learns of any failure
            outcome = {"error": "refused", "message": error_text(e)}
            stop = None if isinstance(e, Exception) else e
    outcome = coordinator.broadcast(outcome)
    if stop is not None:
        raise stop
    if "error" in outcome:
        raise _KINDS.get(outcome["error"], CheckpointError)(outcome["message"])
    return outcome["value"]


def agree(coordinator: Coordinator, prepare: Callable[[], tuple[T, Callable[[], None] | None, Mapping[str, str]]],
          *, what: str = "the checkpoint", group: Sequence[int] | None = None) -> T:
    """Every rank of ``coordinator``'s group (the world: every rank that loads) calls it with its own
    ``prepare``: this rank's reading, checking and staging, which returns its result, the undo of
    what it changed (None: nothing) and its digest (``{part: fingerprint}``: what must be equal
    across its data-parallel ``group``, a list of global ranks).

    If ``prepare`` raised on any rank, expected or not, every rank undoes and raises a
    ``CheckpointError``: its own refusal as it is, any other exception of its own wrapped, or the other
    ranks' failures. If two ranks of one data-parallel group return different digests, every rank
    undoes and raises a ``CheckpointError`` naming the group and the parts that differ. Else every
    rank gets its result. ``what``: what was being loaded, named in the errors.

    Any failure is told, ``BaseException`` included: a rank that stops (``KeyboardInterrupt``, a
    test's ``pytest.fail``) tells the others before it goes, so none waits for it in the collective
    that would follow, and it then raises its own exception as it is."""
    result: Any = None
    error: BaseException | None = None
    undo = None
    digest: Mapping[str, str] = {}
    try:
        result, undo, digest = prepare()
    except BaseException as e:  # noqa: BLE001 - every rank learns of any failure
        error = e
    mine = {"error": None if error is None else error_text(error),
            "group": None if group is None else list(group), "digest": dict(digest or {})}
    try:
        gathered = coordinator.all_gather(mine)
    except BaseException:  # (the exchange itself failed: this rank puts back what it changed, and says why)
        if undo is not None:
            undo()
        raise
    failures = [part["error"] for part in gathered if part["error"]]
    differ = _differences(gathered) if error is None and not failures else None
    if error is None and not failures and differ is None:
        return result
    if undo is not None:
        undo()
    if isinstance(error, CheckpointError) or (error is not None and not isinstance(error, Exception)):
        raise error
    if error is not None:
        raise CheckpointError(f"{what} could not be loaded: {error_text(error)}") from error
    if differ is not None:
        raise CheckpointError(f"{what} was refused: {differ}")
    raise CheckpointError(f"another rank could not load {what}, so this one loads nothing either: "
                          + "; ".join(failures))


def _differences(gathered: Sequence[Mapping[str, Any]]) -> str | None:
    """The first data-parallel group whose ranks' digests differ, with the parts that differ; None if
    every group agrees."""
    by_group: dict[str, list[tuple[int, dict[str, str]]]] = {}
    for index, part in enumerate(gathered):
        if part["group"] is not None:
            by_group.setdefault(repr(part["group"]), []).append((index, part["digest"]))
    for key, members in by_group.items():
        first_rank, first = members[0]
        for rank, digest in members[1:]:
            parts = sorted(k for k in set(first) | set(digest) if first.get(k) != digest.get(k))
            if parts:
                return (f"the data-parallel ranks {key} would install different values ({', '.join(parts)} differ "
                        f"between world ranks {first_rank} and {rank}): each rank's files must hold the same "
                        f"hyperparameters, step counters, loss scale, scheduler and replicated tensors, and here they "
                        f"do not (files from two saves, or altered). Nothing was loaded on any rank")
    return None


def settle(coordinator: Coordinator, act: Callable[[], T], *, what: str, undo: Callable[[], None] | None = None,
           consequence: str = "") -> T:
    """Every rank of ``coordinator``'s group runs its own ``act`` (what is left of an install once the ranks
    agreed: local work that can still fail) and all learn every rank's outcome; returns ``act``'s result
    where it succeeded on every rank. Where it failed on any rank, every rank runs ``undo`` (what can still
    be put back) and raises a ``CheckpointError`` naming each failed rank and its error, then
    ``consequence`` (what is left changed, and what to do). A rank stopped by a ``BaseException`` tells
    the others first and raises its own."""
    result: Any = None
    error: BaseException | None = None
    try:
        result = act()
    except BaseException as e:  # noqa: BLE001 - every rank learns of any failure
        error = e
    try:
        gathered = coordinator.all_gather(None if error is None else error_text(error))
    except BaseException:  # (the exchange itself failed: put back what can be, and say why)
        if undo is not None:
            undo()
        raise
    failures = [f"rank {rank}: {text}" for rank, text in enumerate(gathered) if text is not None]
    if not failures:
        return result
    if undo is not None:
        undo()
    if error is not None and not isinstance(error, Exception):
        raise error
    raise CheckpointError(f"{what} failed after every rank had agreed to load it ({'; '.join(failures)})."
                          + (f" {consequence}" if consequence else "")) from error
