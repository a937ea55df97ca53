"""The shard cache's directory on local disk: what its files are named, how a download becomes one, and
how several processes share it without a second download or a half-written read.

Layout of ``CACHE_DIR`` (flat; content addressed, so two datasets or generations share files and a
stale file can never stand for another shard)::

    KEY.npy               a shard's pixels; KEY = SUM-METASUM, the manifest's checksums of the shard's .npy
                          and of its .jsonl (hex: 32 digits each for xxh3_128, 64 for the sha256 of an
                          older shard, so the two never meet)
    KEY.jsonl             its metadata
    KEY.NAME.npy          its model output NAME (spec, "Model outputs"), where the dataset has outputs; then KEY
                          ends in a third part, ``-OUTSUM``: 32 hex digits of the sha256 of the outputs' xxh3_128
                          digests (a dataset without outputs keeps the two-part key, and its warm files)
    .tmp-KEY.RANDOM       a download in progress (or killed); never read
    locks/KEY.lock        the unit's lock file (empty; never removed)
    index/                the dataset indexes' segments, shared by the node's processes
                          (``shardio.format.segment_cache``; not counted in ``cache_limit``)
    groups/NAME.steps     where each process of a group sharing the directory is in its pass (a few bytes a
                          process; ``shardio.read.cache.group_positions``; removed a day after its last pass)

Why the pair: a unit is two files (and its outputs'), and a name must stand for all of them. Two shards with the
same pixels but different metadata (the same tar uploaded under two names: each ``.jsonl`` line names its tar)
are two units, as are two with the same pixels and metadata but outputs of another model; two with every file
identical share one (one download, one hold, counted once).

The protocol (``flock`` on the lock file; the kernel drops a dead process's locks, SIGKILL included):

- **Download**: under ``LOCK_EX``, every file of the unit into ``.tmp-`` names, each checked (size; the
  ``.npy`` header, an output file's against its dtype and shape; the checksum, by the entry's algorithm or
  an output's xxh3_128, that the download took of the bytes it wrote), then renamed into place. A file
  under its final name is therefore always whole and right, and a warm one needs only a size check (O(1),
  no re-hash).
- **Hold**: a process keeping a shard holds ``LOCK_SH``. A process that wants a shard another one is
  downloading (``LOCK_EX``) or holds waits for ``LOCK_SH`` and adopts the finished file.
- **Remove**: only under ``LOCK_EX`` taken without waiting, i.e. when no other process holds the shard.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

from shardio.errors import MissingExtra, ShardError, ShardFormatError, ShardIntegrityError, StorageAccessError
from shardio.format import HEADER_BYTES, ShardEntry, parse_npy_header
from shardio.format.jpeg_shard import JPEG_SUFFIX, parse_jpeg_header
from shardio.format.model_outputs import OutputSpec, output_header, output_nbytes, output_path, parse_output_header
from shardio.format.yuv_shard import YUV_SUFFIX, parse_yuv_header, yuv_sample_bytes
from shardio.store.checksum import XXH3_128

__all__ = ["CacheDir", "CachedOutput", "CachedShard", "Downloader", "cache_key"]

TEMP_PREFIX = ".tmp-"
# A cache directory this process may read but not write: another user's (EACCES, EPERM), or on a read-only
# mount or container layer (EROFS).
_READ_ONLY = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})


class Downloader(Protocol):
    """What the cache needs from a store: ``Storage.download`` (the whole object into a local file,
    transient errors retried; ``FileNotFoundError`` for a missing object; returns the ``algorithm``
    checksum of the bytes it wrote, hashed as they came, so a checked download reads nothing back)."""

    def download(self, path: str, local_path: str, algorithm: str) -> str: ...


@dataclass(frozen=True)
class CachedOutput:
    """One model output file of a cache unit: its ``name``, ``url``, exact size, xxh3_128 ``digest`` (the shard's
    entry lists it), the ``descr`` it stores and one sample's ``shape`` (its shard's bucket's)."""

    name: str
    url: str
    nbytes: int
    digest: str
    descr: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class CachedShard:
    """One cache unit: a shard's ``.npy`` and ``.jsonl`` and its model ``outputs``' files, named by their
    checksums (``cache_key``)."""

    npy_checksum: str  # both checksums by ``algorithm`` (``shardio.store.checksum``)
    npy_url: str
    meta_url: str
    npy_bytes: int
    meta_bytes: int
    meta_checksum: str
    samples: int
    algorithm: str
    bucket: int = 0  # the shard's bucket (its images' shape: a bucketed dataset's ``buckets[bucket]``)
    outputs: tuple[CachedOutput, ...] = ()  # in the root's ``outputs`` order

    # Both asked for at every step a pass plans and at every eviction (hundreds of times a step): made once.
    @cached_property
    def key(self) -> str:
        """The unit's name in the cache directory (``cache_key``)."""
        return _key(self.npy_checksum, self.meta_checksum, tuple(o.digest for o in self.outputs))

    @cached_property
    def size(self) -> int:
        return self.npy_bytes + self.meta_bytes + sum(o.nbytes for o in self.outputs)

    @classmethod
    def of(cls, directory: str, entry: ShardEntry, join: Callable[..., str],
           outputs: Sequence[OutputSpec] = ()) -> CachedShard:
        """The unit of ``entry``, a shard of the dataset at ``directory`` whose root lists ``outputs``;
        ShardFormatError where the entry's output digests or the root's shapes do not fit them."""
        url = join(directory, entry.path)
        if len(entry.outputs) != len(outputs):
            raise ShardFormatError(f"{url}: the index lists {len(entry.outputs)} output digests, the dataset has "
                                   f"{len(outputs)} outputs (inconsistent)")
        files = []
        for spec, digest in zip(outputs, entry.outputs):
            shape = spec.shapes[entry.bucket] if 0 <= entry.bucket < len(spec.shapes) else None
            if shape is None:
                raise ShardFormatError(f"{url}: the root records no shape of output {spec.name!r} for bucket "
                                       f"{entry.bucket}")
            files.append(CachedOutput(spec.name, join(directory, output_path(entry.path, spec.name)),
                                      output_nbytes(entry.samples, shape, spec.descr), digest, spec.descr, shape))
        return cls(entry.checksum, url, join(directory, entry.meta_path), entry.bytes, entry.meta_bytes,
                   entry.meta_checksum, entry.samples, entry.checksum_algorithm, entry.bucket, tuple(files))


