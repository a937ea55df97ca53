"""Feeding ``ShardDataset`` batches to a model: a counting DataLoader and a device prefetcher.

``ShardLoader`` is a ``torch.utils.data.DataLoader`` fixed to what a batch-yielding dataset needs
(``batch_size=None``, no per-sample collate) that counts the batches it hands out, so ``state_dict()``
is exact with any number of workers. ``DeviceLoader`` moves each batch to the device with
``non_blocking`` copies on a side CUDA stream while the model works on the previous one, and turns the
uint8 NHWC images into normalised float NCHW (channels_last memory, which convolutions prefer).

Copies per batch: memory map → pinned buffer (the pin thread, or the worker's shared memory then the pin
thread) → device. Without ``pin_memory=True`` the host-to-device copy cannot overlap anything. On CUDA
everything done to a batch on the device (the copy, a JPEG batch's decode, the normalisation or transform)
runs on the prefetch thread's own stream, ahead of the step; the training loop's stream waits for it on the
GPU. A JPEG dataset on CUDA can hand its batches out encoded and have them decoded there
(``shardio.train.device_decode``: one batched nvJPEG call a batch, a stream barrier before it); a yuv420
dataset on CUDA hands out its planes (half a raw batch's bytes) and has them converted there, with the
normalisation (``shardio.train.yuv_device``); see ``DeviceLoader``.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Union

import torch
from torch.utils.data import DataLoader

from shardio.read.dataset import EpochPass, ShardDataset
from shardio.read.jpeg_pixels import EncodedImages
from shardio.read.prefetch import PassPrefetch, Prefetcher, prefetched
from shardio.read.yuv_pixels import YuvPlanes
from shardio.read.resume import EpochCursor
from shardio.train.batch_transform import DEVICE_FIELDS, BatchTransform, transform_batch
from shardio.train import device_decode
from shardio.train.device_streams import CudaStreams, LoaderStreams
from shardio.train.staging import Staged, StagingPools
from shardio.train.yuv_device import yuv420_normalized, yuv420_rgb

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "DeviceLoader", "PassSource", "ShardLoader", "to_device"]

_Prefetcher = Prefetcher  # its old name here, for code that checks on live prefetch threads

# On the 0-255 scale of the uint8 pixels.
IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


def _no_collate(batch: Any) -> Any:
    # Module level so that it pickles for spawned workers.
    return batch


class ShardLoader(DataLoader):
    """``DataLoader(dataset, batch_size=None, ...)`` for a ``ShardDataset``: each iteration begins the
    dataset's next pass in the main process (so epochs advance and a resume reaches the workers) and
    counts the batches it hands out on the dataset's cursor (``shardio.read.resume``)."""

    def __init__(self, dataset: ShardDataset, *, num_workers: int = 0, pin_memory: bool = False,
                 **kwargs: Any) -> None:
        if not isinstance(dataset, ShardDataset):
            raise TypeError(f"ShardLoader takes a ShardDataset, got {type(dataset).__name__}")
        for name in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"):
            if name in kwargs:
                raise ValueError(f"{name}= belongs to ShardDataset, which yields whole batches")
        if kwargs.get("persistent_workers"):
            raise ValueError(
                "persistent_workers=True keeps the workers' copy of the dataset from the first epoch, so "
                "set_epoch and load_state_dict would not reach them; leave it False"
            )
        if kwargs.get("in_order") is False:
            raise ValueError("in_order=False would hand batches out of the rank's order; leave it True")
        kwargs.setdefault("collate_fn", _no_collate)
        if num_workers and not dataset.is_local:
            # The S3 client (obstore's tokio runtime) does not survive fork(): workers start fresh.
            kwargs.setdefault("multiprocessing_context", "spawn")
        super().__init__(dataset, batch_size=None, num_workers=num_workers, pin_memory=pin_memory, **kwargs)

    @property
    def cursor(self) -> EpochCursor:
        return self.dataset.cursor  # type: ignore[attr-defined]

    @property
    def batches_seen(self) -> int:
        return self.cursor.batches_seen

    def begin_pass(self) -> EpochPass:
        return self.dataset.begin_pass()  # type: ignore[attr-defined]

    def iter_pass(self, epoch_pass: EpochPass, *, prefetch: int | None = None,
                  encoded: bool | None = None) -> Iterator[Any]:
        """The pass's batches, uncounted (``shardio.read.resume``); ``encoded``: JPEG batches left encoded
        (``ShardDataset``'s ``decode="device"``; default: the dataset's setting)."""
        dataset: ShardDataset = self.dataset  # type: ignore[assignment]
        if self.num_workers == 0:
            # DataLoader's single-process iterator adds nothing to whole batches: the dataset assembles
            # them pinned itself (DataLoader's pin_memory() would then copy nothing) and prefetches.
            # pin_memory without CUDA is a no-op for DataLoader (it warns): the same here.
            pinned = (self.pin_memory and torch.cuda.is_available()) or None
            return dataset.iter_pass(epoch_pass, pin_memory=pinned, prefetch=prefetch, encoded=encoded)
        # The workers copy the dataset while DataLoader's iterator starts: hand them this pass (and how to
        # hand out its batches, read by their copy's iter_pass).
        dataset.cursor.hand_over(epoch_pass)
        decode = dataset.decode
        if encoded is not None:
            dataset.decode = "device" if encoded else "cpu"
        try:
            return super().__iter__()
        finally:
            dataset.cursor.hand_over(None)
            dataset.decode = decode

    def __iter__(self) -> Iterator[Any]:
        epoch_pass = self.begin_pass()
        return self.cursor.handed_out(epoch_pass, self.iter_pass(epoch_pass))

    def state_dict(self, batches_seen: int | None = None) -> dict[str, Any]:
        """The dataset's state (``ShardDataset.state_dict``)."""
        return self.dataset.state_dict(batches_seen)  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)  # type: ignore[attr-defined]


