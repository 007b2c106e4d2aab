"""Checkpoints on object storage (``s3://bucket/prefix``, through boto3: the optional ``nxd_smp[s3]``
extra): the ``Room`` and ``Store`` of ``room`` over S3's calls (``object_io``).

S3 has no rename, so a version cannot be written under a temporary name and swapped in. Instead:

* **Data.** Each save writes a new version under its own prefix, ``<root>/<name>/v-<sequence>-<id>/``
  (the sequence it began at): every rank uploads its files there (``create``: one ``PutObject`` for a
  small file, a multipart upload with parts in parallel for a large one; a multipart upload is
  invisible until completed), and rank 0 the index, the small files and ``COMPLETE.json``, as on
  local disk.
* **The commit.** Once every rank's upload is agreed, rank 0 writes the root's next commit record,
  ``<root>/.nxd_smp_commits/<sequence>.json`` (the *manifest*: the checkpoint's name, its version,
  the save's id, the size and CRC-32 of its ``COMPLETE.json``, which lists every file's), with a
  conditional ``PutObject`` (``If-None-Match: *``). The sequence is chosen when the save begins (one
  more than the highest committed), so two jobs that save one name at once race for the same key:
  exactly one commits, and the other is refused, its version removed. A record taken by a save of
  another name (sibling checkpoints saved at once) moves the commit to the next one, unless a save of
  its own name committed since it began. A retried PUT whose first answer was lost meets its own
  manifest: it is read back and recognised by the save's id.
* **What a load trusts.** The manifests only, never a listing of data: a checkpoint's newest version is
  the one its highest-sequence manifest names, and a root's newest checkpoint is the highest
  sequence. There is no pointer that could lag a manifest: the commit record is the order.
  ``COMPLETE.json`` is checked against the manifest's size and CRC-32, every file against
  ``COMPLETE.json``, every tensor against its CRC-32 as its bytes are read (ranged GETs, in parallel).
* **Removal and retention** delete a checkpoint's manifests (oldest first, so the name never falls
  back to an older version), then its data. A save, once committed, removes the versions of its
  name that the manifests no longer name (a replaced one, or one a killed save left); the next save
  of a name aborts the multipart uploads a killed save of that name left behind (found by its
  prefix). Other abandoned uploads are a bucket lifecycle rule's job
  (``AbortIncompleteMultipartUpload``), which ``docs/checkpoints.md`` shows.
* **A server without conditional writes** (it answers 200 to a second ``If-None-Match: *`` PUT of one
  key: probed once per bucket) gets the single-writer protocol, with a warning: the manifest key is
  checked absent, written, and read back; two jobs saving into one root at once may then both
  believe they committed.

The calls themselves, their retries and their errors are ``object_io``'s; a write that fails for good
fails the save on every rank, and the previous checkpoint stays the newest.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
import secrets
import warnings
import zlib
from dataclasses import dataclass
from typing import Any

from ..core.errors import CheckpointError, LostCommitError, NotCommittedError
from .files import after_publish, check_name, warn_on_failure
from .object_io import (
    RangedReader,
    S3Path,
    Upload,
    call,
    delete_objects,
    error_code,
    get_range,
    is_absent,
    is_refused_condition,
    list_objects,
    s3_client,
    s3_errors,
)
from .room import FileStat, Room, Store
from .typed_json import loads
from .versions import COMPLETE_FILE, is_link_name

#: The folder of a root's commit records (manifests), beside its checkpoints' names (which are never hidden).
COMMITS = ".nxd_smp_commits"
COMMIT_FORMAT = "nxd_smp.commit/1"
_SEQUENCE_DIGITS = 16
#: A version folder: the sequence its save began at (16 digits), then a random id.
_VERSION = re.compile(r"v-(\d{16})-[0-9a-f]{12}")
_SAVE_ID = re.compile(r"[0-9a-f]{32}")
_MANIFEST_LIMIT = 1 << 20
_OTHER_NAMES_RETRIES = 1000  # commit records another name's save took while this one was written


# ---------------------------------------------------------------------------- a version's files
class ObjectRoom(Room):
    """The files of one version, the objects below ``path``. ``pinned``: files whose size and CRC-32 the
    commit recorded (``COMPLETE.json``), checked when read."""

    def __init__(self, path: S3Path, *, pinned: dict[str, tuple[int, int]] | None = None,
                 listing: dict[str, int] | None = None):
        self.path = path
        self._pinned = dict(pinned or {})
        self._listing = listing

    def where(self, name: str = "") -> str:
        return f"{self.path}/{name}" if name else str(self.path)

    def _key(self, name: str, source: str | None = None) -> str:
        check_name(name, source or self.where())
        return f"{self.path.key}/{name}"

    def _sizes(self) -> dict[str, int]:
        """The version's objects (name -> size), listed once: a committed version never changes."""
        if self._listing is None:
            objects = list_objects(self.path.bucket, self.path.prefix)
            self._listing = {key[len(self.path.prefix):]: size for key, size in objects.items()}
        return self._listing

    def stat_file(self, name: str) -> FileStat | None:
        self._key(name)
        size = self._sizes().get(name)
        return None if size is None else FileStat(name, size, True)

    def tree_size(self) -> int:
        return sum(self._sizes().values())

    def exists(self, name: str) -> bool:
        """Whether a file or a folder is at ``name`` (a name that is no plain path: nothing; a listing that
        fails raises)."""
        try:
            check_name(name, self.where())
        except CheckpointError:
            return False
        return self.stat_file(name) is not None or self.is_dir(name)

    def _stat(self, name: str, source: str | None) -> FileStat:
        key = self._key(name, source)
        found = self.stat_file(name)
        if found is None:
            named = f" (named by {source})" if source else ""
            raise CheckpointError(f"s3://{self.path.bucket}/{key} is missing{named}.")
        return found

    def open_file(self, name: str, *, source: str | None = None) -> io.BufferedReader:
        """Buffered for a parser's small reads; a large ``readinto`` goes straight to the ranged GETs."""
        raw = RangedReader(self.path.bucket, self._key(name, source), self._stat(name, source).size)
        return io.BufferedReader(raw, buffer_size=1 << 20)

    def opened_stat(self, file: Any) -> FileStat:
        raw = file.raw
        return FileStat(raw.key, raw.size, True)

    def is_file(self, name: str) -> bool:
        try:
            check_name(name, self.where())
        except CheckpointError:
            return False
        return self.stat_file(name) is not None

    def is_dir(self, name: str) -> bool:
        check_name(name, self.where())
        return any(key.startswith(f"{name}/") for key in self._sizes())

    def names(self) -> list[str]:
        return sorted({key.split("/", 1)[0] for key in self._sizes()})

    def sub(self, name: str, *, source: str | None = None) -> ObjectRoom:
        self._key(name, source)
        if not self.is_dir(name):
            raise CheckpointError(f"{self.where(name)} is missing" + (f" (named by {source})" if source else "") + ".")
        below = {key[len(name) + 1:]: size for key, size in self._sizes().items() if key.startswith(f"{name}/")}
        return ObjectRoom(self.path / name, listing=below)

    def read_bytes(self, name: str, *, limit: int, source: str | None = None) -> bytes:
        size = self._stat(name, source).size
        if size > limit:
            raise CheckpointError(f"{self.where(name)} holds {size} bytes, more than the {limit} such a file may; "
                                  f"refused.")
        data = get_range(self.path.bucket, self._key(name), 0, size)
        if name in self._pinned and (len(data), zlib.crc32(data)) != self._pinned[name]:
            raise CheckpointError(f"{self.where(name)} is not the file its commit record names (size or CRC-32 "
                                  f"differ): altered after the save; refused.")
        return data

    def restricted_to(self, files: dict[str, tuple[int, int]]) -> ObjectRoom:
        """This version as its completion record lists it: exactly the files ``files`` (name -> size, CRC-32),
        each there at its size, each checked against its CRC-32 when read whole (``read_bytes``); an object
        the record does not list is not seen.

        Raises:
            CheckpointError: a listed file missing or of another size, naming it.
        """
        listed = self._sizes()
        bad = sorted(name for name, (size, _) in files.items() if listed.get(name) != size)
        if bad:
            raise CheckpointError(f"the checkpoint at {self.where()} is damaged: {bad[:4]} "
                                  f"{'is' if len(bad) == 1 else 'are'} missing or not of the size its completion "
                                  f"record lists.")
        return ObjectRoom(self.path, pinned={**self._pinned, **files},
                          listing={name: size for name, (size, _) in files.items()})

    def create(self, name: str) -> Upload:
        return Upload(self.path.bucket, self._key(name))

    def sync_file(self, file: Any) -> None:
        """Nothing: an object is durable once its upload completes."""

    def write_bytes(self, name: str, data: bytes | memoryview, *, sync: bool = True) -> None:
        with self.create(name) as upload:
            upload.write(data)

    def fsync(self) -> None:
        """Nothing: S3 has no names to make durable."""

    def dup(self) -> ObjectRoom:
        return ObjectRoom(self.path, pinned=self._pinned, listing=self._listing)

    def close(self) -> None:
        """Nothing to release."""


