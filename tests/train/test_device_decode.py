"""Decoding JPEG batches on the device (``shardio.train.device_decode``, ``DeviceLoader(decode_on_device=...)``).

torchvision is not installed here (it would replace Pillow-SIMD), so the decoder's stacking, layout and error
paths run with an injected decode function, Pillow's, standing in for ``torchvision.io.decode_jpeg``; the
real batched nvJPEG decode runs in the CUDA test, skipped only where CUDA is absent. Bound asserted there
(docs/reader.md, "Decoding JPEG batches on the GPU"): every pixel within 8 levels of the CPU decode, mean
absolute difference under 1 level. Batches of varying shape (a bucketed dataset's) decode in one call each,
at their own shape.
"""

from __future__ import annotations

import io
import sys
import threading
import types

import numpy as np
import pytest
import torch
from bucket_fixtures import BUCKETS, make_bucketed_dataset
from dataset_fixtures import make_dataset, make_photo_dataset
from PIL import Image

from varying_batches import SHAPES, jpeg_batch

from shardio import DeviceLoader, ShardDataset, ShardLoader
from shardio.errors import MissingExtra, ShardIntegrityError
from shardio.read.jpeg_pixels import EncodedImages
from shardio.train import device_decode
from shardio.train.augment import TrainAugment
from shardio.train.device_decode import DeviceDecoder

IDENTITY = {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}


@pytest.fixture(scope="module")
def jpeg_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = str(tmp_path_factory.mktemp("device-decode"))
    make_dataset(directory, encoding="jpeg", height=16, width=16)  # 117 samples, shards of 8
    return directory


@pytest.fixture(scope="module")
def photo_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = str(tmp_path_factory.mktemp("device-decode-photos"))
    make_photo_dataset(directory, (40, 24), side=32, samples_per_shard=8)
    return directory


