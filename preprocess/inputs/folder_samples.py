"""Reading a folder of image files as samples (ImageFolder trees, photo dumps), with ``KEY.txt`` / ``KEY.json``
/ ``KEY.cls`` sidecars.

Every file under the folder (recursively; names starting with ``.`` skipped, directory links not
followed) whose extension is one of ``image_extensions`` (any case: ``x.JPG``) is a sample, in sorted order
of its path relative to the folder. The key rule: a sample's key is that path without the extension
(``cat/0001``), and the files ``KEY.txt``, ``KEY.json``, ``KEY.cls`` beside it are its metadata, as a tar's
members are (a missing one is simply absent). Where two or more image files share that key (``x.jpg`` and
``x.png``, or ``x.JPG`` and ``x.jpg``), each of them is a sample keyed by its path with its extension, as
written (``x.jpg``, ``x.png``): both are kept, and a folder without such a pair keeps the keys it always had.
The stem's sidecars (``x.txt``) then belong to every image of the stem (they name the stem, not one of
its files: nothing says which image they describe more than the other), and a sidecar named after one
image's file (``x.png.txt``) to that image only, over the stem's. A key met twice all the same (``x.jpg.png``
beside that pair is keyed ``x.jpg`` too) makes the later file a counted ``duplicate_key`` failure naming
it. A key with metadata but no image is a failed sample (``missing_image``), as in a tar.

What is not a sample is counted, never dropped unsaid. A file of an image format Pillow reads (TIFF,
BMP, GIF, ...: ``pillow_image_extensions``) whose extension ``image_extensions`` leaves out is not
read, and its sidecars with it (a choice: a key's metadata belongs to its image); a link that leads to
no file (dangling, or a loop such as a link to itself), a link to a folder (not followed, so a
directory loop is never walked) and a special file (a FIFO, a socket) are skipped. Each is counted in
the run report's ``files_ignored`` per folder and reason, with the first file's name
(``FolderFingerprint.ignored``); other files (``notes.md``) are no concern of the folder. A folder with
no image file at all is refused, with what it looked for and the setting that decides it. A file that
cannot be read (no permission, an I/O error) is a counted ``unreadable_file`` failure naming it, not a
failed folder: the folder is committed without that sample; after fixing it, touching the file
(``touch``) changes the folder's fingerprint, and the next run reads the folder again.

Classes (``folder_classes: true``): the first folder level names the class, a sample's ``cls`` is its
class's id and its ``json`` carries the name (``{"class": "cat"}``, beside a sidecar's keys; a ``.cls``
sidecar is then ignored). The ids are the dataset's, not the folder's: the job numbers every name once
in the class table the dataset keeps (``shardio.format.spec``, "Classes"; ``preprocess.inputs.class_table``)
and hands it to the task (``preprocess.inputs.kinds.KindReader``), so ``dog`` has one id in every drop. Read
alone (``diagnose``, a direct call) a folder numbers its sorted first-level sub-folders 0, 1, 2, ...,
torchvision's ``ImageFolder`` rule, which a new dataset's table also follows. An image directly in the
folder has no class: it is a failed sample (``no_class``), never a sample with ``cls`` -1.

A folder on object storage (``s3://bucket/photos/``, a prefix, named with or without its trailing
slash) is read by the same rules over its object keys: the keys under the prefix are its files (a key
ending in ``/``, a console's folder marker, names a folder and is no file), found by one paged LIST
(``Storage.list_files(recursive=True)``), each read by one GET (``Storage.read_tagged``). Only the two
backends of ``FolderSource`` differ ("list the files", "read a file"); grouping, sidecars, classes and the
size limit are this module's, once.

A folder is ONE input for incremental runs, not one per sub-folder. A local folder's fingerprint is the
total size of its files and the newest modification time of its files and directories (adding,
removing or renaming a file changes a directory's mtime), taken by one walk per run (a stat per file).
A prefix's is taken from its one listing: the total size of its objects and a digest of every object's
(key, size, ETag), carried where an object input's ETag is (``preprocess.plan`` compares size + ETag), so
any object added, removed or replaced makes it a changed input, and a rerun with nothing changed reads
no object. The task lists the prefix again and reads it only if that listing still has the digest the
plan saw, and each object only at the ETag listed: an object replaced meanwhile fails the input (not
lasting: the next run reads the new one), so what is committed is exactly what the fingerprint names.
Why one input: a folder is committed all or nothing, like a tar, and its fingerprint is one walk. For
drops that grow, name each drop's folder as its own INPUT (``'drops/{0001..0009}'``): each is then an
input, processed once, and the class table keeps a class's id the same in every drop.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from PIL import Image

from preprocess.config import JobConfig
from preprocess.inputs.raw_sample import SAMPLES, InputExtent, RawSample, SampleProblem
from preprocess.inputs.tar_samples import MAX_MEMBER_BYTES
from shardio.errors import InputError, SampleError
from shardio.failure_reasons import FailureCode
from shardio.format import escape_name
from shardio.store.root import Place, open_input
from shardio.store.base import FileInfo, Storage

__all__ = ["FolderFile", "FolderFingerprint", "FolderSource", "IgnoredFiles", "folder_source",
           "iter_folder_samples", "no_image_reason", "pillow_image_extensions"]

_SIDECARS = ("txt", "json", "cls")


@dataclass(frozen=True)
class FolderFile:
    """One file of a folder: its path relative to the folder (``/``-separated), and, on object storage,
    the size and ETag its listing gave (locally None and "": the read finds the size)."""

    relative: str
    size: int | None = None
    version: str = ""


class IgnoredFiles(NamedTuple):
    """Files of a folder that are no sample, for one reason: how many, and the first in path order."""

    reason: str
    files: int
    first: str


class FolderFingerprint(NamedTuple):
    """(total bytes of its files, newest mtime_ns, a digest of its listing ("" locally), image files, the
    files it leaves aside by reason)."""

    size: int
    mtime_ns: int
    etag: str
    images: int
    ignored: tuple[IgnoredFiles, ...] = ()


@functools.cache
def pillow_image_extensions() -> frozenset[str]:
    """The extensions (lower case, no dot) of the image formats this Pillow opens: ``tif``, ``bmp``,
    ``gif`` ... Pillow's stub plugins (BUFR, GRIB, HDF5) and MPEG name a file's format without decoding it:
    left out."""
    registered = Image.registered_extensions()  # imports every plugin once (~20 ms)
    no_decoder = ("StubImagePlugin", "MpegImagePlugin")
    return frozenset(extension[1:].lower() for extension, name in registered.items()
                     if name in Image.OPEN and not Image.OPEN[name][0].__module__.endswith(no_decoder))


_FILE, _FOLDER = "file", "folder"  # what a walk's entry is, when it is no skipped one
# Why a file of a folder is no sample, in the order a report lists them.
_LEFT_OUT = "image files image_extensions leaves out"
_NO_FILE = "links that lead to no file"
_FOLDER_LINK = "links to folders (not followed)"
_SPECIAL = "special files (not regular files)"


@dataclass
class _Tally:
    """The files a folder leaves aside, counted by reason (the left-out images also by extension)."""

    image_extensions: tuple[str, ...]
    counts: dict[str, int] = field(default_factory=dict)
    first: dict[str, str] = field(default_factory=dict)
    extensions: dict[str, int] = field(default_factory=dict)
    images: int = 0

    def file(self, relative: str) -> None:
        extension = _extension(relative)
        if extension in self.image_extensions:
            self.images += 1
        elif extension in pillow_image_extensions():
            self.extensions[extension] = self.extensions.get(extension, 0) + 1
            self.skip(_LEFT_OUT, relative)

    def skip(self, reason: str, relative: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.first[reason] = min(self.first.get(reason, relative), relative)

    def ignored(self) -> tuple[IgnoredFiles, ...]:
        by_extension = ", ".join(f"{extension} {files}" for extension, files in sorted(self.extensions.items()))
        said = {_LEFT_OUT: f"{_LEFT_OUT} ({by_extension})"}
        return tuple(IgnoredFiles(said.get(reason, reason), self.counts[reason], self.first[reason])
                     for reason in (_LEFT_OUT, _NO_FILE, _FOLDER_LINK, _SPECIAL) if reason in self.counts)


def no_image_reason(image_extensions: Iterable[str], ignored: Iterable[IgnoredFiles] = ()) -> str:
    """Why a folder is no input: what it looked for, the setting, and the images it left out (if any)."""
    named = [f".{extension}" for extension in image_extensions]
    looked = f"{', '.join(named[:-1])} or {named[-1]}" if len(named) > 1 else "".join(named)
    said = f"is a folder with no image file named {looked} (image_extensions)"
    left_out = next((entry for entry in ignored if entry.reason.startswith(_LEFT_OUT)), None)
    if left_out is not None:
        said += (f"; it holds {left_out.files} {left_out.reason}: add their extension to image_extensions to "
                 "read them")
    return said


class FolderSource(Protocol):
    """Where a folder's files come from: what differs between a local folder and a prefix of objects."""

    folder: str

    def files(self) -> list[FolderFile]: ...  # every file under it, hidden names skipped, sorted
    def classes(self) -> list[str]: ...  # the first-level sub-folders' names, sorted
    def read(self, file: FolderFile) -> bytes: ...  # at most MAX_MEMBER_BYTES + 1 bytes
    def fingerprint(self, image_extensions: tuple[str, ...]) -> FolderFingerprint: ...
    def holds_images(self, image_extensions: tuple[str, ...]) -> bool: ...  # names only: no stat per file
    def check_listed(self, etag: str) -> None: ...  # InputError if it changed since the plan's listing


