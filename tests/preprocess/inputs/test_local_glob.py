"""The local glob matches what ``glob.glob(recursive=True)`` + ``isfile`` matched, with each file's
fingerprint from the listing: the same files, the same sizes and mtimes as ``os.stat``."""

from __future__ import annotations

import glob
import os

import pytest

from preprocess.inputs.local_glob import local_glob

PATTERNS = ["*.tar", "*", "?.tar", "[ab].tar", "[!a]*.tar", "**/*.tar", "**", "*/*.tar", "sub/**/*.tar",
            "**/deep/*.tar", ".*", ".hidden/*.tar", "*/.x.tar", "sub/*/", "link*/*.tar", "sub/*/z.tar",
            "sub/deep/z.tar*", "nothing/*.tar", "a.tar/*", "**/*", "*.t?r", "sub/[d]eep/*"]


@pytest.fixture
def tree(tmp_path):
    files = ["a.tar", "b.tar", "c.tar.gz", "stats.json", ".x.tar", "sub/a.tar", "sub/.x.tar",
             "sub/deep/z.tar", "sub/deep/more/y.tar", ".hidden/h.tar", "sub/deep/notes.txt"]
    for number, name in enumerate(files):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * (number + 1))
    (tmp_path / "folder.tar").mkdir()  # a folder named like a tar: never a file
    os.symlink(tmp_path / "a.tar", tmp_path / "link-file.tar")
    os.symlink(tmp_path / "sub", tmp_path / "linkdir")
    os.symlink(tmp_path / "gone.tar", tmp_path / "dangling.tar")
    return tmp_path


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_same_files_as_glob_with_their_stat(tree, pattern, monkeypatch):
    for absolute in (True, False):
        monkeypatch.chdir(tree if not absolute else "/")
        full = str(tree / pattern) if absolute else pattern
        expected = sorted(os.path.abspath(m) for m in glob.glob(full, recursive=True) if os.path.isfile(m))
        found = list(local_glob(full))
        assert sorted(f.path for f in found) == expected, full
        for file in found:
            info = os.stat(file.path)
            assert (file.size, file.mtime_ns) == (info.st_size, info.st_mtime_ns)
            assert file.symlink == os.path.islink(file.path)


@pytest.mark.parametrize("pattern", [*PATTERNS, "*/", "**/", "sub/**"])
def test_with_folders_the_folders_glob_matches_too_below_its_base(tree, pattern, monkeypatch):
    """``folders=True`` (a glob over image folders): the folders ``glob`` matches are yielded as well, flagged,
    except the pattern's own base (``DIR/**`` matches DIR itself in ``glob``: never a folder input)."""
    monkeypatch.chdir(tree)
    base = os.path.abspath(pattern.split("*", 1)[0].rsplit("/", 1)[0] if "/" in pattern.split("*", 1)[0] else ".")
    matches = {os.path.abspath(m) for m in glob.glob(pattern, recursive=True)}
    expected = sorted(m for m in matches if (os.path.isfile(m) or os.path.isdir(m)) and m != base)
    found = list(local_glob(pattern, folders=True))
    assert sorted(f.path for f in found) == expected, pattern
    assert all(f.folder == os.path.isdir(f.path) for f in found)
