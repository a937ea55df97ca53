"""Datasets with model outputs (format version 6, spec "Model outputs"), written with shardio's own writer and
output files as the job writes them, no Ray or model: sample ``i`` (key ``s{i}``) has, whatever its shard,

- ``latent``: float16 of its bucket's shape ``(2, h // 2, w // 2)``, every value ``i / 8``;
- ``embed``: int32 ``[i, -i, 7]`` (one shape in every bucket, as a text model's);
- ``bits``: bfloat16 ``[i, i + 0.5]``, stored as its raw bits (``<u2``);

so a test reads a batch's rows back from its keys alone. ``bucketed``: buckets (4, 8) and (8, 4), sample ``i``
in bucket ``i % 2``.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from shardio.format import InputEntry, Manifest
from shardio.format.model_outputs import OutputSpec, output_header, output_path
from shardio.store.checksum import WRITE_ALGORITHM, file_checksum
from shardio.write.shard_writer import InputShardWriter, write_manifest

SHAPE = (6, 6)
BUCKETS = ((4, 8), (8, 4))
IDENTITIES = {"latent": {"function": "toy:vae", "weights": "xxh3_128:ab", "version": None},
              "embed": {"function": "toy:text", "weights": None, "version": "1"},
              "bits": {"function": "toy:bits", "weights": None, "version": "2"}}


def shapes(bucketed: bool) -> tuple[tuple[int, int], ...]:
    return BUCKETS if bucketed else (SHAPE,)


def latent_shape(height: int, width: int) -> tuple[int, int, int]:
    return (2, height // 2, width // 2)


def expected(name: str, index: int, bucketed: bool = False) -> torch.Tensor:
    """Output ``name`` of sample ``index`` as a batch row holds it."""
    if name == "latent":
        height, width = shapes(bucketed)[index % 2 if bucketed else 0]
        return torch.full(latent_shape(height, width), index / 8, dtype=torch.float16)
    if name == "embed":
        return torch.tensor([index, -index, 7], dtype=torch.int32)
    return torch.tensor([index, index + 0.5], dtype=torch.bfloat16)


def output_specs(bucketed: bool) -> tuple[OutputSpec, ...]:
    latents = tuple(latent_shape(h, w) for h, w in shapes(bucketed))
    count = len(latents)
    return (OutputSpec("latent", "image", "float16", latents, IDENTITIES["latent"]),
            OutputSpec("embed", "text", "int32", ((3,),) * count, IDENTITIES["embed"]),
            OutputSpec("bits", "text", "bfloat16", ((2,),) * count, IDENTITIES["bits"]))


def _stored(name: str, index: int, bucketed: bool) -> np.ndarray:
    value = expected(name, index, bucketed)
    return value.view(torch.int16).numpy().view("<u2") if value.dtype == torch.bfloat16 else value.numpy()


def make_output_dataset(directory: str, inputs: tuple[int, ...] = (7, 5), *, bucketed: bool = False,
                        samples_per_shard: int = 3, with_outputs: bool = True, encoding: str = "raw") -> Manifest:
    """Write the dataset (input ``n``: ``inputs[n]`` samples, ``input-{n}.tar``); return its manifest.
    ``with_outputs`` False: the same samples without models (format version 3 or 4)."""
    os.makedirs(directory, exist_ok=True)
    config: dict[str, Any] = {"height": SHAPE[0], "width": SHAPE[1]}
    if bucketed:
        config.update(mode="bucket", buckets=[list(b) for b in BUCKETS])
    if encoding != "raw":
        config["encoding"] = encoding
    if with_outputs:
        config["models"] = {o.name: {"fn": o.identity["function"], "input": o.input, "dtype": o.dtype}
                            for o in output_specs(bucketed)}
    manifest = Manifest(shape=(*SHAPE, 3), config=config, versions={"shardio": "test"},
                        outputs=output_specs(bucketed) if with_outputs else ())
    index = 0
    for number, count in enumerate(inputs):
        name = f"input-{number}.tar"
        writer = InputShardWriter(directory, f"input-{number}", *SHAPE, samples_per_shard, encoding,
                                  buckets=BUCKETS if bucketed else None)
        for i in range(index, index + count):
            bucket = i % 2 if bucketed else 0
            height, width = shapes(bucketed)[bucket]
            pixels = np.full((height, width, 3), i % 251, np.uint8)
            meta = {"key": f"s{i}", "tar": name, "member": f"{i}.jpg", "width": width, "height": height,
                    "txt": f"caption {i}", "cls": i, "json": None}
            writer.add(pixels, meta, name, bucket)
        entries = writer.close(name)
        if with_outputs:
            entries = [_with_outputs(directory, entry, bucketed) for entry in entries]
        manifest.shards.extend(entries)
        manifest.inputs[name] = InputEntry(size=count, mtime_ns=0, samples=count, failed=0,
                                           shards=[e.path for e in entries])
        index += count
    write_manifest(directory, manifest)
    return manifest


def _with_outputs(directory: str, entry: Any, bucketed: bool) -> Any:
    """The shard's output files written from its samples' keys (its ``.jsonl``), and its entry with their digests."""
    with open(os.path.join(directory, entry.meta_path)) as f:
        indices = [int(json.loads(line)["key"][1:]) for line in f]
    digests = []
    for spec in output_specs(bucketed):
        values = np.stack([_stored(spec.name, i, bucketed) for i in indices])
        path = os.path.join(directory, output_path(entry.path, spec.name))
        with open(path, "wb") as f:
            f.write(output_header(spec.descr, len(indices), values.shape[1:]))
            f.write(np.ascontiguousarray(values).tobytes())
        digests.append(file_checksum(path, WRITE_ALGORITHM))
    return replace(entry, outputs=tuple(digests))
