"""``ShardDataset``: whole batches from memory-mapped shards, with no per-sample CPU work.

This module opens the dataset (and checks that DDP ranks opened the same one) and ties together the
pieces that each have their own module: the layout of each snapshot it opens, one shape or buckets, chosen
there once (``shardio.read.layout``: the epoch order and rank split it asks, ``shardio.read.order`` or
``shardio.read.bucket_order``), the copies (``shardio.read.batches``), the epoch and resume state
(``shardio.read.resume``, the protocol loaders use) and the background thread (``shardio.read.prefetch``).
The design, with its measurements, is docs/reader.md.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from shardio.store.root import DatasetRoot, open_root
from shardio.read.batches import FIELDS, Batch, BatchAssembler
from shardio.read.cache.cache_group import CacheGroup, new_name, place_of, shards_in_flight
from shardio.read.cache.cache_setup import default_cache_dir
from shardio.read.cache.cached_reading import CachedAssembler, fitting_window
from shardio.read.dataloader_checks import WorkerEpochs, refuse_batched_again
from shardio.errors import ShardError
from shardio.format import JPEG, MANIFEST_NAME, NONE, YUV420
from shardio.format.manifests import read_root
from shardio.read.layout import EpochOrder, Layout, layout_of
from shardio.read.order import (
    DEFAULT_SHUFFLE_BLOCK,
    DEFAULT_SHUFFLE_WINDOW,
    ORDER_VERSION,
    ORDER_VERSIONS,
    epoch_runs,
    rank_batches,
)
from shardio.read.jpeg_pixels import check_decoded_bytes
from shardio.read.prefetch import PassPrefetch
from shardio.read.ranks import resolve_world
from shardio.format.model_outputs import OutputSpec
from shardio.read.sample_access import KeyFinder, sample_at
from shardio.read.snapshot import EAGER_CHECK_SHARDS, DatasetSnapshot, open_dataset
from shardio.read.resume import EpochCursor, EpochPass
from shardio.read.selection import SampleSelection, SubsetSnapshot
from shardio.read.cache.shard_cache import ShardCache

# epoch_runs and rank_batches lived here before shardio.read.order: re-exported for code that imports them.
__all__ = ["Batch", "EpochPass", "ShardDataset", "epoch_runs", "rank_batches"]

# What ShardDataset(decode=...) takes: decode JPEG batches here, or hand them out encoded for the device.
DECODE_CHOICES = ("cpu", "device")

def _identity(batch: Batch) -> Batch:
    return batch


class ShardDataset(IterableDataset):
    """Batches of a shardio dataset: ``{"image": uint8 [B, H, W, 3], "__key__": [str], "cls": int64 [B],
    "txt": [str | None], "json": [dict | None], "original_size": int64 [B, 2], "crop_top_left": int64
    [B, 2]}``, the same keys in every batch (``ds.fields``: those of ``cls``, ``txt``, ``json`` the
    manifest records, else all three; a missing label is -1, a missing caption or json None).
    ``original_size`` is each source's upright (height, width) and ``crop_top_left`` the (top, left) its
    centre crop cut, in source pixels: Stable Diffusion XL's conditioning (``shardio.format``, "Metadata";
    -1 where a dataset does not record it). Use with ``batch_size=None`` in a DataLoader, or ``ShardLoader``.

    Each new iteration is the next epoch (order from ``(seed, epoch)``, starting at 0); ``set_epoch(e)``
    pins the next one. ``len(ds)`` is this rank's batches per epoch; ``ds.num_samples`` the samples, and
    ``ds.sample(i)`` / ``ds.find(key)`` reach one sample in the stored order (evaluation, debugging).
    ``state_dict()``/``load_state_dict()``
    resume mid-epoch, also at another world size or number of workers (protocol: ``shardio.read.resume``).

    ``verify=True`` reads every shard and checks its checksum at open (slow); without it, open checks the
    manifest, every file's size and every shard's header, so bytes corrupted in place (same size) are only
    found by ``verify`` (or, for a ``.jsonl``, when its shard is first read). Under ``torch.distributed``
    the ranks compare what they opened: all raise or none. ``cache_shards`` is how many shards' memory maps
    and metadata each process keeps open. ``generation`` opens that kept generation instead of the current
    one; ``follow_updates`` (default: on unless ``generation`` is given) moves each new epoch to the newest
    generation, while a resumed epoch finishes on the generation its state was taken on.
    ``pin_memory=True`` (CUDA only) writes every batch straight into pinned memory, so the copy out of
    the memory map is the only one before the GPU's. Without it, a batch within one shard is a view of the
    memory map (no copy) and a batch spanning runs is one copy into a reused buffer. ``prefetch`` batches
    are assembled ahead on a background thread when iterated in the main process (0: none).
    ``gather_threads`` is how many threads copy a raw batch's samples into it (default: the cores this
    process may use, at most 8; one in a DataLoader worker: ``shardio.read.batches.gather_threads``).
    ``selection`` (``shardio.read.selection.SampleSelection``) reads only the samples it picks, in every
    generation the dataset opens (``shardio.read.subset.SubsetDataset`` is the shorthand).

    A bucketed dataset (``mode: bucket``; ``ds.buckets``, ``ds.bucket_sizes``) yields batches of one
    bucket each, ``image`` uint8 [B, h, w, 3] of that bucket plus ``"bucket"`` (its index), the same bucket
    on every rank at each step; ``drop_last`` drops each bucket's rest (``shardio.read.bucket_order``).

    ``decode`` (JPEG datasets, ``encoding: jpeg``): ``"cpu"`` (default) decodes each batch here into the
    uint8 ``image``; ``"device"`` leaves it encoded: ``image`` is a ``shardio.read.jpeg_pixels.EncodedImages``
    (each sample's JPEG bytes, views of the shard maps) for a decoder on the GPU
    (``shardio.train.device_decode``; ``DeviceLoader`` asks for this by itself on CUDA). yuv420 datasets
    (``encoding: yuv420``): ``"cpu"`` converts each batch here to the same uint8 RGB ``image`` as a raw
    dataset's; ``"device"`` hands out its planes, ``image`` a ``shardio.read.yuv_pixels.YuvPlanes`` (B, S)
    uint8, half the bytes, for ``DeviceLoader`` to convert on the device (``shardio.train.yuv_device``). The
    batches, their order, resume and rank split are the same either way: only ``image`` differs.

    ``path`` may be an object-storage URL (``s3://bucket/ds``): shards are downloaded ahead of need into
    ``cache_dir`` (default ``$SHARDIO_CACHE_DIR``, else ``~/.cache/shardio``), at most ``cache_limit``
    bytes (an int or a size such as ``"50GB"``, ``"512MiB"``; default: the smaller of the dataset's size
    and half the cache disk's free space), evicting the shard needed farthest ahead
    (``shardio.read.cache.shard_cache``); ``cache_stats()`` has its counters. Ranks under ``torch.distributed``
    sharing a ``cache_dir`` plan their downloads together, each shard fetched once for the node and ``cache_limit``
    the node's (``shardio.read.cache.cache_group``). For a local path both are refused
    (a local dataset is read in place).
    """

    def __init__(
        self,
        path: str | DatasetRoot,
        batch_size: int,
        *,
        shuffle: bool = False,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        shuffle_window: int | None = None,
        shuffle_block: int | None = None,
        order_version: int | None = None,
        verify: bool = False,
        cache_shards: int | None = None,
        pin_memory: bool = False,
        generation: int | None = None,
        follow_updates: bool | None = None,
        prefetch: int = 2,
        selection: SampleSelection | None = None,
        cache_dir: str | None = None,
        cache_limit: int | str | None = None,
        decode: str = "cpu",
        gather_threads: int | None = None,
    ) -> None:
        super().__init__()
        # The dataset's root, opened once here: its backend says whether the dataset is on this host's disk
        # (memory-mapped in place) or read through a cache; what opens a snapshot below is given the root.
        self.root: DatasetRoot = open_root(path)
        self.is_local = self.root.is_local
        if self.is_local and (cache_dir is not None or cache_limit is not None):
            raise ValueError(f"{path}: cache_dir and cache_limit are for object-storage URLs (s3://, gs://, az://); "
                             "a local dataset is memory-mapped in place: leave them out")
        # Order settings left out take the defaults, and a loaded state's values (``shardio.read.resume``).
        defaulted = frozenset(name for name, value in (("shuffle_window", shuffle_window),
                              ("shuffle_block", shuffle_block), ("order_version", order_version))
                              if value is None)
        shuffle_window = DEFAULT_SHUFFLE_WINDOW if shuffle_window is None else shuffle_window
        shuffle_block = DEFAULT_SHUFFLE_BLOCK if shuffle_block is None else shuffle_block
        order_version = ORDER_VERSION if order_version is None else order_version
        for name, value in (("batch_size", batch_size), ("shuffle_window", shuffle_window),
                            ("shuffle_block", shuffle_block)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if order_version not in ORDER_VERSIONS:
            raise ValueError(f"order_version must be one of {ORDER_VERSIONS}, got {order_version!r}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA (pinned memory is for host-to-GPU copies)")
        if decode not in DECODE_CHOICES:
            raise ValueError(f"decode must be one of {DECODE_CHOICES}, got {decode!r}")
        if gather_threads is not None and (isinstance(gather_threads, bool) or not isinstance(gather_threads, int)
                                           or gather_threads < 1):
            raise ValueError(f"gather_threads must be an int >= 1, got {gather_threads!r}")
        self.decode = decode
        self.gather_threads = gather_threads
        self.path = self.root.path
        self.pin_memory = pin_memory
        self.prefetch = prefetch
        self.batch_size = batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, int(seed), drop_last
        self.verify = verify
        self.selection = selection
        self.follow_updates = generation is None if follow_updates is None else follow_updates
        self.rank, self.world_size, self._from_dist = resolve_world(rank, world_size)
        # Per-sample order draws every batch from about the whole window: keep its maps (and metadata) open.
        self.cache_shards = cache_shards or max(16, 2 * shuffle_window)
        self._kept_per_bucket = cache_shards is None  # a bucketed dataset keeps a window's maps per bucket
        self.cache_dir = cache_dir
        self.cache_limit: int | str | None = cache_limit
        self._cache: ShardCache | None = None
        # The ranks reading through this process's cache directory: found when the ranks compare what they opened.
        self._cache_group = CacheGroup.alone(self.rank)
        self._open(generation, check_ranks=True)
        if decode == "device" and not (self.is_jpeg or self.is_yuv420):
            raise ValueError(f"{path}: decode='device' is for JPEG datasets (encoding: jpeg) and yuv420 ones; "
                             f"this one is {self.snapshot.encoding}: its batches need no decoding")
        if self.is_jpeg and decode == "cpu":  # each batch decodes into batch_size H×W×3: said now, not as a MemoryError
            check_decoded_bytes(batch_size, *self.snapshot.shape[:2], path)
        if shuffle and self._cache is not None:
            in_flight = shards_in_flight(len(self._cache_group.ranks), batch_size,
                                         len(self.snapshot) / max(1, len(self.snapshot.shards)))
            shuffle_window = fitting_window(shuffle_window, "shuffle_window" in defaulted, self._cache,
                                            self.path, self.layout.turns, in_flight)
        self.cursor = EpochCursor(batch_size, self.rank, self.world_size, drop_last, settings={
            "seed": self.seed, "shuffle": shuffle, "shuffle_window": shuffle_window,
            "shuffle_block": shuffle_block, "order_version": order_version, "drop_last": drop_last,
            "batch_size": batch_size}, defaulted=defaulted)
        self._worker_epochs = WorkerEpochs()  # a plain DataLoader's workers starting an epoch again warn
        # Iterated in this process, each pass's thread begins the next pass's first batches at its end.
        self._passes = PassPrefetch()

    # --- opening a snapshot ------------------------------------------------------------------------

    def _segment_cache(self) -> str | None:
        """Where this node keeps a remote dataset's index segments: the shard cache's directory."""
        return None if self.is_local else (self.cache_dir or default_cache_dir())

    def _open(self, generation: int | None, check_ranks: bool = False) -> None:
        manifest_path = self.root.join(MANIFEST_NAME)
        error: ShardError | None = None
        try:
            snapshot = open_dataset(self.root, verify=self.verify, generation=generation,
                                    segment_cache=self._segment_cache())
            if len(snapshot) == 0:
                raise ShardError(f"{manifest_path}: lists no samples; run preprocess on some inputs first")
            if not self.is_local:
                self._attach_cache(snapshot)
            elif len(snapshot.shards) <= EAGER_CHECK_SHARDS:
                for shard in range(len(snapshot.shards)):
                    snapshot.check(shard)  # size and header: a corrupt one fails now, not mid-epoch
        except ShardError as e:
            error = e
        if check_ranks and self._from_dist and self.world_size > 1:
            self._check_same_snapshot(manifest_path, None if error else snapshot, error)  # all raise or none
        if error is not None:
            raise error
        snapshot = self._select(snapshot)
        cache = self._cache
        if cache is not None and isinstance(snapshot, SubsetSnapshot):
            # A subset keeps maps of the shards its fields read: they give way to the cache (the
            # assembler's own hook takes over below).
            cache.on_wait = lambda: snapshot.forget(cache.doomed())
        layout = layout_of(snapshot)  # one shape or buckets: chosen here, asked from now on
        if self.drop_last and layout.largest < self.batch_size * self.world_size:
            raise ValueError(
                f"{self.path}: {layout.largest} samples make no full batch of {self.batch_size} on each of "
                f"{self.world_size} ranks{layout.where_full}, and drop_last=True would yield nothing"
            )
        self.snapshot: DatasetSnapshot = snapshot
        self.samples = len(snapshot)
        self.layout: Layout = layout
        self._finder: tuple[DatasetSnapshot, KeyFinder] | None = None
        # One schema per dataset: the fields the snapshot knows its samples carry (a subset: its shards'),
        # else all of them; a sample without one has -1 (cls) or None.
        recorded = snapshot.fields
        self.fields: tuple[str, ...] = FIELDS if recorded is None else tuple(f for f in FIELDS if f in recorded)
        # Each bucket's batches draw from a window of that bucket's shards, and the buckets take turns: keep
        # the maps of every bucket's window, not just the last bucket's (unless cache_shards was given).
        kept = self.cache_shards * (layout.turns if self._kept_per_bucket else 1)
        # Room for every batch alive at once: the consumer's two, the queue's, the thread's two.
        if self._cache is not None:
            self._assembler: BatchAssembler = CachedAssembler(snapshot, self._cache, kept,
                                                              buffers=self.prefetch + 4, fields=self.fields,
                                                              batch_size=self.batch_size, layout=layout,
                                                              threads=self.gather_threads, group=self._cache_group,
                                                              lag_steps=self.prefetch + 2)
        else:
            self._assembler = BatchAssembler(snapshot, kept, buffers=self.prefetch + 4,
                                             fields=self.fields, batch_size=self.batch_size, layout=layout,
                                             threads=self.gather_threads)

    def _attach_cache(self, snapshot: DatasetSnapshot) -> None:
        """A snapshot on object storage reads through a new cache (same directory and limit: the files
        of shards a new generation keeps are content addressed, found again, not downloaded again)."""
        cache = snapshot.new_cache(self.cache_dir, self.cache_limit)
        self.cache_limit = cache.limit  # the default, resolved once
        snapshot.cache = cache
        if self._cache is not None:
            self._cache.close()
        self._cache = cache

    @property
    def is_jpeg(self) -> bool:
        """Whether the shards hold JPEGs (``encoding: jpeg``), so batches can be handed out encoded."""
        return self.snapshot.encoding == JPEG

    @property
    def is_yuv420(self) -> bool:
        """Whether the shards hold yuv420 planes (``encoding: yuv420``), so batches can be handed out as planes."""
        return self.snapshot.encoding == YUV420

    def cache_stats(self) -> dict[str, int] | None:
        """The shard cache's counters (downloads, bytes_downloaded, adopted, hits, misses, evictions,
        retries, peak_bytes, held_bytes) in this process; None for a local dataset."""
        return None if self._cache is None else dict(self._cache.stats)

    def _select(self, snapshot: DatasetSnapshot) -> DatasetSnapshot:
        # Applied to every snapshot opened (a resume's pinned generation, a new epoch's newest one), so
        # a subset stays the subset whichever generation the cursor asks for.
        return snapshot if self.selection is None else self.selection.apply(snapshot)

    def _check_same_snapshot(self, manifest_path: str, snapshot: DatasetSnapshot | None,
                             error: ShardError | None) -> None:
        """Ranks that opened different generations (a job committed in between) would disagree on the
        batch count, and a rank that failed to open while the others go on leaves them waiting: either
        would hang DDP. So the ranks compare generations (and, for manifests from before generations,
        what they list), and all raise or none does. Each says where its cache directory is too: the ranks
        sharing one plan their downloads together (``shardio.read.cache.cache_group``)."""
        if snapshot is None:
            mine: tuple[Any, ...] = (str(error),)
        else:
            mine = (snapshot.generation, len(snapshot), snapshot.manifest.updated)
        place = "" if self._cache is None else place_of(self._cache.cache_dir)
        everyone: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(everyone, (mine, place, new_name()))
        notes = [note for note, _, _ in everyone]
        failed = [(rank, note[0]) for rank, note in enumerate(notes) if len(note) == 1]
        if error is None and failed:
            rank, message = failed[0]
            raise ShardError(f"{manifest_path}: rank {rank} could not open the dataset: {message}")
        if error is None and any(note != mine for note in notes):
            raise ShardError(
                f"{manifest_path}: the ranks opened different snapshots (generation, samples, updated) = "
                f"{notes}; the dataset changed while they started - start them again once the writer "
                "is done, or pass generation= to all of them"
            )
        if place:
            self._cache_group = CacheGroup.of(self.rank, [where for _, where, _ in everyone],
                                              [name for _, _, name in everyone])

    def _newest_generation(self) -> int:
        """The newest generation every rank can open: under DDP the smallest of each rank's newest (a
        commit may land between two ranks' reads; retention keeps the older one)."""
        newest = int(read_root(self.root).get("generation", 0))
        if self._from_dist and self.world_size > 1:
            everyone: list[Any] = [None] * self.world_size
            torch.distributed.all_gather_object(everyone, newest)
            newest = min(everyone)
        return newest

    def _at(self, generation: int | None) -> tuple[int, str, Layout]:
        """(samples, identity, layout) of the dataset at ``generation`` (None: the snapshot open now)."""
        if generation is None or generation == self.snapshot.generation:
            return self.samples, self.snapshot.identity, self.layout
        snapshot = open_dataset(self.root, generation=generation, segment_cache=self._segment_cache())
        selected = self._select(snapshot)
        return len(selected), snapshot.identity, layout_of(selected)

    @property
    def outputs(self) -> tuple[OutputSpec, ...]:
        """The dataset's model outputs (name, input, dtype, a shape per bucket, the model's identity): each batch
        holds each under its name, a tensor [B, *shape] of its dtype; () where the dataset has none."""
        return self.snapshot.outputs

    @property
    def classes(self) -> list[str]:
        """The class names by id, ``classes[cls]`` (a ``folder_classes`` dataset's table: one id per name
        across every input; ``[]`` where the dataset keeps none)."""
        return list(self.snapshot.classes)

    # --- buckets -----------------------------------------------------------------------------------

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """The (height, width) of each bucket (``mode: bucket``); one shape: ``[(H, W)]``."""
        return list(self.layout.shapes)

    @property
    def bucket_sizes(self) -> list[int]:
        """Samples per bucket (of the selection); one shape: ``[num_samples]``."""
        return list(self.layout.sizes)

    # --- epochs, length, resume -------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch of the current (or, before the first iteration, the next) pass."""
        return self.cursor.epoch

    def set_epoch(self, epoch: int) -> None:
        """Pin the epoch (the shuffle order) of the next iterator; later ones count on from it."""
        self.cursor.set_epoch(epoch)

    def seek(self, epoch: int, batches: int = 0) -> None:
        """The next iterator is ``epoch`` after this rank's first ``batches`` batches of it, on the
        snapshot open now (``EpochCursor.seek``): for a caller that schedules the dataset's epochs itself."""
        if not 0 <= batches <= len(self):
            raise ValueError(f"{self.path}: batches={batches} is outside this rank's 0..{len(self)} of an "
                             "epoch")
        self.cursor.seek(epoch, batches, self.samples, self.snapshot.generation, self.layout)

    @property
    def batches_seen(self) -> int:
        """This rank's batches handed out in the current epoch (resumed ones included)."""
        return self.cursor.batches_seen

    def __len__(self) -> int:
        """This rank's batches per epoch (not samples: ``num_samples``); the same on every rank."""
        return self.layout.batches_per_epoch(self.batch_size, self.world_size, self.drop_last)

    @property
    def shuffle_window(self) -> int:
        """Shards per shuffle window (the default, clamped to the cache, or a loaded state's)."""
        return int(self.cursor.settings["shuffle_window"])

    @property
    def shuffle_block(self) -> int:
        return int(self.cursor.settings["shuffle_block"])

    @property
    def order_version(self) -> int:
        """The order's algorithm (``shardio.read.order``): the newest, or a loaded state's."""
        return int(self.cursor.settings["order_version"])

    def plan(self, epoch: int | None = None) -> EpochOrder:
        """The epoch order, computed window by window as batches reach it (``shardio.read.epoch_plan``):
        O(shards) memory, however many samples. A bucketed dataset's: each bucket's own order, its
        positions laid end to end (``shardio.read.bucket_order.BucketPlan``)."""
        return self.layout.plan(self.snapshot, **self._order_settings(epoch))

    def runs(self, epoch: int | None = None) -> np.ndarray:
        """The whole epoch order as runs ``(shard, start, stop)``: one per sample with blocks of 1, for
        tests and measurements (iteration uses ``plan``). A bucketed dataset's are its epoch positions'
        runs, bucket after bucket (batches take them round by round, ``BucketRankBatches``)."""
        return self.layout.runs(self.snapshot, **self._order_settings(epoch))

    def _order_settings(self, epoch: int | None) -> dict[str, Any]:
        """What fixes an epoch's order, for the lazy plan and the eager runs alike."""
        return {"shuffle": self.shuffle, "seed": self.seed, "epoch": self.epoch if epoch is None else epoch,
                "shuffle_window": self.shuffle_window, "shuffle_block": self.shuffle_block,
                "order_version": self.order_version}

    def sample_order(self, epoch: int | None = None) -> np.ndarray:
        """The epoch order as global stored sample indices (for tests and mixing measurements)."""
        runs = self.runs(epoch)
        offsets = self.snapshot.offsets
        return np.concatenate([np.arange(offsets[s] + a, offsets[s] + b) for s, a, b in runs])

    def state_dict(self, batches_seen: int | None = None) -> dict[str, Any]:
        """Where the run is (``shardio.read.resume``): epoch, global position, generation. ``batches_seen``
        overrides the count of batches handed out in this pass (this rank's batch number)."""
        return self.cursor.state_dict(self.samples, self.snapshot.generation, batches_seen, self.snapshot.identity,
                                      self.layout)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iterator yields what is left of the state's epoch, on the state's generation
        and dealt over this world size; later epochs start fresh."""
        self.cursor.load_state_dict(state, self._at, self.snapshot.identity, self.path)

    def batch_positions(self, batch_number: int) -> range:
        """Epoch positions of this rank's ``batch_number``-th batch of the current epoch (1-based: the
        ``batches_seen`` count right after it was handed out)."""
        current = self.cursor.current
        index = batch_number - 1 - (current.before if current is not None else 0)
        batches = current.batches if current is not None else self._fresh_batches()
        if not 0 <= index < len(batches):
            raise ValueError(f"batch {batch_number} is not one of this rank's batches of the current pass "
                             f"over {self.path}")
        return batches[index]

    def _fresh_batches(self) -> Sequence[range]:
        """This rank's batches of a whole epoch (the current one's order)."""
        return self.layout.rank_batches(self.cursor.deal(), self.epoch)

    # --- iteration: the protocol of shardio.read.resume --------------------------------------------------

    def begin_pass(self) -> EpochPass:
        """Start the next pass (``shardio.read.resume``, step 1): the epoch, where it starts, the generation."""
        epoch, start, generation = self.cursor.next_pass()
        worker = get_worker_info()
        if generation is None and start == 0 and self.follow_updates and worker is None:
            generation = self._newest_generation()
        if generation is not None and generation != self.snapshot.generation:
            self._open(generation)
        epoch_pass = self.cursor.begin(self.samples, self.snapshot.generation, self.snapshot.identity, self.layout)
        if worker is not None:
            self._worker_epochs.started(worker.id, epoch_pass.epoch, self.path)
        return epoch_pass

    def iter_pass(self, epoch_pass: EpochPass, *, pin_memory: bool | None = None,
                  prefetch: int | None = None, encoded: bool | None = None) -> Iterator[Batch]:
        """The pass's batches (in a DataLoader worker, that worker's share); counts nothing: the layer
        that hands them to the training loop wraps them in ``cursor.handed_out``. ``pin_memory``,
        ``prefetch`` and ``encoded`` (JPEG batches left encoded, yuv420 ones as planes: ``decode="device"``)
        default to the dataset's settings."""
        if epoch_pass.generation != self.snapshot.generation:
            raise ValueError(f"{self.path}: this pass was begun on generation {epoch_pass.generation}, the "
                             f"dataset has moved to {self.snapshot.generation}; begin a new pass")
        batches = epoch_pass.batches
        worker = get_worker_info()
        if worker is not None:
            batches = batches[worker.id :: worker.num_workers]
            prefetch = 0  # the worker process is the background already
        pinned = self.pin_memory if pin_memory is None else pin_memory
        if pinned and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA (pinned memory is for host-to-GPU copies)")
        encoded = self.decode == "device" if encoded is None else encoded
        if encoded and not (self.is_jpeg or self.is_yuv420):
            raise ValueError(f"{self.path}: encoded batches are for JPEG datasets (encoding: jpeg) and yuv420 "
                             f"ones; this one is {self.snapshot.encoding}")
        # The plan is made here, where the batches are read (in a DataLoader worker, by the worker): what
        # the pass carries to a worker is a few ints, and each worker builds the windows its batches touch.
        depth = self.prefetch if prefetch is None else prefetch
        if depth <= 0:
            return self._assembler.batches(self.plan(epoch_pass.epoch), batches, worker is not None, pinned, encoded,
                                           pass_id=(epoch_pass.epoch, epoch_pass.start))

        def ahead() -> tuple[tuple[Any, ...], Iterator[Batch]] | None:  # on the prefetch thread
            following = self.pass_ahead()
            if following is None:
                return None
            return (self.pass_key(following, pinned, encoded),
                    self._assembler.batches(self.plan(following.epoch), following.batches, False, pinned, encoded,
                                            pass_id=(following.epoch, following.start)))

        return self._passes.passes(
            self.pass_key(epoch_pass, pinned, encoded),
            lambda: self._assembler.batches(self.plan(epoch_pass.epoch), batches, False, pinned, encoded,
                                            pass_id=(epoch_pass.epoch, epoch_pass.start)),
            _identity, depth, ahead, len(batches))

    def pass_ahead(self) -> EpochPass | None:
        """The pass the next ``begin_pass()`` begins if nothing changes before it (no ``set_epoch`` of another
        epoch, no state loaded, no new generation to follow), begun on a copy of the cursor: the cursor, and
        so ``state_dict``, stay as they are. For a loader that prepares the next epoch's first batches while
        the last ones of this one are consumed (``shardio.read.prefetch.PassPrefetch``); None in a
        DataLoader worker, and on object storage (the shard cache plans its downloads a pass at a time: the
        next pass plans them when it begins)."""
        if get_worker_info() is not None or self._cache is not None:
            return None
        cursor = copy.copy(self.cursor)
        _, _, generation = cursor.next_pass()
        if generation is not None and generation != self.snapshot.generation:
            return None
        return cursor.begin(self.samples, self.snapshot.generation, self.snapshot.identity, self.layout)

    def pass_key(self, epoch_pass: EpochPass, *how: Any) -> tuple[Any, ...]:
        """What fixes a pass's batches, and ``how`` they are made (pinned, encoded...): two passes with equal
        keys yield the same batches."""
        return (id(self._assembler), epoch_pass.epoch, epoch_pass.start, epoch_pass.before, epoch_pass.samples,
                epoch_pass.generation, epoch_pass.dataset, epoch_pass.layout,
                tuple(getattr(epoch_pass.batches, "start", ())),
                len(epoch_pass.batches), self.rank, self.world_size, tuple(sorted(self.cursor.settings.items())),
                *how)

    def __iter__(self) -> Iterator[Batch]:
        # Not a generator function: the epoch and resume point are read now, when DataLoader (or the
        # caller) creates the iterator, not at the first next().
        refuse_batched_again(sys._getframe(1), self.path, self.batch_size)
        worker = get_worker_info()
        epoch_pass = self.cursor.take_handover() if worker is not None else None
        if epoch_pass is None:
            epoch_pass = self.begin_pass()
        batches = self.iter_pass(epoch_pass)
        if worker is not None:
            return batches  # a copy of the dataset: the main process counts (ShardLoader)
        return self.cursor.handed_out(epoch_pass, batches)

    def __getitem__(self, index: object) -> NoReturn:
        """Refused with a pointer: the dataset is iterated, and ``len(ds)`` counts batches, so ``ds[i]``
        as sample ``i`` would not be item ``i`` of ``len``; ``sample(i)`` and ``find(key)`` say which."""
        raise TypeError(f"{self.path}: a ShardDataset is iterated, not indexed: ds.sample(i) is stored "
                        f"sample i (0..{self.num_samples - 1}), ds.find(key) the index of a key; "
                        f"len(ds) = {len(self)} batches of this rank, ds.num_samples = {self.num_samples} "
                        "samples")

    def sample(self, index: int) -> dict[str, Any]:
        """Sample ``index`` (0..``num_samples``-1; negative from the end) in the stored order, whatever the
        epoch's shuffle: ``image`` (uint8 H×W×3), ``__key__``, ``cls`` (-1: none), ``txt``, ``json``,
        ``original_size``, ``crop_top_left`` (int64 [2]), ``shard``, ``row``, ``index``
        (``shardio.read.sample_access``: one binary search, no epoch plan), and each model output under its name
        (a tensor of its shape and dtype, a copy)."""
        sample = sample_at(self._assembler.shard, self.snapshot.offsets, index)
        if self.snapshot.encoding == NONE:  # no pixels kept: the outputs are the sample
            del sample["image"]
        for output in self.snapshot.outputs:
            row = self._assembler.output_rows(output, [(sample["shard"], sample["row"], sample["row"] + 1)], 1, False,
                                          False)
            sample[output.name] = row[0].clone()
        return sample

    def find(self, key: str, input: str | None = None) -> int:
        """The stored index of the sample with ``key`` (of ``input``, a committed input's name, where keys
        repeat across inputs); ``KeyError`` if none. ``ds.sample(ds.find(key))`` is that sample."""
        finder = self._finder
        if finder is None or finder[0] is not self.snapshot:
            finder = self._finder = (self.snapshot, KeyFinder(self.snapshot.shards, self.snapshot.offsets,
                                                              self._assembler.shard))
        return finder[1].find(key, input)

    @property
    def num_samples(self) -> int:
        """The samples of the snapshot (of the selection) being read; ``len(ds)`` is this rank's batches."""
        return self.samples

    def shard(self, shard: int) -> tuple[np.ndarray, Any]:
        """Shard ``shard``'s pixels (a view of its memory map) and metadata, as batches read them."""
        return self._assembler.shard(shard)