class PillowDecode:
    """A stand-in for ``torchvision.io.decode_jpeg(list, mode=RGB, device=...)``: Pillow (libjpeg-turbo, as the
    reader's extension) per image, CHW uint8 on ``device``; records what it was given."""

    def __init__(self) -> None:
        self.calls: list[list[torch.Tensor]] = []

    def __call__(self, jpegs: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        self.calls.append(jpegs)
        out = []
        for jpeg in jpegs:
            try:
                pixels = np.asarray(Image.open(io.BytesIO(jpeg.numpy().tobytes())).convert("RGB"))
            except OSError as e:
                raise RuntimeError(f"decode failed: {e}") from e
            out.append(torch.from_numpy(pixels.copy()).permute(2, 0, 1).to(device))
        return out


def encoded_batch(directory: str, size: int = 16, **options) -> EncodedImages:
    return next(iter(ShardDataset(directory, size, decode="device", **options)))["image"]


# --- the decoder -------------------------------------------------------------------------------------------

def test_the_decoder_gives_the_cpu_decodes_pixels_as_contiguous_nhwc(photo_dir):
    images = encoded_batch(photo_dir, 20, shuffle=True)
    decode = PillowDecode()
    out = DeviceDecoder("cpu", decode=decode)(images)
    assert out.shape == (20, 32, 32, 3) and out.dtype == torch.uint8 and out.is_contiguous()
    assert np.array_equal(out.numpy(), images.decode())
    (given,) = decode.calls  # one call for the whole batch, each JPEG a 1-D uint8 CPU tensor of its bytes
    assert [j.dtype for j in given] == [torch.uint8] * 20 and all(j.ndim == 1 and not j.is_cuda for j in given)
    assert [j.numpy().tobytes() for j in given] == [bytes(j) for j in images.jpegs]


def test_a_sample_decoded_to_the_wrong_shape_is_named_by_shard_and_sample(jpeg_dir):
    images = encoded_batch(jpeg_dir, 8)

    def one_hwc(jpegs, device):  # sample 3 comes back channels-last
        out = PillowDecode()(jpegs, device)
        out[3] = out[3].permute(1, 2, 0)
        return out

    with pytest.raises(ShardIntegrityError, match=r"input-0-00000\.jpg\.npy: sample 3: decodes to torch\.uint8 "
                                                  r"\(16, 16, 3\).*not the dataset's uint8 \(3, 16, 16\)"):
        DeviceDecoder("cpu", decode=one_hwc)(images)


def test_a_batch_the_decoder_rejects_is_named_by_its_bad_sample(jpeg_dir):
    images = encoded_batch(jpeg_dir, 8, shuffle=False)
    ds = ShardDataset(jpeg_dir, 8, decode="device")
    batches = iter(ds)
    next(batches)
    second = next(batches)["image"]  # shard 1: samples 0..7 of input-0-00001
    broken = list(second.jpegs)
    broken[5] = broken[5][: len(broken[5]) // 3]  # truncated: Pillow fails on it alone, too
    bad = EncodedImages(broken, second.height, second.width, second.sources)
    with pytest.raises(ShardIntegrityError, match=r"input-0-00001\.jpg\.npy: sample 5: corrupt JPEG \(cpu decode"):
        DeviceDecoder("cpu", decode=PillowDecode())(bad)
    assert DeviceDecoder("cpu", decode=PillowDecode())(images).shape == (8, 16, 16, 3)


def test_a_batch_that_fails_only_as_a_whole_names_its_shards(jpeg_dir):
    images = encoded_batch(jpeg_dir, 12)

    def fails_batched(jpegs, device):
        if len(jpegs) > 1:
            raise RuntimeError("out of decoder memory")
        return PillowDecode()(jpegs, device)

    with pytest.raises(ShardIntegrityError, match=r"input-0-00000\.jpg\.npy, .*input-0-00001\.jpg\.npy: the cpu "
                                                  r"decode of a batch of 12 failed \(out of decoder memory\)"):
        DeviceDecoder("cpu", decode=fails_batched)(images)


def test_a_decoder_that_loses_images_is_an_error(jpeg_dir):
    images = encoded_batch(jpeg_dir, 8)
    with pytest.raises(ShardIntegrityError, match=r"returned 7 images for a batch of 8"):
        DeviceDecoder("cpu", decode=lambda jpegs, device: PillowDecode()(jpegs, device)[:7])(images)


def test_an_empty_batch_is_an_empty_tensor():
    out = DeviceDecoder("cpu", decode=PillowDecode())(EncodedImages([], 16, 24, [("x.jpg.npy", 0, 0)]))
    assert out.shape == (0, 16, 24, 3) and out.dtype == torch.uint8


# --- which library decodes: torchcodec, else torchvision (deprecated), else what to install ----------------

def fake_torchcodec(version: str, calls: list[str] | None = None) -> types.ModuleType:
    """A torchcodec whose ``decoders.decode_jpeg(list, mode=, device=)`` is Pillow's, noting its calls."""
    module = types.ModuleType("torchcodec")
    module.__version__ = version
    decoders = types.ModuleType("torchcodec.decoders")

    def decode_jpeg(sources, *, mode="RGB", device="cpu"):
        assert mode == "RGB" and isinstance(sources, list)
        if calls is not None:
            calls.append("torchcodec")
        return PillowDecode()(sources, torch.device(device))

    decoders.decode_jpeg = decode_jpeg
    module.decoders = decoders
    return module


def fake_torchvision(version: str, calls: list[str] | None = None) -> types.ModuleType:
    module = types.ModuleType("torchvision")
    module.__version__ = version
    io_module = types.ModuleType("torchvision.io")
    io_module.ImageReadMode = types.SimpleNamespace(RGB="RGB")

    def decode_jpeg(sources, *, mode, device):
        if calls is not None:
            calls.append("torchvision")
        return PillowDecode()(sources, torch.device(device))

    io_module.decode_jpeg = decode_jpeg
    module.io = io_module
    return module


@pytest.fixture
def libraries(monkeypatch: pytest.MonkeyPatch):
    """``install(torchcodec=..., torchvision=...)``: each a module, None (absent), or an exception that
    importing it raises (torchcodec's libraries not loading with a CPU torch)."""

    def install(*, torchcodec=None, torchvision=None) -> None:
        for name, module in (("torchcodec", torchcodec), ("torchvision", torchvision)):
            if isinstance(module, Exception):
                monkeypatch.delitem(sys.modules, name, raising=False)
                monkeypatch.setattr("builtins.__import__", _failing_import(name, module))
                continue
            monkeypatch.setitem(sys.modules, name, module)
            submodule = "decoders" if name == "torchcodec" else "io"
            monkeypatch.setitem(sys.modules, f"{name}.{submodule}", getattr(module, submodule, None))

    return install


def _failing_import(name: str, error: Exception):
    import builtins

    real = builtins.__import__

    def importer(module, *args, **kwargs):
        if module == name or module.startswith(name + "."):
            raise error
        return real(module, *args, **kwargs)

    return importer


def test_torchcodec_is_chosen_where_it_is_installed(jpeg_dir, libraries, recwarn):
    calls: list[str] = []
    libraries(torchcodec=fake_torchcodec("0.17.0", calls), torchvision=fake_torchvision("0.26.0", calls))
    decoder = DeviceDecoder("cpu")
    assert (decoder.backend.name, decoder.backend.version) == ("torchcodec", "0.17.0")
    images = encoded_batch(jpeg_dir, 8)
    assert np.array_equal(decoder(images).numpy(), images.decode())
    assert calls == ["torchcodec"], "one batched call, torchcodec's"
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)], "no deprecation note for it"