PassSource = Union[ShardDataset, ShardLoader]
"""What ``DeviceLoader`` and ``shardio.train.augment`` drive through the protocol of ``shardio.read.resume``:
``begin_pass()``, ``iter_pass(epoch_pass, prefetch=...)``, ``cursor``, ``state_dict``, ``load_state_dict``."""


def to_device(
    batch: dict[str, Any],
    device: torch.device | str,
    *,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """The batch on ``device``: ``image`` as ``(x - mean) / std`` float N×3×H×W (channels_last memory),
    ``cls``, ``original_size``, ``crop_top_left`` (int64) and ``content_box`` (``mode: pad``) on ``device``
    too, their values unchanged (``DEVICE_FIELDS``); other fields unchanged.
    Copies are ``non_blocking``: overlapped when the source is pinned and the caller is on a side stream
    (``DeviceLoader``). A yuv420 batch handed out as planes (``YuvPlanes``) moves its planes and is converted
    and normalised on ``device`` (``shardio.train.yuv_device``): the same values as its CPU conversion's."""
    device = torch.device(device)
    scale, shift = _affine(tuple(mean), tuple(std), device, dtype)
    out = dict(batch)
    if "image" not in batch:  # a dataset of model outputs alone (encoding: none): nothing to normalise
        pass
    elif isinstance(batch["image"], YuvPlanes):
        planes = batch["image"]
        out["image"] = yuv420_normalized(planes.planes.to(device, non_blocking=True), planes.height, planes.width,
                                         scale, shift, dtype)
    else:
        image = batch["image"].to(device, non_blocking=True)
        # permute of NHWC memory is an NCHW view in channels_last strides; the arithmetic keeps them.
        out["image"] = image.permute(0, 3, 1, 2).to(dtype).mul_(scale).add_(shift)
    for name in DEVICE_FIELDS:
        if name in batch:
            out[name] = batch[name].to(device, non_blocking=True)
    return out


@functools.lru_cache(maxsize=16)
def _affine(mean: tuple[float, ...], std: tuple[float, ...], device: torch.device,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x * scale + shift == (x - mean) / std``, made once per device rather than copied every batch."""
    scale = torch.tensor([1.0 / s for s in std], dtype=dtype).view(1, 3, 1, 1).to(device)
    shift = torch.tensor([-m / s for m, s in zip(mean, std)], dtype=dtype).view(1, 3, 1, 1).to(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # cached for every stream: let no stream see them half-copied
    return scale, shift


class DeviceLoader:
    """Iterate ``loader`` with every batch already on ``device`` (see ``to_device``).

    With ``prefetch > 0`` a background thread (``shardio.read.prefetch``) pulls the next ``prefetch`` batches
    (the memory-map copy and the pinning run there, both outside the GIL, and on CPU the whole conversion),
    so with ``num_workers=0``, or a ``ShardDataset`` passed directly (assembled pinned when
    ``pin_memory``), reading overlaps the step. On CUDA that thread also issues each batch's
    host-to-device copy, decode and normalisation (or ``transform``) on a stream of its own; the training
    loop's stream waits for a batch's event on the GPU, so the loop's thread never waits on the host for
    work it could have queued.

    Batches may change shape from step to step (a bucketed dataset's: each batch one bucket's
    [B, h, w, 3]); each keeps its own. On CUDA with ``pin_memory``, a batch that is not pinned already (a
    memory-map view, a worker's shared memory, a JPEG batch decoded on the CPU) is staged in a pinned
    buffer from a pool kept per sample shape (``shardio.train.staging``), reused once the copy that read it
    has run: no pinned allocation per step, at most ``prefetch + 2`` buffers per shape.

    Given a ``ShardDataset`` or ``ShardLoader``, this is the layer that hands batches out, so it counts
    them on the dataset's cursor (``shardio.read.resume``): ``state_dict()`` counts the batches this yielded,
    not those prefetched, so resuming repeats nothing and skips nothing. Any other iterable of batches is
    only moved to the device (``state_dict`` is then the loader's own).

    ``transform`` (e.g. ``shardio.train.augment.TrainAugment``) replaces the normalisation: it gets the uint8
    images on the device with their epoch positions, and the batch's ``content_box`` (on the device) when
    it has one (every batch of a ``mode: pad`` dataset), and returns the float batch.

    JPEG datasets: ``decode_on_device`` chooses, once, where batches are decoded. On (the default on CUDA
    when torchcodec >= 0.17 or torchvision >= 0.19 imports, or when the dataset was made with
    ``decode="device"``), the dataset hands each batch out encoded (same batches, order and resume) and
    ``device_decoder`` (default ``shardio.train.device_decode.DeviceDecoder``: batched nvJPEG, a stream
    barrier before each call) decodes it to uint8 NHWC on the device, on the prefetch thread and its own
    stream, finished before the batch is handed on; the normalisation or ``transform`` then runs on the side
    stream as for any batch. ``True`` without either library is a MissingExtra saying what to install;
    ``False`` decodes on the CPU (the dataset's native threads). A batch that reaches this still encoded
    with device decode off is decoded on the CPU.

    yuv420 datasets: ``decode_on_device`` chooses alike. On (the default on CUDA), the dataset hands out
    each batch's planes (``YuvPlanes``: half a raw batch's bytes to pin and copy) and they are converted on
    the device, fused with the normalisation (``shardio.train.yuv_device``; with a ``transform``, converted
    to uint8 RGB there first); ``True`` on the CPU device does the same with torch's CPU ops. Off (the
    default on the CPU), the dataset converts each batch natively. Either way the images are the same.

    Streams (``shardio.train.device_streams``): on CUDA the prefetch thread's stream has the device's highest
    priority, each batch's work ends with its own event, the training loop's stream waits for that event
    (never a device sync), and the batch's tensors are marked used on the loop's stream. ``streams``
    replaces them (any ``LoaderStreams``; default ``CudaStreams(device)`` on CUDA, none elsewhere).

    Iterated epoch after epoch (the same ``DeviceLoader`` over a ``ShardDataset``, or a ``ShardLoader``
    without workers), the prefetch thread prepares the next epoch's first ``prefetch`` batches while this
    epoch's last ones are consumed (``shardio.read.prefetch.PassPrefetch``); they are dropped if the next
    epoch is not the one that follows (``set_epoch``, ``load_state_dict``).
    """

    def __init__(self, loader: Any, device: torch.device | str, *, prefetch: int = 2,
                 pin_memory: bool | None = None, transform: BatchTransform | None = None,
                 decode_on_device: bool | None = None,
                 device_decoder: Callable[[EncodedImages], torch.Tensor] | None = None,
                 streams: LoaderStreams | None = None, **to_device_kwargs: Any) -> None:
        if transform is not None and to_device_kwargs:
            raise ValueError(f"{sorted(to_device_kwargs)} belong to the transform when one is given")
        self.transform = transform
        self.loader, self.device, self.prefetch = loader, torch.device(device), prefetch
        if self.device.type == "cuda" and not torch.cuda.is_available():
            why = "has no CUDA build" if torch.version.cuda is None else "sees no CUDA device"
            raise RuntimeError(f"DeviceLoader(..., {str(device)!r}): CUDA is not available here (torch "
                               f"{torch.__version__} {why}); pass device='cpu' to run on the CPU, or run on a "
                               "machine with a GPU and a CUDA build of torch")
        # Pin what the loader did not (a ShardDataset used directly: assembled pinned, one host copy).
        self.pin_memory = self.device.type == "cuda" if pin_memory is None else pin_memory
        self.to_device_kwargs = to_device_kwargs
        # The dataset's model outputs (spec, "Model outputs"): moved to the device as they are, never normalised.
        source = getattr(loader, "dataset", loader)
        self.output_names = tuple(o.name for o in getattr(source, "outputs", ()))
        self.streams: LoaderStreams | None = streams
        if streams is None and self.device.type == "cuda":
            self.streams = CudaStreams(self.device)
        self.planes_on_device = self._planes_on_device(decode_on_device, device_decoder)
        self.decoder = None if self.planes_on_device is not None else self._device_decoder(decode_on_device,
                                                                                             device_decoder)
        # Batches not pinned yet are staged in pinned buffers, one pool per sample shape (a bucketed
        # dataset's batches change shape from step to step); a buffer is reused once its copy has run.
        cuda_pinned = self.pin_memory and self.device.type == "cuda"
        self.staging: StagingPools | None = StagingPools(depth=prefetch + 2) if cuda_pinned else None
        # Iterated epoch after epoch, each pass's thread prepares the next one's first batches at its end.
        self.passes = PassPrefetch()

    def _dataset(self) -> ShardDataset | None:
        source = self.loader
        dataset = source if isinstance(source, ShardDataset) else getattr(source, "dataset", None)
        return dataset if isinstance(dataset, ShardDataset) else None

    def _planes_on_device(self, decode_on_device: bool | None, decoder: Any) -> bool | None:
        """For a yuv420 dataset, whether its planes are converted on the device (default: on CUDA); None for
        any other source (``_device_decoder`` decides for JPEG)."""
        dataset = self._dataset()
        if dataset is None or not dataset.is_yuv420:
            return None
        if decoder is not None:
            raise ValueError(f"{dataset.path}: device_decoder= decodes JPEG batches; this dataset is yuv420 (its "
                             "planes are converted on the device by shardio.train.yuv_device)")
        if decode_on_device is None:
            return dataset.decode == "device" or self.device.type == "cuda"
        return decode_on_device

    def _device_decoder(self, decode_on_device: bool | None,
                        decoder: Callable[[EncodedImages], torch.Tensor] | None
                        ) -> Callable[[EncodedImages], torch.Tensor] | None:
        """The decoder of encoded batches on the device, or None to decode JPEG batches on the CPU."""
        source = self.loader
        dataset = source if isinstance(source, ShardDataset) else getattr(source, "dataset", None)
        dataset = dataset if isinstance(dataset, ShardDataset) else None
        if decoder is not None and decode_on_device is False:
            raise ValueError("device_decoder= decodes on the device; it contradicts decode_on_device=False")
        if decode_on_device is None:
            if decoder is not None or (dataset is not None and dataset.decode == "device"):
                decode_on_device = True
            else:  # any batches' source may carry encoded ones; only a known raw dataset never does
                decode_on_device = ((dataset is None or dataset.is_jpeg) and self.device.type == "cuda"
                                    and device_decode.available())
        if not decode_on_device:
            return None
        if dataset is not None and not dataset.is_jpeg:
            raise ValueError(f"{dataset.path}: decode_on_device=True is for JPEG datasets (encoding: jpeg); "
                             f"this one is {dataset.snapshot.encoding}")
        return decoder if decoder is not None else device_decode.DeviceDecoder(self.device)

    def _decoded(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch with an encoded ``image`` decoded: by the device decoder (on CUDA on this thread's own
        stream, finished: ``device_decode.decode_finished``), or else on the CPU."""
        images = batch.get("image")
        if isinstance(images, YuvPlanes) and not self.planes_on_device:  # planes from a source that sends them
            return {**batch, "image": torch.from_numpy(images.convert())}
        if not isinstance(images, EncodedImages):
            return batch
        if self.decoder is None:
            return {**batch, "image": torch.from_numpy(images.decode())}
        return {**batch, "image": device_decode.decode_finished(self.decoder, images, self.device, self.streams)}

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def batches_seen(self) -> int:
        return self.loader.cursor.batches_seen if isinstance(self.loader, (ShardDataset, ShardLoader)) else 0

    def _prepare(self, item: tuple[dict[str, Any], int]) -> tuple[dict[str, Any], int, Any]:
        """What the prefetch thread does to a batch (and its number in the epoch): decode an encoded one
        (on the device, or the CPU); on CPU all of ``to_device``; on CUDA all of it on this thread's own
        stream: pinning, the host-to-device copy, the decode, and the normalisation or ``transform``,
        ending with an event the training loop's stream waits for. The training loop's thread then only
        takes a ready batch: no host work of the batch's (the decode's parsing, nvJPEG's host phase, the
        stream barrier, the transform's kernel launches) delays its next kernel launches."""
        batch, number = item
        streams = self.streams
        if streams is None:
            batch = self._outputs_moved(self._decoded(batch))
            if self.transform is not None:
                return batch, number, None  # transformed in the consumer's thread, with its positions
            return to_device(batch, self.device, **self.to_device_kwargs), number, None
        batch, staged = self._staged(batch)
        stream = streams.producer()
        try:
            with streams.using(stream):
                batch = self._outputs_moved(batch)
                if self.transform is not None:
                    batch = self._transform(batch, number)
                else:
                    batch = to_device(batch, self.device, **self.to_device_kwargs)
                ready = streams.event()  # this batch's own barrier: the loop's stream waits for it
                ready.record(stream)
        except BaseException:
            if staged is not None:  # a copy may have been queued: free the buffer once it has run
                stream.synchronize()
                self.staging.release(staged, None)  # type: ignore[union-attr]
            raise
        if staged is not None:  # its copy to the device is queued before ``ready``: reusable after it
            self.staging.release(staged, ready)  # type: ignore[union-attr]
        return batch, number, ready

    def _outputs_moved(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch with its model outputs on the device, their values as stored (a latent is no picture to
        normalise); copied on the calling thread's stream, as the image is."""
        if not self.output_names:
            return batch
        return {**batch, **{name: batch[name].to(self.device, non_blocking=True) for name in self.output_names
                            if name in batch}}

    def _staged(self, batch: dict[str, Any]) -> tuple[dict[str, Any], Staged | None]:
        """The batch decoded (``_decoded``) with a host ``image`` in pinned memory: one not pinned yet is
        copied (a JPEG batch decoded on the CPU: decoded straight) into a buffer of its shape's pool
        (``shardio.train.staging``), returned too, to release once its copy to the device is queued."""
        images = batch.get("image")
        if self.staging is None:
            return self._decoded(batch), None
        if isinstance(images, EncodedImages) and self.decoder is None:
            staged = self.staging.take(images.shape, torch.uint8)
            try:
                images.decode(out=staged.tensor.numpy())  # type: ignore[union-attr]
            except BaseException:  # a corrupt sample: the buffer was only written on the host
                self.staging.release(staged, None)
                raise
            return {**batch, "image": staged.tensor}, staged
        batch = self._decoded(batch)
        image = batch.get("image")
        if image is None:  # encoding: none: no pixels to stage (its outputs are moved as they are)
            return batch, None
        if isinstance(image, YuvPlanes):  # the planes are what is copied: staged as a (B, S) batch
            if image.planes.is_cuda or image.planes.is_pinned():
                return batch, None
            staged = self.staging.stage(image.planes)
            return {**batch, "image": YuvPlanes(staged.tensor, image.height, image.width)}, staged  # type: ignore[arg-type]
        if image.is_cuda or image.is_pinned():
            return batch, None
        staged = self.staging.stage(image)
        return {**batch, "image": staged.tensor}, staged

    def __iter__(self) -> Iterator[dict[str, Any]]:
        # A generator: the pass begins at the first next(), not when the iterator is made.
        epoch_pass, host = self._host_batches()
        batches = self._on_device(host) if self.streams is not None else self._on_host(host)
        if epoch_pass is None:
            yield from batches
        else:  # counted when yielded: not the batches prepared ahead
            yield from self.loader.cursor.handed_out(epoch_pass, batches)

    def _host_batches(self) -> tuple[EpochPass | None, Iterator[tuple[dict[str, Any], int, Any]]]:
        """The pass (``None`` for a source off the protocol) and its prepared batches (``_prepare``),
        uncounted."""
        source = self.loader
        # Asked for only when decoding on the device: a subclass's iter_pass written before JPEG
        # datasets (examples/train.py's timed loader) keeps working.
        encoded = {"encoded": True} if self.decoder is not None or self.planes_on_device else {}
        # Assembled pinned (one host copy, not two) when this pins; else as the dataset was set up.
        pinned = (self.pin_memory and self.device.type == "cuda") or None
        dataset = source if isinstance(source, ShardDataset) else None
        if isinstance(source, ShardLoader) and source.num_workers == 0:
            dataset = source.dataset  # type: ignore[assignment]

        def numbered(epoch_pass: EpochPass) -> Iterator[tuple[dict[str, Any], int]]:
            if isinstance(source, ShardDataset):
                batches = source.iter_pass(epoch_pass, pin_memory=pinned, prefetch=0, **encoded)
            else:
                batches = source.iter_pass(epoch_pass, prefetch=0, **encoded)
            return zip(batches, itertools.count(epoch_pass.before + 1))

        if isinstance(source, (ShardDataset, ShardLoader)):
            epoch_pass: EpochPass | None = source.begin_pass()
        else:
            epoch_pass = None
        if epoch_pass is not None and dataset is not None and self.prefetch > 0:
            how = (pinned, bool(encoded), type(source).__name__)

            def ahead() -> tuple[tuple[Any, ...], Iterator[tuple[dict[str, Any], int]]] | None:
                following = dataset.pass_ahead()  # on the prefetch thread, at the end of this pass
                return None if following is None else (dataset.pass_key(following, *how), numbered(following))

            return epoch_pass, self.passes.passes(dataset.pass_key(epoch_pass, *how),
                                                  lambda: numbered(epoch_pass), self._prepare, self.prefetch,
                                                  ahead, len(epoch_pass.batches))
        items = numbered(epoch_pass) if epoch_pass is not None else zip(iter(source), itertools.count(1))
        if self.prefetch > 0:
            return epoch_pass, prefetched(items, self._prepare, self.prefetch)
        return epoch_pass, map(self._prepare, items)

    def _on_host(self, host: Iterator[tuple[dict[str, Any], int, Any]]) -> Iterator[dict[str, Any]]:
        for batch, number, _ in host:  # on the device already (_prepare), unless a transform takes it there
            yield self._transform(batch, number) if self.transform is not None else batch

    def _on_device(self, host: Iterator[tuple[dict[str, Any], int, Any]]) -> Iterator[dict[str, Any]]:
        """The prepared batches, each made usable on the training loop's stream: that stream waits (on the
        GPU, not the host) for the batch's event, and each tensor made on the prefetch thread's stream is
        recorded as used on it, so its memory is not handed out again before the loop's work is done."""
        streams = self.streams
        assert streams is not None
        for batch, _, ready in host:
            current = streams.consumer()
            current.wait_event(ready)
            for value in batch.values():
                if isinstance(value, torch.Tensor) and streams.on_device(value):
                    streams.record_use(value, current)
            yield batch

    def _transform(self, batch: dict[str, Any], number: int) -> dict[str, Any]:
        images = batch.get("image")
        if isinstance(images, YuvPlanes):  # the transform takes uint8 RGB: converted on the device first
            planes = images.planes.to(self.device, non_blocking=True)
            batch = {**batch, "image": yuv420_rgb(planes, images.height, images.width)}
        return transform_batch(self.transform, batch, self.device, self.loader, number)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
