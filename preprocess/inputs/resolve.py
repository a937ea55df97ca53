"""Turning the CLI's INPUT arguments (paths, URLs, globs, brace ranges) into a sorted list of input paths.

The glob rule. A glob (or brace range) is how a nightly cron names its inputs, so it must neither
shrink silently nor grow with junk:

- an argument with a glob or a brace range that matches no input at all is a usage error
  (``NoInputsMatched``, exit 2, naming the kinds a glob takes) raised before anything is touched: a
  source mount that is down must not look like an empty drop (with ``--prune`` it would empty the dataset);
- a glob takes tar files (``TAR_SUFFIXES``), and the files of another kind only when the pattern's name
  says that kind (``data/*.parquet``: ``input_kinds.glob_takes``); anything else it matches
  (img2dataset's ``_stats.json`` and ``.parquet`` metadata beside its tars, for ``data/*``) is counted as
  ignored, not a failed input;
- a glob also takes the folders it matches that hold image files, each one input as if named (``data/*``,
  ``data/*/``, ``s3://bucket/drops/*``; not a pattern claiming a file kind, ``data/*.tar``:
  ``input_kinds.glob_takes_folders``); a folder inside one it takes is part of that one, and a folder
  holding no image file is no input (not listed as ignored: ``data/*`` over a drop's sub-folders of tars
  says what it always said), only counted in the message when nothing matched;
- a folder named explicitly that holds image files is one input (``preprocess.inputs.folder_samples``: a local
  one's fingerprint is a walk of it; a prefix URL's, named with or without its ``/``, one paged listing of
  it, and it is named with its ``/``, ``s3://bucket/photos/``); one holding none (a folder of tars) is
  refused, naming what it looked for and the setting (``image_extensions``); the files a folder leaves
  aside (images of a kind ``image_extensions`` leaves out, links to nothing) are ``files_ignored``;
- a path named explicitly is taken as it is: a missing one is a failed input named in the report (exit
  1), as is a missing member of a brace range that matched others; one whose name claims no kind of input
  (``notes.txt``, ``shard-000``) is read (its first 512 bytes) and, if no kind takes them, refused
  before anything is touched (``UnsupportedInput``, exit 2: the table of kinds is
  ``preprocess.inputs.kinds``).

Object storage (``s3://bucket/laion/{00000..00999}.tar``, ``s3://bucket/laion/*.tar``, ``**``), mixed
freely with local paths, by the same rule. A URL stays a URL. Objects are found by LIST, never by a HEAD
per tar: a glob lists the folder before its first glob character (recursively only when the rest of the
pattern has a ``/`` or ``**``), and the names a brace range expands to are looked up in one listing of
their folder; a folder is listed once per call, whatever number of patterns name it. A glob that may
take folders (``s3://bucket/drops/*``, not ``*.tar``) also lists its folder's sub-prefixes (``list_dir``:
one LIST more per 1,000 entries), or reads them from its recursive listing, and lists each prefix it
matches once (its fingerprint), a prefix inside one already looked at not at all. (One URL alone in its
folder is one HEAD: cheaper than listing a big folder.) ``*`` and ``?`` do not cross ``/``, ``**`` does,
and names starting with ``.`` match only a pattern that says so, as the local ``glob`` does. Each found
object carries its fingerprint from the listing (``ResolvedInputs.listed``: size, LastModified, ETag), so
the job recognises committed inputs with no request per tar.

Local files the same way (``preprocess.inputs.local_glob``): each folder a glob names is read once with
``os.scandir``, and each matched tar costs the one ``stat`` that gives its fingerprint; a path named
explicitly (a brace range's members) costs one ``lstat`` (a second ``stat`` only for a symlink). The job
then does no per-file work at all to recognise a committed input.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from typing import NamedTuple

from braceexpand import braceexpand

from preprocess.config import JobConfig
from preprocess.inputs.folder_samples import FolderFingerprint, FolderSource, folder_source, no_image_reason
from preprocess.inputs.kinds import (HEAD_BYTES, TAR_SUFFIXES, accepted_kinds, claimed_kind, glob_kinds, glob_takes,
                                   glob_takes_folders, kind_of, looks_like, FOLDER_KIND)
from preprocess.inputs.local_glob import local_glob
from shardio.store.base import FileInfo, Storage
from shardio.store.root import DatasetRoot, open_input
from shardio.errors import NoInputsMatched, UnsupportedInput

__all__ = ["resolve_inputs", "ResolvedInputs", "InputFingerprint", "NoInputsMatched", "TAR_SUFFIXES",
           "UnsupportedInput"]

_GLOB_CHARS = set("*?[")


class InputFingerprint(NamedTuple):
    """How an input is recognised between runs without reading it: (size, mtime_ns) of a local file; an
    object adds its ETag, and is recognised by (size, ETag) (``preprocess.job``). A plain
    ``(size, mtime_ns)`` tuple is a local fingerprint."""

    size: int
    mtime_ns: int
    etag: str = ""


@dataclass
class ResolvedInputs:
    paths: list[str] = field(default_factory=list)  # absolute paths and URLs, deduplicated, sorted
    failed: list[dict[str, str]] = field(default_factory=list)  # {input, reason}
    ignored: list[str] = field(default_factory=list)  # non-tar files a glob matched
    # path or URL -> fingerprint, from the listing (or the one stat of a path named explicitly): every input
    listed: dict[str, InputFingerprint] = field(default_factory=dict)
    links: set[str] = field(default_factory=set)  # local inputs whose name is a symlink (the output check)
    folders: set[str] = field(default_factory=set)  # inputs that are folders of image files
    # Files of folder inputs that are no sample, per folder and reason: {input, reason, files, first}
    # (preprocess.inputs.folder_samples: images image_extensions leaves out, links that lead to no file).
    files_ignored: list[dict[str, object]] = field(default_factory=list)
    # folder input -> the names of its first-level sub-folders, sorted (``FolderSource.classes``), from the
    # listing that took its fingerprint: what a run's class table learns (``preprocess.inputs.class_table``)
    classes: dict[str, list[str]] = field(default_factory=dict)
    # input -> its kind's name, for the inputs whose name claims none: a folder, or what the first bytes read
    # here once say (the tasks are told it: ``preprocess.inputs.kinds.KindReader``)
    kinds: dict[str, str] = field(default_factory=dict)


def resolve_inputs(patterns: list[str],
                   image_extensions: tuple[str, ...] = JobConfig().image_extensions) -> ResolvedInputs:
    """Expand ``data/{00000..00099}.tar``, ``data/*.tar``, ``s3://bucket/laion/*.tar`` and plain paths into
    absolute paths and URLs, by the glob rule of the module docstring (URLs: one LIST per folder). Paths
    are deduplicated and sorted, so the order of arguments never changes the dataset. Raises
    ``NoInputsMatched`` for a glob or brace range that matches no input."""
    found: set[str] = set()
    ignored: set[str] = set()
    failed: list[dict[str, str]] = []
    # Each expansion opened once, here: its backend chosen, then asked (a URL listed, a local path walked).
    opened = [(pattern, [(expanded, open_input(expanded)) for expanded in braceexpand(pattern)])
              for pattern in patterns]
    remote = _RemoteLookup([e for _, expansions in opened for _, e in expansions], image_extensions)
    on_disk = _LocalLookup(image_extensions)
    for pattern, expansions in opened:
        is_pattern = len(expansions) > 1 or any(_GLOB_CHARS & set(e) for e, _ in expansions)
        matched: set[str] = set()
        pattern_failed: list[dict[str, str]] = []
        pattern_ignored: set[str] = set()
        imageless = [0]  # folders a glob matched that hold no image file (said when nothing matched)
        for expanded, place in expansions:
            if not place.is_local:
                remote.resolve(place, matched, pattern_ignored, pattern_failed, imageless)
                continue
            if _GLOB_CHARS & set(place.path):
                on_disk.glob(place, matched, pattern_ignored, pattern_failed, imageless)
            else:
                problem = on_disk.named(place, matched)
                if problem:
                    pattern_failed.append({"input": expanded, "reason": problem})
        if is_pattern and not matched:
            others = [f"{len(pattern_ignored)} other file(s)"] if pattern_ignored else []
            others += [f"{imageless[0]} folder(s) with no image file"] if imageless[0] else []
            only = f" (only {' and '.join(others)})" if others else ""
            raise NoInputsMatched(
                f"{pattern}: matched no input{only}; a glob takes {glob_kinds()}; nothing was read, written or "
                "pruned. Is the source mounted? A glob or brace range that matches nothing is refused so that an "
                "unmounted drop never looks like an empty one"
            )
        found |= matched
        ignored |= pattern_ignored
        failed += pattern_failed
    folders = on_disk.folders | (remote.folders & found)
    nested = {path for path in folders if _inside(path, folders)}  # named, or matched by two patterns
    found -= nested
    folders -= nested
    listed = on_disk.found  # not copied: at 230k inputs a second dict is ~10 MB more
    for path in nested:
        listed.pop(path, None)
    listed.update((url, remote.listed[url]) for url in found if url in remote.listed)
    told = _refuse_unreadable([path for path in found if claimed_kind(path) is None and path not in folders], listed)
    told.update((path, FOLDER_KIND.name) for path in folders)  # a task is told it, and never stats it again
    fingerprints = {**on_disk.fingerprints, **remote.fingerprints}
    files_ignored = [{"input": path, "reason": entry.reason, "files": entry.files, "first": entry.first}
                     for path in sorted(folders) if path in fingerprints for entry in fingerprints[path].ignored]
    classes = {**on_disk.classes, **remote.classes}
    return ResolvedInputs(sorted(found), failed, sorted(ignored - found), listed, on_disk.links - nested, folders,
                          files_ignored, {path: classes[path] for path in folders if path in classes}, told)


def _inside(path: str, folders: set[str]) -> bool:
    """Whether ``path`` (absolute, or a URL ending in "/") lies inside one of ``folders`` (named alike)."""
    parts = path.rstrip("/").split("/")
    suffix = "/" if path.endswith("/") else ""
    return any("/".join(parts[:depth]) + suffix in folders for depth in range(1, len(parts)))


def _refuse_unreadable(unclaimed: list[str], listed: dict[str, InputFingerprint]) -> dict[str, str]:
    """Read the first bytes of each input whose name claims no kind (only an INPUT named explicitly can
    be one, opened here to read its head); raise ``UnsupportedInput`` naming those no kind takes
    (``preprocess.inputs.kinds``). A file that cannot be read now is left to the task, which names it as a
    failed input. Returns the kind's name of each one read (path -> kind), for the tasks to be told."""
    refused, told = [], {}
    for path in sorted(unclaimed):
        size = listed[path].size if path in listed else HEAD_BYTES
        try:
            head = open_input(path).storage.read_range(path, 0, min(size, HEAD_BYTES)) if size else b""
        except OSError:
            continue
        kind = kind_of(head)
        if kind is None:
            refused.append(f"{path}: {looks_like(head)}, not an input preprocess reads")
        else:
            told[path] = kind.name
    if refused:
        more = f" (and {len(refused) - 5} more)" if len(refused) > 5 else ""
        raise UnsupportedInput(f"{'; '.join(refused[:5])}{more}. INPUT takes: {accepted_kinds()}; nothing was "
                               "read or written")
    return told


class _LocalLookup:
    """Local paths resolved: each glob's folders read once (``local_glob``), a path named explicitly with
    one ``lstat``; what was found, with its fingerprint, across the patterns of one call."""

    def __init__(self, image_extensions: tuple[str, ...]) -> None:
        self.image_extensions = image_extensions
        self.found: dict[str, InputFingerprint] = {}  # path -> fingerprint: every local input
        self.links: set[str] = set()  # inputs whose name is a symlink (the output check)
        self.folders: set[str] = set()  # inputs that are folders of image files
        self.fingerprints: dict[str, FolderFingerprint] = {}  # of those folders (what each leaves aside)
        self.classes: dict[str, list[str]] = {}  # their first-level sub-folders (``FolderSource.classes``)

    def glob(self, opened: DatasetRoot, matched: set[str], ignored: set[str], failed: list[dict[str, str]],
             imageless: list[int]) -> None:
        pattern = opened.path
        files = 0
        matched_folders: dict[str, bool] = {}  # path -> is a link
        for file in local_glob(pattern, folders=glob_takes_folders(pattern)):
            files += 1
            if file.folder:
                matched_folders[file.path] = file.symlink
            elif glob_takes(pattern, file.path):
                matched.add(file.path)
                self.found[file.path] = InputFingerprint(file.size, file.mtime_ns)
                if file.symlink:
                    self.links.add(file.path)
            else:
                ignored.add(file.path)
        for path in sorted(matched_folders):
            if _inside(path, self.folders):  # a folder inside a folder input is part of it
                continue
            taken = self._images_folder(opened.at(path))
            if taken is None:
                imageless[0] += 1
            else:
                self._take_folder(path, *taken, matched, matched_folders[path])
        if not files:
            failed.append({"input": pattern, "reason": "glob matched no files"})

    def _images_folder(self, folder: DatasetRoot) -> tuple[FolderSource, FolderFingerprint] | None:
        """A folder a glob matched that holds image files, with its fingerprint, or None (no image, or
        unreadable). Its names are read first (no stat per file: ``data/**`` over a tree of tars stats
        nothing), its walk with a stat per file only for a folder taken."""
        if claimed_kind(folder.path) is not None:  # a folder named x.tar is no folder input
            return None
        source = folder_source(folder)
        try:
            if not source.holds_images(self.image_extensions):
                return None
            fingerprint = source.fingerprint(self.image_extensions)
        except OSError:
            return None
        return (source, fingerprint) if fingerprint.images else None

    def _take_folder(self, path: str, source: FolderSource, fingerprint: FolderFingerprint, matched: set[str],
                     link: bool) -> None:
        matched.add(path)
        self.folders.add(path)
        self.fingerprints[path] = fingerprint
        self.classes[path] = source.classes()  # one scandir of its top level
        self.found[path] = InputFingerprint(fingerprint.size, fingerprint.mtime_ns)
        if link:
            self.links.add(path)

    def named(self, opened: DatasetRoot, matched: set[str]) -> str:
        """Take a path named explicitly with one ``lstat`` (a symlink: one ``stat`` more; a folder: a walk,
        a stat per file); returns why it is not an input, or ""."""
        local = opened.path
        try:
            info = os.lstat(local)
            link = stat.S_ISLNK(info.st_mode)
            if link:
                info = os.stat(local)
        except (FileNotFoundError, NotADirectoryError):
            return "no such file"
        except OSError as e:
            return f"cannot be read: {e.strerror or e}"
        path = os.path.abspath(local)
        if stat.S_ISDIR(info.st_mode):
            # A folder of image files is one input (preprocess.inputs.folder_samples); one without any (a folder
            # of tars, say) is refused, saying what it looked for; one named as a file kind (x.tar) too.
            if claimed_kind(path) is not None:
                return "is a directory; pass DIR/*.tar"
            source = folder_source(opened.at(path))
            try:
                fingerprint = source.fingerprint(self.image_extensions)
                if not fingerprint.images:
                    names = [file.relative for file in source.files()]
                    return _no_image(fingerprint, self.image_extensions, names, "DIR")
            except OSError as e:
                return f"cannot be read: {e.strerror or e}"
            self._take_folder(path, source, fingerprint, matched, link)
            return ""
        if not stat.S_ISREG(info.st_mode):
            return "not a regular file"
        matched.add(path)
        self.found[path] = InputFingerprint(info.st_size, info.st_mtime_ns)
        if link:
            self.links.add(path)
        return ""


def _no_image(fingerprint: FolderFingerprint, image_extensions: tuple[str, ...], names: list[str],
              folder: str) -> str:
    """Why a folder named as an INPUT is none: it holds no image file (with the input files in it, if any)."""
    said = no_image_reason(image_extensions, fingerprint.ignored)
    kinds = {kind.name: kind for kind in (claimed_kind(name) for name in names) if kind is not None}
    if kinds:
        patterns = " or ".join(f"{folder}/*{kind.suffixes[0]}" for kind in kinds.values())
        said += f"; for the {' and '.join(kinds)} files in it, pass {patterns}"
    return said


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """``glob``'s rules as a regex over full URLs: ``*``/``?``/``[..]`` within one path component, ``**``
    (with ``recursive=True``) across any number of them, ``**/`` also matching none."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and (end := pattern.find("]", i + 2)) != -1:
            body = pattern[i + 1 : end]
            body = "^" + body[1:] if body.startswith("!") else body
            out.append(f"[{body.replace(chr(92), chr(92) * 2)}]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def _hidden_mismatch(pattern_rest: str, path_rest: str) -> bool:
    """A path component starting with "." that the pattern's component does not spell with a "." (glob
    skips hidden files unless asked)."""
    wanted = pattern_rest.split("/")
    for position, part in enumerate(path_rest.split("/")):
        if part.startswith("."):
            spelled = wanted[min(position, len(wanted) - 1)]
            if not spelled.startswith("."):
                return True
    return False


class _RemoteLookup:
    """URLs resolved by listing, each folder listed at most once per ``resolve_inputs`` call."""

    def __init__(self, expansions: list[DatasetRoot], image_extensions: tuple[str, ...]) -> None:
        self.listed: dict[str, InputFingerprint] = {}
        self.folders: set[str] = set()  # prefixes named as INPUTs that hold images, each named "URL/"
        self.fingerprints: dict[str, FolderFingerprint] = {}  # of those prefixes
        self.classes: dict[str, list[str]] = {}  # their first-level sub-folders, from the same listing
        self._image_extensions = image_extensions
        self._listings: dict[tuple[str, bool], dict[str, FileInfo]] = {}
        # Explicit URLs (no glob) per folder: a folder named more than once is listed, not HEADed per name.
        self._named: dict[str, set[str]] = {}
        for expanded in expansions:
            if not expanded.is_local and not _GLOB_CHARS & set(expanded.path):
                self._named.setdefault(expanded.path.rsplit("/", 1)[0], set()).add(expanded.path)

    def _listing(self, store: Storage, folder: str, recursive: bool) -> dict[str, FileInfo]:
        key = (folder, recursive)
        if key not in self._listings:
            if not recursive and (folder, True) in self._listings:  # a deeper listing covers this one
                self._listings[key] = {p: f for p, f in self._listings[(folder, True)].items()
                                       if "/" not in p[len(folder) + 1 :]}
            else:
                files = store.list_files(folder, recursive=recursive)
                self._listings[key] = {f.path: f for f in files}
        return self._listings[key]

    def _found(self, info: FileInfo) -> str:
        self.listed[info.path] = InputFingerprint(info.size, info.mtime_ns, info.version)
        return info.path

    def resolve(self, opened: DatasetRoot, matched: set[str], ignored: set[str], failed: list[dict[str, str]],
                imageless: list[int]) -> None:
        url, store = opened.path, opened.storage
        if not _GLOB_CHARS & set(url):
            self._resolve_named(opened, matched, failed)
            return
        first = min(url.index(c) for c in _GLOB_CHARS if c in url)
        folder = url[:first].rsplit("/", 1)[0]
        if folder.count("/") < 2 or folder.endswith(":/"):  # s3://bu*ket: the glob is in the bucket name
            raise NoInputsMatched(f"{url}: a glob in the bucket name is not supported; name the bucket")
        rest = url.rstrip("/")[len(folder) + 1 :]
        recursive = "/" in rest or "**" in rest
        regex = _glob_regex(url.rstrip("/"))
        listing = self._listing(store, folder, recursive)
        files = [] if url.endswith("/") else [
            info for path, info in listing.items()
            if regex.match(path) and not _hidden_mismatch(rest, path[len(folder) + 1 :])]
        matched.update(self._found(info) for info in files if glob_takes(url, info.path))
        ignored.update(info.path for info in files if not glob_takes(url, info.path))
        prefixes = []
        if glob_takes_folders(url):
            below = (self._prefixes_below(folder, listing) if recursive else
                     {f"{folder}/{name}" for name in store.list_dir(folder)} - set(listing))
            prefixes = [prefix for prefix in below if regex.match(prefix)
                        and not _hidden_mismatch(rest, prefix[len(folder) + 1 :])]
            checked: set[str] = set()
            for prefix in sorted(prefix + "/" for prefix in prefixes):
                # A prefix inside one checked is part of it (no links on object storage: no image there either).
                if not _inside(prefix, checked | self.folders):
                    checked.add(prefix)
                    imageless[0] += not self._take_folder(opened.at(prefix), matched)
        if not files and not prefixes:
            failed.append({"input": url, "reason": "glob matched no objects"})

    @staticmethod
    def _prefixes_below(folder: str, listing: dict[str, FileInfo]) -> set[str]:
        """Every prefix strictly below ``folder`` that a recursive listing's keys lie under."""
        found: set[str] = set()
        for path in listing:
            parts = path[len(folder) + 1 :].split("/")[:-1]
            for depth in range(1, len(parts) + 1):
                found.add(f"{folder}/{'/'.join(parts[:depth])}")
        return found

    def _take_folder(self, prefix: DatasetRoot, matched: set[str], source: FolderSource | None = None) -> bool:
        """Take the prefix (its path ending in "/") as a folder input if it holds images; one LIST."""
        name = prefix.path
        if claimed_kind(name.rstrip("/")) is not None:
            return False
        source = source or folder_source(prefix)
        fingerprint = source.fingerprint(self._image_extensions)
        if not fingerprint.images:
            return False
        self.classes[name] = source.classes()  # from the listing the fingerprint made
        self.listed[name] = InputFingerprint(fingerprint.size, fingerprint.mtime_ns, fingerprint.etag)
        self.fingerprints[name] = fingerprint
        self.folders.add(name)
        matched.add(name)
        return True

    def _resolve_named(self, opened: DatasetRoot, matched: set[str], failed: list[dict[str, str]]) -> None:
        url, store = opened.path, opened.storage
        if url.endswith("/"):
            self._resolve_folder(opened, matched, failed)
            return
        folder = url.rsplit("/", 1)[0]
        if len(self._named.get(folder, ())) > 1 or (folder, False) in self._listings:
            info = self._listing(store, folder, False).get(url)
            if info is not None:
                matched.add(self._found(info))
            else:
                self._resolve_folder(opened, matched, failed)
            return
        try:
            matched.add(self._found(store.info(url)))
        except FileNotFoundError:
            self._resolve_folder(opened, matched, failed)

    def _resolve_folder(self, opened: DatasetRoot, matched: set[str], failed: list[dict[str, str]]) -> None:
        """A URL that names no object: a prefix holding images is one folder input, named ``URL/``, its
        fingerprint from one paged listing (``preprocess.inputs.folder_samples``); a name claiming a file kind
        (``x.tar``) is never taken as a folder, as locally."""
        url = opened.path
        prefix = opened.at(url.rstrip("/") + "/")
        source = folder_source(prefix)
        if self._take_folder(prefix, matched, source):
            return
        names = [file.relative for file in source.files()]
        if not names:
            reason = "no such object"
        elif claimed_kind(url.rstrip("/")) is not None:
            reason = "is a folder; pass FOLDER/*.tar"
        else:
            fingerprint = source.fingerprint(self._image_extensions)
            reason = _no_image(fingerprint, self._image_extensions, names, "FOLDER")
        failed.append({"input": url, "reason": reason})
