"""Datasets in the format before the index (versions 1 and 2: one JSON manifest listing everything), made
from a dataset the current code wrote: what an older shardio left on disk, for the tests that read,
upgrade or hand-edit that layout.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from shardio.format.manifests import load_manifest

__all__ = ["as_legacy", "legacy_doc", "write_legacy"]


def legacy_doc(directory: str) -> dict[str, Any]:
    """The dataset's current generation as one version 1/2 document (``Manifest.to_json``)."""
    return load_manifest(directory).to_json()


def write_legacy(directory: str, doc: dict[str, Any]) -> None:
    """Write ``doc`` as ``manifest.json`` the way version 2 did (``indent=1``, UTF-8)."""
    with open(os.path.join(directory, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, ensure_ascii=False)


def as_legacy(directory: str) -> dict[str, Any]:
    """Turn ``directory`` into the layout an older shardio left: ``manifest.json`` the whole dataset as
    one version 1/2 document, ``manifests/GEN.json`` its copy (older generations dropped), no ``index/``.
    Returns the document."""
    doc = legacy_doc(directory)
    manifests = os.path.join(directory, "manifests")
    shutil.rmtree(manifests, ignore_errors=True)
    shutil.rmtree(os.path.join(directory, "index"), ignore_errors=True)
    write_legacy(directory, doc)
    if doc.get("generation"):
        os.makedirs(manifests, exist_ok=True)
        with open(os.path.join(manifests, f"{doc['generation']:010d}.json"), "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, ensure_ascii=False)
    return doc
