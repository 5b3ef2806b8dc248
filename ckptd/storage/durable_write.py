"""Write files durably: aligned direct I/O with a clean fallback, short writes, fsync of file and directory.

The one place the daemon writes bytes it promises to keep. The commit protocol
(commit_protocol.py) orders these writes; the NVMe flush, the replica receiver,
restore and the file:// object store call it. Calls block: make them from worker
threads. A RangeWriter may be written from several threads at once, each its own
byte range.

Modes are explicit, whatever the umask: directories owned_dir.DIR_MODE (0750), files
owned_dir.FILE_MODE (0640) unless a caller names another. No file is opened through a
symbolic link (O_NOFOLLOW), and new files are made with O_EXCL: a link planted at a
temporary name makes the write fail, it is never followed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Iterable
from pathlib import Path

from ckptd.storage.owned_dir import DIR_MODE, FILE_MODE, create_new

DIRECT_IO_ALIGN_BYTES = 4096


class RangeWriter:
    """Write byte ranges of one new file, with O_DIRECT where the filesystem and the memory allow it.

    Order of calls: RangeWriter(path) creates the file; write_range() any number of
    times, from any threads, on ranges that do not overlap; finish(size_bytes)
    once every write has returned; close() always (also after a failure).

    A direct write needs 4 KiB-aligned memory, offset and length: the caller passes
    a view that may run past `length` up to the next 4 KiB (those padding bytes land
    past the end and finish() cuts them off). When a direct write is refused with
    EINVAL, even after part of a range went out, the rest of that range and every
    later one go through the page cache, starting at the first byte not yet written.
    """

    def __init__(self, path: Path, truncate: bool = True, size_bytes: int = 0) -> None:
        """Open path for writing, created if missing; truncate=False for a file other writers share.

        size_bytes > 0 allocates the file's blocks at once (posix_fallocate): direct writes into
        allocated blocks go faster than writes that allocate as they go (about a tenth here, in
        several ranges at once), and a full disk is known before any byte is written.
        """
        self.path = path
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_TRUNC if truncate else 0)
        self._fd = os.open(path, flags, FILE_MODE)  # made by StepDirCommit.create_temporary, at its mode
        if size_bytes:
            try:
                os.posix_fallocate(self._fd, 0, size_bytes)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem that cannot: write as it goes
                    os.close(self._fd)
                    raise
        self._direct_fd: int | None = None
        try:
            self._direct_fd = os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: this filesystem does no direct I/O
                os.close(self._fd)
                raise
        self._lock = threading.Lock()
        self.direct_refused = False

    def write_range(self, view: memoryview, offset: int, length: int) -> None:
        """Write view[:length] at offset; view may hold padding up to the next 4 KiB for a direct write."""
        done = 0
        if self._direct_fd is not None and not self.direct_refused:
            padded = min(len(view), -(-length // DIRECT_IO_ALIGN_BYTES) * DIRECT_IO_ALIGN_BYTES)
            try:
                while done < length:
                    n = os.pwrite(self._direct_fd, view[done:padded], offset + done)
                    if n <= 0:
                        raise OSError(errno.EIO, f"{self.path}: a write of {padded - done} bytes wrote nothing")
                    done += n
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct_refused = True  # this filesystem took O_DIRECT at open, but not for this write
        while done < length:  # the unwritten tail, through the page cache
            n = os.pwrite(self._fd, view[done:length], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"{self.path}: a write of {length - done} bytes wrote nothing")
            done += n

    def finish(self, size_bytes: int) -> None:
        """Cut the file to size_bytes (direct writes pad the last block) and fsync it."""
        os.ftruncate(self._fd, size_bytes)
        os.fsync(self._fd)

    def close(self) -> None:
        """Close the file's descriptors (idempotent)."""
        with self._lock:
            for fd in (self._fd, self._direct_fd):
                if fd is not None and fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._fd, self._direct_fd = -1, None


def write_file(path: Path, parts: Iterable[bytes | memoryview], mode: int = FILE_MODE, durable: bool = True) -> None:
    """Write a new file (none may have its name) from parts and fsync it (unless not durable): the caller renames it."""
    fd = create_new(path, mode)
    try:
        for part in parts:
            view = memoryview(part)
            while view:
                n = os.write(fd, view)
                if n <= 0:
                    raise OSError(errno.EIO, f"{path}: a write wrote nothing")
                view = view[n:]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: Path, data: bytes, mode: int = FILE_MODE, durable: bool = True) -> None:
    """Replace a file whole: written and fsynced as path.tmp, renamed over path, the directory fsynced.

    durable=False skips both fsyncs, for the staging markers: their slot's bytes are never fsynced
    either (shared memory), and Commit, which the training thread waits for, writes two of them.
    What has the temporary name (left by a crash, or a link planted there) is removed first,
    never followed. One writer per path: callers that share one hold a lock around it.
    """
    temporary = path.with_name(path.name + ".tmp")
    temporary.unlink(missing_ok=True)
    write_file(temporary, [data], mode, durable)
    os.replace(temporary, path)
    if durable:
        fsync_dir(path.parent)


def fsync_dir(path: Path | str) -> None:
    """Make a directory's entries (a rename, a new or removed name) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:  # some filesystems cannot fsync a directory: nothing more to do there
            raise
    finally:
        os.close(fd)


def make_dirs(path: Path) -> None:
    """Create path and its missing parents (mode DIR_MODE), each made durable in its parent."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, DIR_MODE)
            os.chmod(directory, DIR_MODE)  # mkdir's mode passed through the umask
        except FileExistsError:
            pass  # made by another writer meanwhile
        fsync_dir(directory.parent)