# ---------------------------------------------------------------------------- the commit records
def _begun_at(version: str) -> int:
    """The sequence the save of the version folder ``version`` began at (``v-<sequence>-<id>``); a name that
    is not a version's counts as begun before every save."""
    found = _VERSION.fullmatch(version)
    return int(found.group(1)) if found else -1


@dataclass(frozen=True)
class Manifest:
    """One commit record: the checkpoint ``name``'s version ``version`` (below ``<root>/<name>/``), committed
    as the root's ``sequence``-th save by the save ``save``; ``complete``: its ``COMPLETE.json``'s size
    and CRC-32."""

    sequence: int
    name: str
    version: str
    save: str
    complete: tuple[int, int]


def _manifest_bytes(manifest: Manifest) -> bytes:
    return json.dumps({"format": COMMIT_FORMAT, "sequence": manifest.sequence, "name": manifest.name,
                       "version": manifest.version, "save": manifest.save,
                       "complete": list(manifest.complete)}).encode()


def _parse_manifest(data: bytes, sequence: int, source: str) -> Manifest:
    value = loads(data, source)
    fields = {"format", "sequence", "name", "version", "save", "complete"}
    complete = value.get("complete") if isinstance(value, dict) else None
    if not (isinstance(value, dict) and set(value) == fields and value["format"] == COMMIT_FORMAT
            and value["sequence"] == sequence and not isinstance(value["sequence"], bool)
            and is_link_name(value["name"]) and isinstance(value["version"], str)
            and _VERSION.fullmatch(value["version"]) and isinstance(value["save"], str)
            and _SAVE_ID.fullmatch(value["save"]) and isinstance(complete, list) and len(complete) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63 for v in complete)):
        raise CheckpointError(f"{source} is not a commit record nxd_smp writes ({{'format': {COMMIT_FORMAT!r}, "
                              f"'sequence', 'name', 'version', 'save', 'complete'}}, its sequence the key's); it is "
                              f"damaged or crafted and not trusted. Remove it to load the others.")
    return Manifest(sequence, value["name"], value["version"], value["save"], (complete[0], complete[1]))


