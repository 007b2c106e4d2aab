"""The storage interface: what nxd_smp's checkpoints need of where they are kept, with two
implementations, the local room on directory descriptors (``files.Folder``, ``versions.LocalStore``)
and object storage (``object_store``: ``s3://``, through boto3).

Two parts, one per job:

* a ``Room`` is one folder's files (a version being written or read): create a file and write it
  whole, read a file or a range of it, a file's size, durability. nxd_smp's format (``storage``,
  ``smp_format``) reads and writes through it and knows nothing of where the bytes go;
* a ``Store`` is a root of checkpoints (a local directory, an S3 prefix): it makes a version for a
  save, commits it atomically as the checkpoint's name, applies the retention, says which complete
  version a name means and opens it, and removes a checkpoint. Each implementation keeps its own
  protocol for the commit (a link swapped by ``rename(2)`` on disk; a manifest written with a
  conditional PUT on S3), and both keep the same promises: at every instant a name means a complete
  checkpoint or none, a save cut off leaves the previous one, a removal or retention never leaves
  something that looks complete, and "newest" is the store's own order of commits, never a time a
  file claims.

Every value the save's ranks exchange about a version (``begin``'s answer, ``locate``'s) is JSON: rank 0
decides it and every rank opens the same version from it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, BinaryIO, Hashable


@dataclass(frozen=True)
class FileStat:
    """What a reader checks of a file before reading it: which file it is (two names of one file are
    one), its size, and whether it is a plain file (a link, a FIFO or a directory is refused)."""

    identity: Hashable
    size: int
    regular: bool


class Room(ABC):
    """One folder's files: names are relative paths of plain components (``files.check_name``)."""

    @abstractmethod
    def where(self, name: str = "") -> Any:
        """Where ``name`` is (a path, a URL), for messages."""

    @abstractmethod
    def exists(self, name: str) -> bool:
        """Whether something is at ``name``."""

    @abstractmethod
    def stat_file(self, name: str) -> FileStat | None:
        """``name``'s identity, size and kind, None if nothing is there."""

    @abstractmethod
    def is_file(self, name: str) -> bool:
        """Whether ``name`` is a plain file."""

    @abstractmethod
    def is_dir(self, name: str) -> bool:
        """Whether ``name`` is a folder (holds files)."""

    @abstractmethod
    def names(self) -> list[str]:
        """The names in this folder (files and folders, one level), sorted."""

    @abstractmethod
    def sub(self, name: str, *, source: str | None = None) -> Room:
        """The folder ``name`` below this one.

        Raises:
            CheckpointError: missing, or not a folder (a link is never followed); naming it.
        """

    @abstractmethod
    def opened_stat(self, file: BinaryIO) -> FileStat:
        """What ``file`` (``open_file``'s) is: the file itself, not what its name means now."""

    @abstractmethod
    def tree_size(self) -> int:
        """The bytes of every file in the folder and below it."""

    @abstractmethod
    def open_file(self, name: str, *, source: str | None = None) -> BinaryIO:
        """The file ``name`` for reading: ``seek``, ``readinto``, ``read``, ``close``; a context manager.

        Raises:
            CheckpointError: missing, or not a plain file; naming it (and ``source``, what named it).
        """

    @abstractmethod
    def read_bytes(self, name: str, *, limit: int, source: str | None = None) -> bytes:
        """The bytes of the file ``name``, refused if it holds more than ``limit``."""

    @abstractmethod
    def create(self, name: str) -> BinaryIO:
        """A new file ``name`` for writing: ``write`` (may take fewer bytes than given), a context manager
        whose normal exit keeps the file and whose exit on an exception need not."""

    @abstractmethod
    def sync_file(self, file: BinaryIO) -> None:
        """Make what was written to ``file`` (``create``'s) durable before it is closed."""

    @abstractmethod
    def write_bytes(self, name: str, data: bytes | memoryview, *, sync: bool = True) -> None:
        """``data`` as the new file ``name``, durable when this returns unless not ``sync``."""

    @abstractmethod
    def fsync(self) -> None:
        """Make the folder's new names durable."""

    @abstractmethod
    def dup(self) -> Room:
        """An independent handle of the same folder, for a thread that may outlive this one's."""

    @abstractmethod
    def close(self) -> None:
        """Release the handle (a closed room is not used again)."""

    def __enter__(self) -> Room:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Store(ABC):
    """A root of checkpoints, each known by a plain name (``versions.is_link_name``)."""

    @abstractmethod
    def where(self, name: str = "") -> Any:
        """Where the checkpoint ``name`` (or the root) is, for messages."""

    @abstractmethod
    def begin(self, name: str) -> list:
        """Rank 0: a new version for a save of ``name``, as a JSON value every rank opens it by
        (``open_version``) and the commit takes back (``publish``); its first item is the version's
        path relative to the root.

        Raises:
            CheckpointError: ``name`` is taken by something a checkpoint may not replace.
        """

    @abstractmethod
    def open_version(self, begun: list) -> Room:
        """Every rank: the version ``begin`` made, to write into, checked to be that very one.

        Raises:
            CheckpointError: it is not (replaced, gone).
        """

    @abstractmethod
    def publish(self, name: str, begun: list, version: Room, completion: bytes) -> None:
        """Rank 0, once every rank's files are written into ``version`` (``open_version``'s): write the
        completion record ``completion`` (``smp_format.completion_bytes``) and commit the version ``begin``
        made as ``name``, atomically; then remove what it replaced (a failure there is a warning: the
        save stands).

        Raises:
            CheckpointError: nothing was committed (the version was swapped, another job committed first).
        """

    @abstractmethod
    def discard(self, begun: list) -> None:
        """Rank 0, once a rank's write failed (every rank has stopped writing): remove the version ``begin``
        made; what cannot be removed is left with a warning (the next save of its name removes it)."""

    @abstractmethod
    def retain(self, keep: int, newest: str) -> None:
        """Remove all but the newest ``keep`` checkpoints this store committed, never ``newest``; warns,
        never raises (it runs after the publish)."""

    @abstractmethod
    def locate(self, name: str) -> list:
        """The complete version ``name`` means (the checkpoint, or, for a folder of checkpoints, its newest),
        as a JSON value ``open_located`` takes.

        Raises:
            FileNotFoundError: nothing at ``name``.
            CheckpointError: nothing complete there, naming why.
        """

    @abstractmethod
    def open_located(self, location: list) -> Room:
        """The version ``locate`` found, to read."""

    @abstractmethod
    def is_checkpoint(self, name: str) -> bool:
        """Whether ``name`` is a checkpoint of this store, complete or not (a save of it was begun)."""

    @abstractmethod
    def has_checkpoints(self) -> bool:
        """Whether the root holds a complete checkpoint."""

    @abstractmethod
    def remove(self, name: str) -> None:
        """Remove the checkpoint ``name`` (nothing there: nothing to do), first what makes it complete.

        Raises:
            CheckpointError: something at ``name`` is not a checkpoint; it is left alone.
        """

    @abstractmethod
    def dup(self) -> Store:
        """An independent handle of the same root, for a thread that may outlive this one's."""

    @abstractmethod
    def close(self) -> None:
        """Release the handle."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
