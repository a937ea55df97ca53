"""What an INPUT can be: the table of input kinds, and telling one from its name or its first bytes.

One row per kind of input a source reads (today one: a tar, plain or compressed, as WebDataset and
img2dataset write). A row names the kind for a person, the file-name suffixes that claim it, and a test of
the first ``HEAD_BYTES`` bytes. A source of a new kind (a Parquet file, a folder of images) adds its row
here, and ``preprocess.inputs`` asks this table only.

When the first bytes are read. A name that claims a kind (``x.tar``, ``x.tar.gz``) is taken at its word:
a nightly rerun over 10,000 tars makes no read or request per tar (``preprocess.inputs``), and a ``.tar``
that turns out not to be one fails as an input (exit 1, named in the report), as a corrupt one does. A
name that claims no kind (``notes.txt``, ``data.parquet``, ``shard-000``: only an INPUT named explicitly
can be one, a glob takes tar names only) is read: its first 512 bytes, one ``read`` or one ranged GET.
If no kind takes them the run is refused before Ray starts and before the output is touched
(``UnsupportedInput``, exit 2), naming the file, what it looks like and the kinds accepted; once that
started Ray, printed tarfile's internals and committed an empty dataset.
"""

from __future__ import annotations

import tarfile
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["InputKind", "INPUT_KINDS", "HEAD_BYTES", "TAR_SUFFIXES", "claimed_kind", "kind_of", "looks_like",
           "accepted_kinds"]

# A tar's first header is one 512-byte block; every compressed form says so in its first 6 bytes.
HEAD_BYTES = 512
# What the tar reader opens (``tarfile`` mode ``r|*``: plain, gzip, bzip2, xz).
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")
_COMPRESSED = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00")  # gzip, bzip2, xz: what tarfile's r:* detects


@dataclass(frozen=True)
class InputKind:
    name: str
    described: str  # for a person: what it is
    suffixes: tuple[str, ...]  # names that claim this kind (lower case)
    recognises: Callable[[bytes], bool]  # the first HEAD_BYTES bytes (fewer for a shorter file)


def _tar_head(head: bytes) -> bool:
    """A tar's first block: a header whose checksum holds (ustar, GNU, pax and v7 alike: the magic at 257
    is absent from v7 tars, the checksum never), the zero block of an empty archive, or a compressed
    stream that ``tarfile`` opens (whether it holds a tar is known only once decompressed: the worker)."""
    if head.startswith(_COMPRESSED):
        return True
    if len(head) < 512:
        return False
    try:
        tarfile.TarInfo.frombuf(head[:512], "utf-8", "surrogateescape")
    except tarfile.EOFHeaderError:
        return True  # a zero block: an empty archive
    except tarfile.HeaderError:
        return False
    return True


INPUT_KINDS: tuple[InputKind, ...] = (
    InputKind("tar", "a tar archive of samples (WebDataset, img2dataset), plain or compressed with gzip, bzip2 "
                     "or xz", TAR_SUFFIXES, _tar_head),
)

# What a file no kind takes looks like, by its first bytes: said in the refusal so the user sees at once
# what was passed.
_LOOKS = ((b"PAR1", "a Parquet file"), (b"PK\x03\x04", "a zip archive"), (b"\x89PNG", "a PNG image"),
          (b"\xff\xd8", "a JPEG image"), (b"RIFF", "a RIFF file (WebP, WAV)"), (b"%PDF", "a PDF document"),
          (b"\x93NUMPY", "a numpy .npy file"), (b"7z\xbc\xaf", "a 7-Zip archive"))


def claimed_kind(name: str) -> InputKind | None:
    """The kind a path or URL's name claims by its suffix, or None."""
    lowered = name.lower()
    return next((kind for kind in INPUT_KINDS if lowered.endswith(kind.suffixes)), None)


def kind_of(head: bytes) -> InputKind | None:
    """The kind whose test takes these first bytes, or None."""
    return next((kind for kind in INPUT_KINDS if kind.recognises(head)), None)


def looks_like(head: bytes) -> str:
    """What first bytes no kind took look like, for a message."""
    if not head:
        return "an empty file"
    for magic, what in _LOOKS:
        if head.startswith(magic):
            return what
    if head.lstrip()[:1] in (b"{", b"[") and _is_text(head):
        return "JSON text"
    if _is_text(head):
        return "text"
    return f"binary data starting {head[:4].hex()}"


def _is_text(head: bytes) -> bool:
    """UTF-8 of printable characters (the 512 bytes may end inside a character: up to 3 are let go)."""
    for cut in range(4):
        try:
            text = head[: len(head) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        return bool(text) and all(c.isprintable() or c in "\t\r\n" for c in text)
    return False


def accepted_kinds() -> str:
    """The kinds of input a run takes, for a message."""
    return "; ".join(f"{kind.described} ({', '.join(kind.suffixes)}, or any name whose content is one)"
                     for kind in INPUT_KINDS)