@pytest.mark.parametrize("torchcodec", ["0.16.0", "absent", "does not load"])
def test_torchvision_serves_with_a_deprecation_note_when_torchcodec_cannot(jpeg_dir, libraries, torchcodec):
    calls: list[str] = []
    codec = {"absent": None, "does not load": OSError("libtorch_cuda.so: cannot open shared object file"),
             "0.16.0": fake_torchcodec("0.16.0", calls)}[torchcodec]
    libraries(torchcodec=codec, torchvision=fake_torchvision("0.26.0+cu130", calls))
    with pytest.warns(FutureWarning, match=r"torchvision 0\.26\.0\+cu130, whose image decoders are deprecated; "
                                           r"install torchcodec>=0\.17"):
        decoder = DeviceDecoder("cpu")
    assert decoder.backend.name == "torchvision"
    images = encoded_batch(jpeg_dir, 8)
    assert np.array_equal(decoder(images).numpy(), images.decode()) and calls == ["torchvision"]
    assert device_decode.available()


def test_without_either_library_forcing_device_decode_says_why_and_what_to_install(jpeg_dir, libraries):
    libraries(torchcodec=OSError("libnvrtc.so.13: cannot open shared object file"), torchvision=None)
    assert not device_decode.available()
    message = (r"needs torchcodec >= 0\.17 or torchvision >= 0\.19 .*torchcodec does not load with this torch "
               r".*libnvrtc\.so\.13.*torchvision is not installed.*pip install torchcodec>=0\.17.*Pillow-SIMD"
               r".*decode_on_device=False")
    with pytest.raises(MissingExtra, match=message):
        DeviceDecoder("cpu")
    with pytest.raises(MissingExtra, match=message):
        DeviceLoader(ShardDataset(jpeg_dir, 8), "cpu", decode_on_device=True)
    with pytest.raises(MissingExtra, match=message):
        DeviceLoader(ShardDataset(jpeg_dir, 8, decode="device"), "cpu")  # the dataset asked for it


def test_libraries_older_than_batched_decode_are_named(libraries):
    libraries(torchcodec=fake_torchcodec("0.15.1"), torchvision=fake_torchvision("0.18.1+cu121"))
    assert not device_decode.available()
    with pytest.raises(MissingExtra, match=r"torchcodec 0\.15\.1 predates the stream fix of 0\.17; "
                                           r"torchvision 0\.18\.1\+cu121 predates batched decode_jpeg"):
        DeviceDecoder("cuda")


def test_the_default_decodes_on_the_cpu_without_a_library_or_cuda(jpeg_dir, libraries):
    libraries(torchcodec=None, torchvision=None)
    assert DeviceLoader(ShardDataset(jpeg_dir, 8), "cpu").decoder is None
    # a dataset that hands out encoded batches still gets decoded batches when device decode is off
    loader = DeviceLoader(ShardDataset(jpeg_dir, 10, decode="device"), "cpu", decode_on_device=False, **IDENTITY)
    expected = [b["image"].permute(0, 3, 1, 2).float() for b in ShardDataset(jpeg_dir, 10)]
    got = [b["image"] for b in loader]
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))


