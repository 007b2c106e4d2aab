"""The two errors a user meets: a configuration nxd_smp refuses, and a checkpoint it refuses.

Both are ``ValueError``s (a bad value handed in), defined here once; every part raises these
classes, and the public modules re-export them.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value or combination that nxd_smp refuses; the message names the fix."""


class CheckpointError(ValueError):
    """A checkpoint (or a saved state) that is incomplete, damaged, refused (it asks to run code,
    reads outside its folder, claims more memory than it holds), or does not fit the model or the
    optimizer; the message names the file or the field and the fix."""
