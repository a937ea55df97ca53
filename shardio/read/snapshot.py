"""Opening a dataset snapshot and memory-mapping its shards (numpy only).

``open_dataset`` reads the index once as columns (``shardio.format.manifests.load_index``: no object per
shard) and, up to ``EAGER_CHECK_SHARDS`` shards, checks every shard's size in O(1) (one ``stat`` each): a
truncated or missing shard fails at open, naming the file, not mid-epoch. Above that (a web-scale dataset:
2.3M stats would take ~6 s per rank and worker) each shard is checked when it is first mapped, with the
same errors: its file's size and header (``pixels``) and its metadata's size (``meta``); ``preprocess
verify`` checks the whole dataset. The shards it returns are the
manifest's: a job appending meanwhile adds files the snapshot never sees, and a job replacing or pruning
inputs leaves the snapshot's files on disk for the retention (``shardio.format``, "Retention": 24 h and
3 generations by default). ``snapshot.generation`` names the snapshot; ``open_dataset(DIR, generation=G)``
reopens it (to resume a run on exactly the data it started with) while it is kept.

A bucketed dataset (format version 4: ``shardio.format``, "Buckets") has shards of several shapes, one
per shard: ``buckets`` lists them, ``shard_buckets`` says each shard's (a column of the index, no object
per shard), ``shard_shape(i)`` is shard ``i``'s (h, w); every map, header check and JPEG decode here is
at the shard's own shape. A single-shape dataset is the one bucket ``((H, W),)``.

On object storage (``s3://``) the manifest is read the same way and the sizes come from one LIST per
1,000 objects; the bytes are read through a ``shardio.read.cache.shard_cache.ShardCache`` that ``ShardDataset``
attaches (``snapshot.cache``): it downloads each shard (with its model outputs' files) to local disk, checked
against the manifest's size and checksum, and ``pixels`` (``output_arrays``) maps the cached file exactly as a
local shard's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from shardio.errors import ShardError, ShardIntegrityError
from shardio.format import (HEADER_BYTES, JPEG, NONE, YUV420, Manifest, ShardEntry, expected_shard_size,
                            line_crop_default, npy_header, parse_npy_header)
from shardio.format.manifests import DatasetIndex, generation_path, load_index, read_root
from shardio.format.model_outputs import OutputSpec, output_header, output_nbytes, output_path, parse_output_header
from shardio.format.shard_table import ShardTable
from shardio.format.shard_check import shard_problems
from shardio.read.cache.cache_setup import cache_for
from shardio.read.jpeg_pixels import JpegPixels, map_jpeg_shard
from shardio.read.yuv_pixels import YuvPixels, map_yuv_shard
from shardio.read.cache.shard_cache import ShardCache
from shardio.read.shard_meta import ShardMeta
from shardio.store.base import Storage
from shardio.store.paths import check_local
from shardio.store.root import DatasetRoot, Place, open_root

__all__ = ["DatasetSnapshot", "EAGER_CHECK_SHARDS", "ShardMeta", "open_dataset"]

# Up to this many shards, opening a snapshot stats each one (~2.5 µs) and ``ShardDataset`` reads each
# header (``check``, ~10 µs): ~0.1 s at 10k. Above it, both happen at a shard's first map.
EAGER_CHECK_SHARDS = 10_000


class DatasetSnapshot:
    """The shards one manifest lists, with lazy memory maps and metadata (read through ``cache``, a
    ``ShardCache``, when the dataset is on object storage). ``root``: the dataset's, opened by the caller
    (``open_dataset``)."""

    def __init__(self, root: DatasetRoot, manifest: DatasetIndex | Manifest) -> None:
        self.root = root
        self.directory = root.path
        self.manifest = manifest
        self.cache: ShardCache | None = None
        shards = manifest.shards
        self.shards: ShardTable = shards if isinstance(shards, ShardTable) else ShardTable.from_entries(shards)
        self.counts = self.shards.samples
        self.offsets = np.zeros(len(self.counts) + 1, dtype=np.int64)
        np.cumsum(self.counts, out=self.offsets[1:])
        self._shard_buckets: np.ndarray | None = None

    @property
    def store(self) -> Storage:
        """The backend of the dataset's root, chosen when it was opened (a pickled snapshot opens its root
        again where it is unpickled)."""
        return self.root.storage

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.manifest.shape

    @property
    def buckets(self) -> tuple[tuple[int, int], ...]:
        """(h, w) of each bucket, by id: a bucketed dataset's list, else its one shape ``((H, W),)``."""
        return self.manifest.buckets

    @property
    def is_bucketed(self) -> bool:
        """Whether this is a bucketed dataset (format version 4: shards of several shapes)."""
        return self.manifest.is_bucketed

    @property
    def shard_buckets(self) -> np.ndarray:
        """Each shard's bucket id (int64, dataset order; zeros for a single-shape dataset), from the index's
        column, read once."""
        if self._shard_buckets is None:
            self._shard_buckets = self.shards.bucket_ids()
        return self._shard_buckets

    def shard_shape(self, shard: int) -> tuple[int, int]:
        """(h, w) of shard ``shard``'s images: its bucket's."""
        height, width = self.buckets[int(self.shard_buckets[shard])]
        return height, width

    @property
    def generation(self) -> int:
        """The commit this snapshot is (0: a manifest written before generations existed)."""
        return self.manifest.generation

    @property
    def identity(self) -> str:
        """The dataset's identity as this generation's root names it (``shardio.format.spec``, "Identity"):
        what a resume state taken on it names."""
        return self.manifest.identity

    @property
    def classes(self) -> tuple[str, ...]:
        """The dataset's class names by id (``shardio.format.spec``, "Classes": a ``folder_classes`` dataset's
        table; () where it has none): ``classes[cls]`` is a sample's class name."""
        return getattr(self.manifest, "classes", ())

    @property
    def outputs(self) -> tuple[OutputSpec, ...]:
        """The dataset's model outputs (``shardio.format.spec``, "Model outputs"; () where it has none)."""
        return tuple(getattr(self.manifest, "outputs", ()))

    def output_arrays(self, shard_index: int) -> dict[str, np.ndarray]:
        """Each output of shard ``shard_index`` as a copy-on-write memory map (N, *its bucket's shape), of the
        output's stored dtype (bfloat16: its raw bits, uint16), its size and header checked against the index
        first (a missing, truncated or rewritten file is named); on object storage, a map of the file the cache
        downloaded and checked. {} for a dataset without outputs."""
        if not self.outputs:
            return {}
        entry = self.shards[shard_index]
        cache = self._remote_cache()
        if cache is not None:
            with self._reading_remote(entry.path):
                return cache.output_arrays(shard_index)  # sizes, headers and digests checked at download
        arrays = {}
        for output in self.outputs:
            rel = output_path(entry.path, output.name)
            path = self.store.join(self.directory, rel)
            shape = output.sample_shape(entry.bucket)
            local, header = self._checked_head(path, output_nbytes(entry.samples, shape, output.descr))
            if header != output_header(output.descr, entry.samples, shape):
                descr, found = parse_output_header(header, path)
                raise ShardIntegrityError(f"{path}: header says {descr} {list(found)}, the index says {output.descr} "
                                          f"{[entry.samples, *shape]} (the index and the file disagree); {_REBUILD}")
            arrays[output.name] = np.memmap(local, dtype=np.dtype(output.descr), mode="c", offset=HEADER_BYTES,
                                            shape=(entry.samples, *shape))
        return arrays

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def fields(self) -> tuple[str, ...] | None:
        """The metadata fields (of ``cls``, ``txt``, ``json``) this snapshot's samples carry, where that is
        known at open; ``None``: a manifest does not record them, so a batch carries all three."""
        return None

    @property
    def encoding(self) -> str:
        """``raw``, ``jpeg`` or ``yuv420`` (the manifest's config; ``shardio.format``, "Pixel encodings")."""
        return self.manifest.encoding

    def pixels(self, shard_index: int) -> np.ndarray | JpegPixels | YuvPixels:
        """The shard's N×H×W×3 pixels as a copy-on-write memory map (writable views, no copy, no warning
        from ``torch.from_numpy``; pages stay shared with the page cache until someone writes). A JPEG
        dataset's: ``JpegPixels`` over the mapped shard, which slices alike and decodes when indexed; a
        yuv420 dataset's: ``YuvPixels`` over the mapped planes, which slices alike and converts when indexed."""
        if self.encoding == NONE:  # no pixels kept (spec, "Model outputs"): the header alone, checked
            entry = self.shards[shard_index]
            path = self.store.join(self.directory, entry.path)
            cache = self._remote_cache()
            if cache is None:
                self._raw_header(path, entry.bytes, entry.samples, (0, 0))
            else:
                with self._reading_remote(entry.path):
                    _check_raw_header(path, cache.header(shard_index), entry.samples, (0, 0))
            return np.zeros((entry.samples, 0, 0, 3), np.uint8)
        cache = self._remote_cache()
        if cache is not None:
            with self._reading_remote(self.shards[shard_index].path):
                if self.encoding == JPEG:
                    return cache.jpeg_pixels(shard_index)
                if self.encoding == YUV420:
                    return cache.yuv_pixels(shard_index)
                return cache.pixels(shard_index)  # header checked once, at download
        entry = self.shards[shard_index]
        path = self.store.join(self.directory, entry.path)
        shape = self._entry_shape(entry)
        if self.encoding == YUV420:
            local = check_local(path)
            try:
                size = os.path.getsize(local)
            except FileNotFoundError as e:
                raise self._missing(path) from e
            _check_size(path, size, entry.bytes)
            return map_yuv_shard(path, local, entry.samples, *shape)
        if self.encoding != JPEG:
            local, (n, h, w) = self._raw_header(path, entry.bytes, entry.samples, shape)
            return np.memmap(local, dtype=np.uint8, mode="c", offset=HEADER_BYTES, shape=(n, h, w, 3))
        local = check_local(path)
        try:
            size = os.path.getsize(local)
        except FileNotFoundError as e:
            raise self._missing(path) from e
        _check_size(path, size, entry.bytes)
        return map_jpeg_shard(path, local, entry.samples, *shape)

    def _entry_shape(self, entry: ShardEntry) -> tuple[int, int]:
        """(h, w) of a listed shard's images, from its entry's bucket."""
        height, width, _ = self.manifest.bucket_shape(entry.bucket)
        return height, width

    def check(self, shard_index: int) -> None:
        """What ``pixels`` checks of a local shard (size, header; a JPEG shard's offsets), without mapping
        it (~10 µs: ``ShardDataset`` checks every shard of a small dataset at open)."""
        entry = self.shards[shard_index]
        path = self.store.join(self.directory, entry.path)
        if self.encoding in (JPEG, YUV420, NONE):
            self.pixels(shard_index)
        else:
            self._raw_header(path, entry.bytes, entry.samples, self._entry_shape(entry))

    def _checked_head(self, path: str, nbytes: int) -> tuple[str, bytes]:
        """A local file's path and first ``HEADER_BYTES``, its size checked to be ``nbytes`` (a missing or
        truncated file named)."""
        local = check_local(path)
        try:
            with open(local, "rb") as f:
                header = f.read(HEADER_BYTES)
                size = os.fstat(f.fileno()).st_size
        except FileNotFoundError as e:
            raise self._missing(path) from e
        _check_size(path, size, nbytes)
        return local, header

    def _raw_header(self, path: str, nbytes: int, samples: int,
                    shape: tuple[int, int]) -> tuple[str, tuple[int, int, int]]:
        local, header = self._checked_head(path, nbytes)
        _check_raw_header(path, header, samples, shape)
        return local, (samples, *shape)

    @contextmanager
    def _reading_remote(self, rel: str) -> Iterator[None]:
        """Shard file ``rel`` missing from the store, as a local one: retention's doing said as such (the
        cache raises a ShardError caused by a FileNotFoundError; it may name the pixels or the metadata)."""
        try:
            yield
        except ShardError as e:
            if isinstance(e.__cause__, FileNotFoundError) and self.collected():
                raise self._missing(self.store.join(self.directory, rel)) from e
            raise

    def _missing(self, path: str) -> ShardError:
        """A listed file that is not there: deleted by retention because this snapshot's generation is no
        longer kept (``preprocess gc --retain-hours 0`` collects it at once, by design: said so, with what
        to do), else the dataset's damage (the repair hint)."""
        if self.collected():
            return ShardError(
                f"{path}: deleted by retention: this reader opened generation {self.generation}, which is no longer "
                "kept (a run's retention or `preprocess gc` collected it, as --retain-hours/--retain-generations "
                "allow); nothing is damaged: open the dataset again for its current generation (a new epoch does, "
                "with follow_updates), or keep generations as long as an epoch lasts (--retain-hours)")
        return _missing(path)

    def collected(self) -> bool:
        """Whether retention collected this snapshot's generation since it was opened: its root is gone
        and ``manifest.json`` names another generation."""
        if not self.generation:
            return False
        try:
            if self.store.exists(generation_path(self.root, self.generation)):
                return False
            return int(read_root(self.root).get("generation", 0)) != self.generation
        except (ShardError, OSError):
            return False

    def _remote_cache(self) -> ShardCache | None:
        """The cache a URL's shards are read through: ``ShardDataset``'s, else (``shardio preview``, a
        script) one with the defaults (``new_cache``), made at the first read."""
        if self.cache is None and not self.store.is_local:
            self.cache = self.new_cache(None, None)
        return self.cache

    def new_cache(self, cache_dir: str | None, cache_limit: int | str | None) -> ShardCache:
        """A cache of this remote snapshot's shards (``shardio.read.cache.cache_setup.cache_for``; None: its
        defaults): each unit at its bucket's shape (a dataset without pixels: its header's (0, 0)), with its
        model outputs' files."""
        if self.encoding == NONE:
            return cache_for(self.root, self.shards, (0, 0, 3), cache_dir, cache_limit, outputs=self.outputs)
        return cache_for(self.root, self.shards, self.shape, cache_dir, cache_limit,
                         buckets=self.buckets if self.is_bucketed else None, outputs=self.outputs)

    def meta(self, shard_index: int) -> ShardMeta:
        """The shard's metadata: its ``.jsonl`` read and its lines counted now (a count that is not the
        manifest's raises here), each line parsed when first read (``shardio.read.shard_meta``)."""
        entry = self.shards[shard_index]
        path = self.store.join(self.directory, entry.meta_path)
        cache = self._remote_cache()
        if cache is not None:
            with self._reading_remote(entry.meta_path):
                data = cache.meta_bytes(shard_index)
        else:
            local = check_local(path)
            try:
                with open(local, "rb") as f:
                    data = f.read()
            except FileNotFoundError as e:
                raise self._missing(path) from e
            _check_size(path, len(data), entry.meta_bytes)
            return ShardMeta.from_file(path, local, data, entry.samples, *self._entry_shape(entry),
                                       missing_crop=line_crop_default(self.manifest.config))
        return ShardMeta.from_bytes(path, data, entry.samples, *self._entry_shape(entry),
                                    missing_crop=line_crop_default(self.manifest.config))