# --- the stream barrier before every decode ------------------------------------------------------------

class BarrierLog:
    """An injected barrier and decode writing to one log, so the test reads what ran before what."""

    def __init__(self, fail_batched: bool = False, bad_index: int | None = None) -> None:
        self.log: list[tuple[str, object]] = []
        self.fail_batched, self.bad_index = fail_batched, bad_index

    def synchronize(self, device: torch.device) -> None:
        self.log.append(("barrier", device))

    def decode(self, jpegs: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        self.log.append(("decode", len(jpegs)))
        if self.fail_batched and len(jpegs) > 1:
            raise RuntimeError("nvjpegDecodeBatched failed")
        if self.bad_index is not None and len(jpegs) == 1 and self.log.count(("decode", 1)) == self.bad_index + 1:
            raise RuntimeError("corrupt")
        return PillowDecode()(jpegs, device)


def test_every_decode_call_comes_right_after_a_barrier_on_the_decoders_device(jpeg_dir):
    probe = BarrierLog()
    decoder = DeviceDecoder("cpu", decode=probe.decode, synchronize=probe.synchronize)
    for batch in ShardDataset(jpeg_dir, 16, decode="device"):
        decoder(batch["image"])
    calls = [entry for entry in probe.log if entry[0] == "decode"]
    assert len(calls) == -(-117 // 16)
    assert probe.log == [item for call in calls for item in (("barrier", torch.device("cpu")), call)]


@pytest.mark.parametrize("bad_index", [None, 3])
def test_the_per_sample_retries_of_a_failed_batch_each_come_after_a_barrier(jpeg_dir, bad_index):
    probe = BarrierLog(fail_batched=True, bad_index=bad_index)
    decoder = DeviceDecoder("cpu", decode=probe.decode, synchronize=probe.synchronize)
    with pytest.raises(ShardIntegrityError):
        decoder(encoded_batch(jpeg_dir, 8))
    kinds = [kind for kind, _ in probe.log]
    assert kinds == ["barrier", "decode"] * (len(kinds) // 2) and len(kinds) == 2 * (1 + (8 if bad_index is None
                                                                                           else bad_index + 1))


def test_the_default_barrier_waits_only_on_cuda(monkeypatch):
    synchronised: list[str] = []
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: types.SimpleNamespace(synchronize=lambda: synchronised.append(str(device))))
    device_decode.stream_barrier(torch.device("cpu"))
    assert synchronised == []
    device_decode.stream_barrier(torch.device("cuda:1"))
    assert synchronised == ["cuda:1"]


def test_decode_finished_runs_the_decoder_as_is_off_cuda(jpeg_dir):
    images = encoded_batch(jpeg_dir, 8)
    decoder = DeviceDecoder("cpu", decode=PillowDecode())
    assert torch.equal(device_decode.decode_finished(decoder, images, torch.device("cpu")), decoder(images))


def test_device_decode_is_refused_for_a_raw_dataset_and_a_contradiction(tmp_path, jpeg_dir):
    raw = str(tmp_path / "raw")
    make_dataset(raw, (10,))
    with pytest.raises(ValueError, match=rf"{raw}: decode_on_device=True is for JPEG datasets"):
        DeviceLoader(ShardDataset(raw, 4), "cpu", decode_on_device=True)
    with pytest.raises(ValueError, match=r"contradicts decode_on_device=False"):
        DeviceLoader(ShardDataset(jpeg_dir, 4), "cpu", decode_on_device=False, device_decoder=lambda images: None)


# --- DeviceLoader with a device decoder ------------------------------------------------------------------

def counting_decoder() -> tuple[DeviceDecoder, list[int]]:
    sizes: list[int] = []
    inner = DeviceDecoder("cpu", decode=PillowDecode())

    def decoder(images: EncodedImages) -> torch.Tensor:
        assert isinstance(images, EncodedImages)
        sizes.append(len(images))
        return inner(images)

    return decoder, sizes


