"""Assembling one batch from slices of memory-mapped shards: the shard cache and the three copy paths.

A batch within one run of one shard is a view of the memory map (zero copies; the pin or ``.cuda()``
copies it once); any other batch is one copy, into a buffer reused once the batch is released, into shared
memory in a DataLoader worker, or into pinned memory, made by one native call over all its slices with the
GIL released (``shardio.read.gather``; numpy where the extension is not built), while the slices of the
batch after it are read ahead where the page cache lacks them (``read_ahead``). Measurements behind these
choices: docs/reader.md.
A JPEG dataset's batch is decoded straight into that same buffer (``shardio.read.jpeg_pixels``: one native
call, every core, GIL released), so both encodings give the same uint8 [B, H, W, 3] batches; or, asked
for ``encoded``, its ``image`` is the batch's JPEG bytes (``EncodedImages``) for a decoder on the device.
A yuv420 dataset's batch is converted to RGB straight into that buffer (``shardio.read.yuv_pixels``: one
native call over the slices of the planes, GIL released); asked for ``encoded``, its ``image`` is the batch's
planes gathered as a raw batch's pixels are (``YuvPlanes``: half the bytes) for a conversion on the device.
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

try:
    import resource
except ImportError:  # not on Windows, which has no pread for the extension either
    resource = None  # type: ignore[assignment]

from shardio.format.model_outputs import OutputSpec
from shardio.format.spec import NONE
from shardio.read.gather import (ShardFile, gather, gather_started, native, nothing_to_wait_for, read_started,
                                 will_need)
from shardio.read.jpeg_pixels import EncodedImages, JpegPixels, check_decoded_bytes, decode_batch
from shardio.read.layout import EpochOrder, Layout
from shardio.read.shard_meta import rows_columns
from shardio.read.snapshot import DatasetSnapshot, ShardMeta
from shardio.read.yuv_pixels import YuvPixels, YuvPlanes, convert_batch

__all__ = ["FIELDS", "Batch", "BatchAssembler", "has_content_box", "pinned_batch"]

Batch = dict[str, Any]


# The metadata fields a batch can carry, and what a sample without one holds.
FIELDS = ("cls", "txt", "json")  # cls: -1; txt, json: None


# Slices of a batch to come looked at before the read-ahead asks for all of them (``read_ahead``).
READ_AHEAD_PROBES = 8


# The most threads a batch is copied on by default. A 16-core H100 host's shuffled read with the bench's
# second copy beside it (against np.copyto): 0.59 on 1 thread, 0.86 on 2, 0.89 on 4, 0.83 on 8; pinned
# batches alone, what DeviceLoader waits for, were assembled at 27.5 GB/s on 8 threads, half the 54 GB/s a
# pinned copy to the GPU moves. More threads only take cores from the training loop.
MAX_GATHER_THREADS = 8


def gather_threads() -> int:
    """Threads one batch's copy takes by default (``shardio.read.gather``): the cores this process may run
    on, at most ``MAX_GATHER_THREADS``; one in a DataLoader worker (the workers are the parallelism there).
    The copy is a burst of a millisecond or two a batch, on the prefetch thread and the extension's own
    threads, with the GIL released: the training loop's thread is not held up."""
    if get_worker_info() is not None:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_GATHER_THREADS, cores))


def room_for_files(cache_shards: int) -> bool:
    """Whether this process may keep a file open for each of ``cache_shards`` shards besides their maps (each
    map holds a descriptor of its own): ``pread`` is used only then, the soft ``RLIMIT_NOFILE`` left as it
    is (1,024 in many login shells: the default 512 kept shards' maps already take half of it)."""
    if resource is None:
        return False
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft == resource.RLIM_INFINITY or soft >= 2 * cache_shards + FREE_DESCRIPTORS


# Descriptors left for everything else (sockets, logs, checkpoints, a DataLoader's pipes).
FREE_DESCRIPTORS = 256


def has_content_box(snapshot: DatasetSnapshot) -> bool:
    """Whether every batch of this dataset carries ``content_box``: decided once from the manifest's
    config (``mode: pad``), never from the shards a batch happens to touch (one schema per dataset)."""
    return isinstance(snapshot.manifest.config, dict) and snapshot.manifest.config.get("mode") == "pad"


