"""The GPU check's JPEG decode ceiling: the decoder alone, batched, over host bytes, with 1, 2, 4 and 8 host
threads, per library and per size, and ``DeviceLoader``'s rate against it.

``ceiling`` takes each JPEG dataset's shuffled batches still encoded (``bench.gpu_data.encoded_batches``), made
into the 1-D uint8 CPU tensors a decode call takes before any clock starts, so only the decoder runs: each
thread calls the library's batched decode (``shardio.train.device_decode``'s ``DecodeFn``: one nvJPEG call a
batch) on batches of its own, on a CUDA stream of its own, its first call untimed (nvJPEG's handles, the
allocator's blocks); the threads start together behind a barrier and the figure is the batches' samples over
the wall time until the last one ends. ``DeviceLoader`` over the same dataset (its default: the chosen library
through ``DeviceDecoder`` on the prefetch thread) is then set against the best thread count of the chosen
library (goal >= 0.8).

Backends: nvJPEG has a hardware engine (A100, H100) and CUDA (hybrid / GPU-assisted) decoders;
``backend_choice`` reads each library's ``decode_jpeg`` signature for a parameter that selects one and records
what it finds. A library that exposes none is measured once, at the backend it picks itself, and its entry
says so; a choice it exposes is measured per value where the signature lists the values (a ``Literal`` or an
``Enum``), else at its default, said.

On a CPU (the dry run) no device library decodes: the same harness runs with the CPU reader's batch decode
(``EncodedImages.decode``, libjpeg-turbo, the GIL released) standing in for it, so the threads, the barrier and
the table run; its rates are the CPU's, named as such.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import threading
import time
import typing
from collections.abc import Callable
from typing import Any

import torch

from bench.gpu_data import encoded_batches
from bench.gpu_figures import _timed
from shardio import DeviceLoader, ShardDataset
from shardio.errors import MissingExtra
from shardio.read.jpeg_pixels import EncodedImages
from shardio.train import device_decode

THREADS = (1, 2, 4, 8)

# decode(prepared batch) -> samples decoded; each thread gets its own, made on that thread.
BatchDecode = Callable[[Any], int]


def backend_choice(name: str) -> dict[str, Any]:
    """Whether library ``name``'s ``decode_jpeg`` lets a caller choose nvJPEG's backend, from its signature:
    ``{"exposed": False, "parameters": [...]}``, or the parameter, its default and its values where listed."""
    try:
        if name == "torchcodec":
            from torchcodec.decoders import decode_jpeg
        else:
            from torchvision.io import decode_jpeg
    except Exception as error:  # noqa: BLE001 - recorded: absent, or not loadable with this torch
        return {"exposed": None, "why": f"{type(error).__name__}: {error}"}
    return choice_in_signature(decode_jpeg, name)


def choice_in_signature(decode_jpeg: Callable[..., Any], name: str) -> dict[str, Any]:
    """``backend_choice``'s reading of one ``decode_jpeg``'s signature."""
    try:  # the annotations as objects (a Literal's values), where they evaluate
        signature = inspect.signature(decode_jpeg, eval_str=True)
    except Exception:  # noqa: BLE001 - a name the module does not define at run time: read them as text
        signature = inspect.signature(decode_jpeg)
    for parameter in signature.parameters.values():
        if "backend" in parameter.name.lower() or "hardware" in parameter.name.lower():
            values = _listed_values(parameter.annotation)
            return {"exposed": True, "parameter": parameter.name, "default": repr(parameter.default),
                    "values": [repr(v) for v in values] if values else None}
    return {"exposed": False, "parameters": list(signature.parameters),
            "note": f"{name}'s decode_jpeg takes no backend: nvJPEG picks it (measured once, as it picks)"}


def _listed_values(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) is typing.Literal:
        return list(typing.get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return list(annotation)
    return []


def threaded_rate(prepared: list[Any], make_decode: Callable[[], BatchDecode], threads: int, batches: int,
                  device: torch.device) -> dict[str, Any]:
    """``batches`` batches of ``prepared`` (cycled) split over ``threads`` threads, each with the decode
    ``make_decode()`` gives it on a CUDA stream of its own (on CUDA), started together: samples/s over the
    wall time to the last thread's end, and the process's CPU cores busy meanwhile."""
    per_thread = [batches // threads + (1 if index < batches % threads else 0) for index in range(threads)]
    began: list[float] = []  # wall and CPU clocks when the last thread reaches the barrier, all warm
    ends = [0.0] * threads
    start = threading.Barrier(threads, action=lambda: began.extend((time.perf_counter(), time.process_time())))
    counts, errors = [0] * threads, []

    def work(index: int) -> None:
        try:
            decode = make_decode()
            stream = torch.cuda.Stream(device) if device.type == "cuda" else None
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                decode(prepared[index % len(prepared)])  # untimed: handles, blocks
                if stream is not None:
                    stream.synchronize()
                start.wait()
                for number in range(per_thread[index]):
                    counts[index] += decode(prepared[(index + number * threads) % len(prepared)])
                if stream is not None:
                    stream.synchronize()
            ends[index] = time.perf_counter()
        except BaseException as error:  # noqa: BLE001 - raised in the caller
            errors.append(error)
            start.abort()

    workers = [threading.Thread(target=work, args=(index,), daemon=True) for index in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    wall, cpu = max(ends) - began[0], time.process_time() - began[1]
    total = sum(counts)
    return {"samples": total, "seconds": round(wall, 3), "samples_per_s": round(total / wall, 1),
            "cpu_cores_busy": round(cpu / wall, 2)}


def _library_decode(backend: device_decode.JpegBackend, device: torch.device) -> Callable[[], BatchDecode]:
    def make() -> BatchDecode:
        def decode(jpegs: list[torch.Tensor]) -> int:
            return len(backend.decode(jpegs, device))

        return decode

    return make


def _cpu_decode() -> BatchDecode:
    def decode(images: EncodedImages) -> int:
        return len(images.decode(threads=1))  # one native thread per host thread: the threads are the row

    return decode


def ceiling(jpeg_dirs: dict[str, str], device: torch.device, batch: int = 256, batches: int = 32,
            threads: tuple[int, ...] = THREADS) -> dict[str, Any]:
    """Per size (``jpeg_dirs``: a label such as "256²" -> a JPEG dataset): samples/s per thread count per
    library (or the CPU stand-in off CUDA), the best, and ``DeviceLoader``'s epoch against the chosen
    library's best. ``batches`` at the first size; at a larger one, as many as take the same decode time
    (by pixels), at least two a thread."""
    cuda = device.type == "cuda"
    out: dict[str, Any] = {"threads": list(threads), "batch": batch, "batches": batches, "sizes": {},
                           "backend_choice": {name: backend_choice(name) for name in device_decode.LIBRARIES}}
    chosen = None
    if cuda:
        try:
            chosen = device_decode.choose_backend(note=False).name
        except MissingExtra as error:
            out["chosen"] = f"none: {error}"
    out.setdefault("chosen", chosen or "no device library off CUDA: the CPU decoder stands in")
    base_side = None
    for label, directory in jpeg_dirs.items():
        images = encoded_batches(directory, batch, min(batches, 8))
        side = images[0].height
        base_side = base_side or side
        # The same decode time at each size: a quarter of the batches at twice the side, at least two a thread.
        count = max(2 * max(threads), round(batches * (base_side / side) ** 2))
        row: dict[str, Any] = {"side": side, "batches": count, "jpeg_bytes_mean":
                               round(sum(len(j) for i in images for j in i.jpegs) / sum(len(i) for i in images))}
        deciders: dict[str, tuple[list[Any], Callable[[], BatchDecode]]] = {}
        if cuda:
            prepared = [[torch.from_numpy(jpeg) for jpeg in image.jpegs] for image in images]
            for name in device_decode.LIBRARIES:
                backend, why = device_decode.library(name)
                if backend is None:
                    row[name] = f"not available: {why}"
                    continue
                deciders[f"{name} {backend.version}"] = (prepared, _library_decode(backend, device))
        else:
            deciders["cpu (stand-in off CUDA)"] = (images, _cpu_decode)
        best = {}
        for name, (prepared, make) in deciders.items():
            per_threads = {str(n): _recorded(lambda n=n: threaded_rate(prepared, make, n, count, device))
                           for n in threads}
            measured = [n for n in per_threads if "samples_per_s" in per_threads[n]]
            row[name] = {"by_threads": per_threads}
            if measured:
                top = max(measured, key=lambda n: per_threads[n]["samples_per_s"])
                row[name].update(best_threads=int(top), best_samples_per_s=per_threads[top]["samples_per_s"])
                best[name.split(" ")[0]] = per_threads[top]["samples_per_s"]
        loader = row["device_loader"] = _recorded(lambda: _device_loader_rate(directory, device, batch))
        reference = best.get(chosen) if chosen else next(iter(best.values()), None)
        if reference and "samples_per_s" in loader:
            row["device_loader_over_ceiling"] = round(loader["samples_per_s"] / reference, 3)
        out["sizes"][label] = row
    return out


def _recorded(measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``measure()``, or its error recorded: one thread count a library refuses (a decoder shared by threads
    that it does not allow) leaves the other rows standing."""
    try:
        return measure()
    except Exception as error:  # noqa: BLE001 - recorded in the row
        return {"error": f"{type(error).__name__}: {str(error)[:300]}"}


def _device_loader_rate(directory: str, device: torch.device, batch: int) -> dict[str, Any]:
    """A warm shuffled epoch of ``DeviceLoader`` over the JPEG dataset, its default decode and normalisation."""
    loader = DeviceLoader(ShardDataset(directory, batch, shuffle=True), device)

    def epoch() -> int:
        return sum(len(item["image"]) for item in loader)

    epoch()  # warm: page cache, the decoder's handles
    return _timed(epoch, device)
