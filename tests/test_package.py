"""The package boundaries: shardio imports with numpy + torch alone (xxhash only when a checksum is taken),
and exports what it documents."""

from __future__ import annotations

import subprocess
import sys

import shardio


def test_shardio_imports_without_ray_pillow_or_preprocess():
    code = (
        "import sys, shardio\n"
        "from shardio import ShardDataset, open_dataset\n"
        # the writer side too: the dataset directory, storage, the run report and `shardio info`
        "import shardio.directory, shardio.storage, shardio.run_report, shardio.info, shardio.writer\n"
        # xxhash too: it checks xxh3_128 checksums only when one is taken (verify, a download, the writer)
        "bad = [m for m in ('PIL', 'ray', 'yaml', 'typer', 'webdataset', 'preprocess', 'xxhash')\n"
        "       if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_preprocessing_workers_do_not_import_torch():
    code = "import sys, preprocess.worker\nassert 'torch' not in sys.modules\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_exported_members_exist():
    for name in shardio.__all__:
        assert getattr(shardio, name) is not None, name