_conditional_writes: dict[tuple[str, str], bool] = {}


class ObjectStore(Store):
    """The checkpoints below an S3 prefix (the module's docstring)."""

    def __init__(self, root: S3Path):
        s3_client()  # (a missing extra is refused before anything else)
        self.root = root

    def where(self, name: str = "") -> str:
        return str(self.root / name) if name else str(self.root)

    @property
    def _bucket(self) -> str:
        return self.root.bucket

    @property
    def _server(self) -> tuple[str, str]:
        """(endpoint, bucket): what the probe of conditional writes is kept by."""
        return getattr(s3_client().meta, "endpoint_url", ""), self._bucket

    def _commit_key(self, sequence: int) -> str:
        return f"{self.root.prefix}{COMMITS}/{sequence:0{_SEQUENCE_DIGITS}d}.json"

    def _sequences(self) -> list[int]:
        """The sequences committed, oldest first (a listing of the commit records; nothing else counts)."""
        objects = list_objects(self._bucket, f"{self.root.prefix}{COMMITS}/")
        found = []
        for key in objects:
            name = key.rsplit("/", 1)[-1]
            if re.fullmatch(rf"\d{{{_SEQUENCE_DIGITS}}}\.json", name):
                found.append(int(name[:_SEQUENCE_DIGITS]))
        return sorted(found)

    def _manifest(self, sequence: int) -> Manifest | None:
        """The commit record ``sequence``, None if it is gone (removed since the listing).

        Raises:
            CheckpointError: it cannot be read, or it is not one nxd_smp writes.
        """
        key = self._commit_key(sequence)
        with s3_errors(f"reading s3://{self._bucket}/{key}"):
            try:
                answer = call("get_object", Bucket=self._bucket, Key=key, Range=f"bytes=0-{_MANIFEST_LIMIT}")
            except Exception as e:
                if is_absent(e):
                    return None
                raise
            data = answer["Body"].read()
        if len(data) > _MANIFEST_LIMIT:
            raise CheckpointError(f"s3://{self._bucket}/{key} is larger than a commit record may be; refused.")
        return _parse_manifest(data, sequence, f"s3://{self._bucket}/{key}")

    def manifests(self) -> list[Manifest]:
        """Every commit record of the root, oldest first."""
        return [m for m in (self._manifest(s) for s in self._sequences()) if m is not None]

    def _versions_of(self, name: str) -> tuple[list[str], list[str]]:
        """(the version folders below ``<root>/<name>/`` that hold objects, the other objects there), from one
        listing of its objects (not of its folders: a server may list a folder it emptied)."""
        below = (self.root / name).prefix
        objects = list_objects(self._bucket, below)
        versions: set[str] = set()
        other = []
        for key in objects:
            first, _, rest = key[len(below):].partition("/")
            if _VERSION.fullmatch(first) and rest:
                versions.add(f"{below}{first}/")
            else:
                other.append(key)
        return sorted(versions), other

    # ------------------------------------------------------------------ saving
    def begin(self, name: str) -> list:
        versions, other = self._versions_of(name)
        if other:
            raise CheckpointError(f"{self.where(name)} holds objects that are not nxd_smp versions (the first: "
                                  f"s3://{self._bucket}/{other[0]}); pass a new path (or tag) or remove them.")
        self._probe()
        sequence = max(self._sequences(), default=0) + 1
        self._abort_uploads(name, sequence)
        return [f"{name}/v-{sequence:0{_SEQUENCE_DIGITS}d}-{secrets.token_hex(6)}", sequence, secrets.token_hex(16)]

    def _abort_uploads(self, name: str, sequence: int) -> None:
        """Abort the multipart uploads that killed saves of ``name`` left: those of versions begun at ``sequence``
        or before (a save begun at the same one races this one for its commit record and would lose it to
        one of them anyway; one begun later, after a commit, is left to finish)."""
        prefix = (self.root / name).prefix
        with warn_on_failure(f"aborting the uploads left below {self.where(name)} by a save cut off",
                             "a lifecycle rule (AbortIncompleteMultipartUpload) removes them"):
            with s3_errors(f"listing the uploads below {self.where(name)}"):
                pages = s3_client().get_paginator("list_multipart_uploads").paginate(Bucket=self._bucket, Prefix=prefix)
                uploads = [(u["Key"], u["UploadId"]) for page in pages for u in page.get("Uploads", [])]
            for key, upload_id in uploads:
                if _begun_at(key[len(prefix):].split("/", 1)[0]) <= sequence:
                    with s3_errors(f"aborting the upload of s3://{self._bucket}/{key}"):
                        call("abort_multipart_upload", Bucket=self._bucket, Key=key, UploadId=upload_id)

    def _probe(self) -> None:
        """Whether the server honours ``If-None-Match: *`` (once per bucket): PUT one key twice."""
        found = self._server
        if found in _conditional_writes:
            return
        key = f"{self.root.prefix}{COMMITS}/probe-{secrets.token_hex(8)}"
        with s3_errors(f"probing s3://{self._bucket} for conditional writes"):
            call("put_object", Bucket=self._bucket, Key=key, Body=b"")  # (unconditional: a resend changes nothing)
            try:
                call("put_object", Bucket=self._bucket, Key=key, Body=b"", IfNoneMatch="*")
                honoured = False
            except Exception as e:
                if error_code(e) in ("NotImplemented", "InvalidArgument", "InvalidRequest"):  # (the header refused outright)
                    honoured = False
                elif not is_refused_condition(e):
                    raise
                else:
                    honoured = True
            call("delete_object", Bucket=self._bucket, Key=key)
        if not honoured:
            warnings.warn(f"nxd_smp: the S3 server of s3://{self._bucket} ignores conditional writes (If-None-Match); "
                          f"checkpoints are committed with the single-writer protocol (checked, written, read back), "
                          f"which cannot tell two jobs saving into one prefix at the same moment apart.", stacklevel=2)
        _conditional_writes[found] = honoured

    def open_version(self, begun: list) -> ObjectRoom:
        return ObjectRoom(self.root / begun[0])

    def publish(self, name: str, begun: list, version: Room, completion: bytes) -> None:
        path, sequence, save = begun
        version.write_bytes(COMPLETE_FILE, completion)
        manifest = Manifest(sequence, name, path.rsplit("/", 1)[-1], save, (len(completion), zlib.crc32(completion)))
        try:
            committed = self._commit(manifest)
        except LostCommitError:  # (only then: a commit whose outcome is unknown may stand, and its data with it)
            with warn_on_failure(f"removing the version {self.where(path)} that was not committed",
                                 "remove it by hand"):
                self._remove_versions([f"{(self.root / path).prefix}"])
            raise
        manifest = committed
        # committed: from here on nothing fails the save
        with after_publish(f"removing the versions of {self.where(name)} that its commit replaced",
                           "they are left in place (remove them by hand)"):
            self._remove_replaced(name, manifest)

    def _commit(self, manifest: Manifest) -> Manifest:
        """Write ``manifest``'s commit record; where another name's save took its sequence meanwhile (sibling
        checkpoints saved at once: tensor-parallel coordinates), the next free one. Returns what was committed.

        Raises:
            LostCommitError: a save of the same name took the record (this one is not committed).
            CheckpointError: the outcome is unknown (the server stayed away): the version is kept.
        """
        conditional = _conditional_writes.get(self._server, True)
        for _ in range(_OTHER_NAMES_RETRIES):
            key = self._commit_key(manifest.sequence)
            with s3_errors(f"committing {self.where(manifest.name)} (s3://{self._bucket}/{key})"):
                found = None if conditional else self._manifest(manifest.sequence)
                if found is None:
                    try:
                        call("put_object", Bucket=self._bucket, Key=key, Body=_manifest_bytes(manifest),
                              **({"IfNoneMatch": "*"} if conditional else {}))
                    except Exception as e:
                        if not is_refused_condition(e):
                            raise
                    found = self._manifest(manifest.sequence)  # (ours, also where a resent PUT met its first write)
            if found is not None and found.save == manifest.save:
                return manifest
            if found is not None and found.name == manifest.name:
                raise self._lost(manifest)
            # another name's save (or one removed since): the next sequence, unless a save of this name committed
            # since this one began (its record skipped on the way: this one would replace it unseen)
            begun = _begun_at(manifest.version)
            if any(m.name == manifest.name and m.save != manifest.save and m.sequence >= begun
                   for m in self.manifests()):
                raise self._lost(manifest)
            manifest = Manifest(max(self._sequences(), default=0) + 1, *dataclasses.astuple(manifest)[1:])
        raise CheckpointError(f"committing {self.where(manifest.name)} found {_OTHER_NAMES_RETRIES} commit records "
                              f"taken by other saves in a row; nothing was committed.")

    def _lost(self, manifest: Manifest) -> CheckpointError:
        return LostCommitError(
            f"another job committed a checkpoint to {self.where()} while this save of {manifest.name} was being "
            f"written (both took the commit record {manifest.sequence}); this save was not committed and its version "
            f"is removed. One job saves into a prefix at a time: give each job its own.")

    def _remove_replaced(self, name: str, manifest: Manifest) -> None:
        """After ``manifest``'s commit: the older commit records of ``name`` (oldest first), then every version of
        ``name`` that no commit record names (replaced, or left by a save cut off)."""
        manifests = self.manifests()
        for old in manifests:
            if old.name == name and old.sequence < manifest.sequence:
                self._delete_manifest(old)
        named = {m.version for m in manifests if m.name == name and m.sequence >= manifest.sequence}
        ours = _begun_at(manifest.version)
        versions, _ = self._versions_of(name)  # (a save of this name begun after our commit's is left to finish)
        self._remove_versions([v for v in versions if v.rstrip("/").rsplit("/", 1)[-1] not in named
                               and _begun_at(v.rstrip("/").rsplit("/", 1)[-1]) <= ours])

    def _delete_manifest(self, manifest: Manifest) -> None:
        with s3_errors(f"removing the commit record {manifest.sequence} of {self.where()}"):
            call("delete_object", Bucket=self._bucket, Key=self._commit_key(manifest.sequence))

    def _remove_versions(self, prefixes: list[str]) -> None:
        """Remove every object below each version folder in ``prefixes`` (keys ending in ``/``)."""
        for prefix in prefixes:
            objects = list_objects(self._bucket, prefix)
            if objects:
                delete_objects(self._bucket, sorted(objects))

    def discard(self, begun: list) -> None:
        with warn_on_failure(f"removing {self.where(begun[0])}, the version of a save that failed",
                             "the next save of its name removes it"):
            self._remove_versions([(self.root / begun[0]).prefix])

    def retain(self, keep: int, newest: str) -> None:
        with after_publish(f"the retention in {self.where()} (num_kept_ckpts={keep})"):
            manifests = self.manifests()
            last = {m.name: m.sequence for m in manifests}  # (the newest commit of each name)
            names = sorted(last, key=last.get)
            for name in names[:max(0, len(names) - keep)]:
                if name != newest:
                    with after_publish(f"removing the checkpoint {self.where(name)} (num_kept_ckpts={keep})",
                                       "it is left in place (remove it by hand)"):
                        self._remove_name(name, [m for m in manifests if m.name == name])

    def _remove_name(self, name: str, manifests: list[Manifest]) -> None:
        for manifest in sorted(manifests, key=lambda m: m.sequence):  # (the newest last: no older one comes back)
            self._delete_manifest(manifest)
        versions, _ = self._versions_of(name)
        self._remove_versions(versions)

    # ------------------------------------------------------------------ loading
    def locate(self, name: str) -> list:
        if _VERSION.fullmatch(name) and self.root.key:  # (a version's own path, as save_checkpoint returns it)
            outer = ObjectStore(self.root.parent)
            named = [m for m in outer.manifests() if m.name == self.root.name and m.version == name]
            if not named:
                raise NotCommittedError(f"{self.where(name)} is a version that no commit record of {outer.where()} "
                                        f"names (replaced since, or its save was cut off); load the checkpoint by its "
                                        f"name.")
            return self._location(name, named[-1])
        manifests = [m for m in self.manifests() if m.name == name]
        if manifests:
            return self._location(f"{name}/{manifests[-1].version}", manifests[-1])
        inner = ObjectStore(self.root / name)
        found = inner.manifests()
        if found:
            return self._location(f"{name}/{found[-1].name}/{found[-1].version}", found[-1])
        versions, other = self._versions_of(name)
        if versions:
            raise NotCommittedError(f"no complete checkpoint at {self.where(name)}: its saves were cut off before "
                                    f"their commit (no commit record in {self.where()}/{COMMITS} names it). Resume "
                                    f"from an earlier checkpoint.")
        if other:
            raise NotCommittedError(f"{self.where(name)} holds objects but no committed nxd_smp checkpoint (the first: "
                                    f"s3://{self._bucket}/{other[0]}).")
        raise FileNotFoundError(f"no checkpoint at {self.where(name)}: nothing is stored there.")

    @staticmethod
    def _location(path: str, manifest: Manifest) -> list:
        return [path, *manifest.complete]

    def open_located(self, location: list) -> ObjectRoom:
        path, size, crc = location
        return ObjectRoom(self.root / path, pinned={COMPLETE_FILE: (size, crc)})

    def is_checkpoint(self, name: str) -> bool:
        return any(m.name == name for m in self.manifests()) or bool(self._versions_of(name)[0])

    def has_checkpoints(self) -> bool:
        return bool(self._sequences())

    def remove(self, name: str) -> None:
        manifests = [m for m in self.manifests() if m.name == name]
        versions, other = self._versions_of(name)
        if not manifests and other:
            raise CheckpointError(f"{self.where(name)} is not an nxd_smp checkpoint (it holds other objects); nothing "
                                  f"was removed.")
        self._remove_name(name, manifests)

    def dup(self) -> ObjectStore:
        return ObjectStore(self.root)

    def close(self) -> None:
        """Nothing to release."""
