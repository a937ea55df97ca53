"""A root's fields, each read and checked before anything is sized or trusted by it (spec, "Index": the
root; "Identity", "Fencing names", "Classes"): shape, generation, identity, fence, class table, and the
JSON they come in. A forged or edited root is refused naming its file, never half-read."""

from __future__ import annotations

import json
import uuid
from typing import Any

from shardio.errors import ShardFormatError
from shardio.format.spec import MAX_SIDE

__all__ = ["root_shape", "root_generation", "new_dataset_id", "derived_identity", "root_dataset_id",
           "root_name_fence", "root_classes", "proves_another_dataset", "parse_json"]


def root_shape(doc: dict[str, Any], path: str) -> tuple[int, int, int]:
    """A root's (or manifest's) ``shape``: ``[H, W, 3]``, whole numbers with each side at most
    ``MAX_SIDE`` (the writer's bound); ShardFormatError naming ``path`` otherwise, before anything is sized
    by it (a JPEG dataset's shards are small whatever H×W the root claims: a reader would allocate H×W×3
    per sample to decode them)."""
    shape = doc["shape"]
    if (not isinstance(shape, list) or len(shape) != 3 or any(type(x) is not int for x in shape)
            or shape[2] != 3):
        raise ShardFormatError(f"{path}: shape {str(shape)[:80]} is not [H, W, 3] (whole numbers)")
    height, width, _ = shape
    if not (0 <= height <= MAX_SIDE and 0 <= width <= MAX_SIDE):
        raise ShardFormatError(f"{path}: shape {shape} has a side outside 0..{MAX_SIDE} (no shardio writes larger "
                               "images): the root was edited or forged, nothing was read")
    return height, width, 3

def root_generation(doc: dict[str, Any], path: str) -> int:
    """A root's (or version 1/2 manifest's) ``generation``: a JSON integer >= 0, 0 where absent (written
    before generations); ShardFormatError naming ``path`` for anything else (``1e400``, ``1.7``, ``"3"``),
    never a bare OverflowError or a silently truncated number."""
    value = doc.get("generation", 0)
    if type(value) is not int or value < 0:
        raise ShardFormatError(f"{path}: \"generation\" is {str(value)[:40]!r}, not a whole number >= 0 (the root "
                               "was edited or forged)")
    return value


_IDENTITY_DIGITS = 32
_DERIVED_IDENTITY = "config:"
_FENCE_DIGITS = 16


def new_dataset_id() -> str:
    """A new dataset's identity (spec, "Identity"): a random UUID4 as 32 lower-case hex digits."""
    return uuid.uuid4().hex


def derived_identity(config_hash: str) -> str:
    """The identity of a dataset whose root has no ``dataset`` (spec, "Identity"): ``config:`` and the
    first 32 hex digits of its config hash."""
    return f"{_DERIVED_IDENTITY}{config_hash[:_IDENTITY_DIGITS]}"


def root_dataset_id(doc: dict[str, Any], path: str) -> str:
    """A root's ``dataset`` (spec, "Identity"): "" where absent; ShardFormatError naming ``path`` for a
    value that is not 32 lower-case hex digits."""
    return _root_hex(doc, path, "dataset", _IDENTITY_DIGITS, "an identity")


def root_name_fence(doc: dict[str, Any], path: str) -> str:
    """A root's ``fence`` (spec, "Fencing names"): "" where absent; ShardFormatError naming ``path`` for a
    value that is not 16 lower-case hex digits."""
    return _root_hex(doc, path, "fence", _FENCE_DIGITS, "a fence")


def root_classes(doc: dict[str, Any], path: str) -> tuple[str, ...]:
    """A root's ``classes`` (spec, "Classes"): () where absent; ShardFormatError naming ``path`` for anything
    but a list of distinct non-empty strings."""
    value = doc.get("classes", [])
    if not isinstance(value, list):
        raise ShardFormatError(f"{path}: \"classes\" is {str(value)[:40]!r}, not a list of class names "
                               "(edited or forged): nothing was read")
    seen: set[str] = set()
    for number, name in enumerate(value):
        if not isinstance(name, str) or not name or name in seen:
            what = ("listed twice (a class has one id)" if name in seen
                    else "not a class name (a non-empty string)")
            raise ShardFormatError(f"{path}: \"classes\"[{number}] is {repr(name)[:40]}, {what} (edited or "
                                   "forged): nothing was read")
        seen.add(name)
    return tuple(value)


def _root_hex(doc: dict[str, Any], path: str, key: str, digits: int, what: str) -> str:
    """An optional root field of exactly ``digits`` lower-case hex digits: "" where absent, else checked."""
    value = doc.get(key, "")
    if value != "" and not (isinstance(value, str) and len(value) == digits
                            and all(c in "0123456789abcdef" for c in value)):
        raise ShardFormatError(f"{path}: \"{key}\" is {str(value)[:40]!r}, not {what} ({digits} lower-case hex "
                               "digits): the root was edited or forged")
    return value


def proves_another_dataset(earlier: str, current: str) -> bool:
    """Whether a state naming identity ``earlier`` cannot come from a dataset whose current root names
    ``current``: they differ and are both drawn, or both derived from a config, or ``earlier`` is drawn
    and ``current`` derived (a dataset draws its identity once and keeps it). A derived ``earlier`` and a
    drawn ``current`` may be one dataset that drew its identity since (its older roots tell)."""
    if earlier == current:
        return False
    return not (earlier.startswith(_DERIVED_IDENTITY) and not current.startswith(_DERIVED_IDENTITY))


def parse_json(data: bytes, path: str) -> Any:
    """``data`` (a root, a manifest) as JSON; ShardFormatError naming ``path`` for bytes that are not
    UTF-8 JSON, or nest deeper than Python's recursion limit (a forged file; the writer nests 4 levels)."""
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ShardFormatError(f"{path}: not valid JSON ({e})") from e
    except RecursionError as e:
        raise ShardFormatError(f"{path}: JSON nested too deeply to read (edited or forged)") from e
