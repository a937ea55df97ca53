"""A JPEG's marker layout, read from the bytes before any decoding: its scans and where its data ends.

Two uses. The scan count bounds a progressive JPEG's decode time before it starts (decode time grows with
the number of scans: 510 scans over 423 KB took 21 s). And the end of the last scan tells where the EOI
marker is, which ``transform`` needs to make libjpeg's "premature end of data segment" an error: libjpeg
only *warns* when a scan runs out of data before the image does (a JPEG cut mid-scan with an EOI appended,
or a header claiming 9000x9000 over 64x64 worth of data), fills the rest with grey, and Pillow drops the
warning. See ``_StrictJpegDecoder``.

Only markers are walked, segment lengths skipped. Crossing a scan's entropy-coded data means finding the
next ``FF`` not followed by a stuffed ``00`` or a restart marker (``D0``-``D7``): a regex does it at ~2 ns
a byte, 0.8 ms on a 400 KB JPEG, a quarter of the ~3.5 ms it takes to draft-decode a baseline JPEG. So a
single-scan JPEG (the first scan holds every component, sequential: almost every baseline JPEG) is not
crossed: its EOI is the last ``FF D9`` of the file (``rfind`` from the end, ~1 us), which such data cannot
contain. Trailing bytes holding an ``FF D9`` of their own move that guess into them; the real EOI is then
delivered to the decoder and only weakens the check for that file. Multi-scan JPEGs (progressive) are
walked scan by scan: their decode is 10x slower than the walk.

A stray marker inside a scan's data (``FF 01`` inserted 16 bytes into it, an ``FF D0`` in a JPEG without
restart interval, a reserved code) is where libjpeg stops reading that scan: it warns, fills the rest of
the image with grey, skips the bytes after the marker as "extraneous" and finishes. So the data ends there:
the walk stops at it (``eoi`` is its offset, ``stray_marker`` True), and the strict decoder gets the bytes
before it, as if the file were cut there. The markers that may end a scan's data are the next segment's
(``_AFTER_SCAN``) and the EOI; restart markers belong to a scan that has a restart interval. The single
scan that the walk does not cross is searched only where Pillow decodes it (``strict_data_end``); the region
decoder hears of the same marker from libjpeg itself (``_jpeg_region.c``).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Any

from PIL import Image, ImageFile

__all__ = ["JpegLayout", "ScanDataEnded", "jpeg_layout", "strict_data_end", "use_strict_decoder"]

# The next marker after entropy-coded data: FF (with any FF fill bytes before it) then a byte that is
# neither a stuffed 00 nor a restart marker RST0-RST7 (D0-D7), which are part of the scan.
# Starts with a literal, which lets the regex engine skip to each FF (a leading \xff+ made it 15x slower).
# A match on FF FF is a fill byte before the marker: the walk skips fill bytes.
_MARKER_AFTER_SCAN = re.compile(rb"\xff[^\x00\xd0-\xd7]")
_SOI, _EOI, _SOS, _APP1, _APP2 = 0xD8, 0xD9, 0xDA, 0xE1, 0xE2
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}  # not C4/C8/CC
_SOF_PROGRESSIVE = {0xC2, 0xC6, 0xCA, 0xCE}
# Markers without a length field (TEM, RSTn); everything else from C0 to FE carries a 2-byte length.
_STANDALONE = {0x01, *range(0xD0, 0xD8)}
_DRI, _RST = 0xDD, range(0xD0, 0xD8)
# The markers that may follow a scan's entropy-coded data (besides the EOI): DHT, DAC, SOS, DQT, DNL, DRI,
# APPn, COM. Anything else found there is a stray marker: see the module docstring.
_AFTER_SCAN = {0xC4, 0xCC, 0xDA, 0xDB, 0xDC, 0xDD, 0xFE, *range(0xE0, 0xF0)}
# Any marker inside entropy-coded data, restart markers included (for a scan without restart interval).
_MARKER_IN_SCAN = re.compile(rb"\xff[^\x00]")
# Fed in place of the EOI by ``_StrictJpegDecoder``: libjpeg-turbo's Huffman decoder refills its 64-bit
# bit buffer to at least 57 bits, so it reads up to 8 bytes past the last bit it needs; 8 zero bytes let a
# complete scan finish without suspending. No more: an incomplete scan decodes them as data, and 64 zero
# bits can complete at most the tail of the last MCU (a luma block needs ~190 of them with the standard
# tables), which is the one cut this check cannot see.
_FILLER = bytes(8)


@dataclass(frozen=True)
class JpegLayout:
    scans: int  # SOS markers: 1 for a baseline JPEG, ~10 for a usual progressive one
    progressive: bool
    # Huffman-coded (SOF0-3, 5-7): arithmetic-coded JPEGs (SOF9-15, rare) cannot suspend mid-scan, so the
    # strict decoder's end-of-data probe does not apply to them.
    huffman: bool
    # Every frame component reaches full precision (all 64 coefficients sent down to Al=0) in some scan.
    # False for a JPEG cut between two scans (an EOI appended there gives no decoder warning at all).
    complete: bool
    eoi: int | None  # offset of the EOI marker that ends the data; None if the data stops before one
    trailing: int  # bytes after the EOI (web JPEGs often carry some: ignored, as libjpeg does)
    # The frame header (SOF): size and component count, 0 if none was read.
    width: int = 0
    height: int = 0
    components: int = 0
    # The first APP1 "Exif" segment (its bytes, "Exif\0\0" included), as Pillow keeps it in info["exif"].
    exif: bytes | None = None
    # Every marker before the first scan is one whose meaning ``transform`` reproduces without Pillow's
    # header parse: no XMP (Pillow reads an orientation there), no second Exif segment (Pillow joins them),
    # no MPF (Pillow opens the file as MPO).
    plain_header: bool = False
    # Each frame component's (horizontal, vertical) sampling factors, in SOF order: ((2, 2), (1, 1), (1, 1))
    # for 4:2:0. ``jpeg_region`` decodes only the layouts it is proven on.
    sampling: tuple[tuple[int, int], ...] = ()
    restart_interval: int = 0  # MCUs between restart markers (DRI) when the first scan starts; 0: none
    # The walk stopped at a stray marker inside a scan's data: ``eoi`` is where it is (module docstring).
    stray_marker: bool = False
    scan_data: int = 0  # offset of the first scan's entropy-coded data (0 if none)


def jpeg_layout(data: bytes) -> JpegLayout | None:
    """The marker layout of a JPEG, or None if the bytes are not a well-formed marker sequence (the
    decoder then gives its own reason)."""
    if not data.startswith(b"\xff\xd8"):
        return None
    pos, scans, progressive, huffman = 2, 0, False, True
    size = len(data)
    components: list[int] = []
    width = height = 0
    exif: bytes | None = None
    plain = True
    full: dict[int, set[int]] = {}  # component id -> coefficients sent at full precision
    sampling: tuple[tuple[int, int], ...] = ()
    eoi: int | None = None
    restart_interval = first_restart_interval = scan_data = 0
    stray = False
    while pos < size:
        if data[pos] != 0xFF:
            if scans:  # a segment after a scan whose length lands in garbage: the data ends there
                eoi, stray = pos, True
                break
            return None  # garbage between segments: libjpeg's own error is clearer than ours
        start = pos
        while pos < size and data[pos] == 0xFF:
            pos += 1  # fill bytes
        if pos >= size:
            break
        marker = data[pos]
        pos += 1
        if marker == _EOI:
            eoi = pos - 2
            break
        if scans and marker not in _AFTER_SCAN and not (marker in _RST and restart_interval):
            eoi, stray = start, True  # where libjpeg stops reading the scan: see the module docstring
            break
        if marker in _STANDALONE or marker == _SOI:
            continue
        if pos + 2 > size:
            break
        (length,) = struct.unpack_from(">H", data, pos)
        if length < 2:
            return None
        segment = data[pos + 2: pos + length]
        pos += length
        if marker in _SOF and len(segment) >= 6:
            components = list(segment[6:6 + 3 * segment[5]:3])  # Nf, then (id, sampling, table) each
            sampling = tuple((factors >> 4, factors & 0x0F) for factors in segment[7:6 + 3 * segment[5]:3])
            height, width = struct.unpack_from(">HH", segment, 1)
            progressive = marker in _SOF_PROGRESSIVE
            huffman = marker < 0xC8
        elif marker == _APP1 and scans == 0:
            if segment.startswith(b"Exif\0\0") and exif is None:
                exif = segment
            else:
                plain = False  # XMP, a second Exif, or an APP1 this walk does not know
        elif marker == _APP2 and segment.startswith(b"MPF\0"):
            plain = False
        elif marker == _DRI and len(segment) >= 2:
            (restart_interval,) = struct.unpack_from(">H", segment)
        elif marker == _SOS and segment:
            scans += 1
            if scans == 1:
                first_restart_interval, scan_data = restart_interval, pos
            count = segment[0]
            if len(segment) >= 4 + 2 * count:
                start, end, approx = segment[1 + 2 * count: 4 + 2 * count]
                if approx & 0x0F == 0:  # Al = 0: these coefficients are now exact
                    for component in segment[1:1 + 2 * count:2]:
                        full.setdefault(component, set()).update(range(start, min(end, 63) + 1))
            if scans == 1 and not progressive and components and count == len(components):
                found_eoi = data.rfind(b"\xff\xd9", pos)  # one scan: see the module docstring
                eoi = found_eoi if found_eoi >= 0 else None
                break
            found = (_MARKER_AFTER_SCAN if restart_interval else _MARKER_IN_SCAN).search(data, pos)
            if found is None:
                break  # cut inside the scan: the decoder reports the truncation
            pos = found.start()
    complete = bool(components) and all(len(full.get(c, ())) == 64 for c in components)
    return JpegLayout(scans, progressive, huffman, complete, eoi, size - eoi - 2 if eoi is not None else 0,
                      width, height, len(components), exif, plain and scans > 0, sampling,
                      first_restart_interval, stray, scan_data)


def strict_data_end(data: bytes, layout: JpegLayout) -> int:
    """Where the data Pillow's strict decoder gets ends: the EOI, or a stray marker before it.

    The walk found it already in a multi-scan JPEG; a single scan (the EOI from ``rfind``) is searched here,
    ~2 ns a byte, only on Pillow's path (the region decoder hears of the marker from libjpeg)."""
    end = layout.eoi if layout.eoi is not None else len(data)
    if layout.stray_marker or not layout.scan_data or layout.scans != 1 or layout.progressive:
        return end
    in_scan = _MARKER_AFTER_SCAN if layout.restart_interval else _MARKER_IN_SCAN
    found = in_scan.search(data, layout.scan_data, end)
    while found is not None:
        pos = found.start()
        while pos < end and data[pos] == 0xFF:
            pos += 1
        if pos >= end:
            return end  # fill bytes before the EOI
        marker = data[pos]
        if marker in _AFTER_SCAN:
            return end  # the scan's data ended at a segment (a COM before the EOI): nothing stray
        if marker == 0x00 or (marker in _RST and layout.restart_interval):
            found = in_scan.search(data, pos + 1, end)  # FF FF 00 or FF FF D0: fill bytes inside the scan
            continue
        return found.start()
    return end

