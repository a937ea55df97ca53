"""The local glob matches what ``glob.glob(recursive=True)`` + ``isfile`` matched, with each file's
fingerprint from the listing: the same files, the same sizes and mtimes as ``os.stat``."""

from __future__ import annotations

import glob
import os

import pytest

from preprocess.local_glob import local_glob

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
