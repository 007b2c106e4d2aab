"""A checkpoint of today rewritten as the previous release wrote it (format 2), so that the attacks
on that format's pickled files keep a healthy folder to start from.

Format 2 held the same raw tensor files, but its index was DCP's ``Metadata`` pickled with
nxd_smp's ``RawItem`` records (``.metadata``) and its small files were ``torch.save`` files
(``nxd_smp_meta.pt``, ``extra.pt``). ``tests/fixtures/format2`` is a checkpoint that release wrote
itself; this rewrite lets a test start from any model, optimizer and scheduler of its own. The
test ``test_a_rewritten_checkpoint_is_what_format_2_wrote`` keeps the two in step.
"""

from __future__ import annotations

import json
import pickle
import zlib
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from nxd_smp.checkpointing import format as fmt
from nxd_smp.checkpointing.dcp_index import METADATA_FILE, RawItem
from nxd_smp.checkpointing.storage import INDEX_FILE, read_index


def index_pickle(entries: dict[str, list]) -> bytes:
    """Format 2's ``.metadata`` for ``entries`` (format 3's JSON index entries)."""
    state, storage = {}, {}
    for key, (file, offset, length, crc, dtype_name, shape) in sorted(entries.items()):
        dtype = getattr(torch, dtype_name)
        size = torch.Size(shape)
        zeros = torch.Size([0] * len(shape))
        state[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), size, [ChunkStorageMetadata(zeros, size)])
        storage[MetadataIndex(key, zeros, 0)] = RawItem(file, offset, length, crc, dtype, tuple(shape))
    return pickle.dumps(Metadata(state_dict_metadata=state, storage_data=storage))


def to_format_2(path: Path) -> Path:
    """Rewrite the checkpoint ``path`` (a link to a format-3 version) in place as format 2: the
    same tensor files, a pickled index, ``torch.save`` small files, a completion record listing
    them. Its small files may hold no tensors (the previous release pickled those inline)."""
    version = path.resolve()
    record = json.loads((version / fmt.COMPLETE_FILE).read_text())
    index = read_index(version)
    meta, saved = fmt.read_small_files(version, record, index)
    entries = json.loads((version / INDEX_FILE).read_text())["entries"]
    entries = {k: v for k, v in entries.items() if not k.startswith(fmt.SMALL_PREFIX)}
    meta = {**meta, "format": fmt.FORMAT_V2}
    files = {name: v for name, v in record["files"].items()
             if name not in (INDEX_FILE, fmt.META_FILE, fmt.EXTRA_FILE)}
    for name, data in ((METADATA_FILE, index_pickle(entries)), (fmt.META_FILE_V2, _saved(meta)),
                       (fmt.EXTRA_FILE_V2, _saved(saved))):
        (version / name).write_bytes(data)
        files[name] = [len(data), zlib.crc32(data)]
    for name in (INDEX_FILE, fmt.META_FILE, fmt.EXTRA_FILE):
        (version / name).unlink()
    (version / fmt.COMPLETE_FILE).write_text(json.dumps({**record, "format": fmt.FORMAT_V2, "files": files}))
    return path


def _saved(value) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()
