"""Where a checkpoint is: the one door a user's path or URL comes in by (``location_of``), and the store
that holds checkpoints there (``open_store``): a local directory (``versions.LocalStore``) or an S3
prefix (``object_store.ObjectStore``).

``s3://bucket/prefix`` is object storage; so is ``s3:/bucket/prefix``, which is what ``pathlib.Path``
makes of it (it folds ``//``), as NxD's scripts often pass it. Any other URL scheme (``gs://``,
``hdfs://``, ``http://``, ``file://``, ...) is refused by name, never made into a local folder
(``files.local_path``).
"""

from __future__ import annotations

import os
from pathlib import Path

from .files import Folder, local_path, url_scheme
from .object_io import S3Path, require_boto3
from .object_store import ObjectStore
from .room import Store
from .versions import LocalStore


def location_of(path: str | os.PathLike | S3Path, what: str = "path") -> Path | S3Path:
    """``path`` (a user's checkpoint path or directory) as a local ``Path`` or an ``S3Path``.

    Raises:
        TypeError: ``path`` is not a str or an ``os.PathLike`` of a str.
        ConfigError: a URL of another scheme than ``s3``, an S3 URL that names no bucket and prefix, or an S3
            URL without boto3 installed (naming the install line).
    """
    if isinstance(path, S3Path):
        return path
    if isinstance(path, (str, os.PathLike)):
        text = os.fspath(path)
        if isinstance(text, str):
            as_url = text if url_scheme(text) else str(Path(text))  # (``./s3:/x``, which Path folds to ``s3:/x``)
            if url_scheme(as_url) == "s3":
                found = S3Path.parse(as_url, what)
                require_boto3()
                return found
    return local_path(path, what)


def open_store(location: Path | S3Path | str, *, create: bool = False) -> Store:
    """The store of checkpoints at ``location`` (``location_of``'s, or its ``str``), opened; ``create``: a
    local directory is made where missing (an S3 prefix needs no making; its bucket must exist).

    Raises:
        FileNotFoundError: a local directory that does not exist (and not ``create``).
        ConfigError: S3 without the ``s3`` extra installed, naming the install line.
    """
    if isinstance(location, str) and location.startswith("s3://"):  # (a store's own ``where()``: maybe a bucket)
        location = S3Path.parse(location, bucket_alone=True)
    location = location_of(location)
    if isinstance(location, S3Path):
        return ObjectStore(location)
    return LocalStore(Folder.open(location, create=create))