@pytest.mark.parametrize("workers", [None, 0, 2])
def test_device_loader_decodes_each_batch_once_with_the_cpu_paths_result(photo_dir, workers):
    """Same batches, values and count as decoding on the CPU, through a ShardDataset or a ShardLoader."""
    def source(**options):
        ds = ShardDataset(photo_dir, 10, shuffle=True, **options)
        return ds if workers is None else ShardLoader(ds, num_workers=workers)

    on_cpu = DeviceLoader(source(), "cpu", decode_on_device=False, **IDENTITY)
    expected = list(on_cpu)
    decoder, sizes = counting_decoder()
    loader = DeviceLoader(source(), "cpu", device_decoder=decoder, **IDENTITY)
    got = list(loader)
    loader.passes.join_ahead()  # in this process, the next epoch's first two batches are decoded at this one's end
    ahead = [10, 10] if workers != 2 else []
    assert sizes == [len(b["cls"]) for b in expected] + ahead
    assert [b["__key__"] for b in got] == [b["__key__"] for b in expected]
    assert all(torch.equal(a["image"], b["image"]) for a, b in zip(got, expected))
    assert loader.state_dict() == on_cpu.state_dict() and loader.state_dict()["batches_seen"] == len(expected)


@pytest.mark.parametrize("workers", [None, 0])
def test_the_device_decode_runs_on_the_prefetch_thread_not_the_training_loops(photo_dir, workers):
    threads: list[str] = []
    inner = DeviceDecoder("cpu", decode=PillowDecode())

    def decoder(images: EncodedImages) -> torch.Tensor:
        threads.append(threading.current_thread().name)
        return inner(images)

    ds = ShardDataset(photo_dir, 10, shuffle=True)
    loader = DeviceLoader(ds if workers is None else ShardLoader(ds, num_workers=workers), "cpu",
                          device_decoder=decoder, **IDENTITY)
    assert len(list(loader)) == 7
    loader.passes.join_ahead()  # at the epoch's end the thread decoded the next epoch's first two batches
    assert len(threads) == 7 + 2 and set(threads) == {"shardio-prefetch"}, threads


def test_a_cuda_device_without_cuda_says_so_and_what_to_do(jpeg_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"DeviceLoader\(\.\.\., 'cuda'\): CUDA is not available here \(torch "
                                           r".*\); pass device='cpu' to run on the CPU"):
        DeviceLoader(ShardDataset(jpeg_dir, 8), "cuda")


def test_device_decoded_batches_resume_and_augment_as_cpu_decoded_ones(photo_dir):
    augment = TrainAugment(24, seed=5)
    expected = [b["image"] for b in DeviceLoader(ShardDataset(photo_dir, 8, shuffle=True), "cpu",
                                                 decode_on_device=False, transform=augment)]
    decoder, _ = counting_decoder()
    first = DeviceLoader(ShardDataset(photo_dir, 8, shuffle=True), "cpu", device_decoder=decoder, transform=augment)
    batches = iter(first)
    head = [next(batches)["image"] for _ in range(3)]
    state = first.state_dict()
    resumed = DeviceLoader(ShardDataset(photo_dir, 8, shuffle=True), "cpu", device_decoder=decoder,
                           transform=augment)
    resumed.load_state_dict(state)
    got = head + [b["image"] for b in resumed]
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))


# --- the real decode: batched nvJPEG ----------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.filterwarnings("ignore:decoding JPEG batches on the device with torchvision")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU decode is nvJPEG's)")
def test_cuda_decodes_a_jpeg_dataset_within_the_documented_bound_of_the_cpu(photo_dir):
    pytest.importorskip("torchvision", reason="the GPU decode needs torchvision >= 0.19")
    expected = [b["image"].permute(0, 3, 1, 2).float() for b in ShardDataset(photo_dir, 16, shuffle=True)]
    loader = DeviceLoader(ShardLoader(ShardDataset(photo_dir, 16, shuffle=True), pin_memory=True), "cuda",
                          **IDENTITY)
    assert isinstance(loader.decoder, DeviceDecoder), "device decode is the default on CUDA with torchvision"
    got = [b["image"] for b in loader]
    assert len(got) == len(expected)
    for image, reference in zip(got, expected):
        assert image.is_cuda and image.shape == reference.shape
        difference = (image.cpu() - reference).abs()
        assert difference.max() <= 8, f"nvJPEG differs from libjpeg-turbo by {difference.max():.0f} levels"
        assert difference.mean() < 1.0, f"mean difference {difference.mean():.2f} levels"


