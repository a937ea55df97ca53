"""``bench/results.json`` and ``results.md``, written by several benchmarks: each owns its part and keeps the
others'. ``bench.run`` owns the document's top (every key but the sections' and the text before the first
section marker); ``bench.object_store`` and ``bench.cold_epoch`` each own a key and a marked section."""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["write_top", "write_section", "SECTION_MARK"]

SECTION_MARK = "<!-- "  # a section's first line: "<!-- NAME: written by python -m bench.NAME -->"


def _read(directory: str) -> tuple[dict[str, Any], str]:
    json_path, md_path = os.path.join(directory, "results.json"), os.path.join(directory, "results.md")
    doc: dict[str, Any] = {}
    if os.path.exists(json_path):
        with open(json_path) as f:
            doc = json.load(f)
    text = ""
    if os.path.exists(md_path):
        with open(md_path) as f:
            text = f.read()
    return doc, text


def _write(directory: str, doc: dict[str, Any], text: str) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "results.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(directory, "results.md"), "w") as f:
        f.write(text.rstrip("\n") + "\n")


def _sections(text: str) -> list[str]:
    """The marked sections of ``text``, each from its marker to the next one (or the end)."""
    starts = [i for i in range(len(text)) if text.startswith(SECTION_MARK, i) and (i == 0 or text[i - 1] == "\n")]
    return [text[a:b].rstrip("\n") for a, b in zip(starts, starts[1:] + [len(text)])]


def write_top(directory: str, results: dict[str, Any], markdown: str, section_keys: tuple[str, ...]) -> None:
    """``bench.run``'s results as the document's top: its keys replace the old top's, and the sections the other
    benchmarks wrote (``section_keys`` in the JSON, their marked parts of the text) are kept."""
    old, text = _read(directory)
    doc = {**results, **{key: old[key] for key in section_keys if key in old}}
    _write(directory, doc, "\n\n".join([markdown.rstrip("\n"), *_sections(text)]))


def write_section(directory: str, key: str, results: dict[str, Any], marker: str, markdown: str) -> None:
    """One benchmark's ``results`` under ``key`` and its ``markdown`` (starting with ``marker``) as its section:
    an older one replaced in place, every other part kept."""
    doc, text = _read(directory)
    doc[key] = results
    sections = _sections(text)
    top = text[:text.find(sections[0])] if sections else text
    mine = markdown.rstrip("\n")
    replaced = [mine if section.startswith(marker) else section for section in sections]
    if mine not in replaced:
        replaced.append(mine)
    _write(directory, doc, "\n\n".join(part for part in [top.rstrip("\n"), *replaced] if part))