def cache_key(entry: ShardEntry) -> str:
    """The cache's name for a shard's unit: what all of its files hold, whatever shard lists them."""
    return _key(entry.checksum, entry.meta_checksum, entry.outputs)


def _key(npy_checksum: str, meta_checksum: str, output_digests: Sequence[str] = ()) -> str:
    # Hex digits and dashes: no dot (``usage`` splits at it). The outputs' part only where there are outputs: a
    # dataset without them keeps the keys (and so the warm files) it always had.
    if not output_digests:
        return f"{npy_checksum}-{meta_checksum}"
    outputs = hashlib.sha256(",".join(output_digests).encode()).hexdigest()[:32]
    return f"{npy_checksum}-{meta_checksum}-{outputs}"


class CacheDir:
    """One process's view of a cache directory (see the module docstring). ``count(name, n)`` receives
    the counters ``downloads``, ``bytes_downloaded``, ``adopted``, ``retries``; ``stop`` ends a wait."""

    def __init__(self, root: str, shape: tuple[int, int, int], store: Callable[[], Downloader],
                 count: Callable[[str, int], None], stop: threading.Event, attempts: int = 3,
                 buckets: Sequence[tuple[int, int]] | None = None) -> None:
        self.root, self.shape, self.store, self.count, self.stop = root, shape, store, count, stop
        self.attempts, self.buckets = attempts, buckets
        locks = os.path.join(root, "locks")
        try:
            os.makedirs(locks, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as e:
            raise ShardError(f"{e.filename or locks}: not a directory, where the shard cache keeps "
                             f"its folder {locks}; remove what is there, or set cache_dir (or "
                             "SHARDIO_CACHE_DIR) to another directory") from e
        except OSError as e:
            if e.errno not in _READ_ONLY:
                raise
            raise self._not_writable(e) from e

    def path(self, key: str) -> str:
        return os.path.join(self.root, f"{key}.npy")

    def meta_path(self, unit: CachedShard) -> str:
        return os.path.join(self.root, f"{unit.key}.jsonl")

    def output_path(self, unit: CachedShard, output: CachedOutput) -> str:
        """Where output ``output`` of ``unit`` is cached: beside its ``.npy``, ``KEY.NAME.npy``."""
        return os.path.join(self.root, f"{unit.key}.{output.name}.npy")

    def _files(self, unit: CachedShard) -> list[tuple[str, str, int, str, str, Callable[[str, str], None]]]:
        """(url, cached path, size, checksum algorithm, expected checksum, header check) of each file of the unit."""
        def pixels(url: str, path: str) -> None:
            self._check_pixel_header(url, path, self.unit_shape(unit))

        def no_header(url: str, path: str) -> None:
            pass

        files = [(unit.npy_url, self.path(unit.key), unit.npy_bytes, unit.algorithm, unit.npy_checksum, pixels),
                 (unit.meta_url, self.meta_path(unit), unit.meta_bytes, unit.algorithm, unit.meta_checksum,
                  no_header)]
        for output in unit.outputs:
            files.append((output.url, self.output_path(unit, output), output.nbytes, XXH3_128, output.digest,
                          lambda url, path, output=output: _check_output_header(url, path, unit.samples, output)))
        return files

    def _lock_fd(self, key: str) -> int:
        path = os.path.join(self.root, "locks", f"{key}.lock")
        cloexec = getattr(os, "O_CLOEXEC", 0)
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | cloexec, 0o666)
        except OSError as refused:
            if refused.errno not in _READ_ONLY:
                raise
            # Another user's lock file in a shared cache directory, or a cache on a read-only mount: flock
            # works on a descriptor opened for reading too.
            try:
                return os.open(path, os.O_RDONLY | cloexec)
            except FileNotFoundError:
                raise self._not_writable(refused) from refused

    def _not_writable(self, error: OSError) -> ShardError:
        if error.errno == errno.EROFS:
            return ShardError(f"the cache directory {self.root} is on a read-only file system ({error}): the "
                              "shards it holds are read, others cannot be downloaded into it; set cache_dir "
                              "(or SHARDIO_CACHE_DIR) to a writable directory")
        return ShardError(f"the cache directory {self.root} is not writable by this user ({error}); give "
                          "each user a cache_dir (or SHARDIO_CACHE_DIR) of their own, or make this one "
                          "group-writable")

    # --- getting a shard ----------------------------------------------------------------------------

    def fetch(self, unit: CachedShard) -> int:
        """Make the unit's files present and whole (adopted, or downloaded and checked); return an fd
        holding its ``LOCK_SH`` (``release`` gives it up)."""
        fd = self._lock_fd(unit.key)
        try:
            while True:
                if self.stop.is_set():
                    raise ShardError(f"{unit.npy_url}: the cache was closed")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    # Another process downloads it (EX) or holds it (SH): adopt it once it is whole.
                    try:
                        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    except BlockingIOError:
                        time.sleep(0.05)
                        continue
                    if self.present(unit):
                        self.count("adopted", 1)
                        return fd
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    time.sleep(0.05)
                    continue
                if self.present(unit):
                    self.count("adopted", 1)
                else:
                    self._download(unit)
                fcntl.flock(fd, fcntl.LOCK_SH)  # others may adopt it now; none may remove it
                return fd
        except BaseException:
            os.close(fd)
            raise

    def present(self, unit: CachedShard) -> bool:
        return all(_size(path) == size for _, path, size, _, _, _ in self._files(unit))

    def _download(self, unit: CachedShard) -> None:
        """Every file of the unit, checked, renamed into place; ``attempts`` tries (a missing object, refused
        credentials or a full disk: none more). Holding the unit's ``LOCK_EX``."""
        self._remove_temps(unit.key)  # a killed download's leftovers (only we write them now)
        last: ShardError | None = None
        for attempt in range(self.attempts):
            if attempt:
                self.count("retries", 1)
                time.sleep(min(2.0, 0.2 * 2**attempt))
            url = unit.npy_url
            try:
                temps = []
                try:
                    for url, final, size, algorithm, expected, check_header in self._files(unit):
                        temp = os.path.join(self.root, f"{TEMP_PREFIX}{unit.key}.{secrets.token_hex(4)}")
                        temps.append((temp, final))
                        digest = self.store().download(url, temp, algorithm)
                        self._check(url, temp, size, algorithm, expected, digest, check_header)
                        self.count("bytes_downloaded", size)
                    for temp, final in temps:
                        os.replace(temp, final)
                finally:
                    for temp, _ in temps:
                        _remove(temp)
                self.count("downloads", 1)
                return
            except FileNotFoundError as e:
                raise ShardError(f"{url}: listed in the manifest but missing from the store; HINT: run "
                                 "`preprocess verify DIR --repair`") from e
            except StorageAccessError as e:
                raise ShardError(f"{url}: {e}") from e
            except ShardIntegrityError as e:
                last = e
            except MissingExtra:  # xxhash not installed: no retry can help, and the message says what to do
                raise
            except Exception as e:  # a network or disk error: retried, then reported
                # The cache directory, not the store: waiting will not help.
                if isinstance(e, OSError) and e.errno in _READ_ONLY:
                    raise ShardError(f"{url}: {self._not_writable(e)}") from e
                if isinstance(e, IsADirectoryError):  # not the cache's to remove
                    raise ShardError(f"{e.filename2 or e.filename}: a directory where the shard cache keeps "
                                     f"a file (of {url}); remove it, or set cache_dir (or "
                                     "SHARDIO_CACHE_DIR) to another directory") from e
                if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise ShardError(f"{url}: the cache's disk is full ({self.root}): {e}") from e
                last = ShardError(f"{url}: download failed: {type(e).__name__}: {e}")
                last.__cause__ = e
        assert last is not None
        raise ShardError(f"{last} (after {self.attempts} attempts)") from last

    def unit_shape(self, unit: CachedShard) -> tuple[int, int]:
        """(h, w) of the unit's images: its bucket's in a bucketed dataset (``buckets``), else the dataset's."""
        if self.buckets is None:
            return self.shape[0], self.shape[1]
        if not 0 <= unit.bucket < len(self.buckets):
            raise ShardIntegrityError(f"{unit.npy_url}: bucket {unit.bucket}, the dataset has {len(self.buckets)}")
        height, width = self.buckets[unit.bucket]
        return height, width

    def _check(self, url: str, path: str, size: int, algorithm: str, expected: str, digest: str,
               check_header: Callable[[str, str], None]) -> None:
        actual = _size(path)
        if actual != size:
            raise ShardIntegrityError(f"{url}: downloaded {actual} bytes, the manifest says {size}")
        check_header(url, path)
        if digest != expected:
            raise ShardIntegrityError(f"{url}: {algorithm} differs from the manifest (corrupt object in the "
                                      "store, or changed after the commit); HINT: run `preprocess verify DIR "
                                      "--repair`")

    def _check_pixel_header(self, url: str, path: str, shape: tuple[int, int]) -> None:
        if url.endswith(JPEG_SUFFIX):
            with open(path, "rb") as f:
                parse_jpeg_header(f.read(HEADER_BYTES), url)  # the offsets are checked when it is mapped
        elif url.endswith(YUV_SUFFIX):
            with open(path, "rb") as f:
                n, sample_bytes = parse_yuv_header(f.read(HEADER_BYTES), url)
            if sample_bytes != yuv_sample_bytes(*shape):
                raise ShardIntegrityError(f"{url}: header says {n} samples of {sample_bytes} bytes, the shard's "
                                          f"images are {shape} ({yuv_sample_bytes(*shape)} bytes each: the index and "
                                          "the shard disagree); HINT: run `preprocess verify DIR --repair` to "
                                          "rebuild it from its input")
        elif url.endswith(".npy"):
            with open(path, "rb") as f:
                n, h, w = parse_npy_header(f.read(HEADER_BYTES), url)
            if (h, w) != shape:
                raise ShardIntegrityError(f"{url}: header says {(n, h, w)}, the shard's images are {shape} "
                                          "(the index and the shard disagree); HINT: run `preprocess verify "
                                          "DIR --repair` to rebuild it from its input")

    # --- giving a shard up --------------------------------------------------------------------------

    def release(self, unit: CachedShard, fd: int) -> None:
        """Give up this process's hold (``fetch``'s fd): the files are removed unless another process
        holds them too."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while another process holds it
            for _, path, _, _, _, _ in self._files(unit):
                _remove(path)
        except BlockingIOError:
            pass
        finally:
            os.close(fd)

    def remove_unheld(self, key: str) -> bool:
        """Remove the unit's files if no process holds it (False: one does)."""
        return self._if_unheld(key, lambda name: name.split(".", 1)[0] == key)

    def _remove_temps(self, key: str) -> None:
        for name in os.listdir(self.root):
            if name.startswith(f"{TEMP_PREFIX}{key}."):
                _remove(os.path.join(self.root, name))

    def remove_dead_temps(self, key: str) -> bool:
        """Remove a killed download's temp files, unless a process is downloading that shard now."""
        return self._if_unheld(key, lambda name: name.startswith(f"{TEMP_PREFIX}{key}."))

    def _if_unheld(self, key: str, chosen: Callable[[str], bool]) -> bool:
        fd = self._lock_fd(key)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        try:
            for name in os.listdir(self.root):
                if chosen(name):
                    _remove(os.path.join(self.root, name))
        finally:
            os.close(fd)
        return True

    def bytes_now(self, loading: Mapping[str, int], size_of: Callable[[str], int | None]) -> int:
        """The bytes of every shard file in the directory now, downloads in progress included: what all the processes
        sharing it hold (a group's first process downloads ahead only while they leave room, ``cache_room``). A
        download is counted at the size it will have, not the part written so far: the calling process's
        (``loading``: unit key -> bytes, its ``.tmp-`` files there yet or not) and any other process's whose unit
        ``size_of`` knows (the processes of a group download the units of one plan); another's at what it wrote."""
        total, whole = 0, dict(loading)
        with os.scandir(self.root) as entries:
            for entry in entries:
                temp = entry.name.startswith(TEMP_PREFIX)
                if temp:
                    key = entry.name[len(TEMP_PREFIX):].split(".", 1)[0]
                    size = whole.get(key, size_of(key))
                    if size is not None:
                        whole[key] = size  # a unit's files, counted once
                        continue
                if temp or entry.name.endswith((".npy", ".jsonl")):
                    try:
                        if entry.is_file(follow_symlinks=False):
                            total += entry.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:  # removed meanwhile by another process
                        pass
        return total + sum(whole.values())

    def usage(self) -> tuple[dict[str, int], set[str]]:
        """(bytes of finished files per shard key, keys with temp files) in the directory now."""
        sizes: dict[str, int] = {}
        temps: set[str] = set()
        for name in os.listdir(self.root):
            if name.startswith(TEMP_PREFIX):
                temps.add(name[len(TEMP_PREFIX):].split(".", 1)[0])
            elif name.endswith((".npy", ".jsonl")):
                size = _size(os.path.join(self.root, name))
                if size >= 0:
                    key = name.split(".", 1)[0]
                    sizes[key] = sizes.get(key, 0) + size
        return sizes, temps


def _check_output_header(url: str, path: str, samples: int, output: CachedOutput) -> None:
    """An output file's header is the one its dtype, sample count and shape make (spec, "Model outputs")."""
    with open(path, "rb") as f:
        header = f.read(HEADER_BYTES)
    if header == output_header(output.descr, samples, output.shape):
        return
    try:
        descr, found = parse_output_header(header, url)
    except ShardFormatError as e:  # a corrupt object: refused as one, not retried as a failed download
        raise ShardIntegrityError(str(e)) from e
    raise ShardIntegrityError(f"{url}: header says {descr} {list(found)}, the index says {output.descr} "
                              f"{[samples, *output.shape]} (the index and the file disagree); HINT: run `preprocess "
                              "verify DIR --repair` to rebuild it from its input")


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return -1


def _remove(path: str) -> None:
    """Remove a cache file, unless it is gone already, another user's (a shared cache directory: not ours
    to remove, and it stays valid for its owner), on a read-only file system (it stays valid there), or a
    directory (not a file the cache wrote)."""
    try:
        os.remove(path)
    except (FileNotFoundError, IsADirectoryError):
        pass
    except OSError as e:
        if e.errno not in _READ_ONLY:
            raise