_REBUILD = "HINT: run `preprocess verify DIR --repair` to rebuild it from its input"


def _missing(path: str) -> ShardIntegrityError:
    return ShardIntegrityError(f"{path}: listed in the manifest but missing; {_REBUILD}")


def _check_raw_header(path: str, header: bytes, samples: int, shape: tuple[int, int]) -> None:
    """A raw shard's header against its entry's sample count and shape."""
    if header == npy_header(samples, *shape):  # the writer's own bytes: no parse (~130 µs)
        return
    n, h, w = parse_npy_header(header, path)
    if (n, h, w) != (samples, *shape):
        raise ShardIntegrityError(f"{path}: header says {(n, h, w)}, manifest says {(samples, *shape)} "
                                  f"(the index and the shard disagree); {_REBUILD}")


def _check_size(path: str, size: int, expected: int) -> None:
    """A listed file's size against the manifest's, checked at its first read (O(1))."""
    if size != expected:
        raise ShardIntegrityError(f"{path}: {size} bytes, the manifest says {expected} (truncated or overwritten); "
                                  f"{_REBUILD}")


def open_dataset(place: Place, *, verify: bool = False, generation: int | None = None,
                 segment_cache: str | None = None) -> DatasetSnapshot:
    """Open the dataset at ``place`` (a path, or its root opened already): manifest checked, every shard's size
    checked (O(1) each).

    ``generation``: open that kept generation instead of the current one (``snapshot.generation`` of an
    earlier open). ``verify=True`` also reads every byte and compares its checksum with the manifest's (slow).
    A URL: the sizes from a LIST of the shards' folders; ``verify`` is moot (every download is checked);
    ``segment_cache`` (a local directory: the shard cache's) keeps the index's segments for every process of
    the node, so each is fetched once per node (``shardio.format.segment_cache``).
    """
    root = open_root(place)
    store, directory = root.storage, root.path
    if not store.is_local:
        manifest = load_index(root, generation, segment_cache)
        problem = (_remote_size_problem(store, directory, manifest) if len(manifest.shards) <= EAGER_CHECK_SHARDS
                   else None)
        if problem:
            raise ShardIntegrityError(f"{problem}; HINT: run `preprocess verify {directory} --repair` to rebuild "
                                      "it from its input")
        return DatasetSnapshot(root, manifest)
    manifest = load_index(root, generation)
    eager = len(manifest.shards) <= EAGER_CHECK_SHARDS
    problems = shard_problems(root, manifest) if eager else []  # O(1) each: sizes only
    if problems:
        raise ShardIntegrityError(f"{problems[0][1]}; HINT: run `preprocess verify DIR --repair` to rebuild "
                                  "it from its input")
    if verify:
        problems = shard_problems(root, manifest, checksums=True)
        if problems:
            raise ShardIntegrityError("; ".join(problem for _, problem in problems))
    return DatasetSnapshot(root, manifest)