def folder_source(place: Place) -> FolderSource:
    """The folder at ``place`` (a local directory, or a prefix URL ending in ``/``; or that input opened
    already: ``shardio.store.root.open_input``), by its backend."""
    folder = open_input(place)
    return _LocalFolder(folder.path) if folder.is_local else _ObjectFolder(folder.path, folder.storage)


def _extension(relative: str) -> str:
    name = relative.rsplit("/", 1)[-1]
    return name.rsplit(".", 1)[1].lower() if "." in name[1:] else ""


class _LocalFolder:
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def _walk(self) -> Iterator[tuple[str, os.DirEntry[str], str]]:
        """(path relative to the folder, entry, what it is) of every entry under it, hidden names skipped:
        a regular file (or a link to one) is ``_FILE``, a folder ``_FOLDER`` (its mtime counts in the
        fingerprint; yielded as relative path + "/"), else the reason it is skipped. A link is followed to a
        file only: a link to a folder, to nothing or to itself (``ELOOP`` from its ``stat``) is skipped."""
        stack = [""]
        while stack:
            relative = stack.pop()
            with os.scandir(os.path.join(self.folder, relative) if relative else self.folder) as entries:
                for entry in entries:
                    if entry.name.startswith("."):
                        continue
                    path = f"{relative}{entry.name}"
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(path + "/")
                        yield path + "/", entry, _FOLDER
                        continue
                    try:
                        kind = _FILE if entry.is_file() else _FOLDER_LINK if entry.is_dir() else None
                    except OSError:  # a link to itself, or through a loop of links
                        kind = None
                    yield path, entry, kind or (_NO_FILE if entry.is_symlink() else _SPECIAL)

    def files(self) -> list[FolderFile]:
        return [FolderFile(relative) for relative in sorted(r for r, _, kind in self._walk() if kind == _FILE)]

    def holds_images(self, image_extensions: tuple[str, ...]) -> bool:
        return any(kind == _FILE and _extension(relative) in image_extensions
                   for relative, _, kind in self._walk())

    def classes(self) -> list[str]:
        with os.scandir(self.folder) as entries:
            return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False) and not e.name.startswith("."))

    def fingerprint(self, image_extensions: tuple[str, ...]) -> FolderFingerprint:
        size, newest = 0, os.stat(self.folder).st_mtime_ns
        tally = _Tally(image_extensions)
        for relative, entry, kind in self._walk():
            if kind not in (_FILE, _FOLDER):
                tally.skip(kind, relative)
                continue
            info = entry.stat()
            newest = max(newest, info.st_mtime_ns)
            if kind == _FILE:
                size += info.st_size
                tally.file(relative)
        return FolderFingerprint(size, newest, "", tally.images, tally.ignored())

    def check_listed(self, etag: str) -> None:
        """Nothing to check: a local folder's files are read as they are (a vanished one fails the input)."""

    def read(self, file: FolderFile) -> bytes:
        """One ``open``, ``fstat`` and ``read`` of exactly its size; ``SampleError`` (``unreadable_file``)
        for a file that cannot be read (its sample fails, not the folder). A buffered ``open().read(limit)``
        sized its buffer by the 256 MB limit: 229 µs a sample of three files against 39 µs now (the tar
        reader: 65)."""
        relative = file.relative
        try:
            fd = os.open(os.path.join(self.folder, relative), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise InputError(self.folder, f"{relative!r} vanished while the folder was read: rerun",
                             lasting=False) from None
        except OSError as e:
            raise _unreadable(relative, e) from e
        try:
            wanted = min(os.fstat(fd).st_size, MAX_MEMBER_BYTES + 1)
            parts, got = [], 0
            while got < wanted:
                part = os.read(fd, wanted - got)
                if not part:
                    break
                parts.append(part)
                got += len(part)
            return parts[0] if len(parts) == 1 else b"".join(parts)  # b"" for an empty file
        except OSError as e:
            raise _unreadable(relative, e) from e
        finally:
            os.close(fd)


def _unreadable(relative: str, error: OSError) -> SampleError:
    """A file that cannot be read fails its sample, not the folder (the module docstring)."""
    return SampleError(FailureCode.UNREADABLE_FILE, f"cannot read {relative!r} ({error.strerror or error})")


class _ObjectFolder:
    """A prefix of objects; its listing taken once (``files``, ``classes`` and ``fingerprint`` share it)."""

    def __init__(self, folder: str, storage: Storage) -> None:
        self.folder = folder
        self._prefix = folder.rstrip("/")
        self._storage = storage
        self._listing: list[tuple[str, FileInfo]] | None = None

    def _listed(self) -> list[tuple[str, FileInfo]]:
        """(relative key, info) of every object under the prefix whose key has no hidden part, sorted;
        folder markers (keys ending in "/") included: they name folders."""
        if self._listing is None:
            start = len(self._prefix) + 1
            found = []
            for info in self._storage.list_files(self._prefix, recursive=True):
                relative = info.path[start:]
                if relative and not any(part.startswith(".") for part in relative.split("/")):
                    found.append((relative, info))
            self._listing = sorted(found, key=lambda item: item[0])
        return self._listing

    def files(self) -> list[FolderFile]:
        return [FolderFile(relative, info.size, info.version) for relative, info in self._listed()
                if not relative.endswith("/")]

    def holds_images(self, image_extensions: tuple[str, ...]) -> bool:
        return any(_extension(file.relative) in image_extensions for file in self.files())

    def classes(self) -> list[str]:
        return sorted({relative.split("/", 1)[0] for relative, _ in self._listed() if "/" in relative})

    def fingerprint(self, image_extensions: tuple[str, ...]) -> FolderFingerprint:
        digest = hashlib.sha256()
        size, newest = 0, 0
        tally = _Tally(image_extensions)
        for relative, info in self._listed():
            digest.update(f"{relative}\0{info.size}\0{info.version}\n".encode("utf-8", "surrogateescape"))
            size += info.size
            newest = max(newest, info.mtime_ns)
            if not relative.endswith("/"):
                tally.file(relative)
        return FolderFingerprint(size, newest, f"listing-sha256:{digest.hexdigest()[:32]}", tally.images,
                                 tally.ignored())

    def check_listed(self, etag: str) -> None:
        now = self.fingerprint(()).etag
        if etag and now != etag:
            raise InputError(self.folder, "objects were added, removed or replaced under it since it was listed: "
                                          "not committed; the next run reads it as it is then", lasting=False)

    def read(self, file: FolderFile) -> bytes:
        url = f"{self._prefix}/{file.relative}"
        try:
            if file.size is not None and file.size > MAX_MEMBER_BYTES:  # refused unread past the limit
                return self._storage.read_range(url, 0, MAX_MEMBER_BYTES + 1)
            data, version = self._storage.read_tagged(url)
        except FileNotFoundError:
            raise InputError(self.folder, f"{file.relative!r} vanished while the folder was read: rerun",
                             lasting=False) from None
        if file.version and version and version != file.version:
            raise InputError(self.folder, f"{file.relative!r} was replaced while the folder was read (ETag "
                                          f"{version}, listed as {file.version}): not committed; the next run "
                                          "reads the new one", lasting=False)
        return data


@dataclass
class _Stem:
    """The files of one path without its extension: its images (sorted), its sidecars, and whether an image
    ``image_extensions`` leaves out has it."""

    images: list[FolderFile] = field(default_factory=list)
    sidecars: dict[str, FolderFile] = field(default_factory=dict)
    left_out: bool = False


def iter_folder_samples(place: Place, cfg: JobConfig, size: int | None = None, etag: str = "",
                        extent: InputExtent | None = None, class_ids: Mapping[str, int] | None = None,
                        ) -> Iterator[RawSample | SampleProblem]:
    """Yield each image file under the folder ``place`` (its path, or the input opened already) as a sample
    (the module docstring's rules); ``etag``: a prefix's listing digest when the plan saw it
    (``FolderFingerprint.etag``); ``class_ids``: the dataset's class table (name -> id) under
    ``folder_classes`` (None: the folder's own sorted order)."""
    folder = open_input(place)
    path = folder.path
    source = folder_source(folder)
    try:
        files = source.files()
        source.check_listed(etag)
        classes = _class_ids(path, source, class_ids) if cfg.folder_classes else None
    except OSError as e:
        raise InputError(path, f"cannot list the folder ({e.strerror or e})", lasting=False) from e
    stems: dict[str, _Stem] = {}  # in sorted path order
    for file in files:
        extension = _extension(file.relative)
        if not extension:
            continue
        stem = file.relative[: -len(extension) - 1]
        if extension in cfg.image_extensions:
            stems.setdefault(stem, _Stem()).images.append(file)
        elif extension in _SIDECARS:
            stems.setdefault(stem, _Stem()).sidecars.setdefault(extension, file)
        elif extension in pillow_image_extensions():
            stems.setdefault(stem, _Stem()).left_out = True
    if not any(stem.images or stem.sidecars for stem in stems.values()):
        raise InputError(path, no_image_reason(cfg.image_extensions))
    # A sidecar named after an image's file (x.png.txt) belongs to that image when its stem has others.
    claimed = {file.relative for stem in stems.values() if len(stem.images) > 1 for file in stem.images}
    if extent is not None:  # one item per image, and per sidecar left without one: known once listed
        extent.expect(sum(len(stem.images) or (stem_key not in claimed and not stem.left_out)
                          for stem_key, stem in stems.items()), SAMPLES)
    keys: set[str] = set()
    for stem_key, stem in stems.items():
        if len(stem.images) > 1:
            for file in stem.images:
                own = stems.get(file.relative)
                yield _keyed(source, file.relative, file, {**stem.sidecars, **(own.sidecars if own else {})},
                             cfg, classes, keys)
        elif stem.images:
            yield _keyed(source, stem_key, stem.images[0], stem.sidecars, cfg, classes, keys)
        elif stem.sidecars and not stem.left_out and stem_key not in claimed:
            present = ", ".join(sorted(stem.sidecars))
            yield SampleProblem(escape_name(stem_key), FailureCode.MISSING_IMAGE,
                                f"no image file (has: {present})")


def _class_ids(path: str, source: FolderSource, table: Mapping[str, int] | None) -> dict[str, int]:
    """Class folder name -> id: the dataset's table's, or the folder's own sorted order without one. A class
    folder the table lacks appeared after the run listed the folder: the input fails, and the next run
    (which lists it again) numbers it."""
    names = source.classes()
    if table is None:
        return {escape_name(name): index for index, name in enumerate(names)}
    unknown = [name for name in names if escape_name(name) not in table]
    if unknown:
        raise InputError(path, f"class folder {unknown[0]!r} appeared after the run listed the folder: not "
                               "committed; the next run numbers it", lasting=False)
    return {escape_name(name): table[escape_name(name)] for name in names}


def _keyed(source: FolderSource, key: str, file: FolderFile, sidecars: dict[str, FolderFile], cfg: JobConfig,
           classes: dict[str, int] | None, keys: set[str]) -> RawSample | SampleProblem:
    """The sample of one image under ``key``, unless an earlier file took that key."""
    if key in keys:
        return SampleProblem(escape_name(key), FailureCode.DUPLICATE_KEY,
                             f"file {escape_name(file.relative)!r} has the key of an earlier image (the first "
                             "is kept)", escape_name(file.relative))
    keys.add(key)
    try:
        return _sample(source, key, file, sidecars, cfg, classes)
    except SampleError as e:
        return SampleProblem(escape_name(key), e.code, e.detail, escape_name(file.relative))


def _sample(source: FolderSource, key: str, file: FolderFile, sidecars: dict[str, FolderFile], cfg: JobConfig,
            classes: dict[str, int] | None) -> RawSample | SampleProblem:
    escaped = escape_name(key)
    member = escape_name(file.relative)
    top = escaped.split("/", 1)[0] if "/" in escaped else None  # its class folder's name
    if classes is not None and top is None:  # refused unread
        return SampleProblem(escaped, FailureCode.NO_CLASS,
                             f"{member!r} is not in a class folder (folder_classes: the first folder level "
                             "names the class)", member)
    too_large = file.size is not None and file.size > MAX_MEMBER_BYTES  # listed: refused without a GET
    image = b"" if too_large else source.read(file)
    if too_large or len(image) > MAX_MEMBER_BYTES:
        return SampleProblem(escaped, FailureCode.MEMBER_TOO_LARGE,
                             f"file {member!r} is over {MAX_MEMBER_BYTES} bytes: skipped", member)
    fields = {e: source.read(sidecars[e]) for e in _SIDECARS if e in sidecars}
    if classes is not None and top is not None:
        fields.pop("cls", None)
        fields["cls"] = str(classes[top]).encode()
        fields["json"] = _with_class(fields.get("json"), top)
    return RawSample(escaped, member, image, fields)


def _with_class(sidecar: bytes | None, name: str) -> bytes:
    """The sidecar's JSON object with ``"class": name`` added (a malformed sidecar is kept as it is, for
    ``parse_fields`` to count as the failure it is)."""
    if sidecar is None:
        return json.dumps({"class": name}, ensure_ascii=False).encode()
    try:
        value = json.loads(sidecar)
    except ValueError:
        return sidecar
    if not isinstance(value, dict):
        return sidecar
    return json.dumps({**value, "class": name}, ensure_ascii=False).encode()
