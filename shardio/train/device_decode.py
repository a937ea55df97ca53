"""Decoding a batch's JPEGs on the GPU in one call: ``DeviceDecoder`` turns a batch's ``EncodedImages``
(``ShardDataset(decode="device")``) into the uint8 [B, H, W, 3] tensor a decoded batch has, on the device.

**The library, chosen once** (``choose_backend``, when a decoder is made): torchcodec >= 0.17 where it is
installed (``torchcodec.decoders.decode_jpeg`` on a list: one batched nvJPEG call, hardware engine where the
GPU has one), else torchvision >= 0.19 (``torchvision.io.decode_jpeg``, the same batched call), whose image
decoders are deprecated in favour of torchcodec's: choosing it says so once (a ``FutureWarning``). Both are
optional, imported here when a decoder is made, never by ``import shardio``. torchvision depends on stock
Pillow, fine in a training image but never to be installed into the preprocess job's environment, where it
would replace Pillow-SIMD (``preprocess/image/pillow_check.py`` tells). torchcodec's wheel links a CUDA torch: on
a CPU-only torch it does not import, and the choice falls through to torchvision.

**Stream-safe by construction: a host barrier before every decode call.** nvJPEG's hardware engine does not
honour stream order: it writes its output buffers as soon as it is called, while the buffers come from
PyTorch's caching allocator, which hands a block back out as soon as it is freed on the stream that owns it
(later use being ordered on that stream). A block that kernels already queued on the stream still read can
thus be overwritten before they run: wrong numbers in a training step that never touched the decoder
(pytorch/vision#9606: 134 of 200 iterations on an H100). Both libraries allocate the outputs themselves and
take no output buffers, so the decoder cannot bring its own memory; instead ``DeviceDecoder`` synchronises
the stream it decodes on (``stream_barrier``) right before each call, the per-sample retries included: then
no block of that stream's pool is still read by queued work, and blocks last used on other streams come
back only once their recorded events completed (``record_stream``). torchcodec >= 0.17 puts the same barrier
inside its hardware decode (meta-pytorch/torchcodec#1634); this one keeps torchvision, and any injected
decode, safe too. It costs little: ``DeviceLoader`` decodes on the prefetch thread's own stream
(``decode_finished``), where nothing but the decoder's own kernels is queued, so the barrier never waits for
the training step, and the libraries host-synchronise before returning anyway.

nvJPEG's IDCT and chroma upsampling are not libjpeg-turbo's: the pixels may differ from the CPU decode
(``shardio.read.jpeg_pixels``) by a few levels; docs/reader.md, "Decoding JPEG batches on the GPU", has the
bound the CUDA test asserts. The decode and the barrier are injectable (``DeviceDecoder(device, decode=...,
synchronize=...)``) so the stacking, layout, barrier and error paths run anywhere.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardio.errors import MissingExtra, ShardIntegrityError
from shardio.read.jpeg_pixels import EncodedImages
from shardio.train.device_streams import CudaStreams, LoaderStreams, thread_stream

__all__ = ["DecodeFn", "DeviceDecoder", "JpegBackend", "LIBRARIES", "MIN_TORCHCODEC", "MIN_TORCHVISION",
           "available", "choose_backend", "library", "decode_finished", "stream_barrier", "thread_stream",
           "torchcodec_decode", "torchvision_decode"]

DecodeFn = Callable[[list[torch.Tensor], torch.device], list[torch.Tensor]]
"""``decode(jpegs, device)``: each 1-D uint8 CPU tensor of JPEG bytes decoded to a uint8 (3, H, W) tensor on
``device``, in order (what ``decode_jpeg(jpegs, mode=RGB, device=device)`` of either library returns)."""

# The first torchcodec with the barrier before its hardware decode (meta-pytorch/torchcodec#1634).
MIN_TORCHCODEC = (0, 17)
# The first torchvision whose decode_jpeg takes a list on a CUDA device in one batched nvJPEG call.
MIN_TORCHVISION = (0, 19)

INSTALL_HINT = (
    "pip install torchcodec>=0.17 (the build for your torch and CUDA) into the training image, or "
    "torchvision>=0.19 (deprecated image decoders; it pulls stock Pillow, fine there but never in the "
    "preprocess job's environment, where it would replace Pillow-SIMD). Or decode on the CPU: "
    "DeviceLoader(..., decode_on_device=False)"
)

TORCHVISION_NOTE = (
    "decoding JPEG batches on the device with torchvision {version}, whose image decoders are deprecated; "
    "install torchcodec>=0.17 (the maintained decoder, with nvJPEG's stream fix) and shardio uses it instead"
)


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


@dataclass(frozen=True)
class JpegBackend:
    """The library that decodes: its ``name``, ``version`` and batched ``decode``."""

    name: str
    version: str
    decode: DecodeFn


def _torchcodec() -> tuple[JpegBackend | None, str]:
    """torchcodec's backend, or None with why not (absent, too old, or not loadable with this torch)."""
    try:
        import torchcodec
        from torchcodec.decoders import decode_jpeg  # noqa: F401 - the image decoders arrived in 0.16
    except ImportError as e:
        return None, f"torchcodec is not installed ({e})"
    except (OSError, RuntimeError) as e:  # its libraries need a CUDA torch of a matching ABI
        return None, f"torchcodec does not load with this torch {torch.__version__} ({e})"
    version = getattr(torchcodec, "__version__", "0")
    if _version(version) < MIN_TORCHCODEC:
        return None, f"torchcodec {version} predates the stream fix of {_dotted(MIN_TORCHCODEC)}"
    return JpegBackend("torchcodec", version, torchcodec_decode), ""