def _remote_size_problem(store: Storage, directory: str, manifest: DatasetIndex) -> str | None:
    """The first listed file (a shard's, its metadata's or one of its model outputs') missing or of the wrong
    size, from one LIST of each folder holding shards (1,000 objects a request), not a HEAD per file."""
    wanted = {}
    for entry in manifest.shards:
        expected = expected_shard_size(entry, manifest.bucket_shape(entry.bucket), manifest.encoding)
        if entry.bytes != expected:
            return (f"{store.join(directory, entry.path)}: the manifest lists {entry.bytes} bytes, "
                    f"{entry.samples} samples imply {expected} (inconsistent)")
        wanted[store.join(directory, entry.path)] = entry.bytes
        wanted[store.join(directory, entry.meta_path)] = entry.meta_bytes
        for output in manifest.outputs:  # model outputs' files, beside their shards (spec, "Model outputs")
            path = store.join(directory, output_path(entry.path, output.name))
            shape = output.shapes[entry.bucket]
            if shape is None:
                return f"{path}: the root records no shape of output {output.name!r} for bucket {entry.bucket}"
            wanted[path] = output_nbytes(entry.samples, shape, output.descr)
    folders = sorted({path.rsplit("/", 1)[0] for path in wanted})
    found = {info.path: info.size for folder in folders for info in store.list_files(folder)}
    for path, size in wanted.items():
        if path not in found:
            return f"{path}: listed in the manifest but missing"
        if found[path] != size:
            return f"{path}: {found[path]} bytes, the manifest says {size} (truncated or overwritten)"
    return None
