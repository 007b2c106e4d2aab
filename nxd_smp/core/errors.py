"""Every error class nxd_smp raises, defined here once.

A user meets two: a configuration nxd_smp refuses (``ConfigError``) and a checkpoint it refuses
(``CheckpointError``), both ``ValueError``s (a bad value handed in), re-exported by the public modules.
The others narrow them (or, for the ranks' coordination, a ``RuntimeError``), so a caller can tell
the cause apart; each part raises the class of its cause from here.

Which error user input gets (docs/design.md, "Errors"): a value of the right type that nxd_smp refuses
is a ``ConfigError`` (a checkpoint or a saved state: a ``CheckpointError``); a value of the wrong type
is a ``TypeError``; a call in the wrong state (a lazily built optimizer before ``init_zero()``, a
parameter unfrozen after the build) is a ``RuntimeError``. Every message names the cause and the fix.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value or combination that nxd_smp refuses; the message names the fix."""


class CheckpointError(ValueError):
    """A checkpoint (or a saved state) that is incomplete, damaged, refused (it asks to run code,
    reads outside its folder, claims more memory than it holds), or does not fit the model or the
    optimizer; the message names the file or the field and the fix."""


class ChecksumError(CheckpointError):
    """The bytes read back are not the bytes written (CRC-32 mismatch, truncation)."""


class UnsafeFileError(CheckpointError):
    """A file asks to build an object that loading must not build (it could run code or allocate
    more than the file holds)."""


class BudgetError(CheckpointError):
    """A parse asked for more memory or work than its file's size allows: a crafted (or damaged)
    file. The message names the file, the budget and what its size allowed."""


class LostCommitError(CheckpointError):
    """A save to object storage found its commit record taken by another save of the same checkpoint
    name (another job): it is certainly not committed."""


class NotCommittedError(CheckpointError):
    """A checkpoint name on object storage with versions but no commit record: its saves were cut off
    before their commit."""


class CoordinationError(RuntimeError):
    """A rank did not take part in an exchange (it failed, or it waited past the timeout)."""
