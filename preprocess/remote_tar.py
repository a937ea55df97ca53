"""A tar in a bucket, read while it downloads: spooled to local scratch by a background thread.

The tar reader (``preprocess.tar_samples``) reads a local tar by byte ranges (``pread``). An object is
brought to a local scratch file (``$SHARDIO_SCRATCH``, else the system temp dir) by one background thread,
in ranged GETs of ``CHUNK_BYTES`` (8 MB: large enough that request overhead is small, small enough that
the first samples decode after one request) written in order; a read of a range that has not arrived
yet waits for it. So decoding starts after the first chunk and overlaps the rest of the download, and
memory stays at one chunk whatever the tar's size (several GB is common): the tar is on disk, never
whole in memory.

The scratch file has no name from the start (``tempfile.TemporaryFile``: ``O_TMPFILE``, or unlinked at
once), so it is gone however the input ends: finished, failed, cancelled, or the worker killed (the
kernel frees it with the last descriptor). A download that fails for good (obstore has already retried
transient errors: connection resets, 5xx, SlowDown, with backoff) fails this input only, naming the URL,
how far it got and why (``InputError``). The object is read at the size its LIST reported, and with the
listed ETag one HEAD at the end checks it was not replaced while it was read (an object replaced mid-way
would mix two archives' bytes); a mismatch fails the input, and the next run reads the new object.
"""

from __future__ import annotations

import io
import os
import tempfile
import threading
from typing import Any

from shardio import storage
from shardio.errors import InputError
from shardio.object_storage import scratch_dir

__all__ = ["SpooledObject", "CHUNK_BYTES"]

CHUNK_BYTES = 8 << 20
# tarfile reads 512-byte headers; a buffer this size turns those into few waits on the spool.
_READ_BUFFER = 1 << 20


class SpooledObject:
    """One object being downloaded into an anonymous scratch file; ``pread`` waits for its range.

    A context manager: leaving it stops the download (after the request in flight) and frees the file.
    ``backend`` is the object's ``Storage`` (``read_range``, ``info``); tests pass a stand-in.
    """

    def __init__(self, url: str, size: int, etag: str = "", backend: Any = None,
                 chunk_bytes: int | None = None) -> None:
        self.url, self.size, self.etag = url, size, etag
        self._backend = backend if backend is not None else storage.for_path(url)
        self._chunk = chunk_bytes or CHUNK_BYTES
        self._file = tempfile.TemporaryFile(dir=scratch_dir(), prefix=".shardio-spool-")
        self._fd = self._file.fileno()
        self._arrived = 0  # bytes [0, arrived) are in the scratch file
        self._error: BaseException | None = None
        self._done = self._closed = False
        self._changed = ""  # why the object is not the listed one, found after its last byte
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._download, name=f"spool {url}", daemon=True)
        self._thread.start()

    def __enter__(self) -> SpooledObject:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _download(self) -> None:
        offset = 0
        try:
            while offset < self.size:
                if self._closed:
                    return
                length = min(self._chunk, self.size - offset)
                data = self._backend.read_range(self.url, offset, length)
                if len(data) != length:
                    raise InputError(self.url, f"the object ends at byte {offset + len(data)}, not at {self.size} "
                                     "as listed: it changed while it was read; rerun")
                view = memoryview(data)
                while view:
                    written = os.pwrite(self._fd, view, offset)
                    view, offset = view[written:], offset + written
                with self._cond:
                    self._arrived = offset
                    self._cond.notify_all()
            if self.etag:
                now = self._backend.info(self.url).version
                if now and now != self.etag:
                    self._changed = (f"the object was replaced while it was read (ETag {now}, listed as "
                                     f"{self.etag}): not committed; the next run reads the new one")
        except BaseException as e:  # noqa: BLE001 - handed to the reading thread, which raises it
            with self._cond:
                self._error = e
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()
                if self._closed:
                    self._file.close()

    def _raise_failure(self) -> None:
        error = self._error
        if isinstance(error, InputError):
            raise error
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
        if isinstance(error, FileNotFoundError):
            reason = "the object is gone (deleted since it was listed)"
        raise InputError(self.url, f"download failed at byte {self._arrived} of {self.size}: {reason}") from error

    def pread(self, length: int, offset: int) -> bytes:
        """Up to ``length`` bytes at ``offset`` (fewer only past the end), once they have arrived."""
        end = min(offset + length, self.size)
        with self._cond:
            while self._arrived < end and self._error is None:
                self._cond.wait()
            if self._arrived < end:
                self._raise_failure()
        return os.pread(self._fd, max(0, end - offset), offset) if end > offset else b""

    def read_some(self, length: int, offset: int) -> bytes:
        """At least one byte at ``offset`` (b"" at the end), at most ``length``: what has arrived, so a
        buffered reader never waits for more than the bytes it was asked for."""
        with self._cond:
            while self._arrived <= offset < self.size and self._error is None:
                self._cond.wait()
            if self._arrived <= offset < self.size:
                self._raise_failure()
            available = min(length, self._arrived - offset)
        return os.pread(self._fd, available, offset) if available > 0 else b""

    def reader(self) -> io.BufferedReader:
        """A seekable binary file over the spool (for ``tarfile``), blocking like ``pread``."""
        return io.BufferedReader(_SpoolReader(self), buffer_size=_READ_BUFFER)

    def finish(self) -> None:
        """Wait for the end of the download; raise ``InputError`` if it failed or the object changed."""
        with self._cond:
            while not self._done:
                self._cond.wait()
        if self._error is not None:
            self._raise_failure()
        if self._changed:
            raise InputError(self.url, self._changed)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            if self._done:
                self._file.close()  # else the download thread closes it when its request returns


class _SpoolReader(io.RawIOBase):
    def __init__(self, spool: SpooledObject) -> None:
        self._spool, self._pos = spool, 0
        self.name = spool.url

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._spool.read_some(len(buffer), self._pos)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._spool.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos
