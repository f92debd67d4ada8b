"""Where Halfway's files live: a local directory (``file://``, the default: today's data and
artifact directories) or an S3-compatible bucket (``s3://bucket/prefix``, for several hosts
with nothing shared but the database and the store).

Everything above this module speaks keys (``"7/model.keras"``), never paths, so the API, the
supervisor and the training child work the same on both. Three stores per deployment: the
artifacts (a job's model, log, checkpoints, TensorBoard files under ``<job id>/``), the
data (uploaded datasets, under the paths specs name) and the code (one object per code
bundle, ``service/files/codestore.py``).

S3 is reached through boto3: the reference client, synchronous like the code that calls it,
with multipart uploads and retries built in (s3transfer), and the client that MinIO, Ceph and
moto test against. No TensorFlow here, and boto3 itself is only imported for an ``s3://`` URL.
"""

from __future__ import annotations

import functools
import io
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

CHUNK = 1 << 20


class StorageError(ValueError):
    """A storage URL or key Halfway cannot use."""


class StorageUnavailable(Exception):
    """The store did not answer (or refused us): the API says 503, a job's attempt fails and
    is retried."""


class AlreadyExists(Exception):
    """``if_absent`` was asked and the key was taken (perhaps by a concurrent writer)."""


@dataclass(frozen=True)
class Entry:
    key: str
    size: int


def check_key(key: str) -> str:
    """Keys are relative, '/'-separated, without '.' or '..' parts: nothing a request names
    can reach outside its store."""
    parts = key.split("/")
    if not key or key.startswith("/") or "\x00" in key or any(p in ("", ".", "..") for p in parts):
        raise StorageError(f"not a usable storage key: {key!r}")
    return key


class Store(ABC):
    """One namespace of objects. Every write is atomic: a reader sees the whole object or
    none (a temporary file renamed into place; an S3 PUT or completed multipart upload)."""

    @abstractmethod
    def put_file(self, key: str, path: Path) -> None: ...

    @abstractmethod
    def put_stream(self, key: str, stream: IO[bytes], *, if_absent: bool = False) -> None:
        """Write the stream's bytes under ``key``; with ``if_absent``, raise AlreadyExists
        rather than replace an object (the check and the write are one step)."""

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self.put_stream(key, io.BytesIO(data), if_absent=if_absent)

    @abstractmethod
    def get_file(self, key: str, path: Path) -> bool:
        """Copy the object to ``path`` (atomically). False when there is no such object."""

    @abstractmethod
    def size(self, key: str) -> int | None:
        """The object's size, or None when it does not exist."""

    @abstractmethod
    def read_range(self, key: str, start: int, length: int) -> bytes: ...

    @abstractmethod
    def iter_bytes(self, key: str, start: int = 0, chunk: int = CHUNK) -> Iterator[bytes]: ...

    @abstractmethod
    def list(self, prefix: str = "") -> list[Entry]:
        """Every object whose key starts with ``prefix``, sorted by key."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete the object; a missing one is not an error."""

    def local_root(self) -> Path | None:
        """The directory holding the store, where it is local (so a writer can write in place
        and a reader can send the file). None for a remote store."""
        return None

    def local_path(self, key: str) -> Path | None:
        root = self.local_root()
        return None if root is None else _inside(root, key)

    @abstractmethod
    def url(self, key: str = "") -> str:
        """Where the key lives, for people (``s3://bucket/prefix/7/tensorboard``)."""

    def get_bytes(self, key: str) -> bytes | None:
        size = self.size(key)
        return None if size is None else self.read_range(key, 0, size)

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def open_reader(self, key: str) -> IO[bytes]:
        """A seekable reader of the object, reading only the ranges asked for (zipfile reads
        an .npz's headers with a few seeks, not the whole file)."""
        size = self.size(key)
        if size is None:
            raise FileNotFoundError(key)
        return io.BufferedReader(_RangeReader(self, key, size), buffer_size=64 * 1024)


