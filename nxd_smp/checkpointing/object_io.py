"""S3 through boto3 (the optional ``nxd_smp[s3]`` extra): the URL (``S3Path``), the process's client and
its errors, and the calls on single objects that object storage is made of: list, ranged GETs read in
parallel (``RangedReader``), uploads whose parts go up in parallel (``Upload``), deletes. Nothing here
knows a checkpoint: ``object_store`` builds the storage interface's room and store on these calls.

Credentials, region and endpoint come from boto3's standard chain (``AWS_ENDPOINT_URL`` for a server
other than AWS). Throttling, timeouts, 5xx and dropped connections are retried by botocore's standard
mode with jittered exponential backoff; a body cut off while it streams is read again here; AWS's
``409 ConditionalRequestConflict`` is retried here too. Every failure that remains is a
``CheckpointError`` naming what was being done and the fix (``s3_errors``).
"""

from __future__ import annotations

import io
import random
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..core.errors import CheckpointError, ChecksumError, ConfigError

#: The boto3 release whose ``put_object`` and ``complete_multipart_upload`` take ``IfNoneMatch`` and ``IfMatch``.
BOTO3_MIN = (1, 35, 69)
INSTALL = "pip install 'nxd_smp[s3]'"
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
#: SeaweedFS hides keys below a folder of this name from listings: a prefix never holds one.
_HIDDEN_BY_SERVERS = (".versions",)
_KEY_LIMIT = 900  # S3 keys hold 1024 bytes; a version's own names take the rest
#: Bytes per uploaded part (the first thousand parts; then larger, S3 allowing 10,000 parts) and per ranged GET.
PART_BYTES = 16 << 20
_PARTS_IN_FLIGHT = 4  # per file being uploaded: bounds the memory an upload holds
_TRANSFER_THREADS = 16
_CONFLICT_RETRIES = 8  # AWS answers 409 ConditionalRequestConflict to concurrent conditional writes
_STREAM_RETRIES = 5


# ---------------------------------------------------------------------------- the URL
@dataclass(frozen=True)
class S3Path:
    """``s3://bucket/key``: a bucket and a key of plain ``/``-separated components (``""``: the bucket)."""

    bucket: str
    key: str

    @classmethod
    def parse(cls, text: str, what: str = "path", *, bucket_alone: bool = False) -> S3Path:
        """``s3://bucket/prefix`` (or the ``s3:/bucket/prefix`` ``pathlib`` folds it into; a trailing ``/`` is
        dropped). ``bucket_alone``: ``s3://bucket`` too (a root of checkpoints; a user's path names a prefix).

        Raises:
            ConfigError: not a bucket name and a prefix of plain components, naming why.
        """
        rest = text.split(":", 1)[1].lstrip("/")
        bucket, _, key = rest.partition("/")
        key = key.rstrip("/")
        if not _BUCKET.fullmatch(bucket) or ".." in bucket:
            raise ConfigError(f"{what} {text!r} names the bucket {bucket!r}, which is not an S3 bucket name (3-63 "
                              f"lowercase letters, digits, '.' and '-').")
        if not key and not bucket_alone:
            raise ConfigError(f"{what} {text!r} names a bucket only; name a prefix in it (s3://{bucket}/run1).")
        return cls(bucket, "")._join(key, what, text) if key else cls(bucket, "")

    def _join(self, key: str, what: str, text: str) -> S3Path:
        parts = key.split("/")
        bad = next((p for p in parts if p in ("", ".", "..") or "\0" in p or p in _HIDDEN_BY_SERVERS), None)
        if bad is not None:
            why = ("S3 servers hide keys below it" if bad in _HIDDEN_BY_SERVERS
                   else "a prefix is a path of plain names")
            raise ConfigError(f"{what} {text!r} holds the component {bad!r}; refused ({why}).")
        joined = f"{self.key}/{key}" if self.key else key
        if len(joined.encode()) > _KEY_LIMIT:
            raise ConfigError(f"{what} {text!r} is too long for S3 keys (at most {_KEY_LIMIT} bytes of prefix).")
        return S3Path(self.bucket, joined)

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> S3Path:
        return S3Path(self.bucket, self.key.rsplit("/", 1)[0] if "/" in self.key else "")

    @property
    def prefix(self) -> str:
        """The keys below this path begin with it."""
        return f"{self.key}/" if self.key else ""

    def __truediv__(self, name: str) -> S3Path:
        return self._join(name, "the name", name)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}" if self.key else f"s3://{self.bucket}"


# ---------------------------------------------------------------------------- the client and its errors
_client: Any = None
_client_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def require_boto3() -> None:
    """Refuse S3 where boto3 is missing or too old, before anything is made.

    Raises:
        ConfigError: naming the install line.
    """
    try:
        import boto3
    except ImportError:
        raise ConfigError(f"s3:// checkpoints need boto3, which is not installed: {INSTALL}.") from None
    found = tuple(int(p) for p in re.findall(r"\d+", boto3.__version__)[:3])
    if found < BOTO3_MIN:
        raise ConfigError(f"s3:// checkpoints need boto3>={'.'.join(map(str, BOTO3_MIN))} (conditional writes); found "
                          f"{boto3.__version__}: {INSTALL} --upgrade.")