class ScanDataEnded(OSError):
    """A JPEG scan needed more data than the file holds: libjpeg would have filled the rest with grey."""


class _StrictJpegDecoder(ImageFile.PyDecoder):
    """Pillow's own JPEG decoder (same pixels), fed the bytes up to the EOI and then probed at the end.

    libjpeg pads a scan with zero bits and only warns when it *hits a marker* before the scan is complete;
    with no marker in sight, Pillow's suspending data source instead reports that it needs more data. So
    the EOI is held back: when everything before it has been delivered and the decoder still wants more,
    it gets 8 zero bytes instead. A complete JPEG uses them only for libjpeg-turbo's read-ahead: a
    single-scan one finishes, a multi-scan (progressive) one consumes
    them all as bytes before a marker and waits for the EOI, which it then gets. An incomplete scan eats
    the zeros as data and suspends inside an MCU, leaving unconsumed bytes: that is the error. (One probe
    in ~8 can end exactly on an MCU boundary; three probes make a miss ~1 in 500 for an incomplete
    progressive JPEG, and never reject a complete one.) A single-scan JPEG must finish on the first probe:
    with restart markers, an incomplete one eats the zeros while it looks for the next marker, leaves
    nothing, and finishes once the EOI comes, the rest filled in.
    """

    def __init__(self, mode: str, *args: Any) -> None:
        # config: Pillow's (draft scale, draft flag)
        rawmode, jpegmode, self._limit, self._single_scan, *config = args
        super().__init__(mode)
        self._inner = Image.core.jpeg_decoder(mode, rawmode, jpegmode, *config)
        self._consumed = 0  # bytes of the file (from the tile's offset) the decoder has consumed

    def setimage(self, im: Any, extents: Any = None) -> None:
        self._inner.setimage(im, extents)

    def cleanup(self) -> None:
        self._inner.cleanup()

    def decode(self, buffer: bytes | Any) -> tuple[int, int]:
        room = self._limit - self._consumed
        chunk = memoryview(buffer)[:room]  # a view: the decoder reads any bytes-like object, no copy
        consumed, err = self._inner.decode(chunk)
        if consumed < 0 or len(chunk) < room:
            self._consumed += max(consumed, 0)
            return consumed, err
        rest = bytes(chunk[consumed:])  # everything up to the EOI was delivered and the decoder wants more
        for _ in range(_PROBES):
            rest += _FILLER
            consumed, err = self._inner.decode(rest)
            if consumed < 0:
                return consumed, err
            rest = rest[consumed:]
            if rest or self._single_scan:
                raise ScanDataEnded("the scan data ends before the image does")
        consumed, err = self._inner.decode(b"\xff\xd9")
        if consumed < 0:
            return consumed, err
        raise ScanDataEnded("the decoder wants data after the EOI marker")


_STRICT_CODEC = "shardio_strict_jpeg"
_PROBES = 3
Image.register_decoder(_STRICT_CODEC, _StrictJpegDecoder)


def use_strict_decoder(im: Image.Image, layout: JpegLayout, data: bytes) -> None:
    """Make ``im.load()`` (after any ``draft``) decode ``im`` with ``_StrictJpegDecoder``: data past the
    EOI (or a stray marker: ``strict_data_end``) is ignored, and a missing EOI is no error if the scans are
    complete."""
    if len(im.tile) != 1 or im.tile[0].codec_name != "jpeg" or not isinstance(im.tile[0].args, tuple):
        return
    if not layout.huffman:
        return
    tile = im.tile[0]
    end = strict_data_end(data, layout)
    single_scan = layout.scans == 1 and not layout.progressive
    im.tile = [tile._replace(codec_name=_STRICT_CODEC, args=(*tile.args, end - tile.offset, single_scan))]
