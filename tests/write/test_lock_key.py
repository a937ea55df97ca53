"""The one-writer lock is keyed by the dataset's root: however a caller spells the directory (a trailing slash,
``file://``, an opened root), the proof that the lock is held (``check_held``) finds the handle ``writing``
took, and a write made under another spelling is not let through unchecked; a local dataset is keyed by its
absolute path, so a relative and an absolute spelling are one lock."""

from __future__ import annotations

import os

import pytest

from shardio.errors import OutputLocked
from shardio.store.root import open_root
from shardio.write import directory as dataset_dir
from shardio.write import lock


class _Lost:
    """A lock handle whose holder can no longer prove it holds the lock."""

    taken_over = False

    def check(self) -> None:
        raise OutputLocked("lost")


@pytest.mark.parametrize("held_as", ["{d}", "{d}/", "file://{d}"])
def test_every_spelling_of_a_dataset_checks_the_one_handle(tmp_path, held_as):
    directory = str(tmp_path / "ds")
    dataset_dir.ensure_output_dir(directory)
    with dataset_dir.writing(held_as.format(d=directory)):
        assert list(lock._held) == [os.path.abspath(directory)]
        lock._held[os.path.abspath(directory)] = _Lost()
        for spelling in (directory, f"{directory}/", f"file://{directory}", open_root(f"{directory}//")):
            with pytest.raises(OutputLocked):
                dataset_dir.check_held(spelling)
    assert lock._held == {}


def test_a_relative_and_an_absolute_path_are_one_lock(tmp_path, monkeypatch):
    directory = tmp_path / "ds"
    dataset_dir.ensure_output_dir(str(directory))
    monkeypatch.chdir(tmp_path)
    with dataset_dir.writing("ds"):
        assert list(lock._held) == [os.path.abspath(directory)]
        lock._held[os.path.abspath(directory)] = _Lost()
        for spelling in ("ds", "./ds", "ds/", str(directory), f"{tmp_path}/./ds", f"file://{directory}"):
            with pytest.raises(OutputLocked):
                dataset_dir.check_held(spelling)
    assert lock._held == {}