def s3_client() -> Any:
    """The process's boto3 S3 client (thread-safe): boto3's standard chain for credentials, region and
    endpoint (``AWS_ENDPOINT_URL``), botocore's standard retries (jittered exponential backoff on
    throttling, timeouts, 5xx and dropped connections).

    Raises:
        ConfigError: boto3 is missing or older than ``BOTO3_MIN``, naming the install line.
    """
    global _client
    with _client_lock:
        if _client is None:
            require_boto3()
            import boto3
            from botocore.config import Config

            config = Config(retries={"mode": "standard", "max_attempts": 10},
                            max_pool_connections=4 * _TRANSFER_THREADS,
                            connect_timeout=10, read_timeout=120)
            _client = boto3.session.Session().client("s3", config=config)
    return _client


def _transfers() -> ThreadPoolExecutor:
    """The threads that move parts and ranges (I/O bound: the GIL is released while they wait)."""
    global _pool
    with _client_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_TRANSFER_THREADS, thread_name_prefix="nxd_smp-s3")
    return _pool


def error_code(error: Exception) -> str:
    response = getattr(error, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return {412: "PreconditionFailed", 404: "NoSuchKey"}.get(status, code) if code in ("", str(status)) else code


def is_absent(error: Exception) -> bool:
    return error_code(error) in ("NoSuchKey", "NotFound", "404")


def is_refused_condition(error: Exception) -> bool:
    return error_code(error) == "PreconditionFailed"


@contextmanager
def s3_errors(doing: str) -> Iterator[None]:
    """Turn boto3's errors in the block into a ``CheckpointError`` naming ``doing`` and the fix."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    try:
        yield
    except NoCredentialsError:
        raise CheckpointError(f"{doing} failed: boto3 found no AWS credentials (environment, ~/.aws, an instance "
                              f"role); for a server other than AWS also set AWS_ENDPOINT_URL.") from None
    except ClientError as e:
        code = error_code(e)
        message = e.response.get("Error", {}).get("Message", "")
        hint = {"NoSuchBucket": " (the bucket does not exist: create it first)",
                "AccessDenied": " (the credentials may not do this)",
                "InvalidAccessKeyId": " (unknown access key)", "SignatureDoesNotMatch": " (wrong secret key)"}
        raise CheckpointError(f"{doing} failed: {code}: {message}{hint.get(code, '')}.") from None
    except BotoCoreError as e:
        raise CheckpointError(f"{doing} failed after botocore's retries: {e}.") from None


def call(operation: str, **kwargs: Any) -> Any:
    """``client.<operation>(**kwargs)``, retried with jitter on ``ConditionalRequestConflict`` (botocore does
    not retry it)."""
    for attempt in range(_CONFLICT_RETRIES):
        try:
            return getattr(s3_client(), operation)(**kwargs)
        except Exception as e:
            if error_code(e) != "ConditionalRequestConflict" or attempt == _CONFLICT_RETRIES - 1:
                raise
            time.sleep(random.uniform(0.05, 0.2) * 2**attempt)
    raise AssertionError("unreachable")


def _listed(bucket: str, prefix: str) -> Iterator[dict[str, Any]]:
    """Every object below ``prefix``, as ``ListObjectsV2`` describes it (``Key``, ``Size``, ``LastModified``)."""
    pages = s3_client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    with s3_errors(f"listing s3://{bucket}/{prefix}"):
        for page in pages:
            yield from page.get("Contents", [])


def list_objects(bucket: str, prefix: str) -> dict[str, int]:
    """The objects below ``prefix``: key -> size."""
    return {o["Key"]: o["Size"] for o in _listed(bucket, prefix)}


def objects_below(path: S3Path) -> dict[str, tuple[int, float]]:
    """The objects below ``path``, by their names relative to it: (size, time last modified, in seconds since
    the epoch): what a reader of another tool's folder orders by where that tool does (NxD's ``done``)."""
    return {o["Key"][len(path.prefix):]: (o["Size"], o["LastModified"].timestamp())
            for o in _listed(path.bucket, path.prefix)}


def get_range(bucket: str, key: str, start: int, length: int, into: memoryview | None = None) -> bytes | None:
    """Bytes ``[start, start + length)`` of the object ``key`` (a ranged GET), or into ``into``.

    Raises:
        ChecksumError: the object ends before them.
    """
    from botocore.exceptions import ClientError, NoCredentialsError

    where = f"s3://{bucket}/{key}"
    if length == 0:
        return b"" if into is None else None
    with s3_errors(f"reading {where}"):
        for attempt in range(_STREAM_RETRIES):  # (botocore retries a request, not a body cut off while it streams)
            try:
                body = call("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{start + length - 1}")["Body"]
                data = body.read()
                break
            except (ClientError, NoCredentialsError):  # (an answer, not a dropped stream)
                raise
            except Exception:
                if attempt == _STREAM_RETRIES - 1:
                    raise
                time.sleep(random.uniform(0.5, 1.5) * 2**attempt)
    if len(data) != length:
        raise ChecksumError(f"{where}: {len(data)} bytes at {start}, expected {length} (truncated or replaced).")
    if into is None:
        return data
    into[:] = data
    return None


def delete_objects(bucket: str, keys: list[str]) -> None:
    """Remove the objects ``keys``, a thousand per call (``DeleteObjects``)."""
    for first in range(0, len(keys), 1000):
        batch = keys[first:first + 1000]
        with s3_errors(f"removing {len(batch)} objects below s3://{bucket}/{batch[0].rsplit('/', 1)[0]}"):
            answer = call("delete_objects", Bucket=bucket,
                           Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
        if answer.get("Errors"):
            error = answer["Errors"][0]
            raise CheckpointError(f"removing s3://{bucket}/{error.get('Key')} failed: {error.get('Code')}: "
                                  f"{error.get('Message')} ({len(answer['Errors'])} objects left).")


# ---------------------------------------------------------------------------- reading and writing one object
class RangedReader(io.RawIOBase):
    """An object opened for reading: each ``readinto`` is ranged GETs of exactly what it asks for, a large
    one split into ``PART_BYTES`` ranges fetched in parallel."""

    def __init__(self, bucket: str, key: str, size: int):
        super().__init__()
        self._bucket, self._key, self._size, self._pos = bucket, key, size, 0

    @property
    def key(self) -> str:
        return self._key

    @property
    def size(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._size - self._pos))
        ranges = [(a, min(n, a + PART_BYTES)) for a in range(0, n, PART_BYTES)]
        if len(ranges) == 1:
            get_range(self._bucket, self._key, self._pos, n, view[:n])
        elif ranges:
            start = self._pos
            futures = [_transfers().submit(get_range, self._bucket, self._key, start + a, b - a, view[a:b])
                       for a, b in ranges]
            for future in futures:
                future.result()
        self._pos += n
        return n


class Upload:
    """A new object being written: a small one is one ``PutObject`` when it is closed; past ``PART_BYTES`` a
    multipart upload whose parts go up in parallel as they fill (at most ``_PARTS_IN_FLIGHT`` held at once),
    completed when the block ends and aborted if it ends by an exception (nothing of it is then visible)."""

    def __init__(self, bucket: str, key: str):
        self._bucket, self._key = bucket, key
        self._where = f"s3://{bucket}/{key}"
        self._pending = bytearray()
        self._upload_id: str | None = None
        self._parts: list[Future] = []
        self._slots = threading.Semaphore(_PARTS_IN_FLIGHT)

    def __enter__(self) -> Upload:
        return self

    def __exit__(self, kind: type | None, *rest: object) -> None:
        if kind is None:
            self._finish()
        else:
            self._abort()

    def _part_bytes(self) -> int:
        return PART_BYTES * (1 + len(self._parts) // 1000)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        part = self._part_bytes()
        if self._pending:
            take = min(part - len(self._pending), len(view))
            self._pending += view[:take]
            view = view[take:]
            if len(self._pending) == part:
                self._send(bytes(self._pending))
                self._pending = bytearray()
        while len(view) >= part:
            self._send(bytes(view[:part]))
            view = view[part:]
            part = self._part_bytes()
        self._pending += view
        return n

    def _send(self, data: bytes) -> None:
        failed = next((f for f in self._parts if f.done() and f.exception() is not None), None)
        if failed is not None:
            failed.result()
        if self._upload_id is None:
            with s3_errors(f"starting the upload of {self._where}"):
                self._upload_id = call("create_multipart_upload", Bucket=self._bucket, Key=self._key)["UploadId"]
        number = len(self._parts) + 1
        self._slots.acquire()
        try:
            future = _transfers().submit(self._upload_part, number, data)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _: self._slots.release())
        self._parts.append(future)

    def _upload_part(self, number: int, data: bytes) -> dict[str, Any]:
        with s3_errors(f"uploading part {number} of {self._where}"):
            answer = call("upload_part", Bucket=self._bucket, Key=self._key, UploadId=self._upload_id,
                           PartNumber=number, Body=data)
        return {"PartNumber": number, "ETag": answer["ETag"]}

    def _finish(self) -> None:
        if self._upload_id is None:
            with s3_errors(f"writing {self._where}"):
                call("put_object", Bucket=self._bucket, Key=self._key, Body=bytes(self._pending))
            return
        try:
            if self._pending:
                self._send(bytes(self._pending))
            parts = [future.result() for future in self._parts]
            with s3_errors(f"completing the upload of {self._where}"):
                call("complete_multipart_upload", Bucket=self._bucket, Key=self._key, UploadId=self._upload_id,
                      MultipartUpload={"Parts": parts})
        except BaseException:
            self._abort()
            raise

    def _abort(self) -> None:
        for future in self._parts:
            future.cancel()
        for future in self._parts:
            if not future.cancelled():
                future.exception()
        if self._upload_id is not None:
            try:
                call("abort_multipart_upload", Bucket=self._bucket, Key=self._key, UploadId=self._upload_id)
            except Exception:  # noqa: BLE001 - the next save of this checkpoint aborts it again
                pass