def _torchvision() -> tuple[JpegBackend | None, str]:
    try:
        import torchvision
        import torchvision.io  # noqa: F401
    except ImportError as e:
        return None, f"torchvision is not installed ({e})"
    if _version(torchvision.__version__) < MIN_TORCHVISION:
        return None, (f"torchvision {torchvision.__version__} predates batched decode_jpeg "
                      f"({_dotted(MIN_TORCHVISION)})")
    return JpegBackend("torchvision", torchvision.__version__, torchvision_decode), ""


LIBRARIES = ("torchcodec", "torchvision")
"""The decode libraries, in the order ``choose_backend`` prefers them."""


def library(name: str) -> tuple[JpegBackend | None, str]:
    """Library ``name``'s backend if it can decode here, else None and why not (absent, too old, or, for
    torchcodec, not loadable with this torch)."""
    probes = {"torchcodec": _torchcodec, "torchvision": _torchvision}
    if name not in probes:
        raise ValueError(f"no device decode library {name!r}: one of {', '.join(LIBRARIES)}")
    return probes[name]()


def choose_backend(*, note: bool = True) -> JpegBackend:
    """torchcodec >= 0.17 if it loads, else torchvision >= 0.19 (with a ``FutureWarning`` naming the
    deprecation when ``note``); MissingExtra saying why neither and what to install."""
    codec, codec_why = _torchcodec()
    if codec is not None:
        return codec
    vision, vision_why = _torchvision()
    if vision is not None:
        if note:
            warnings.warn(TORCHVISION_NOTE.format(version=vision.version), FutureWarning, stacklevel=3)
        return vision
    raise MissingExtra(f"decoding JPEG batches on the device needs torchcodec >= {_dotted(MIN_TORCHCODEC)} or "
                       f"torchvision >= {_dotted(MIN_TORCHVISION)} (batched nvJPEG): {codec_why}; "
                       f"{vision_why}: {INSTALL_HINT}")


def available() -> bool:
    """Whether a device decode library is here (``choose_backend`` would succeed)."""
    try:
        choose_backend(note=False)
    except MissingExtra:
        return False
    return True


