"""obstore's ``ReadableFile`` (a seekable reader of ranged GETs) as a binary file object: what
``ObjectStorage.open_read`` returns, so callers read an object as they read a local file."""

from __future__ import annotations

import io
from typing import Any

__all__ = ["ReaderFile"]


class ReaderFile(io.RawIOBase):
    """obstore's ReadableFile as a binary file object (context manager, readinto)."""

    def __init__(self, reader: Any, path: str) -> None:
        self._reader, self.name = reader, path

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        return bytes(self._reader.read() if size is None or size < 0 else self._reader.read(size))

    def readall(self) -> bytes:
        return self.read()

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._reader.seek(offset, whence)

    def tell(self) -> int:
        return self._reader.tell()

    def close(self) -> None:
        if not self.closed:
            self._reader.close()
        super().close()
