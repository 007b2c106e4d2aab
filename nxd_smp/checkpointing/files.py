"""The one filesystem room: every open, read, write, rename, link and removal a checkpoint makes
goes through a ``Folder``, a directory descriptor, relative to it.

A checkpoint root is often shared (a team's bucket mount, a scratch directory), and someone else
with write access to it can rename a folder away and plant another one, or a link, under the
same name while a save or a load runs. A path is looked up anew at every call, so a write by path
can land anywhere the planted link points; a descriptor cannot be redirected. So:

* the user's own path is resolved once (its links are the user's), and opened as a directory;
  below it nothing is followed: each further component is opened with ``O_DIRECTORY |
  O_NOFOLLOW`` relative to its parent's descriptor (``Folder.sub``), so a link below the root is
  refused, never followed (``O_NOFOLLOW`` alone covers only a last component);
* new files are created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (nothing planted at the name is
  opened), reads with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO cannot block) and a bound;
* renames, links, removals and link reads are ``*at`` calls on descriptors (``src_dir_fd`` /
  ``dst_dir_fd`` / ``dir_fd``);
* trees are walked (removed, synced, measured) by one loop over directory descriptors
  (``walk_tree``), never by recursion: a link is an entry, never entered; at most
  ``MAX_TREE_DEPTH`` levels below the folder are entered (one descriptor held per level), and what
  lies deeper is left as it is, with one warning naming it;
* writers that only take a path (DCP's ``FileSystemWriter``, ``torch.save``, safetensors) write
  into a fresh ``0700`` staging folder of ours, through ``/proc/self/fd/<n>`` (the descriptor,
  not its name), which is then renamed into place (``write_output_directory``).

Where the platform lacks one of these calls, every operation is refused with a
``CheckpointError`` rather than done by path (``require_descriptors``).

This room is local: a user's path comes in through ``local_path``, which refuses a URL
(``gs://bucket/run``, or the ``gs:/bucket/run`` that ``pathlib`` makes of it) by its scheme
rather than let it become a folder named ``gs:`` on the local disk; object storage is the other
implementation of the storage interface (``room``, ``object_store``).
"""

from __future__ import annotations

import errno
import io
import os
import re
import secrets
import stat
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from ..core.errors import CheckpointError, ConfigError
from .room import FileStat, Room

#: What ``rename(2)`` or ``link(2)`` answer when something is already at the target.
_TAKEN = (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR)
#: What ``link(2)`` answers on a filesystem without hard links.
_NO_HARD_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK)
_READ_CHUNK = 1 << 20
#: A URL's scheme (RFC 3986: a letter, then letters, digits, ``+``, ``-``, ``.``) as a path's first
#: component, ``scheme:`` followed by ``/``: ``s3://bucket/x``, and ``s3:/bucket/x``, which is what
#: ``pathlib.Path("s3://bucket/x")`` makes of it (it folds ``//`` into ``/``).
_URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):/")
#: How many levels below a folder its walks and removals enter. nxd_smp's versions nest none, NxD's tag
#: folders three (``optim/<file>.pt.tensors/tensor_<id>.pt``), DCP's and the exports' none; what lies
#: deeper is left as it is (a tree planted or built by a bug, which a recursion on its depth would
#: not survive). It is also the most descriptors a walk holds open at once.
MAX_TREE_DEPTH = 64


def require_descriptors() -> None:
    """Refuse on a platform without the descriptor-relative calls this room is made of.

    Raises:
        CheckpointError: naming the missing call.
    """
    missing = [name for name, ok in (
        ("O_NOFOLLOW", hasattr(os, "O_NOFOLLOW")), ("O_DIRECTORY", hasattr(os, "O_DIRECTORY")),
        ("open(dir_fd=)", os.open in os.supports_dir_fd), ("mkdir(dir_fd=)", os.mkdir in os.supports_dir_fd),
        ("rename(dir_fd=)", os.rename in os.supports_dir_fd), ("unlink(dir_fd=)", os.unlink in os.supports_dir_fd),
        ("symlink(dir_fd=)", os.symlink in os.supports_dir_fd), ("readlink(dir_fd=)", os.readlink in os.supports_dir_fd),
        ("stat(dir_fd=, follow_symlinks=False)", os.stat in os.supports_dir_fd and os.stat in os.supports_follow_symlinks),
        ("rmdir(dir_fd=)", os.rmdir in os.supports_dir_fd), ("scandir(fd)", os.scandir in os.supports_fd),
        ("/proc/self/fd", os.path.isdir("/proc/self/fd")),
    ) if not ok]
    if missing:
        raise CheckpointError(f"this platform lacks {', '.join(missing)}; nxd_smp reads and writes checkpoints only "
                              f"relative to directory descriptors, and refuses rather than fall back to paths.")


def _kind(mode: int) -> str:
    return ("a link" if stat.S_ISLNK(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a regular file" if stat.S_ISREG(mode) else "something else")


def _one(name: str) -> str:
    """``name`` if it is one plain component (what the ``*at`` calls below take: a ``/`` would have them
    follow the links on its way)."""
    if not isinstance(name, str) or not name or "/" in name or "\0" in name or name in (".", ".."):
        raise CheckpointError(f"{name!r} is not a plain name in a folder; refused.")
    return name


def check_name(name: object, source: str) -> list[str]:
    """``name`` (from a file, an index, a reference) as its components: a relative path of plain
    names, no ``.``, ``..``, empty part or NUL.

    Raises:
        CheckpointError: naming ``source`` and the name.
    """
    if not isinstance(name, str) or not name or "\0" in name:
        raise CheckpointError(f"{source} names a file {name!r}, which is not a path; refused.")
    parts = name.split("/")
    if name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise CheckpointError(f"{source} names the file {name!r} outside its folder; refused (a checkpoint's files are "
                              f"relative paths inside it).")
    return parts


def url_scheme(path: str) -> str | None:
    """The scheme of ``path`` if it is a URL (``"s3"`` for ``s3://bucket/x`` and for the ``s3:/bucket/x``
    pathlib makes of it), else None: a local path (``runs/ckpt``, ``ckpt/step:5``, ``/abs/s3:/x``)."""
    found = _URL_SCHEME.match(path)
    return found.group(1) if found else None


def local_path(path: str | os.PathLike, what: str = "path") -> Path:
    """``path``, a user's path (a checkpoint, a directory of them, an output, a file to import), as a
    local ``Path``: the one door every entry point takes a user's path through, once, before anything
    is read or made.

    This room is the local file system (directory descriptors). A URL handed to ``pathlib`` becomes a
    relative path (``gs://bucket/run`` is ``gs:/bucket/run``): a save would make the folder
    ``./gs:/bucket/run`` on the instance's own disk and report success, and the checkpoint would die
    with the instance. So any ``scheme://`` and its folded ``scheme:/`` form (also as ``pathlib`` reads
    it: ``./gs:/x`` is ``gs:/x``) is refused by name. The checkpoint entry points take ``s3://`` before
    this door (``locations.location_of``); the outputs and the other tools' files (exports, DCP folders,
    the loops' files) are local only. A colon elsewhere (``ckpt/step:5``) is a local name; a local folder
    whose name ends in ``:`` is reached by its absolute path.

    Args:
        path: the user's path.
        what: what the path is, for messages (``"path"``, ``"the output path"``, ...).

    Raises:
        TypeError: ``path`` is not a str or an ``os.PathLike`` of a str.
        ConfigError: ``path`` is a URL; the message names its scheme.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{what} must be a str or os.PathLike, got {type(path).__name__}.")
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a str path, got {type(text).__name__} from {type(path).__name__}.")
    scheme = url_scheme(text) or url_scheme(str(Path(text)))  # (``s3://`` alone; ``./s3:/x``, which Path folds)
    if scheme is not None:
        folded = "" if text.startswith(f"{scheme}://") else " (pathlib.Path folds a URL's '//' into '/')"
        where = ("checkpoints are saved to and loaded from s3:// (save_checkpoint, load_checkpoint and the "
                 "inspecting tools); this one takes a local path" if scheme == "s3"
                 else "nxd_smp stores checkpoints on local paths and s3:// only")
        raise ConfigError(f"{what} {text!r} is a {scheme!r} URL{folded}: {where}. Refused rather than written to a "
                          f"local folder named '{scheme}:'.")
    return Path(text)


class Folder(Room):
    """An open directory: a descriptor and, for messages only, the path it was opened as.

    Every method takes names relative to it (one component, or a relative path walked one
    component at a time without following a link). Close it (or use it as a context manager);
    ``dup()`` gives an independent descriptor of the same directory, for another thread that may
    outlive this one's.
    """

    def __init__(self, fd: int, path: Path):
        self.fd = fd
        self.path = path

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, path: str | os.PathLike, *, create: bool = False) -> Folder:
        """The user's directory ``path``, resolved once (links in it are the user's), opened.
        ``create``: make it and its missing parents first.

        Raises:
            FileNotFoundError: it does not exist (and not ``create``).
            CheckpointError: it is not a directory.
            ConfigError: ``path`` is a URL (``local_path``; the entry points refuse it first).
        """
        require_descriptors()
        path = Path(os.path.realpath(local_path(path, "the folder")))
        if create:
            path.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise FileNotFoundError(f"no checkpoint at {path}: the path does not exist.") from None
        except NotADirectoryError:
            raise CheckpointError(f"{path} is not a directory.") from None
        return cls(fd, path)

    def dup(self) -> Folder:
        return Folder(os.dup(self.fd), self.path)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Folder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except OSError:
            pass

    def where(self, name: str = "") -> Path:
        """The path of ``name`` in this folder, for messages."""
        return self.path / name if name else self.path

    @property
    def fd_path(self) -> str:
        """A path to this directory through its descriptor (``/proc/self/fd/<n>``): for writers that only
        take a path, into a folder of our own that a rename elsewhere cannot redirect."""
        return f"/proc/self/fd/{self.fd}"

    def _walk(self, name: str, source: str | None) -> tuple[int, str, bool]:
        """(descriptor of the folder holding the last component, that component, whether the
        descriptor is a new one to close)."""
        parts = check_name(name, source or str(self.where()))
        fd, own = self.fd, False
        try:
            for part in parts[:-1]:
                try:
                    new = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except OSError as e:
                    raise self._refusal(e, "/".join(parts[: parts.index(part) + 1]), source) from None
                if own:
                    os.close(fd)
                fd, own = new, True
        except BaseException:
            if own:
                os.close(fd)
            raise
        return fd, parts[-1], own

    def _refusal(self, error: OSError, name: str, source: str | None) -> Exception:
        where = self.where(name)
        if error.errno == errno.ENOENT:
            return CheckpointError(f"{where} is missing" + (f" (named by {source})" if source else "") + ".")
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            try:
                kind = _kind(os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode) if "/" not in name else None
            except OSError:
                kind = None
            return CheckpointError(f"{where} is {kind or 'a link or not a directory'}; nxd_smp follows no link inside a "
                                   f"checkpoint's folder. Refused.")
        return CheckpointError(f"{where} cannot be opened: {error.strerror or error}.")

    def sub(self, name: str, *, source: str | None = None) -> Folder:
        """The directory ``name`` below this one, opened without following a link on the way.

        Raises:
            CheckpointError: missing, a link, or not a directory.
        """
        fd, last, own = self._walk(name, source)
        try:
            new = os.open(last, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        except OSError as e:
            raise self._refusal(e, name, source) from None
        finally:
            if own:
                os.close(fd)
        return Folder(new, self.where(name))

    # ------------------------------------------------------------------ reading
    def open_file(self, name: str, *, source: str | None = None) -> io.FileIO:
        """The regular file ``name``, opened for reading, unbuffered: never through a link, never
        blocking on a FIFO; a device or a socket is refused without reading from it.

        Raises:
            CheckpointError: missing, a link, or not a regular file; naming it.
        """
        fd, last, own = self._walk(name, source)
        try:
            file = os.open(last, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
        except OSError as e:
            raise self._refusal(e, name, source) from None
        finally:
            if own:
                os.close(fd)
        mode = os.fstat(file).st_mode
        if not stat.S_ISREG(mode):
            os.close(file)
            raise CheckpointError(f"{self.where(name)} is {_kind(mode)}; a checkpoint's files are regular files. Refused.")
        os.set_blocking(file, True)
        return io.FileIO(file, "rb", closefd=True)

    def read_bytes(self, name: str, *, limit: int, source: str | None = None) -> bytes:
        """The bytes of the regular file ``name``, refused if it holds more than ``limit``.

        Raises:
            CheckpointError: as ``open_file``, or too large; naming the file.
        """
        with self.open_file(name, source=source) as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise CheckpointError(f"{self.where(name)} holds {size} bytes, more than the {limit} such a file may; "
                                      f"refused.")
            data = bytearray()
            while len(data) <= limit and (chunk := f.read(min(_READ_CHUNK, limit + 1 - len(data)))):
                data += chunk
        if len(data) > limit:  # (it grew since)
            raise CheckpointError(f"{self.where(name)} holds more than the {limit} bytes such a file may; refused.")
        return bytes(data)

    def lstat(self, name: str) -> os.stat_result | None:
        """``name``'s own status (a link's, not its target's), None if nothing is there."""
        fd, last, own = self._walk(name, None)
        try:
            return os.stat(last, dir_fd=fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        finally:
            if own:
                os.close(fd)

    def stat_file(self, name: str) -> FileStat | None:
        """``name``'s identity (device, inode), size and whether it is a regular file (a link is not: it is
        never followed); None if nothing is there.

        Raises:
            CheckpointError: a link or a file on the way to it.
        """
        st = self.lstat(name)
        return None if st is None else FileStat((st.st_dev, st.st_ino), st.st_size, stat.S_ISREG(st.st_mode))

    def exists(self, name: str) -> bool:
        """Whether anything (a dangling link included) is at ``name``."""
        try:
            return self.lstat(name) is not None
        except CheckpointError:  # (a link on the way)
            return False

    def is_dir(self, name: str) -> bool:
        found = self._safe_lstat(name)
        return found is not None and stat.S_ISDIR(found.st_mode)

    def is_file(self, name: str) -> bool:
        found = self._safe_lstat(name)
        return found is not None and stat.S_ISREG(found.st_mode)

    def is_link(self, name: str) -> bool:
        found = self._safe_lstat(name)
        return found is not None and stat.S_ISLNK(found.st_mode)

    def _safe_lstat(self, name: str) -> os.stat_result | None:
        try:
            return self.lstat(name)
        except CheckpointError:
            return None

    def readlink(self, name: str) -> str | None:
        """What the link ``name`` says (never followed); None if it is not a link."""
        try:
            return os.readlink(_one(name), dir_fd=self.fd)
        except (OSError, ValueError):
            return None

    def names(self) -> list[str]:
        """The names in this directory, sorted."""
        return sorted(os.listdir(self.fd))

    def identity(self, name: str | None = None) -> tuple[int, int]:
        """(device, inode) of this directory, or of the entry ``name`` in it (not followed)."""
        st = os.fstat(self.fd) if name is None else self.lstat(name)
        if st is None:
            raise CheckpointError(f"{self.where(name or '')} is missing.")
        return st.st_dev, st.st_ino

    def tree_size(self) -> int:
        """The bytes of the regular files in this directory and the directories below it, links
        neither counted nor followed; what lies deeper than ``MAX_TREE_DEPTH`` is not counted (a
        warning says so)."""
        total, left = 0, Left()
        for fd, _, files, _ in walk_tree(self.fd, left):
            for name in files:
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                total += st.st_size if stat.S_ISREG(st.st_mode) else 0
        left.warn(f"the size of {self.where()} leaves out what nxd_smp did not reach")
        return total

    # ------------------------------------------------------------------ writing
    def create(self, name: str, mode: int = 0o666) -> io.FileIO:
        """A new regular file ``name``, opened for writing, unbuffered: made here (``O_EXCL``), never
        through anything planted at its name.

        Raises:
            FileExistsError: something is there.
        """
        fd, last, own = self._walk(name, None)
        try:
            new = os.open(last, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
        finally:
            if own:
                os.close(fd)
        return io.FileIO(new, "wb", closefd=True)

    def write_bytes(self, name: str, data: bytes | memoryview, *, sync: bool = True) -> None:
        """``data`` as the new file ``name`` (``create``), on disk when this returns unless not ``sync``."""
        with self.create(name) as f:
            view = memoryview(data)
            while view:
                view = view[f.write(view):]
            if sync:
                os.fsync(f.fileno())

    def sync_file(self, file: BinaryIO) -> None:
        os.fsync(file.fileno())

    def opened_stat(self, file: BinaryIO) -> FileStat:
        st = os.fstat(file.fileno())
        return FileStat((st.st_dev, st.st_ino), st.st_size, stat.S_ISREG(st.st_mode))

    def mkdir(self, name: str, mode: int = 0o777) -> Folder:
        """A new directory ``name`` (``mkdir(2)``: nothing planted there is reused), opened."""
        fd, last, own = self._walk(name, None)
        try:
            os.mkdir(last, mode, dir_fd=fd)
        finally:
            if own:
                os.close(fd)
        return self.sub(name)

    def makedirs(self, name: str) -> Folder:
        """The directory ``name`` below this one, made where missing (no link followed on the way); ranks
        making the same directory at once all get it."""
        parts = check_name(name, str(self.where()))
        folder = self
        for part in parts:
            try:  # (made here, or by another rank writing into the same folder at the same moment)
                child = folder.mkdir(part)
            except FileExistsError:
                child = folder.sub(part)
            if folder is not self:
                folder.close()
            folder = child
        return folder

    def symlink(self, target: str, name: str) -> None:
        os.symlink(target, _one(name), dir_fd=self.fd)

    def rename(self, name: str, new_name: str, *, into: Folder | None = None) -> None:
        """Rename ``name`` to ``new_name`` (in ``into``, or here), replacing what is there as
        ``rename(2)`` does (a link there is replaced itself, never followed)."""
        os.rename(_one(name), _one(new_name), src_dir_fd=self.fd, dst_dir_fd=(into or self).fd)

    def link_new(self, name: str, new_name: str) -> None:
        """Give the file ``name`` the new name ``new_name`` without clobbering anything there, a
        dangling link included (``link(2)``; where the filesystem has no hard links, checked and
        renamed), then drop ``name``.

        Raises:
            CheckpointError: something took ``new_name``.
        """
        try:
            os.link(_one(name), _one(new_name), src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)
        except OSError as e:
            if e.errno not in _NO_HARD_LINKS:
                raise self.taken(new_name) if e.errno in _TAKEN else e
            if self.exists(new_name):
                raise self.taken(new_name) from None
            self.rename(name, new_name)
            return
        self.unlink(name)

    def taken(self, name: str) -> CheckpointError:
        return CheckpointError(f"{self.where(name)} appeared while the output was being written and was left as it is; "
                               f"pass another path, or overwrite=True (--overwrite) to replace it.")

    def unlink(self, name: str, *, missing_ok: bool = True) -> None:
        try:
            os.unlink(_one(name), dir_fd=self.fd)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def rmdir(self, name: str) -> None:
        os.rmdir(_one(name), dir_fd=self.fd)

    def remove_tree(self, name: str) -> None:
        """Remove ``name`` (a directory and everything below it, or a file or link itself): no
        link is followed, inside or at ``name`` (a link is removed itself); what is already gone is
        no error. Never an ``OSError`` and never a recursion on the tree's depth (``walk_tree``):
        what cannot be removed (deeper than ``MAX_TREE_DEPTH`` below ``name``, or refused by the
        system) is left in place, and one warning names it."""
        found = self._safe_lstat(_one(name))
        if found is None:
            return
        left, lead = Left(), f"{self.where(name)} was removed in part; left in place"
        if stat.S_ISDIR(found.st_mode):
            try:
                top = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
            except FileNotFoundError:
                return
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):  # (else: swapped for a link or a file since)
                    left.failed("", e)
                    left.warn(lead)
                    return
            else:
                try:
                    for fd, path, files, dirs in walk_tree(top, left):
                        for entry in files:
                            _remove_entry(os.unlink, entry, fd, path, left)
                        for entry in dirs:
                            _remove_entry(os.rmdir, entry, fd, path, left)
                finally:
                    os.close(top)
                _remove_entry(os.rmdir, name, self.fd, "", left, top=True)
                left.warn(lead)
                return
        _remove_entry(os.unlink, name, self.fd, "", left, top=True)
        left.warn(lead)

    def fsync(self) -> None:
        os.fsync(self.fd)

    def fsync_tree(self) -> None:
        """fsync every regular file and directory below this one (links not followed), then it;
        what lies deeper than ``MAX_TREE_DEPTH`` is not synced (a warning says so)."""
        left, synced = Left(), False
        for fd, _, files, _ in walk_tree(self.fd, left):
            for name in files:
                try:
                    f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
                except OSError:  # (a link: not ours to sync)
                    continue
                try:
                    if stat.S_ISREG(os.fstat(f).st_mode):
                        os.fsync(f)
                finally:
                    os.close(f)
            os.fsync(fd)
            synced = fd == self.fd
        if not synced:  # (it could not be listed)
            os.fsync(self.fd)
        left.warn(f"{self.where()} was synced in part; not synced")

    def chmod(self, mode: int) -> None:
        os.fchmod(self.fd, mode)


# ---------------------------------------------------------------------------- walking a tree
class Left:
    """What a walk of a tree did not reach or could not remove, told in one warning."""

    def __init__(self) -> None:
        self.deeper: list[str] = []  # folders not entered: deeper than MAX_TREE_DEPTH
        self.failures: list[str] = []  # entries the system refused to open or remove, with why

    def failed(self, path: str, error: OSError) -> None:
        self.failures.append(f"{path or '.'} ({error.strerror or error})")

    def __bool__(self) -> bool:
        return bool(self.deeper or self.failures)

    def warn(self, lead: str) -> None:
        """One warning, if anything was left: ``lead`` (what happened, naming the folder), then what."""
        if not self:
            return
        parts = []
        if self.deeper:
            n = len(self.deeper)
            parts.append(f"{n} folder{'s' if n > 1 else ''} more than {MAX_TREE_DEPTH} levels down, where nxd_smp "
                         f"does not go (the first: {_shown(self.deeper[0])})")
        if self.failures:
            n = len(self.failures)
            parts.append(f"{n} entr{'ies' if n > 1 else 'y'} the system refused (the first: "
                         f"{_shown(self.failures[0])})")
        warnings.warn(f"nxd_smp: {lead}: {'; and '.join(parts)}.", stacklevel=3)


def _shown(path: str) -> str:
    return path if len(path) <= 160 else f"{path[:80]}...{path[-60:]}"


def walk_tree(top: int, left: Left) -> Iterator[tuple[int, str, list[str], list[str]]]:
    """The directories of the tree below the directory descriptor ``top`` (``top`` included), each
    after every directory below it: (its descriptor, its path relative to ``top`` (``""`` for
    ``top``), the names of its entries that are not directories (links included), the names of its
    subdirectories that were walked). A loop over an explicit stack, never a recursion; nothing is
    followed (each directory is opened ``O_DIRECTORY | O_NOFOLLOW`` relative to its parent's
    descriptor, and one swapped for a link meanwhile is an entry like a file); at most
    ``MAX_TREE_DEPTH`` levels below ``top`` are entered, and the folders deeper than that are added
    to ``left`` (with those the system refused to open), not walked. A descriptor is valid until
    the walk moves on; ``top`` stays the caller's."""

    def scan(fd: int) -> tuple[list[str], list[str]]:
        files, dirs = [], []
        with os.scandir(fd) as entries:
            for entry in entries:
                try:
                    is_dir = entry.is_dir(follow_symlinks=False)
                except OSError:
                    is_dir = False
                (dirs if is_dir else files).append(entry.name)
        return files, dirs

    # each level: [descriptor, relative path, entries not directories, directories still to walk, walked]
    try:
        stack: list[list] = [[top, "", *scan(top), []]]
    except OSError as e:
        left.failed("", e)
        return
    try:
        while stack:
            fd, path, files, pending, walked = stack[-1]
            if pending:
                name = pending.pop()
                below = f"{path}/{name}" if path else name
                if len(stack) > MAX_TREE_DEPTH:
                    left.deeper.append(below)
                    continue
                try:
                    sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):  # (swapped for a link or a file since)
                        files.append(name)
                    elif e.errno != errno.ENOENT:
                        left.failed(below, e)
                    continue
                try:
                    stack.append([sub, below, *scan(sub), []])
                except BaseException as e:
                    os.close(sub)
                    if not isinstance(e, OSError):
                        raise
                    left.failed(below, e)
                    continue
                walked.append(name)
                continue
            yield fd, path, files, walked
            stack.pop()
            if fd != top:
                os.close(fd)
    finally:
        for level in stack:
            if level[0] != top:
                os.close(level[0])


def _remove_entry(remove: Callable[..., None], name: str, fd: int, path: str, left: Left, *,
                  top: bool = False) -> None:
    """``remove(name, dir_fd=fd)`` (``os.unlink`` or ``os.rmdir``); what is gone is no error, a folder
    left non-empty by what was left below it is told by that, anything else is added to ``left``."""
    try:
        remove(name, dir_fd=fd)
    except FileNotFoundError:
        pass
    except OSError as e:
        if not (e.errno in (errno.ENOTEMPTY, errno.EEXIST) and left):
            left.failed("" if top else f"{path}/{name}" if path else name, e)


def user_path(path: str | os.PathLike) -> str:
    """The user's own path resolved, once (its links are the user's): what every rank then opens."""
    return os.path.realpath(path)


def entry_kind(path: str | os.PathLike) -> str | None:
    """What is at the user's path ``path`` (its last component not followed): ``"link"``, ``"directory"``,
    ``"file"``, ``"other"``, or None for nothing (or a parent that is not a directory)."""
    try:
        with Folder.open(Path(path).parent) as parent:
            st = parent.lstat(Path(path).name) if Path(path).name not in ("", ".", "..") else os.fstat(parent.fd)
    except (OSError, CheckpointError):
        return None
    if st is None:
        return None
    return ("link" if stat.S_ISLNK(st.st_mode) else "directory" if stat.S_ISDIR(st.st_mode)
            else "file" if stat.S_ISREG(st.st_mode) else "other")


def hidden_name(name: str, kind: str) -> str:
    """A fresh hidden name beside ``name``: ``.<name>.<kind>-<random>``."""
    return f".{name}.{kind}-{secrets.token_hex(6)}"


def umask() -> int:
    """The process's umask, read without changing it where Linux tells it (``/proc``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# ---------------------------------------------------------------------------- outputs
def check_output(out: str | os.PathLike, *, overwrite: bool, directory: bool) -> Path:
    """``out`` as a ``Path`` if an output may be written there, checked without following its last
    component: absent; for a directory output, an empty directory (not a link to one); with
    ``overwrite=True``, anything but a directory for a file output, anything at all for a
    directory output.

    Raises:
        TypeError: ``out`` is not a path, or ``overwrite`` not a bool.
        ConfigError: ``out`` is a URL (``local_path``).
        CheckpointError: something is at ``out`` (named, with the fix); ``out`` names no new entry
            (``.``, ``..``); a parent of ``out`` is a file.
    """
    out = local_path(out, "the output path")
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be True or False, got {overwrite!r}.")
    if out.name in ("", ".", ".."):
        raise CheckpointError(f"{str(out)!r} names no file or directory to write; pass a path ending in a new name.")
    try:
        mode = os.lstat(out).st_mode
    except FileNotFoundError:
        return out
    except NotADirectoryError:
        raise CheckpointError(f"cannot write {out}: a parent of it is not a directory.") from None
    is_dir, is_link = stat.S_ISDIR(mode), stat.S_ISLNK(mode)
    if directory and is_dir and not any(os.scandir(out)):
        return out  # an empty directory is taken
    if not directory and is_dir:
        raise CheckpointError(f"{out} is a directory; pass the path of the file to write.")
    if not overwrite:
        what = "is a symbolic link" if is_link else "exists"
        raise CheckpointError(f"{out} {what}{' and is not an empty directory' if directory else ''}; pass another "
                              f"path, or overwrite=True (--overwrite) to replace it.")
    return out


@contextmanager
def _parent_of(out: Path) -> Iterator[Folder]:
    try:
        parent = Folder.open(out.parent, create=True)
    except (FileExistsError, NotADirectoryError):
        raise CheckpointError(f"cannot write {out}: a parent of it is not a directory.") from None
    with parent:
        yield parent


def write_output_file(out: str | os.PathLike, write: Callable[[BinaryIO], None], *, overwrite: bool) -> Path:
    """Write a file at ``out``: ``write(f)`` fills ``f``, a new file of ours made beside ``out``
    under a hidden name, which is fsynced and moved into place: without ``overwrite`` by
    ``link(2)``, which clobbers nothing that appeared meanwhile; with it by ``rename(2)`` over what
    is there (a link replaced itself). The file gets the default mode (``0o666`` less the umask).

    Returns:
        ``out`` as a ``Path``.
    """
    out = check_output(out, overwrite=overwrite, directory=False)
    with _parent_of(out) as parent:
        staging = hidden_name(out.name, "partial")
        try:
            with parent.create(staging, 0o600) as f:
                buffered = io.BufferedWriter(f, buffer_size=1 << 20)
                write(buffered)
                buffered.flush()
                buffered.detach()
                os.fchmod(f.fileno(), 0o666 & ~umask())
                os.fsync(f.fileno())
            if overwrite:
                if parent.is_dir(out.name):
                    raise CheckpointError(f"{out} is a directory; pass the path of the file to write.")
                parent.rename(staging, out.name)
            else:
                parent.link_new(staging, out.name)
        except BaseException:
            parent.unlink(staging)
            raise
        with after_publish(f"syncing {parent.where()}"):
            parent.fsync()
    return out


def write_output_directory(out: str | os.PathLike, fill: Callable[[str], None], *, overwrite: bool) -> Path:
    """Write a directory at ``out``: ``fill(staging)`` writes into ``staging``, the path through its
    descriptor (``Folder.fd_path``) of a new ``0700`` directory of ours beside ``out``, which nobody
    else can enter and a rename of its name cannot redirect; everything in it is fsynced, the
    directory given the default mode (``0o777`` less the umask) and renamed into place. Without
    ``overwrite`` only an absent name or an empty directory is taken; with it what is there (a
    directory, a file or a link, itself) is moved aside, the new one renamed in and the old removed
    (put back if the rename fails).

    Returns:
        ``out`` as a ``Path``.
    """
    out = check_output(out, overwrite=overwrite, directory=True)
    with _parent_of(out) as parent:
        staging_name = hidden_name(out.name, "partial")
        staging = parent.mkdir(staging_name, 0o700)
        try:
            with staging:
                fill(staging.fd_path)
                staging.fsync_tree()
                staging.chmod(0o777 & ~umask())
                identity = staging.identity()
            place_directory(parent, staging_name, out.name, replace=overwrite, identity=identity)
        except BaseException:
            parent.remove_tree(staging_name)
            raise
    return out


def place_directory(parent: Folder, staging: str, name: str, *, replace: bool,
                     retire: Callable[[Folder], None] | None = None, identity: tuple[int, int] | None = None) -> None:
    """``staging`` (a complete directory in ``parent``) renamed to ``name``. Without ``replace`` only
    an absent name or an empty directory is taken. With it, what is there is first handed to
    ``retire`` (a directory: NxD's tags lose their ``done``), moved aside, the new one renamed in
    and the old one removed; if the rename fails, the old one goes back. ``identity``: the (device,
    inode) of the directory that was written: if ``staging`` names another one now (someone renamed
    it away and put theirs there), nothing is placed.

    Raises:
        CheckpointError: something took ``name`` (without ``replace``, or meanwhile); ``staging`` was
            swapped.
    """
    if identity is not None and (parent.lstat(staging) is None or parent.identity(staging) != tuple(identity)):
        raise CheckpointError(f"{parent.where(staging)}, the folder this save wrote, was moved or replaced while it "
                              f"was being written; nothing was put in place of {parent.where(name)}.")
    if not (replace and parent.exists(name)):
        try:
            parent.rename(staging, name)
        except OSError as e:
            raise parent.taken(name) if e.errno in _TAKEN else e
        with after_publish(f"syncing {parent.where()}"):
            parent.fsync()
        return
    if retire is not None and parent.is_dir(name):
        with parent.sub(name) as old:
            retire(old)
    aside = hidden_name(name, "old")
    parent.rename(name, aside)
    try:
        parent.rename(staging, name)
    except BaseException as e:
        try:
            parent.rename(aside, name)
        except OSError:
            raise CheckpointError(f"{parent.where(name)} was taken while the output was being written; what was there "
                                  f"before is kept at {parent.where(aside)}.") from e
        if isinstance(e, OSError) and e.errno in _TAKEN:
            raise parent.taken(name) from e
        raise
    with after_publish(f"syncing {parent.where()}"):
        parent.fsync()
    with after_publish(f"removing what {parent.where(name)} replaced (moved aside to {parent.where(aside)})",
                       "it is left there (remove it by hand)"):
        parent.remove_tree(aside)


@contextmanager
def after_publish(doing: str, left: str = "") -> Iterator[None]:
    """Run the block, a step after a save or an output was put in place (syncing the directory,
    removing what it replaced, retention): the save stands whatever happens there, so an exception
    (anything but ``KeyboardInterrupt`` and ``SystemExit``: an ``OSError``, a ``RecursionError``, a
    ``CheckpointError``) becomes a warning naming ``doing`` and, in ``left``, what it left behind."""
    with warn_on_failure(f"the save is in place, but {doing}", left):
        yield


@contextmanager
def warn_on_failure(doing: str, left: str = "") -> Iterator[None]:
    """Run the block, clean-up that no save's outcome depends on (what a failed save wrote, what a killed
    one left, what a published one replaced): an exception (but ``KeyboardInterrupt`` and ``SystemExit``)
    becomes a warning naming ``doing`` and what it ``left``."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - clean-up only
        warnings.warn(f"nxd_smp: {doing} failed ({type(e).__name__}: {str(e)[:300]}){f'; {left}' if left else ''}.",
                      stacklevel=3)


def replace_file(folder: Folder, name: str, data: bytes) -> None:
    """``data`` as the file ``name`` of ``folder``, whole or not at all: written to a new file beside
    it, fsynced, and renamed over whatever is at ``name`` (a link there is replaced, not followed)."""
    staging = hidden_name(name, "partial")
    try:
        folder.write_bytes(staging, data)
        folder.rename(staging, name)
    except BaseException:
        folder.unlink(staging)
        raise
    folder.fsync()
