"""The benchmark's input: a deterministic LAION-like WebDataset corpus, cached under ``bench/out``.

img2dataset's high-resolution LAION output is JPEGs of roughly 1-2.5 megapixels at quality 80-95, about
1.5 bits per pixel, each with ``.json`` and ``.txt``, in tars of a few hundred samples. Flat-colour test
images decode several times faster than photos, so the pixels come from ``preprocess.sample_data.photo_like``
(multi-scale texture and grain: ~1.5 bits/px at these qualities). Generation costs ~0.3 s per image, so
tars are written by a process pool and kept: a rerun with the same parameters reuses them.
"""

from __future__ import annotations

import json
import os
import tarfile
from dataclasses import asdict, dataclass
from multiprocessing import Pool

import numpy as np

from preprocess.sample_data import encode_jpeg, photo_like, write_tar

__all__ = ["Corpus", "CorpusSpec", "build_corpus", "combined_tar", "read_images"]

# 1.05-2.46 MP, landscape and portrait, as web photos come.
WEB_SIZES = [
    (1024, 1024),
    (1280, 853),
    (1280, 960),
    (1440, 1080),
    (1600, 1067),
    (1200, 1600),
    (1920, 1080),
    (1920, 1280),
]


@dataclass(frozen=True)
class CorpusSpec:
    tars: int = 6
    samples_per_tar: int = 200
    seed: int = 0

    @property
    def name(self) -> str:
        return f"laion-like-{self.tars}x{self.samples_per_tar}-s{self.seed}"


@dataclass
class Corpus:
    spec: CorpusSpec
    directory: str
    tars: list[str]
    images: int
    megapixels_mean: float
    bits_per_pixel: float
    jpeg_kb_mean: float
    quality_range: tuple[int, int]

    def summary(self) -> dict:
        doc = asdict(self)
        doc["spec"] = asdict(self.spec)
        doc["tars"] = [os.path.basename(t) for t in self.tars]
        return doc


def _write_one(args: tuple[str, int, int, int]) -> dict:
    path, tar_index, samples, seed = args
    rng = np.random.default_rng([seed, tar_index])
    members: list[tuple[str, bytes]] = []
    stats = {"pixels": 0, "bytes": 0, "qualities": []}
    for i in range(samples):
        width, height = WEB_SIZES[int(rng.integers(len(WEB_SIZES)))]
        quality = int(rng.integers(80, 96))
        data = encode_jpeg(photo_like(rng, width, height), quality)
        key = f"{tar_index:05d}{i:04d}"
        caption = f"a photo-like benchmark image {key}, {width}x{height}"
        meta = {
            "key": key,
            "url": f"https://example.com/{key}.jpg",
            "width": width,
            "height": height,
            "caption": caption,
            "status": "success",
            "quality": quality,
        }
        members += [
            (f"{key}.jpg", data),
            (f"{key}.txt", caption.encode()),
            (f"{key}.json", json.dumps(meta).encode()),
        ]
        stats["pixels"] += width * height
        stats["bytes"] += len(data)
        stats["qualities"].append(quality)
    write_tar(path, members)
    return stats


def build_corpus(root: str, spec: CorpusSpec, processes: int | None = None, log=print) -> Corpus:
    """Write (or reuse) ``root/<spec.name>/{00000..}.tar`` and return its description."""
    directory = os.path.join(root, spec.name)
    os.makedirs(directory, exist_ok=True)
    summary_path = os.path.join(directory, "corpus.json")
    paths = [os.path.join(directory, f"{t:05d}.tar") for t in range(spec.tars)]
    if os.path.exists(summary_path) and all(os.path.exists(p) for p in paths):
        with open(summary_path) as f:
            doc = json.load(f)
        return Corpus(
            spec=spec,
            directory=directory,
            tars=paths,
            images=doc["images"],
            megapixels_mean=doc["megapixels_mean"],
            bits_per_pixel=doc["bits_per_pixel"],
            jpeg_kb_mean=doc["jpeg_kb_mean"],
            quality_range=tuple(doc["quality_range"]),
        )
    images = spec.tars * spec.samples_per_tar
    log(
        f"generating the corpus: {images} photo-like JPEGs in {spec.tars} tars (~0.3 s/image/core, cached "
        f"in {directory})"
    )
    jobs = [(p, t, spec.samples_per_tar, spec.seed) for t, p in enumerate(paths)]
    with Pool(processes or os.cpu_count() or 1) as pool:
        stats = pool.map(_write_one, jobs, chunksize=1)
    pixels = sum(s["pixels"] for s in stats)
    size = sum(s["bytes"] for s in stats)
    qualities = [q for s in stats for q in s["qualities"]]
    corpus = Corpus(
        spec=spec,
        directory=directory,
        tars=paths,
        images=images,
        megapixels_mean=round(pixels / images / 1e6, 3),
        bits_per_pixel=round(size * 8 / pixels, 3),
        jpeg_kb_mean=round(size / images / 1e3, 1),
        quality_range=(min(qualities), max(qualities)),
    )
    with open(summary_path, "w") as f:
        json.dump(corpus.summary(), f, indent=1)
    return corpus


def combined_tar(corpus: Corpus) -> str:
    """All of the corpus in one tar (cached): one task fills whole 1,000-sample shards (memory figure)."""
    path = os.path.join(corpus.directory, "combined", "all.tar")
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)

    def members():
        for tar_path in corpus.tars:
            with tarfile.open(tar_path) as tar:
                for info in tar:
                    yield info.name, tar.extractfile(info).read()

    write_tar(path, members())
    return path


def read_images(tar_paths: list[str], extension: str = ".jpg") -> list[bytes]:
    """The encoded images of ``tar_paths``, in order (the per-core paths time decoding, not tar reading)."""
    images = []
    for path in tar_paths:
        with tarfile.open(path) as tar:
            for info in tar:
                if info.name.endswith(extension):
                    images.append(tar.extractfile(info).read())
    return images
