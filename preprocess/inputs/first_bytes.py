"""What a file's first bytes look like, for a message about an input no kind of source reads.

Shared by the table of input kinds (``preprocess.inputs.kinds``: refusing an input before Ray starts) and
the readers (a ``.tar`` that is not one fails as an input, said as what it is), which is why it is a leaf.
"""

from __future__ import annotations

__all__ = ["HEAD_BYTES", "looks_like"]

# The bytes read to tell an input's kind: a tar's first header is one 512-byte block, every compressed
# form and Parquet's magic say what they are in their first 6.
HEAD_BYTES = 512

# What a file no kind takes looks like, by its first bytes: said in the refusal so the user sees at once
# what was passed.
_LOOKS = ((b"PAR1", "a Parquet file"), (b"PK\x03\x04", "a zip archive"), (b"\x89PNG", "a PNG image"),
          (b"\xff\xd8", "a JPEG image"), (b"RIFF", "a RIFF file (WebP, WAV)"), (b"%PDF", "a PDF document"),
          (b"\x93NUMPY", "a numpy .npy file"), (b"7z\xbc\xaf", "a 7-Zip archive"))


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
