"""The one-writer lock is keyed by the dataset's root: however a caller spells the directory (a trailing slash,
``file://``, an opened root), the proof that the lock is held (``check_held``) finds the handle ``writing``
took, and a write made under another spelling is not let through unchecked."""

from __future__ import annotations

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
        assert list(lock._held) == [directory]
        lock._held[directory] = _Lost()
        for spelling in (directory, f"{directory}/", f"file://{directory}", open_root(f"{directory}//")):
            with pytest.raises(OutputLocked):
                dataset_dir.check_held(spelling)
    assert lock._held == {}