class _RangeReader(io.RawIOBase):
    def __init__(self, store: Store, key: str, size: int) -> None:
        self.store, self.key, self.length, self.pos = store, key, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self.length - self.pos)
        if n <= 0:
            return 0
        data = self.store.read_range(self.key, self.pos, n)
        view[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _inside(root: Path, key: str) -> Path:
    path = (root / check_key(key)).resolve()
    if not path.is_relative_to(root.resolve()):  # a symlink pointing out
        raise StorageError(f"{key!r} leads outside the store")
    return path


class FileStore(Store):
    """A directory. Writes go to a temporary file beside the target and are renamed into
    place, so a reader (or a resumed job) never sees half a file."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()

    def path(self, key: str) -> Path:
        return _inside(self.root, key)

    def local_root(self) -> Path | None:
        return self.root

    def _temp_beside(self, target: Path) -> tuple[int, Path]:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
        return fd, Path(name)

    def put_file(self, key: str, path: Path) -> None:
        target = self.path(key)
        if path.resolve() == target:
            return
        fd, tmp = self._temp_beside(target)
        try:
            with os.fdopen(fd, "wb") as out, open(path, "rb") as src:
                shutil.copyfileobj(src, out, CHUNK)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)

    def put_stream(self, key: str, stream: IO[bytes], *, if_absent: bool = False) -> None:
        target = self.path(key)
        fd, tmp = self._temp_beside(target)
        try:
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(stream, out, CHUNK)
                out.flush()
                os.fsync(out.fileno())
            if if_absent:
                try:
                    os.link(tmp, target)  # fails if the name is taken, atomically
                except FileExistsError:
                    raise AlreadyExists(key) from None
            else:
                os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)

    def get_file(self, key: str, path: Path) -> bool:
        source = self.path(key)
        if not source.is_file():
            return False
        if source == path.resolve():
            return True
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".part")
        shutil.copyfile(source, tmp)
        os.replace(tmp, path)
        return True

    def size(self, key: str) -> int | None:
        try:
            path = self.path(key)
            return path.stat().st_size if path.is_file() else None
        except OSError:  # a name too long for the file system, say: no such object
            return None

    def read_range(self, key: str, start: int, length: int) -> bytes:
        with open(self.path(key), "rb") as f:
            f.seek(start)
            return f.read(length)

    def iter_bytes(self, key: str, start: int = 0, chunk: int = CHUNK) -> Iterator[bytes]:
        with open(self.path(key), "rb") as f:
            f.seek(start)
            while data := f.read(chunk):
                yield data

    def list(self, prefix: str = "") -> list[Entry]:
        base = self.root
        out = []
        if base.is_dir():
            for path in base.rglob("*"):
                # Our own writes in flight (see _temp_beside) are not objects yet.
                if not path.is_file() or (path.name[0] == "." and path.name.endswith(".part")):
                    continue
                key = path.relative_to(base).as_posix()
                if key.startswith(prefix):
                    out.append(Entry(key, path.stat().st_size))
        return sorted(out, key=lambda e: e.key)

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def url(self, key: str = "") -> str:
        return (self.path(key) if key else self.root).as_uri()


def _unavailable_on_boto_errors(cls: type[S3Store]) -> type[S3Store]:
    """Every public method turns botocore's failures (other than the ones it handles, such
    as a missing key) into StorageUnavailable, so callers need not import botocore."""
    from functools import wraps

    def wrap(method: Any) -> Any:
        @wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            from boto3.exceptions import Boto3Error
            from botocore.exceptions import BotoCoreError, ClientError

            try:
                result = method(*args, **kwargs)
                if method.__name__ == "iter_bytes":
                    return _guarded(result)
                return result
            # boto3's transfers (upload_file, download_file) turn a refused request into their
            # own S3UploadFailedError or RetriesExceededError, not a botocore error.
            except (BotoCoreError, ClientError, Boto3Error) as exc:
                raise StorageUnavailable(f"the object store failed: {exc}") from exc

        return call

    for name in (
        "put_file",
        "put_stream",
        "get_file",
        "size",
        "read_range",
        "list",
        "delete",
        "iter_bytes",
    ):
        setattr(cls, name, wrap(getattr(cls, name)))
    return cls


def _guarded(chunks: Iterator[bytes]) -> Iterator[bytes]:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield from chunks
    except (BotoCoreError, ClientError) as exc:
        raise StorageUnavailable(f"the object store failed: {exc}") from exc


@_unavailable_on_boto_errors
class S3Store(Store):
    """A bucket, under a prefix."""

    def __init__(self, client: S3Client, bucket: str, prefix: str = "") -> None:
        self.client, self.bucket = client, bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""

    def name(self, key: str) -> str:
        return self.prefix + check_key(key)

    def put_file(self, key: str, path: Path) -> None:
        # s3transfer switches to a multipart upload past 8 MiB; its parts become visible
        # together, on CompleteMultipartUpload.
        self.client.upload_file(str(path), self.bucket, self.name(key))

    def put_stream(self, key: str, stream: IO[bytes], *, if_absent: bool = False) -> None:
        from botocore.exceptions import ClientError

        if not if_absent:
            self.client.upload_fileobj(stream, self.bucket, self.name(key))
            return
        # A conditional PUT (If-None-Match: *, S3 since 2024, MinIO, moto) is one request,
        # so it takes the whole body: uploads are spooled to a local file first anyway.
        try:
            self.client.put_object(
                Bucket=self.bucket, Key=self.name(key), Body=stream, IfNoneMatch="*"
            )
        except ClientError as exc:
            if _code(exc) in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                raise AlreadyExists(key) from None
            raise

    def get_file(self, key: str, path: Path) -> bool:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".part")
        try:
            self.client.download_file(self.bucket, self.name(key), str(tmp))
        except Exception as exc:
            tmp.unlink(missing_ok=True)
            if _missing(exc):
                return False
            raise
        os.replace(tmp, path)
        return True

    def size(self, key: str) -> int | None:
        try:
            return int(
                self.client.head_object(Bucket=self.bucket, Key=self.name(key))["ContentLength"]
            )
        except Exception as exc:
            if _missing(exc):
                return None
            raise

    def read_range(self, key: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        body = self.client.get_object(
            Bucket=self.bucket, Key=self.name(key), Range=f"bytes={start}-{start + length - 1}"
        )["Body"]
        with body:
            data: bytes = body.read()
        return data

    def iter_bytes(self, key: str, start: int = 0, chunk: int = CHUNK) -> Iterator[bytes]:
        body = self.client.get_object(
            Bucket=self.bucket, Key=self.name(key), Range=f"bytes={start}-" if start else ""
        )["Body"]
        with body:
            yield from body.iter_chunks(chunk)

    def list(self, prefix: str = "") -> list[Entry]:
        out = []
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + prefix
        )
        for page in pages:
            for obj in page.get("Contents", []):
                out.append(Entry(obj["Key"][len(self.prefix) :], int(obj["Size"])))
        return sorted(out, key=lambda e: e.key)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.name(key))

    def url(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{self.prefix}{key}"


def _code(exc: Any) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))


def _missing(exc: Exception) -> bool:
    return _code(exc) in ("404", "NoSuchKey", "NotFound")


class Sub(Store):
    """A store under a key prefix of another (``artifacts/`` and ``data/`` of one bucket)."""

    def __init__(self, base: Store, prefix: str) -> None:
        self.base, self.prefix = base, prefix.strip("/") + "/"

    def _k(self, key: str) -> str:
        return self.prefix + check_key(key)

    def put_file(self, key: str, path: Path) -> None:
        self.base.put_file(self._k(key), path)

    def put_stream(self, key: str, stream: IO[bytes], *, if_absent: bool = False) -> None:
        self.base.put_stream(self._k(key), stream, if_absent=if_absent)

    def get_file(self, key: str, path: Path) -> bool:
        return self.base.get_file(self._k(key), path)

    def size(self, key: str) -> int | None:
        return self.base.size(self._k(key))

    def read_range(self, key: str, start: int, length: int) -> bytes:
        return self.base.read_range(self._k(key), start, length)

    def iter_bytes(self, key: str, start: int = 0, chunk: int = CHUNK) -> Iterator[bytes]:
        return self.base.iter_bytes(self._k(key), start, chunk)

    def list(self, prefix: str = "") -> list[Entry]:
        return [
            Entry(e.key[len(self.prefix) :], e.size) for e in self.base.list(self.prefix + prefix)
        ]

    def delete(self, key: str) -> None:
        self.base.delete(self._k(key))

    def local_root(self) -> Path | None:
        root = self.base.local_root()
        return None if root is None else root / self.prefix.rstrip("/")

    def url(self, key: str = "") -> str:
        return self.base.url(self.prefix + key)


@dataclass(frozen=True)
class StorageConfig:
    """What a process needs to open the stores: plain strings, so it travels in a training
    child's payload (to another host, under Ray). Credentials are never in it: boto3 reads
    them from each host's own environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
    AWS_SESSION_TOKEN, AWS_PROFILE, an instance role)."""

    url: str | None  # None: the three directories below
    artifact_dir: str
    data_dir: str
    code_dir: str
    s3_endpoint_url: str | None = None
    s3_region: str | None = None

    def to_dict(self) -> dict[str, str | None]:
        return {
            "url": self.url,
            "artifact_dir": self.artifact_dir,
            "data_dir": self.data_dir,
            "code_dir": self.code_dir,
            "s3_endpoint_url": self.s3_endpoint_url,
            "s3_region": self.s3_region,
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> StorageConfig:
        return StorageConfig(**d)


@dataclass(frozen=True)
class Storage:
    artifacts: Store
    data: Store
    code: Store
    config: StorageConfig

    @property
    def remote(self) -> bool:
        return self.artifacts.local_root() is None


def s3_client(endpoint_url: str | None, region: str | None) -> S3Client:
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"max_attempts": 5, "mode": "standard"},
        # MinIO, Ceph and moto serve buckets under the path, not as a subdomain.
        s3={"addressing_style": "path"} if endpoint_url else {},
    )
    client: S3Client = boto3.session.Session().client(
        "s3", endpoint_url=endpoint_url, region_name=region, config=config
    )
    return client


def check_storage_url(url: str) -> tuple[str, str, str]:
    """(scheme, bucket or '', path) of a usable HALFWAY_STORAGE_URL; StorageError if not."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
            raise StorageError(f"{url}: a file:// URL names a local path (file:///...)")
    elif parsed.scheme == "s3":
        if not parsed.netloc:
            raise StorageError(f"{url}: an s3:// URL names a bucket (s3://bucket/prefix)")
    else:
        raise StorageError(f"{url}: HALFWAY_STORAGE_URL is file:///path or s3://bucket/prefix")
    return parsed.scheme, parsed.netloc, unquote(parsed.path)


@functools.lru_cache(maxsize=8)
def open_storage(config: StorageConfig) -> Storage:
    """The stores a configuration names; one per process and configuration (a boto3 client
    costs tens of milliseconds to build and is safe to share between threads)."""
    if not config.url:
        return Storage(
            FileStore(Path(config.artifact_dir)),
            FileStore(Path(config.data_dir)),
            FileStore(Path(config.code_dir)),
            config,
        )
    scheme, bucket, path = check_storage_url(config.url)
    if scheme == "file":
        root: Store = FileStore(Path(path))
    else:
        client = s3_client(config.s3_endpoint_url, config.s3_region)
        root = S3Store(client, bucket, path)
    return Storage(Sub(root, "artifacts"), Sub(root, "data"), Sub(root, "code"), config)
