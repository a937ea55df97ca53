"""A batch's slices of shards copied into one buffer, in one native call (numpy where it is not built):
from their memory maps (``gather``) or read from the files with ``pread`` (``read``); and the kernel asked
to read ahead the slices of the batch after it (``will_need``).

With the default shuffle (windows of 256 shards, blocks of 1) a batch of 256 is 256 slices of 196 KB from
as many places. ``torch.cat`` over them split the copy over torch's OpenMP threads, which wait for each
other on cores the training loop keeps busy: a shuffled epoch read at 0.18-0.20 of ``np.copyto``, against
0.96 sequential (``python -m bench.reader``; ``--shuffled-gather`` sets the ways of copying side by side,
docs/reader.md has the figures). The optional extension ``shardio.read._gather`` copies a batch in one
call, its bytes split evenly over threads, the GIL released; where it is not built (a training image
without a C compiler), numpy copies the slices one after the other from the maps (the GIL released during
each copy): the same bytes in the same places.

**Maps or pread, measured** (a 2-core AMD EPYC VM, Linux 6.18, ext4, page cache warm; 12 shards of 250
256x256 images, 590 MB; batches of 256 single-sample slices against ``np.copyto`` of the same bytes on one
thread, 21-23 GB/s; medians of 3-5 rounds: ``python -m bench.gather``, its rows ``map_ways`` and
``assembly``)::

                                              1 thread    2 threads
    maps whose pages are mapped already         0.87-0.93   1.16
    fresh maps: a page fault every 16 pages     0.53-0.55   0.78
    fresh maps + MAP_POPULATE (whole shard)     0.38-0.40
    fresh maps + MADV_POPULATE_READ a slice     0.36
    fresh maps + MADV_HUGEPAGE                  0.54-0.57   (no effect: the page cache holds small folios)
    fresh maps + MADV_WILLNEED                  0.53-0.56
    pread into the batch                        0.59        0.85

Populating a map costs what faulting it does, or more (page by page, without the fault-around of 16
pages); huge pages need huge page-cache folios, which a file read into the page cache does not get here.
``pread`` moves no page tables: the kernel copies from the page cache into the batch at ~14 GB/s a core
(13.9 GB/s into a 196 KB buffer that stays in the cache: its copy, not the destination, is the limit), and
takes no lock the other copy threads or the training loop need, where a fault on every thread shares the
process's page tables (the 16-core H100 host's fresh maps: 8.2 GB/s with 2.9 of 8 copy threads busy).
Hence ``BatchAssembler``'s choice, made once per dataset: copy from the maps when every shard's map stays
open (its pages are mapped in the first epoch and read at memory speed in every later one), else ``pread``
(each slice is a first touch every epoch, and ``pread`` is the faster first touch). A cold batch (its files
dropped from the page cache) took 405-467 ms by page faults, 46-79 ms with ``will_need`` first and 60-73 ms
by ``pread`` on one thread (a loaded VM).

**Threads**: C threads, a pool kept across batches (``_gather.c``), rather than Python threads each calling
a GIL-free C routine: a Python thread takes the GIL back to return from each call, and with the training
loop's thread holding it that waits up to the switch interval (5 ms), more than a 50 MB batch's copy at
27 GB/s (1.9 ms); the pool's threads never touch Python. Kept rather than started per batch: a 16-core host
would start up to 7 threads a batch; on the 2-core VM the two cost the same within its noise (an 8 MB batch
on 2 threads: 150-156 us with the pool, 158-176 us starting a thread per call).

``will_need`` is advice (``madvise(MADV_WILLNEED)``): a shard file not in the page cache is read ahead
while the batch before is copied, instead of one page fault (or one ``pread``) at a time in the copy.
Without the extension it does nothing.
"""

from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Callable, Sequence

import numpy as np

from shardio.errors import ShardIntegrityError

try:
    from shardio.read import _gather
except ImportError:  # optional, like the JPEG decoder: setup.py builds it where a C compiler exists
    _gather = None

__all__ = ["ShardFile", "gather", "gather_started", "native", "nothing_to_wait_for", "read", "read_started",
           "will_need"]


def native() -> bool:
    """Whether batches are copied by the compiled extension (else by numpy)."""
    return _gather is not None


def gather(pieces: Sequence[np.ndarray], out: np.ndarray, threads: int = 1) -> None:
    """Copy ``pieces`` (C-contiguous arrays, e.g. slices of shard maps) one after the other into ``out``
    (C-contiguous, exactly their total size), on up to ``threads`` threads."""
    if _gather is not None:
        _gather.gather_into(pieces, out, threads)
        return
    _gather_numpy(pieces, out)


def gather_started(pieces: Sequence[np.ndarray], out: np.ndarray, threads: int = 1) -> Callable[[], None]:
    """``gather`` begun on the copy threads, returning the function that waits for it: the caller builds the
    rest of the batch (its metadata, ~0.6 ms a batch of 256 in Python) while the bytes are copied, instead of
    after. The wait must come before ``out`` is read and before this thread copies again (a second copy
    started first is refused with RuntimeError). Without the extension the copy is done here, at once."""
    if _gather is not None:
        return _gather.gather_start(pieces, out, threads).wait
    _gather_numpy(pieces, out)
    return nothing_to_wait_for


