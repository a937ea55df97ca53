"""Folders of image files for tests: the files ``TarFactory.samples`` puts in a tar, written to a folder."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from tests.tar_factory import index_image, jpeg_bytes

__all__ = ["write_file", "flat_folder", "class_drop"]


def write_file(path, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def flat_folder(root, indices, with_meta=True) -> str:
    """The files of ``TarFactory.samples``: KEY.jpg + KEY.txt / KEY.cls / KEY.json, directly in the folder."""
    for i in indices:
        write_file(os.path.join(root, f"{i:06d}.jpg"), jpeg_bytes(index_image(i)))
        if with_meta:
            write_file(os.path.join(root, f"{i:06d}.txt"), f"caption {i}".encode())
            write_file(os.path.join(root, f"{i:06d}.cls"), str(i).encode())
            write_file(os.path.join(root, f"{i:06d}.json"), json.dumps({"index": i}).encode())
    return str(root)


def class_drop(root, classes: dict[str, Iterable[int]]) -> str:
    """A drop folder holding one sub-folder per class (``folder_classes``), each with the self-identifying
    images of its indices (``CLASS/NNNNNN.jpg``)."""
    for name, indices in classes.items():
        for index in indices:
            write_file(os.path.join(root, name, f"{index:06d}.jpg"), jpeg_bytes(index_image(index)))
    return str(root)
