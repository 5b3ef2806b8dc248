"""Objects under one fsspec URL: small whole objects, large ones part by part, create-only commit records.

The object tier's only way to the store. Three backends behind one interface:
S3Store (s3fs: multipart uploads with parts in flight at once, If-None-Match
create-only writes, abandoned multipart uploads aborted), LocalStore (file://:
temporary name, fsync, rename, and create-only through link()), and the base
ObjectStore for any other fsspec URL (create-only is check-then-write there:
documented in docs/GUIDE.md). Every object is written through one ObjectParts that
open_parts returns (put() writes a small one through it too). Calls block: make
them from worker threads. Paths are relative to the URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import fsspec
from ckpt_core.errors import CheckpointError
from ckpt_core.format import PARTIAL_SUFFIX

from ckptd.storage.durable_write import fsync_dir, make_dirs, write_file

UPLOAD_CONCURRENCY = 8  # parts of one object in flight at once (and batches of deletes)
DELETE_BATCH = 1000  # keys one DeleteObjects request removes at most

F = TypeVar("F", bound=Callable[..., Any])


class ObjectStoreError(OSError):
    """The store or the way to it failed (an HTTP error, a refused connection, a timeout)."""


def _store_errors(method: F) -> F:
    """Raise what a backend raises as OSError, the one kind of error callers expect from a store."""

    @functools.wraps(method)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except (OSError, CheckpointError):  # a store's own, or a caller's from the parts it hands over
            raise
        except Exception as e:  # botocore, aiohttp and fsspec backends each have their own
            raise ObjectStoreError(f"{type(e).__name__}: {e}") from e

    return guarded  # type: ignore[return-value]


def shown_url(url: str) -> str:
    """Return url as status, logs and errors show it: without a user or password written into it (s3://k:s@b/p)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority, slash, path = rest.partition("/")
    host = authority.rpartition("@")[2]
    return f"{scheme}://{'***@' if '@' in authority else ''}{host}{slash}{path}"


class ObjectStore:
    """Read and write objects under one URL through fsspec (any backend)."""

    # Shard objects spread over hash prefixes (tiers/object_keys): object stores throttle requests per prefix.
    spreads_keys = True

    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        self.url = url.rstrip("/")
        self.shown = shown_url(self.url)  # for messages and status: never the credentials a URL may carry
        # No listings cache: other nodes write to the same prefix, and a cached listing
        # would hide their objects (s3fs even answers reads of an object from it).
        fs, root = fsspec.url_to_fs(self.url, **{"use_listings_cache": False, **storage_options})
        self.fs: Any = fs
        self.root = root.rstrip("/")

    def bucket_missing(self) -> str | None:
        """Return the bucket's name if the store says it does not exist, else None (stores with no buckets: None)."""
        return None

    def path(self, *names: str) -> str:
        """Return the store path of names under the URL."""
        return "/".join([self.root, *names])

    def describe(self, *names: str) -> str:
        """Return the URL of names under the store, for messages (without credentials)."""
        return "/".join([self.shown, *names])

    @_store_errors
    def names(self, *directory: str) -> dict[str, int]:
        """Return {name: size in bytes} of what is directly under directory (empty when there is nothing)."""
        try:
            entries = self.fs.ls(self.path(*directory), detail=True, refresh=True)
        except FileNotFoundError:
            return {}
        found = {}
        for e in entries:
            name = e["name"].rstrip("/").rsplit("/", 1)[-1]
            found[name] = -1 if e.get("type") == "directory" else int(e.get("size") or 0)
        return found

    @_store_errors
    def read(self, *names: str, start: int | None = None, end: int | None = None) -> bytes:
        """Return an object's bytes, or bytes [start, end) of it; raise FileNotFoundError if it is missing."""
        return bytes(self.fs.cat_file(self.path(*names), start=start, end=end))

    @_store_errors
    def put(self, data: bytes, *names: str) -> None:
        """Write a small object whole, replacing any object of that name."""
        parts = self.open_parts(*names)
        parts.put(data)
        parts.finish()

    @_store_errors
    def open_parts(self, *names: str) -> ObjectParts:
        """Begin writing an object part by part (see ObjectParts): it replaces any object of that name once finished."""
        return _FsspecParts(self, names)

    @_store_errors
    def create(self, data: bytes, *names: str) -> bool:
        """Write a small object only if none of that name exists; return whether this call wrote it."""
        if self.fs.exists(self.path(*names)):
            return False
        self.put(data, *names)
        return True

    @_store_errors
    def remove_dir(self, *directory: str) -> None:
        """Remove everything under directory (nothing there is fine)."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(*directory), recursive=True)

    @_store_errors
    def remove(self, *names: str) -> None:
        """Remove one object (a missing one is fine)."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(*names))

    @_store_errors
    def remove_objects(self, paths: list[tuple[str, ...]]) -> None:
        """Remove objects by name (missing ones are fine), with the temporaries a crashed write of them left.

        A directory left with nothing else in it goes too: on a filesystem it would stay for ever.
        """
        by_dir: dict[tuple[str, ...], set[str]] = {}
        for path in paths:
            by_dir.setdefault(path[:-1], set()).add(path[-1])
        for directory, names in by_dir.items():
            listed = self.names(*directory)
            doomed = {n for n in listed if n in names or _written_as(n) in names}
            if doomed and doomed == set(listed):
                self.remove_dir(*directory)
                continue
            for name in doomed:
                self.remove(*directory, name)

    @_store_errors
    def abort_uploads(self, *directory: str) -> int:
        """Abort unfinished multipart uploads under directory; return how many (only S3 has them)."""
        return 0

    @_store_errors
    def unfinished_uploads(self, *directory: str) -> list[str]:
        """Return the paths, relative to the URL, of objects under directory with an unfinished upload."""
        return []


class LocalStore(ObjectStore):
    """A directory on a mounted filesystem (file://): durable writes, atomic renames and links."""

    spreads_keys = False  # a filesystem has no per-prefix limit: the flat layout, which ckpt.load_local reads as is

    @_store_errors
    def open_parts(self, *names: str) -> ObjectParts:
        return _FileParts(self.path(*names))

    @_store_errors
    def create(self, data: bytes, *names: str) -> bool:
        target = self.path(*names)
        make_dirs(Path(target).parent)
        temporary = _temporary_name(target)
        try:
            write_file(Path(temporary), [data])
            os.link(temporary, target)  # fails if the name exists: create-only, and atomic
        except FileExistsError:
            return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
        fsync_dir(os.path.dirname(target))
        return True


class S3Store(ObjectStore):
    """An S3 bucket and prefix through s3fs: multipart uploads with parts in flight at once."""

    def bucket_missing(self) -> str | None:
        """Return the bucket's name if the store answers that it does not exist, else None (also if it does not answer).

        Called once at the daemon's start, on a worker thread: ckptd never creates a bucket.
        """
        bucket = self.fs.split_path(self.path())[0]
        try:
            self._call("head_bucket", Bucket=bucket)
        except FileNotFoundError:
            return bucket
        except Exception:  # an outage at start is not a config error: uploads retry it and say so
            return None
        return None

    @_store_errors
    def names(self, *directory: str) -> dict[str, int]:
        # One ListObjectsV2 per 1,000 names: s3fs's ls lists the parent too when nothing is there.
        bucket, key, _ = self.fs.split_path(self.path(*directory))
        prefix = f"{key}/" if key else ""
        found: dict[str, int] = {}
        markers: dict[str, str] = {}
        while True:
            listed = self._call("list_objects_v2", Bucket=bucket, Prefix=prefix, Delimiter="/", **markers)
            found |= {p["Prefix"][len(prefix) :].rstrip("/"): -1 for p in listed.get("CommonPrefixes", [])}
            found |= {o["Key"][len(prefix) :]: int(o["Size"]) for o in listed.get("Contents", []) if o["Key"] != prefix}
            if not listed.get("IsTruncated"):
                return found
            markers = {"ContinuationToken": listed["NextContinuationToken"]}

    @_store_errors
    def read(self, *names: str, start: int | None = None, end: int | None = None) -> bytes:
        if start is not None or end is not None:
            return super().read(*names, start=start, end=end)
        # One GET: s3fs first asks a whole object's size (a HEAD, and a LIST when it is missing) to
        # fetch a large one in parallel, and every object read whole here is a small record.
        bucket, key, _ = self.fs.split_path(self.path(*names))

        async def get() -> bytes:
            reply = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)  # NoSuchKey: FileNotFoundError
            try:
                return bytes(await reply["Body"].read())
            finally:
                reply["Body"].close()

        return asyncio.run_coroutine_threadsafe(get(), self.fs.loop).result()

    @_store_errors
    def remove_objects(self, paths: list[tuple[str, ...]]) -> None:
        # DeleteObjects by name, UPLOAD_CONCURRENCY batches at once: no listing (S3 leaves no temporaries,
        # only unfinished multipart uploads, which abort_uploads removes).
        keys = [self.fs.split_path(self.path(*p)) for p in paths]
        batches = [keys[i : i + DELETE_BATCH] for i in range(0, len(keys), DELETE_BATCH)]
        for at in range(0, len(batches), UPLOAD_CONCURRENCY):
            in_flight = [
                asyncio.run_coroutine_threadsafe(
                    self.fs._call_s3(
                        "delete_objects",
                        Bucket=batch[0][0],
                        Delete={"Objects": [{"Key": key} for _, key, _ in batch], "Quiet": True},
                    ),
                    self.fs.loop,
                )
                for batch in batches[at : at + UPLOAD_CONCURRENCY]
            ]
            errors = [e for f in in_flight for e in f.result().get("Errors", [])]
            if errors:
                raise ObjectStoreError(f"{len(errors)} objects were not removed, first {errors[0]}")

    @_store_errors
    def open_parts(self, *names: str) -> ObjectParts:
        return _S3Parts(self, names)

    @_store_errors
    def create(self, data: bytes, *names: str) -> bool:
        try:
            self.fs.pipe_file(self.path(*names), data, mode="create")  # If-None-Match: *
        except FileExistsError:
            return False
        return True

    @_store_errors
    def abort_uploads(self, *directory: str) -> int:
        bucket, _, _ = self.fs.split_path(self.path(*directory))
        uploads = self._uploads(*directory)
        for key, upload_id in uploads:
            self._call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        return len(uploads)

    @_store_errors
    def unfinished_uploads(self, *directory: str) -> list[str]:
        _, root, _ = self.fs.split_path(self.root + "/")
        return [key[len(root) :].lstrip("/") for key, _ in self._uploads(*directory)]

    def _uploads(self, *directory: str) -> list[tuple[str, str]]:
        """Return (key, upload id) of every unfinished multipart upload under directory, every page of them."""
        bucket, prefix, _ = self.fs.split_path(self.path(*directory))
        found: list[tuple[str, str]] = []
        markers: dict[str, str] = {}
        while True:
            listed = self._call("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers)
            for u in listed.get("Uploads", []):
                if u["Key"] == prefix or u["Key"].startswith(prefix + "/"):
                    found.append((u["Key"], u["UploadId"]))
            if not listed.get("IsTruncated"):
                return found
            markers = {"KeyMarker": listed["NextKeyMarker"], "UploadIdMarker": listed["NextUploadIdMarker"]}

    def _call(self, method: str, **kwargs: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(self.fs._call_s3(method, **kwargs), self.fs.loop).result()


def open_store(url: str, storage_options: dict[str, Any]) -> ObjectStore:
    """Return the store for an fsspec URL, with the backend its protocol needs."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol in ("s3", "s3a"):
        return S3Store(url, storage_options)
    if protocol in ("file", "local"):
        return LocalStore(url, storage_options)
    return ObjectStore(url, storage_options)


def _temporary_name(target: str) -> str:
    """Name a temporary for the object target: <target>.<random>.partial (see _written_as)."""
    return f"{target}.{uuid.uuid4().hex[:8]}{PARTIAL_SUFFIX}"


def _written_as(name: str) -> str:
    """Return the object a temporary name stands for (see _temporary_name), else ""."""
    return name[: -len(PARTIAL_SUFFIX)].rsplit(".", 1)[0] if name.endswith(PARTIAL_SUFFIX) else ""


class ObjectParts(ABC):
    """One object on its way into a store, part by part: readers see it whole once finished, or never.

    ObjectStore.open_parts returns it; then, from one thread: put() for every part, in
    order, then finish(), or abort() at any point before (from that thread too). A put()
    or finish() that fails aborts it first. After finish or abort it is spent; abort is
    safe to call again. Parts but the last must be of at least 5 MiB (S3's multipart
    floor); a part handed to put() is the store's from then on: never change it.
    """

    @abstractmethod
    def put(self, part: bytes) -> None:
        """Add the next part (it may still be on its way when put returns)."""

    @abstractmethod
    def finish(self) -> None:
        """Make the object whole under its name, once every part is in (no part at all: an empty object)."""

    @abstractmethod
    def abort(self) -> None:
        """Give the object up: nothing of it stays (no temporary, no unfinished multipart upload)."""


class _TemporaryParts(ObjectParts):
    """A file object under a temporary name, written part by part in order; finish moves it into place (_install)."""

    _file: Any

    @_store_errors
    def put(self, part: bytes) -> None:
        try:
            self._file.write(part)  # a buffered file writes all of it, or raises
        except BaseException:
            self.abort()
            raise

    @_store_errors
    def finish(self) -> None:
        try:
            self._install()
        except BaseException:
            self.abort()
            raise

    @abstractmethod
    def _install(self) -> None:
        """Close the file and give it the object's name."""


class _FsspecParts(_TemporaryParts):
    """Any fsspec backend: a file object under a temporary name, moved into place once finished."""

    def __init__(self, store: ObjectStore, names: tuple[str, ...]) -> None:
        self._fs = store.fs
        self._target = store.path(*names)
        self._temporary = _temporary_name(self._target)  # a file object commits what it has when closed
        self._file = self._fs.open(self._temporary, "wb")

    def _install(self) -> None:
        self._file.close()
        self._fs.mv(self._temporary, self._target)

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._file.close()
        with contextlib.suppress(Exception):
            self._fs.rm_file(self._temporary)


class _FileParts(_TemporaryParts):
    """A file under a temporary name, written through the page cache, fsynced and renamed into place once finished.

    Not durable_write.RangeWriter: its direct I/O suits NVMe, not a store that may be a network
    filesystem, where uncached writes would each wait for the server.
    """

    def __init__(self, target: str) -> None:
        make_dirs(Path(target).parent)
        self._target = target
        self._temporary = Path(_temporary_name(target))
        self._file = open(self._temporary, "wb")  # noqa: SIM115 (kept open across put calls, closed by finish/abort)

    def _install(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._temporary, self._target)
        fsync_dir(os.path.dirname(self._target))

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()
        self._temporary.unlink(missing_ok=True)


class _S3Parts(ObjectParts):
    """A multipart upload with up to UPLOAD_CONCURRENCY parts in flight (a window, not batches); one part: a PUT.

    An unfinished upload of the same key (a crash's) is aborted when it opens. The first part
    waits for the second: only then is a multipart upload begun.
    """

    def __init__(self, store: S3Store, names: tuple[str, ...]) -> None:
        self._store = store
        self._fs = store.fs  # s3fs: its event loop and its S3 calls, for the parts in flight
        self._path = store.path(*names)
        self._bucket, self._key, _ = self._fs.split_path(self._path)
        store.abort_uploads(*names)  # an upload of this object that a crash left unfinished
        self._first: bytes | None = None
        self._upload_id: str | None = None
        self._in_flight: dict[int, Future[Any]] = {}
        self._etags: dict[int, str] = {}
        self._sent = 0  # parts handed to the store: the last one's number

    @_store_errors
    def put(self, part: bytes) -> None:
        try:
            if self._upload_id is None:
                if self._first is None:
                    self._first = part
                    return
                reply = self._store._call("create_multipart_upload", Bucket=self._bucket, Key=self._key)
                self._upload_id = reply["UploadId"]
                first, self._first = self._first, None
                self._send(first)
            self._send(part)
        except BaseException:
            self.abort()
            raise

    def _send(self, part: bytes) -> None:
        while len(self._in_flight) >= UPLOAD_CONCURRENCY:
            self._collect_one()
        self._sent += 1
        coro = self._fs._call_s3(
            "upload_part",
            Bucket=self._bucket,
            Key=self._key,
            UploadId=self._upload_id,
            PartNumber=self._sent,
            Body=part,
        )
        self._in_flight[self._sent] = asyncio.run_coroutine_threadsafe(coro, self._fs.loop)

    def _collect_one(self) -> None:
        first = min(self._in_flight)
        self._etags[first] = self._in_flight.pop(first).result()["ETag"]

    @_store_errors
    def finish(self) -> None:
        try:
            if self._upload_id is None:  # one part (or none): a plain PUT
                self._store._call("put_object", Bucket=self._bucket, Key=self._key, Body=self._first or b"")
                self._first = None
            else:
                while self._in_flight:
                    self._collect_one()
                done = [{"PartNumber": n, "ETag": self._etags[n]} for n in sorted(self._etags)]
                self._store._call(
                    "complete_multipart_upload",
                    Bucket=self._bucket,
                    Key=self._key,
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": done},
                )
                self._upload_id = None
        except BaseException:
            self.abort()
            raise
        self._fs.invalidate_cache(self._path)

    def abort(self) -> None:
        for f in self._in_flight.values():
            f.cancel()
        self._in_flight.clear()
        self._first = None
        upload_id, self._upload_id = self._upload_id, None
        if upload_id is not None:
            with contextlib.suppress(OSError):  # else the next upload of this object, or the step's removal, aborts it
                self._store._call("abort_multipart_upload", Bucket=self._bucket, Key=self._key, UploadId=upload_id)
