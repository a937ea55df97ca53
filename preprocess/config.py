"""The job's config: typed defaults in one dataclass, a YAML file over them, CLI flags over the file.

Only fields that change the pixels or the shard layout live here: they are stored in the manifest and
hashed, and a dataset refuses a run whose config differs. Run-time choices (workers, Ray address, report
path) are CLI options, not config, so they never make two runs incompatible.

A rerun into an existing dataset starts from the dataset's stored config (``load_config(base=...)``), so
the nightly command need not repeat a flag; a file or flag may still name a key, and one that disagrees
with the dataset is refused (``preprocess.job``). What must match is ``output_dict()``: the shape, mode,
resample, fill, background, draft, samples_per_shard, image_extensions and encoding (with quality and
subsampling for JPEG: the pixels and layout; the resolved ``buckets`` list with ``bucket_step`` and
``bucket_max_ratio`` for ``mode: bucket``), the Parquet columns read (image_column, label_column), folder_classes,
and the sample filters and limits (min_image_size, max_aspect_ratio, max_image_pixels, max_jpeg_scans,
max_decoded_bytes: which samples the dataset holds, so that every input was filtered by the same rules).
Run policy may change from run to run: max_failed_fraction and max_decode_seconds (what the latter fails
depends on the machine's load), with the defaults below unless the file or a flag says otherwise.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import yaml

from shardio.errors import ConfigError
from preprocess.image.buckets import (DEFAULT_MAX_RATIO, DEFAULT_STEP, Bucket, check_buckets, derive_buckets,
                                      nearest_bucket)
from preprocess.models.model_config import ModelSpec, parse_models
from shardio.format import BUCKET_MODE, ENCODINGS, JPEG, MAX_SIDE, NONE, RAW, SUBSAMPLINGS

__all__ = ["JobConfig", "ConfigError", "load_config", "RESIZE_MODES", "RESAMPLE_FILTERS", "BUCKET"]

BUCKET = BUCKET_MODE  # the spec's: a stored config says it (shardio.format.spec)
RESIZE_MODES = ("center_crop", "pad", "stretch", BUCKET)
# Pillow's filter names; "box" and "bilinear" are cheaper, "lanczos" sharper; bicubic is what
# torchvision and timm use for ImageNet-style training.
RESAMPLE_FILTERS = ("nearest", "box", "bilinear", "hamming", "bicubic", "lanczos")


@dataclass
class JobConfig:
    height: int = 256
    width: int = 256
    mode: str = "center_crop"
    resample: str = "bicubic"
    # Letterbox colour for mode=pad, and the background alpha is composited on (RGB 0-255).
    fill: tuple[int, int, int] = (0, 0, 0)
    background: tuple[int, int, int] = (255, 255, 255)
    # Largest DCT scale (1/2, 1/4, 1/8) that keeps both kept sides >= the target: most of the speed.
    draft: bool = True
    samples_per_shard: int = 1000
    # Pixel-bomb limit: an image with more pixels is a failed sample, never decoded. Pillow's own
    # warning band (above MAX_IMAGE_PIXELS) is treated as this error too.
    max_image_pixels: int = 89_478_485
    # Smallest accepted short side and largest long/short side ratio (img2dataset's min_image_size and
    # max_aspect_ratio): 0 and None (no limit, img2dataset's inf) keep every image, as before these keys.
    # A 90x160 thumbnail is upscaled to 256 otherwise; the report counts how many samples were upscaled.
    min_image_size: int = 0
    max_aspect_ratio: float | None = None
    # Per-image resource limits, each a counted failure (see preprocess/image/transform.py). Decode time grows
    # with a progressive JPEG's scan count (510 scans over 423 KB took 21 s): usual encoders write 10
    # (libjpeg's progressive script; 6 for grayscale), so 100 leaves room for custom scripts.
    max_jpeg_scans: int = 100
    # Peak bytes of one image's decoded pixels plus its conversions to RGB, checked before decoding:
    # Pillow stores RGB in 4 bytes a pixel, and an RGBA PNG needs ~13 bytes a pixel until it is
    # composited (a 194 KB 16-bit RGBA PNG took 1.7 GB). 512 MiB admits RGB at the max_image_pixels limit
    # (358 MB) and keeps a worker's memory bounded by about that plus its ~125 MB baseline. A progressive
    # (multi-scan) JPEG adds the DCT coefficients libjpeg keeps for the whole image while it reads the
    # scans, at full resolution whatever the draft: components x blocks x 64 x 2 bytes (a 2 MB 9400x9400
    # 4:4:4 one: 506 MiB + 5 MiB of drafted pixels, measured peak 511 MiB over the baseline).
    max_decoded_bytes: int = 512 * 1024 * 1024
    # Wall time of one image (decode to resized pixels), checked after the fact: a decode inside one C call
    # cannot be interrupted, the two limits above prevent the long ones. Normal images take ~5 ms; a
    # sample failed by this limit depends on the machine's load, so keep it far above the normal. A decode
    # that never returns is ended at 2 x this + 1 s (61 s): preprocess/image/decode_watch.py.
    max_decode_seconds: float = 30.0
    image_extensions: tuple[str, ...] = ("jpg", "jpeg", "png", "webp")
    # Fraction of failed samples above which the run exits non-zero even if every input was read.
    max_failed_fraction: float = 1.0
    # How the shards hold the pixels (shardio.format, "Pixel encodings"): raw H×W×3 bytes (196 KB an image
    # at 256², no decode to read), each image once as a JPEG, or yuv420 (Y full size, Cb and Cr half size each
    # way: 98 KB at 256², converted back to RGB by the reader), or none (with models only: the outputs are the
    # dataset, no pixels kept). quality and subsampling apply to jpeg only;
    # the defaults were chosen at 256² from the curve python -m bench.jpeg_quality prints (photo-like images:
    # q90 4:4:4 about 24 KB, median PSNR about 42 dB against raw; q90 4:2:0 is smaller and loses more).
    encoding: str = RAW
    quality: int = 90
    subsampling: str = "4:4:4"
    # Which Parquet column holds the image and which the label (preprocess.inputs.parquet_samples): None finds them
    # by type and name. Stored only when set, so a dataset made before these keys keeps its config bytes.
    image_column: str | None = None
    label_column: str | None = None
    # A folder input's first folder level as the class (preprocess.inputs.folder_samples): cls = the index of its
    # name among the sorted sub-folder names, and the name in the sample's json. Stored only when true.
    folder_classes: bool = False
    # mode: bucket (preprocess.image.buckets): height x width is the pixel budget; each image goes to the bucket
    # nearest its aspect ratio. ``buckets`` lists them as [height, width] pairs, or None to derive them from
    # the budget with sides multiples of ``bucket_step`` and long/short side up to ``bucket_max_ratio``.
    # Resolved at load (``buckets`` is then always the list, in the order that gives the bucket ids); stored
    # only in bucket mode, so other datasets keep their config bytes.
    buckets: list[Bucket] | None = None
    bucket_step: int = DEFAULT_STEP
    bucket_max_ratio: float = DEFAULT_MAX_RATIO
    # Model outputs (preprocess.models.model_config): an output name to ``MODULE:FUNCTION`` or to a mapping with
    # ``fn`` and options; each sample's output is stored beside its pixels (shardio.format, "Model outputs").
    # Normalised at load to the canonical mapping (every option spelled out); None or empty: no models, stored
    # only when non-empty, so a dataset without models keeps its config bytes. What must match to append is
    # each output's ``fn``, ``input`` and ``dtype``; ``batch_size``, ``device`` and ``replicas`` are how it runs.
    models: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.fill = tuple(self.fill)  # YAML gives lists
        self.background = tuple(self.background)
        self.image_extensions = tuple(e.lower().lstrip(".") for e in self.image_extensions)
        if isinstance(self.max_aspect_ratio, (int, float)) and math.isinf(self.max_aspect_ratio):
            self.max_aspect_ratio = None  # YAML's .inf: no limit, stored as null (JSON has no infinity)
        # YAML's 30 is stored as 30.0, as the default
        for name in ("max_aspect_ratio", "max_decode_seconds", "bucket_max_ratio"):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(self, name, float(value))
        self.validate()
        if self.mode == BUCKET:
            self.buckets = (check_buckets(self.buckets) if self.buckets is not None
                            else derive_buckets(self.height, self.width, self.bucket_step, self.bucket_max_ratio))
        elif self.buckets is not None:
            raise ConfigError(f"buckets is for mode: bucket only (mode is {self.mode!r})")
        # Per-image lookups of bucket mode, kept off the dataclass's fields (never stored or compared).
        self._bucket_configs: dict[int, JobConfig] = {}
        self._nearest: dict[tuple[int, int], int] = {}
        self._max_side = max(max(shape) for shape in self.shapes)
        self._model_specs = parse_models(self.models)
        self.models = {spec.name: spec.to_dict() for spec in self._model_specs} or None

    @property
    def model_specs(self) -> tuple[ModelSpec, ...]:
        """The ``models:`` outputs, in the config's order (``preprocess.models.model_config``; () without models)."""
        return self._model_specs

    @property
    def shapes(self) -> list[Bucket]:
        """Every (height, width) a sample may be stored at: the buckets, or the one target shape (a config
        holds a list exactly in ``mode: bucket``, resolved at load)."""
        return list(self.buckets or [(self.height, self.width)])

    @property
    def max_side(self) -> int:
        """The longest side any sample is stored at (a resize's intermediate size is bounded by it)."""
        return self._max_side

    def bucket_of(self, width: int, height: int) -> int:
        """The bucket id of an upright ``width`` x ``height`` image (``preprocess.image.buckets.nearest_bucket``)."""
        found = self._nearest.get((width, height))
        if found is None:
            if len(self._nearest) >= 4096:  # web images repeat a few hundred sizes: bounded all the same
                self._nearest.clear()
            found = self._nearest[(width, height)] = nearest_bucket(width, height, self.buckets or ())
        return found

    def bucket_config(self, bucket: int) -> JobConfig:
        """This config as ``center_crop`` to bucket ``bucket``'s shape: what the transform does to an image
        of that bucket (the same draft, region decode and resampling as a centre crop)."""
        found = self._bucket_configs.get(bucket)
        if found is None:
            assert self.buckets is not None
            height, width = self.buckets[bucket]
            found = self._bucket_configs[bucket] = dataclasses.replace(
                self, mode="center_crop", height=height, width=width, buckets=None)
        return found

    def validate(self) -> None:
        if not (1 <= self.height <= MAX_SIDE and 1 <= self.width <= MAX_SIDE):
            raise ConfigError(f"height/width must be 1..{MAX_SIDE}, got {self.height}x{self.width}")
        if self.mode not in RESIZE_MODES:
            raise ConfigError(f"mode must be one of {', '.join(RESIZE_MODES)}, got {self.mode!r}")
        if self.resample not in RESAMPLE_FILTERS:
            raise ConfigError(f"resample must be one of {', '.join(RESAMPLE_FILTERS)}, got {self.resample!r}")
        for name in ("fill", "background"):
            value = getattr(self, name)
            if len(value) != 3 or not all(isinstance(v, int) and 0 <= v <= 255 for v in value):
                raise ConfigError(f"{name} must be three integers 0-255, got {list(value)}")
        if self.samples_per_shard < 1:
            raise ConfigError(f"samples_per_shard must be >= 1, got {self.samples_per_shard}")
        if self.max_image_pixels < 1:
            raise ConfigError(f"max_image_pixels must be >= 1, got {self.max_image_pixels}")
        _check_number("min_image_size", self.min_image_size, int, 0)
        if self.max_aspect_ratio is not None:
            _check_number("max_aspect_ratio", self.max_aspect_ratio, float, 1.0)
        _check_number("max_jpeg_scans", self.max_jpeg_scans, int, 1)
        _check_number("max_decoded_bytes", self.max_decoded_bytes, int, 1)
        _check_number("max_decode_seconds", self.max_decode_seconds, float, 1e-9)
        if not 0.0 <= self.max_failed_fraction <= 1.0:
            raise ConfigError(f"max_failed_fraction must be in [0, 1], got {self.max_failed_fraction}")
        if self.encoding not in ENCODINGS:
            raise ConfigError(f"encoding must be one of {', '.join(ENCODINGS)}, got {self.encoding!r}")
        if self.encoding == NONE and not self.models:
            raise ConfigError("encoding: none keeps no pixels, only model outputs: give models (the outputs to "
                              "store), or another encoding")
        _check_number("quality", self.quality, int, 1)
        if self.quality > 100:
            raise ConfigError(f"quality must be 1..100, got {self.quality}")
        if self.subsampling not in SUBSAMPLINGS:
            raise ConfigError(f"subsampling must be one of {', '.join(SUBSAMPLINGS)}, got {self.subsampling!r}")
        if not isinstance(self.folder_classes, bool):
            raise ConfigError(f"folder_classes must be true or false, got {self.folder_classes!r}")
        _check_number("bucket_step", self.bucket_step, int, 1)
        _check_number("bucket_max_ratio", self.bucket_max_ratio, float, 1.0)
        for name in _COLUMN_KEYS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{name} must be a column name, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        """The canonical form stored in the manifest and hashed (JSON types only)."""
        d = dataclasses.asdict(self)
        d["fill"] = list(self.fill)
        d["background"] = list(self.background)
        d["image_extensions"] = list(self.image_extensions)
        if self.encoding == RAW:
            # A raw dataset's stored config (and so its manifest bytes and config hash) stays what it was
            # before encodings existed: older datasets keep appending, the golden dataset is unchanged.
            for key in ("encoding", "quality", "subsampling"):
                del d[key]
        elif self.encoding != JPEG:  # yuv420, none: quality and subsampling say nothing of their pixels
            for key in ("quality", "subsampling"):
                del d[key]
        for key in (*_COLUMN_KEYS, "folder_classes"):
            if d[key] in (None, False):
                del d[key]
        if self.mode == BUCKET:
            d["buckets"] = [list(b) for b in self.shapes]
        else:
            for key in _BUCKET_KEYS:
                del d[key]
        if not self.models:  # stored only when there are models: every other dataset keeps its config bytes
            del d["models"]
        return d

    def output_dict(self) -> dict[str, Any]:
        """The fields that decide the pixels and layout: what must match to append to a dataset."""
        d = self.to_dict()
        d.pop("max_failed_fraction")  # a run policy, not part of the data
        d.pop("max_decode_seconds")  # a run policy too: what it fails depends on the machine's load
        if "models" in d:  # batch_size, device and replicas are how a model runs, not what it stores
            d["models"] = {spec.name: spec.output_dict() for spec in self._model_specs}
        return d

    def full_output_dict(self) -> dict[str, Any]:
        """``output_dict`` with the keys a raw config leaves out (encoding, quality, subsampling): what a
        message comparing two configs shows for a key one of them does not store."""
        return {**self.output_dict(), "encoding": self.encoding, "quality": self.quality,
                "subsampling": self.subsampling, "image_column": self.image_column,
                "label_column": self.label_column, "folder_classes": self.folder_classes,
                "buckets": [list(b) for b in self.buckets] if self.buckets else None,
                "bucket_step": self.bucket_step, "bucket_max_ratio": self.bucket_max_ratio,
                "models": self.output_dict().get("models")}