class BatchAssembler:
    """Batches of one snapshot: ``assemble(pieces, shared, pinned)``; keeps ``cache_shards`` shards'
    memory maps and metadata open (per process: a pickled copy starts empty). Every batch has the keys
    ``image``, ``__key__``, ``original_size`` and ``crop_top_left`` (int64 [B, 2]: the source's upright
    (height, width) and what its centre crop cut, (top, left) in source pixels; -1 where the dataset does not
    record it: ``shardio.format``, "Metadata") and ``fields``, whatever shards it came from (one schema per
    dataset), and a ``mode: pad`` dataset's every batch ``content_box`` (int32 [B, 4] x0, y0, x1, y1; see
    ``has_content_box``).

    A raw batch's bytes are copied on ``threads`` threads (default ``gather_threads()``), chosen once: from
    the memory maps when the maps of every shard stay open (``cache_shards`` or more), so their pages are
    mapped once and each later epoch copies at memory speed; else with ``pread`` from the files, since every
    map would be a first touch, a page fault per few pages (``shardio.read.gather``, the measurements), where
    the process may open a file per kept shard (``room_for_files``)."""

    def __init__(self, snapshot: DatasetSnapshot, cache_shards: int, buffers: int = 4,
                 fields: tuple[str, ...] = FIELDS, batch_size: int = 0, *, layout: Layout,
                 threads: int | None = None) -> None:
        unknown = set(fields) - set(FIELDS)
        if unknown:
            raise ValueError(f"unknown batch fields {sorted(unknown)}; known: {list(FIELDS)}")
        self.snapshot, self.cache_shards, self.buffer_count = snapshot, cache_shards, buffers
        self.fields = fields
        self.content_box = has_content_box(snapshot)
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"gather_threads must be an int >= 1, got {threads!r}")
        self.threads = threads
        # (pixels, metadata, the file to pread from or None) per open shard, least recently used first.
        self.cache: OrderedDict[int, tuple[np.ndarray | JpegPixels | YuvPixels, ShardMeta, ShardFile | None]] = (
            OrderedDict())
        # Each open shard's model outputs (``DatasetSnapshot.output_arrays``), kept and let go with its entry above.
        self.output_maps: dict[int, dict[str, np.ndarray]] = {}
        self.reads_files = native() and len(snapshot.shards) > cache_shards and room_for_files(cache_shards)
        # A bucketed dataset's batches differ in shape: each buffer is made large enough for a batch of the
        # largest bucket, so one pool serves every bucket and no step allocates once the pool is full.
        self.layout = layout  # the snapshot's (``shardio.read.layout.layout_of``, asked once at open)
        # A dataset without pixels (``encoding: none``) assembles no image: no buffer is made for one.
        self.pixels_kept = snapshot.encoding != NONE
        self.buffer_bytes = self.layout.buffer_bytes(batch_size) if self.pixels_kept else 0
        self.buffers = BufferPool(buffers, self.buffer_bytes)

    def shard(self, shard: int) -> tuple[np.ndarray | JpegPixels | YuvPixels, ShardMeta]:
        """Shard ``shard``'s pixels (a view of its memory map) and metadata."""
        hit = self._open(shard)
        return hit[0], hit[1]

    def _open(self, shard: int) -> tuple[np.ndarray | JpegPixels | YuvPixels, ShardMeta, ShardFile | None]:
        hit = self.cache.get(shard)
        if hit is None:
            pixels = self.snapshot.pixels(shard)
            file = None
            if isinstance(pixels, YuvPixels):
                pixels = pixels.with_plain_view()
            elif not isinstance(pixels, JpegPixels):
                file = ShardFile.of(pixels) if self.reads_files and self.pixels_kept else None
                # A plain ndarray view of the memory map: slicing a np.memmap costs ~3 µs more per piece.
                pixels = np.asarray(pixels)
            hit = (pixels, self.snapshot.meta(shard), file)
            self.cache[shard] = hit
            if self.snapshot.outputs:
                self.output_maps[shard] = {name: np.asarray(array)
                                           for name, array in self.snapshot.output_arrays(shard).items()}
            if len(self.cache) > self.cache_shards:
                gone, _ = self.cache.popitem(last=False)
                self.output_maps.pop(gone, None)
        else:
            self.cache.move_to_end(shard)
        return hit

    def read_ahead(self, pieces: list[tuple[int, int, int]]) -> None:
        """Ask the kernel to read the pixels of a batch still to come into the page cache, in the
        background (``shardio.read.gather.will_need``): a shuffled batch's 256 slices of a dataset larger
        than memory arrive together, not one page fault at a time in ``assemble``. Only through the maps
        already open (a window's shards are, after its first batch or two), which it neither opens nor
        moves up the cache. A few slices spread over the batch are looked at first: when they are all in
        memory (a dataset the page cache holds) the rest are not (each look is a system call, ~0.8 us)."""
        if not self.pixels_kept:
            return
        step = max(1, len(pieces) // READ_AHEAD_PROBES)
        probe = self._mapped_slices(pieces[::step][:READ_AHEAD_PROBES])
        if probe and will_need(probe):
            will_need(self._mapped_slices(pieces))

    def _mapped_slices(self, pieces: list[tuple[int, int, int]]) -> list[np.ndarray]:
        """The pieces of shards mapped now, as slices of their maps (a yuv420 dataset's: of its planes; none
        of a JPEG dataset's: its slices are no arrays, and it reads a fraction of the bytes)."""
        slices = []
        for shard, start, stop in pieces:
            hit = self.cache.get(shard)
            if hit is not None and isinstance(hit[0], np.ndarray):
                slices.append(hit[0][start:stop])
            elif hit is not None and isinstance(hit[0], YuvPixels):
                slices.append(np.asarray(hit[0].planes[start:stop]))
        return slices

    def batches(self, plan: EpochOrder, batches: Sequence[range], shared: bool, pinned: bool,
                encoded: bool = False, *, pass_id: tuple[int, int] = (0, 0)) -> Iterator[Batch]:
        """The batches of ``batches`` (ranges of ``plan``'s epoch positions), in order. The next batch's
        slices are asked of the kernel before this one is copied: read ahead in the background where the
        page cache lacks them (``read_ahead``). ``pass_id`` (epoch, start) names the pass to processes reading
        it together (a shard cache's group: ``CachedAssembler``); local shards need no one's help."""
        ahead = plan.pieces(batches[0]) if len(batches) else []
        for number in range(len(batches)):
            pieces = ahead
            if number + 1 < len(batches):
                ahead = plan.pieces(batches[number + 1])
                self.read_ahead(ahead)
            yield self.assemble(pieces, shared, pinned, encoded)

    def assemble(self, pieces: list[tuple[int, int, int]], shared: bool, pinned: bool,
                 encoded: bool = False) -> Batch:
        """The batch of the ``(shard, start, stop)`` slices, in order. ``shared``: in a DataLoader worker
        (shared memory; never pinned, CUDA cannot be used in forked workers). ``encoded`` (JPEG datasets):
        ``image`` is the samples' ``EncodedImages``, not decoded; (yuv420 datasets) the samples' ``YuvPlanes``,
        not converted; everything else is the same."""
        shards = [self._open(shard) for shard, _, _ in pieces]
        count = sum(stop - start for _, start, stop in pieces)
        pinned = pinned and not shared
        jpeg = isinstance(shards[0][0], JpegPixels)
        yuv = isinstance(shards[0][0], YuvPixels)
        if encoded and not (jpeg or yuv):
            raise ValueError(f"{self.snapshot.directory}: encoded batches are for JPEG datasets "
                             "(encoding: jpeg) and yuv420 ones; this one is raw")
        image: torch.Tensor | EncodedImages | YuvPlanes | None
        copied = nothing_to_wait_for  # a copy from the maps runs while the metadata is built: waited for below
        if not self.pixels_kept:
            image = None
        elif encoded and jpeg:
            image = EncodedImages.of([pixels[start:stop] for (pixels, _, _), (_, start, stop) in zip(shards, pieces)])
        elif encoded:
            image = self._planes(shards, pieces, count, shared, pinned)
        elif len(pieces) == 1 and not shared and not pinned and not jpeg and not yuv:
            # One slice of one shard: a view of the page cache; the one copy is the caller's pin/transfer.
            _, start, stop = pieces[0]
            image = torch.from_numpy(shards[0][0][start:stop])
        else:
            # A bucketed dataset's batch is one bucket (``shardio.read.bucket_order``): its first shard's shape.
            height, width = self.layout.batch_shape(self.snapshot, pieces[0][0])
            shape = (count, height, width, 3)
            if jpeg:  # the buffer below is the decoded size, whatever the shards' bytes
                check_decoded_bytes(count, shape[1], shape[2], self.snapshot.directory)
            if shared:  # what default_collate does in a worker: no copy when sent to the main process
                nbytes = count * height * width * 3
                image = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))
                image = image.view(shape)
            elif pinned:  # the one copy lands where the GPU copies from; torch caches pinned blocks
                image = pinned_batch(shape, self.buffer_bytes)
            else:
                image = torch.from_numpy(self.buffers.take(shape))
            threads = self.threads or gather_threads()
            if jpeg:
                decode_batch([pixels[start:stop] for (pixels, _, _), (_, start, stop) in zip(shards, pieces)],
                             image.numpy())
            elif yuv:
                convert_batch([pixels[start:stop] for (pixels, _, _), (_, start, stop) in zip(shards, pieces)],
                              image.numpy(), threads)
            elif all(file is not None for _, _, file in shards):
                copied = read_started([(file, start, stop) for (_, _, file), (_, start, stop) in zip(shards, pieces)],
                                      image.numpy(), threads)
            else:
                copied = gather_started([pixels[start:stop] for (pixels, _, _), (_, start, stop) in
                                         zip(shards, pieces)], image.numpy(), threads)
        try:
            # Only the lines of these rows are parsed (a shuffled batch takes one or two of a shard's 1,000).
            rows = [row for (_, meta, _), (_, start, stop) in zip(shards, pieces) for row in meta.rows(start, stop)]
            keys, txt, cls, js, box, original_size, crop_top_left = rows_columns(rows)
        finally:
            copied()
        batch: Batch = {"__key__": keys, "original_size": torch.from_numpy(original_size),
                        "crop_top_left": torch.from_numpy(crop_top_left)}
        if image is not None:
            batch = {"image": image, **batch}
        if "cls" in self.fields:
            batch["cls"] = torch.from_numpy(cls)
        if "txt" in self.fields:
            batch["txt"] = txt
        if "json" in self.fields:
            batch["json"] = js
        if self.content_box:
            batch["content_box"] = torch.from_numpy(box)
        batch.update(self.layout.batch_fields(self.snapshot, pieces[0][0]))  # a bucketed dataset's: "bucket"
        for output in self.snapshot.outputs:
            batch[output.name] = self.output_rows(output, pieces, count, shared, pinned)
        return batch

    def output_rows(self, output: OutputSpec, pieces: list[tuple[int, int, int]], count: int, shared: bool,
                pinned: bool) -> torch.Tensor:
        """Model output ``output`` of the batch's samples, [count, *shape] of its dtype, gathered from the open
        shards' output maps as raw pixels are: a view of the map for one slice, else one copy into shared,
        pinned or fresh memory (a bfloat16 output's raw bits viewed as torch.bfloat16)."""
        slices = [self.output_maps[shard][output.name][start:stop] for shard, start, stop in pieces]
        dtype = getattr(torch, output.dtype)  # the output's own (bfloat16: the map's uint16 bits viewed as it)
        if len(slices) == 1 and not shared and not pinned:
            return torch.from_numpy(slices[0]).view(dtype)
        shape = (count, *slices[0].shape[1:])
        nbytes = int(np.prod(shape)) * slices[0].itemsize
        if shared:
            raw = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))
        elif pinned:
            raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            raw = torch.empty(nbytes, dtype=torch.uint8)
        gather(slices, raw.numpy(), self.threads or gather_threads())
        return raw.view(dtype).view(shape)

    def _planes(self, shards: list[tuple[Any, ShardMeta, Any]], pieces: list[tuple[int, int, int]], count: int,
                shared: bool, pinned: bool) -> YuvPlanes:
        """A yuv420 batch's planes, (count, S) uint8, gathered as a raw batch's pixels are (a view of the map
        for one slice, else one native copy into shared, pinned or pooled memory)."""
        slices = [pixels[start:stop] for (pixels, _, _), (_, start, stop) in zip(shards, pieces)]
        height, width = slices[0].height, slices[0].width
        arrays = [np.asarray(piece.planes) for piece in slices]
        sample_bytes = arrays[0].shape[1]
        if len(arrays) == 1 and not shared and not pinned:
            return YuvPlanes(torch.from_numpy(arrays[0]), height, width)
        shape = (count, sample_bytes)
        if shared:
            planes = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(count * sample_bytes))
            planes = planes.view(shape)
        elif pinned:
            planes = pinned_batch(shape, self.buffer_bytes)
        else:
            planes = torch.from_numpy(self.buffers.take(shape))
        gather(arrays, planes.numpy(), gather_threads())
        return YuvPlanes(planes, height, width)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["cache"] = OrderedDict()  # each process maps its own shards
        state["output_maps"] = {}  # and their outputs (a pickled map is a full copy)
        state["buffers"] = BufferPool(self.buffer_count, self.buffer_bytes)
        return state