def torchcodec_decode(jpegs: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The batch in one ``torchcodec.decoders.decode_jpeg`` call: batched nvJPEG on CUDA (RGB, 3×H×W uint8)."""
    from torchcodec.decoders import decode_jpeg

    return list(decode_jpeg(jpegs, mode="RGB", device=device))


def torchvision_decode(jpegs: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The batch in one ``torchvision.io.decode_jpeg`` call: batched nvJPEG on CUDA (RGB, 3×H×W uint8)."""
    import torchvision.io as io

    return list(io.decode_jpeg(jpegs, mode=io.ImageReadMode.RGB, device=device))


def stream_barrier(device: torch.device) -> None:
    """Wait on the host until the work queued on ``device``'s current stream has run (no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class DeviceDecoder:
    """``decoder(images)``: an ``EncodedImages`` batch as uint8 [B, H, W, 3] (contiguous NHWC, as a decoded
    batch) on ``device``, decoded by ``decode`` (default: ``choose_backend``'s library) on the caller's
    current stream, each decode call preceded by ``synchronize(device)`` (default ``stream_barrier``; see
    the module docstring). A sample that fails or decodes to another shape is a ShardIntegrityError naming
    its shard file and sample."""

    def __init__(self, device: torch.device | str, decode: DecodeFn | None = None,
                 synchronize: Callable[[torch.device], None] = stream_barrier) -> None:
        self.device = torch.device(device)
        self.backend = (JpegBackend("injected", "", decode) if decode is not None
                        else choose_backend())  # the missing install said now, not at the first batch
        self.decode = self.backend.decode
        self.synchronize = synchronize

    def _decode(self, jpegs: list[torch.Tensor]) -> list[torch.Tensor]:
        self.synchronize(self.device)  # before every call: see the module docstring
        return self.decode(jpegs, self.device)

    def __call__(self, images: EncodedImages) -> torch.Tensor:
        height, width = images.height, images.width
        if len(images) == 0:
            return torch.empty((0, height, width, 3), dtype=torch.uint8, device=self.device)
        jpegs = [torch.from_numpy(jpeg) for jpeg in images.jpegs]
        try:
            decoded = self._decode(jpegs)
        except RuntimeError as e:
            raise self._first_failure(images, jpegs, e) from e
        if len(decoded) != len(images):
            raise ShardIntegrityError(f"{images.sources[0][0]}: the {self.device} decoder returned "
                                      f"{len(decoded)} images for a batch of {len(images)}")
        for index, image in enumerate(decoded):
            if (tuple(image.shape) != (3, height, width) or image.dtype != torch.uint8
                    or image.device.type != self.device.type):
                raise images.bad_sample(index, f"decodes to {image.dtype} {tuple(image.shape)} on "
                                        f"{image.device}, not the dataset's uint8 (3, {height}, {width}) on "
                                        f"{self.device}")
        # Two kernels whatever the batch size (one stack of the CHW images, one NCHW -> NHWC copy): 256
        # permuted views stacked at once cost ~1.5 ms of host time a batch, the decode itself ~12 ms.
        return torch.stack(decoded).permute(0, 2, 3, 1).contiguous()

    def _first_failure(self, images: EncodedImages, jpegs: list[torch.Tensor],
                       error: RuntimeError) -> ShardIntegrityError:
        """The batched call says only that something failed: decode alone each sample until one fails."""
        for index, jpeg in enumerate(jpegs):
            try:
                self._decode([jpeg])
            except RuntimeError as alone:
                return images.bad_sample(index, f"corrupt JPEG ({self.device} decode: {alone})")
        shards = sorted({path for path, _, _ in images.sources})
        return ShardIntegrityError(f"{', '.join(shards)}: the {self.device} decode of a batch of {len(images)} "
                                   f"failed ({error}), though each sample decodes alone")


def decode_finished(decoder: Callable[[EncodedImages], torch.Tensor], images: EncodedImages,
                    device: torch.device, streams: LoaderStreams | None = None) -> torch.Tensor:
    """``decoder(images)`` run to completion: on CUDA on the calling thread's own stream (of the highest
    priority: ``shardio.train.device_streams``; ``streams`` to inject them), waited for before returning, so
    any stream may read the result at once. The caller calls ``record_stream`` for each stream that uses it
    (its memory belongs to this one). Meant for the prefetch thread: the decode's host work and the barrier
    then never hold up the training loop's thread."""
    if streams is None:
        if device.type != "cuda":
            return decoder(images)
        streams = CudaStreams(device)
    stream = streams.producer()
    with streams.using(stream):
        decoded = decoder(images)
    stream.synchronize()
    return decoded