def test_a_library_is_asked_for_by_name(libraries):
    libraries(torchcodec=fake_torchcodec("0.17.1"), torchvision=None)
    backend, why = device_decode.library("torchcodec")
    assert backend is not None and backend.version == "0.17.1" and why == ""
    backend, why = device_decode.library("torchvision")
    assert backend is None and "torchvision is not installed" in why
    with pytest.raises(ValueError, match=r"no device decode library 'nvimagecodec': one of torchcodec, torchvision"):
        device_decode.library("nvimagecodec")


# --- batches of varying shape (a bucketed dataset's) -----------------------------------------------------------

def test_the_device_decoder_decodes_batches_of_any_shape_in_one_call_each():
    decode = PillowDecode()
    decoder = DeviceDecoder("cpu", decode=decode)
    shapes = [(16, 24), (24, 16), (32, 32), (16, 24)]
    for index, (h, w) in enumerate(shapes):
        images, _ = jpeg_batch(h, w, 3 + index, seed=index)
        out = decoder(images)
        assert out.shape == (3 + index, h, w, 3) and out.is_contiguous()
        assert np.array_equal(out.numpy(), images.decode())
    assert [len(call) for call in decode.calls] == [3, 4, 5, 6]


def test_a_sample_of_another_shape_than_its_batch_is_named():
    images, _ = jpeg_batch(16, 24, 3)
    other, _ = jpeg_batch(24, 16, 1)
    mixed = EncodedImages(images.jpegs[:2] + other.jpegs, 16, 24, images.sources)
    with pytest.raises(Exception, match=r"b-16x24\.jpg\.npy: sample 2: decodes to .*\(3, 24, 16\).*not the "
                                        r"dataset's uint8 \(3, 16, 24\)"):
        DeviceDecoder("cpu", decode=PillowDecode())(mixed)


def test_device_loader_decodes_encoded_batches_of_varying_shape():
    batches, expected = [], []
    for index, (h, w) in enumerate(SHAPES):
        images, _ = jpeg_batch(h, w, 2, seed=index)
        batches.append({"image": images, "bucket": index})
        expected.append(images.decode())
    loader = DeviceLoader(batches, "cpu", device_decoder=DeviceDecoder("cpu", decode=PillowDecode()),
                          prefetch=2, **IDENTITY)
    out = list(loader)
    assert [b["bucket"] for b in out] == list(range(len(SHAPES)))
    for got, reference in zip(out, expected):
        assert torch.equal(got["image"], torch.from_numpy(reference).permute(0, 3, 1, 2).float())


@pytest.fixture(scope="module")
def bucketed_jpeg(tmp_path_factory) -> str:
    return make_bucketed_dataset(str(tmp_path_factory.mktemp("bucketed-jpeg") / "ds"), encoding="jpeg")


def test_a_bucketed_jpeg_dataset_decoded_on_the_device(bucketed_jpeg):
    cpu = list(DeviceLoader(ShardDataset(bucketed_jpeg, 8, shuffle=True), "cpu", **IDENTITY))
    decode = PillowDecode()
    loader = DeviceLoader(ShardDataset(bucketed_jpeg, 8, shuffle=True), "cpu",
                          device_decoder=DeviceDecoder("cpu", decode=decode), **IDENTITY)
    device = list(loader)
    loader.passes.join_ahead()  # the next epoch's first two batches, decoded at this one's end
    assert len(decode.calls) == len(device) + 2 and len(device) == len(cpu), "one decode call per batch"
    for on_cpu, on_device in zip(cpu, device):
        assert on_device["__key__"] == on_cpu["__key__"] and on_device["bucket"] == on_cpu["bucket"]
        assert tuple(on_device["image"].shape[2:]) == BUCKETS[on_device["bucket"]]
        assert torch.equal(on_device["image"], on_cpu["image"])  # libjpeg-turbo on both sides here