def pinned_batch(shape: tuple[int, ...], min_bytes: int = 0) -> torch.Tensor:
    """A pinned uint8 tensor of ``shape`` from torch's caching host allocator, which keeps freed blocks by
    size and hands one out again once the copies recorded on it are done (safe with ``non_blocking``
    copies, which a pool of our own would not know about). A bucketed dataset asks for ``min_bytes`` (a
    batch of its largest bucket) whatever the batch's bucket, so every batch takes a block of one size
    and the allocator's blocks serve every bucket: none is pinned anew once the first few are made."""
    nbytes = int(np.prod(shape))
    if min_bytes <= nbytes:
        return torch.empty(shape, dtype=torch.uint8, pin_memory=True)
    return torch.empty(min_bytes, dtype=torch.uint8, pin_memory=True)[:nbytes].view(shape)


class BufferPool:
    """Batch buffers reused once nothing holds the batch any more.

    A fresh 50 MB buffer (256 images of 256×256) is a fresh ``mmap`` from malloc: 12k page faults and
    zeroing cost as much as the copy into it; shuffled batches ran at 0.15 of ``np.copyto`` that way, and
    at about 0.5 with reuse (``bench.reader``). A buffer is free again when the array handed to
    ``torch.from_numpy`` is gone, i.e. when the tensor's storage is freed (usually right after pinning or
    the step): a weak reference tells. At most ``size`` buffers are kept; past that, batches get new ones.
    Each buffer has at least ``min_bytes`` (a bucketed dataset's largest batch), so a buffer made for one
    bucket's batch fits the next bucket's; ``allocations`` counts the buffers made.
    """

    def __init__(self, size: int = 4, min_bytes: int = 0) -> None:
        self.size, self.min_bytes = size, min_bytes
        self.allocations = 0
        self.buffers: list[tuple[np.ndarray, weakref.ref | None]] = []

    def take(self, shape: tuple[int, ...]) -> np.ndarray:
        nbytes = int(np.prod(shape))
        for i, (buffer, lent) in enumerate(self.buffers):
            if buffer.nbytes >= nbytes and (lent is None or lent() is None):
                break
        else:
            buffer = np.empty(max(nbytes, self.min_bytes), np.uint8)
            self.allocations += 1
            if len(self.buffers) >= self.size:
                return buffer[:nbytes].reshape(shape)
            self.buffers.append((buffer, None))
            i = len(self.buffers) - 1
        array = buffer[:nbytes].reshape(shape)
        self.buffers[i] = (buffer, weakref.ref(array))
        return array
