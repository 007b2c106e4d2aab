"""Part of the checkpoint format, not an import path: format 2's index (``.metadata``) pickles each
record as ``nxd_smp.checkpoint_storage.RawItem``, the class's home when the format was made, and
every release reads it by that name. ``RawItem`` lives in ``nxd_smp.checkpointing.dcp_index``; this
module gives it its name, so that pickling a format-2 index (the tests rewrite fresh checkpoints in
the previous format to attack it) names it as that format does. Format 3 pickles nothing. It stays
as long as format 2 is read.
"""

from .checkpointing.dcp_index import RawItem  # noqa: F401 - (its name on disk)

__all__: list[str] = []
