"""A run's folder classes (``folder_classes: true``): the class names its folder inputs bring, the inputs
that bring none, and the dataset's class table extended with the new names before any task starts.

One id per class name in the whole dataset (``shardio.format.spec``, "Classes"): numbering each folder's
own sub-folders, as torchvision's ``ImageFolder`` does, gave ``dog`` id 1 in a drop holding ``cat/`` and
``dog/`` and id 0 in the next drop holding only ``dog/``, and drops named as separate inputs are what
incremental runs ask for. So the driver learns the names from the listing it took every folder's
fingerprint with (``ResolvedInputs.classes``: no second walk or LIST), appends the ones the committed
table lacks (``EditableIndex.add_classes``: sorted, so a run killed and rerun numbers them alike) and
gives every task the whole table (``preprocess.inputs.kinds.KindReader``). Names are learnt from every folder
input of the run, skipped ones too (they are listed anyway). A skipped input's names are in the table
already, unless its dataset was written before it kept one: those names then enter first, sorted, so a
dataset of one such folder (its samples numbered by its own sorted sub-folders) keeps its ids, and the
names of the inputs processed follow.

Class folders named as the inputs themselves (``preprocess run data/folder/*``): each input's images sit
at its top level, where the first folder level (the class) is missing, so every sample would have no
class. Such an input (a folder holding no sub-folder at all) is a failed input, named in the report with
the fix, before anything starts; a run left with no input is refused and writes nothing. Reading the
input folder's own name as the class instead was rejected: the same folder would then mean its name in
one run and its sub-folders in the next, once one appears. An image beside the class folders of a folder
that has them is a failed sample (``no_class``), counted, never a sample with ``cls`` -1.
"""

from __future__ import annotations

import os

from preprocess.inputs.resolve import InputFingerprint, ResolvedInputs
from shardio.format import escape_name
from shardio.write.editable_index import EditableIndex

__all__ = ["folder_class_names", "extend_class_table", "NO_CLASS_FOLDER"]

NO_CLASS_FOLDER = ("folder_classes is true but its images are not in class sub-folders (the first folder "
                   "level names the class), so none would have a class")


def folder_class_names(resolved: ResolvedInputs) -> dict[str, set[str]]:
    """Folder input -> its class names (escaped as sample keys are), from the listings; each folder input
    with no sub-folder is taken out of ``resolved`` (paths, folders) into its ``failed``, with the fix."""
    names: dict[str, set[str]] = {}
    refused = []
    for folder in sorted(resolved.folders):
        found = resolved.classes[folder]  # every folder input's, from its listing (preprocess.inputs.resolve)
        if not found:
            refused.append(folder)
        else:
            names[folder] = {escape_name(name) for name in found}
    for folder in refused:
        parent = os.path.dirname(folder.rstrip("/")) or folder
        reason = (f"{NO_CLASS_FOLDER}: give the folder that holds the class folders ({parent}) as the INPUT, "
                  "not each class folder")
        resolved.failed.append({"input": folder, "reason": reason})
        resolved.folders.discard(folder)
    if refused:
        gone = set(refused)
        resolved.paths = [path for path in resolved.paths if path not in gone]
    return names


def extend_class_table(index: EditableIndex, names: dict[str, set[str]],
                       todo: list[tuple[str, InputFingerprint]]) -> dict[str, int]:
    """The dataset's class table with the run's new names appended (the module docstring's order: a skipped
    input's missing names first, then the others; each group sorted); returns it as name -> id."""
    processed = {path for path, _ in todo}
    index.add_classes({name for folder, found in names.items() if folder not in processed for name in found})
    return index.add_classes({name for found in names.values() for name in found})