def nothing_to_wait_for() -> None:
    """The wait of a copy already done (``gather_started`` without the extension), or of none started."""


def _gather_numpy(pieces: Sequence[np.ndarray], out: np.ndarray) -> None:
    """The fallback: what ``gather_into`` writes, and refuses, with numpy."""
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise TypeError("gather: out must be a writable C-contiguous array")
    for i, piece in enumerate(pieces):
        if not piece.flags.c_contiguous:
            raise TypeError(f"gather: piece {i} is not C-contiguous")
    total = sum(piece.nbytes for piece in pieces)
    if total != out.nbytes:
        raise ValueError(f"gather: the pieces hold {total} bytes, out {out.nbytes}")
    flat = out.reshape(-1).view(np.uint8)
    at = 0
    for piece in pieces:
        size = piece.nbytes
        flat[at : at + size] = piece.reshape(-1).view(np.uint8)  # numpy releases the GIL for the copy
        at += size


class ShardFile:
    """A shard file open for reading at offsets (``read``), and where the rows of one of its memory maps lie in
    it: row ``i`` of the map is ``nbytes_per_row`` bytes at ``first_row + i * nbytes_per_row``. Closed when the
    last reference goes (a batch being read holds its files, so an evicted map's file stays open until then)."""

    __slots__ = ("path", "fd", "first_row", "nbytes_per_row", "__weakref__")

    def __init__(self, path: str, first_row: int, nbytes_per_row: int) -> None:
        self.path, self.first_row, self.nbytes_per_row = path, first_row, nbytes_per_row
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        weakref.finalize(self, os.close, self.fd)

    @classmethod
    def of(cls, rows: np.ndarray) -> ShardFile | None:
        """The file under ``rows`` (an ``np.memmap`` of whole C-contiguous rows, or a slice of one along its
        first axis), or None when it is no map of a file (then batches copy from it)."""
        mapped = getattr(rows, "_mmap", None)
        if not isinstance(rows, np.memmap) or not isinstance(mapped, mmap.mmap) or not rows.filename:
            return None
        if not rows.flags.c_contiguous or rows.ndim < 1:
            return None
        # np.memmap maps from the allocation boundary at or before its offset; where the map starts in memory
        # is that boundary's place in the file.
        start = np.frombuffer(mapped, np.uint8).ctypes.data
        mapped_from = rows.offset - rows.offset % mmap.ALLOCATIONGRANULARITY
        nbytes_per_row = int(np.prod(rows.shape[1:], dtype=np.int64)) * rows.itemsize
        return cls(rows.filename, mapped_from + rows.ctypes.data - start, nbytes_per_row)


def read(pieces: Sequence[tuple[ShardFile, int, int]], out: np.ndarray, threads: int = 1) -> None:
    """Read the rows ``start:stop`` of each ``(file, start, stop)`` one after the other into ``out``
    (C-contiguous, exactly their total size) with ``pread``, on up to ``threads`` threads (needs the
    extension: ``native()``). A file shorter than its rows (cut since it was opened) is a
    ShardIntegrityError naming it; any other failure an OSError naming it."""
    if _gather is None:
        raise RuntimeError("shardio.read.gather.read needs the compiled extension (native())")
    spans = _spans(pieces)
    _raise_read_failure(pieces, spans, _gather.read_into(spans, out, threads))


def read_started(pieces: Sequence[tuple[ShardFile, int, int]], out: np.ndarray,
                 threads: int = 1) -> Callable[[], None]:
    """``read`` begun on the copy threads, returning the function that waits for it and raises what ``read``
    raises (as ``gather_started``: the batch's metadata is built meanwhile). The pieces' files are held open
    until the wait."""
    if _gather is None:
        raise RuntimeError("shardio.read.gather.read_started needs the compiled extension (native())")
    spans = _spans(pieces)
    job = _gather.read_start(spans, out, threads)

    def wait() -> None:
        _raise_read_failure(pieces, spans, job.wait())

    return wait


def _spans(pieces: Sequence[tuple[ShardFile, int, int]]) -> np.ndarray:
    """Each piece's (fd, offset, nbytes), int64 [n, 3]: what the extension reads."""
    return np.array([(f.fd, f.first_row + start * f.nbytes_per_row, (stop - start) * f.nbytes_per_row)
                     for f, start, stop in pieces], np.int64).reshape(-1, 3)


def _raise_read_failure(pieces: Sequence[tuple[ShardFile, int, int]], spans: np.ndarray,
                        failed: tuple[int, int] | None) -> None:
    """The extension's answer for a read: nothing, or the error naming the file of the piece that failed."""
    if failed is None:
        return
    index, code = failed
    file, start, stop = pieces[index]
    if code == 0:
        raise ShardIntegrityError(f"{file.path}: ends before sample {stop - 1}'s last byte (at "
                                  f"{int(spans[index, 1] + spans[index, 2])}); was it cut after it was opened?")
    raise OSError(code, f"{os.strerror(code)} reading samples {start}:{stop}", file.path)


def will_need(pieces: Sequence[np.ndarray]) -> int:
    """Ask the kernel to read those of ``pieces`` (slices of memory-mapped files) whose first page is not
    in the page cache, now, in the background; how many it asked for (advice: never raises for it; 0
    without the extension)."""
    if _gather is None:
        return 0
    return int(_gather.will_need(pieces))