_COLUMN_KEYS = ("image_column", "label_column")
_BUCKET_KEYS = ("buckets", "bucket_step", "bucket_max_ratio")


def _check_number(name: str, value: Any, kind: type, minimum: float) -> None:
    # bool is an int in Python: `min_image_size: true` is a mistake, not 1.
    ok_types = (int,) if kind is int else (int, float)
    bad_type = isinstance(value, bool) or not isinstance(value, ok_types)
    if bad_type or not value >= minimum or not math.isfinite(value):  # JSON (the manifest) has no infinity
        what = "an integer" if kind is int else "a number"
        raise ConfigError(f"{name} must be {what} >= {minimum:g}, got {value!r}")


_FIELDS = {f.name for f in dataclasses.fields(JobConfig)}
# libyaml's safe loader where PyYAML has it (the same documents, the same types): a file listing 65,536
# buckets loads in about a second instead of five.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _from_mapping(values: dict[str, Any], source: str) -> dict[str, Any]:
    unknown = sorted(set(values) - _FIELDS)
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(_FIELDS))}")
    return values


def load_config(path: str | None = None, overrides: dict[str, Any] | None = None,
                base: dict[str, Any] | None = None) -> JobConfig:
    """Defaults, then ``base`` (an existing dataset's stored config: keys this version does not know are
    left out), then the YAML file at ``path``, then ``overrides`` (CLI flags; None values ignored)."""
    values: dict[str, Any] = {k: v for k, v in (base or {}).items() if k in _FIELDS}
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                doc = yaml.load(f, Loader=_YAML_LOADER) or {}
        except OSError as e:
            raise ConfigError(f"{path}: cannot read config ({e.strerror})") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from e
        if not isinstance(doc, dict):
            raise ConfigError(f"{path}: a config file is a mapping of keys to values")
        values.update(_from_mapping(doc, path))
        if doc.get("buckets") is not None:
            check_buckets(doc["buckets"], f"{path}: buckets")  # the file named: its list is the one refused
    values.update(_from_mapping({k: v for k, v in (overrides or {}).items() if v is not None}, "flags"))
    if values.get("mode", "center_crop") != BUCKET and (base or {}).get("buckets") == values.get("buckets"):
        # A bucketed dataset's list under a file or flag that names another mode: the run is refused for its
        # mode (preprocess.job names the keys that differ), not for holding the dataset's own list.
        values.pop("buckets", None)
    try:
        return JobConfig(**values)
    except TypeError as e:
        raise ConfigError(f"{path or 'config'}: {e}") from e
