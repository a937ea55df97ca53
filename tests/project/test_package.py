"""The package boundaries: shardio imports with numpy + torch alone (xxhash only when a checksum is taken),
and exports what it documents."""

from __future__ import annotations

import subprocess
import sys

import shardio
from tests.dataset_fixtures import make_dataset

# What a reader-only install (`pip install 'shardio @ git+...'`: numpy and torch) does not have.
NOT_IN_A_READER_INSTALL = ("preprocess", "PIL", "ray", "obstore", "boto3", "xxhash", "typer", "click", "rich",
                           "yaml", "webdataset", "pyarrow", "lightning", "pytorch_lightning")

# Makes the modules above unimportable in a fresh interpreter, as if they were not installed.
_BLOCKER = f"""
import importlib.abc, sys
BLOCKED = {NOT_IN_A_READER_INSTALL!r}
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: a reader-only install)", name=name)
        return None
sys.meta_path.insert(0, NotInstalled())
"""


def test_shardio_imports_without_ray_pillow_or_preprocess():
    code = (
        "import sys, shardio\n"
        "from shardio import ShardDataset, open_dataset\n"
        # the writer side too: the dataset directory, storage, the run report and `shardio info`
        "import shardio.write.directory, shardio.store.backends, shardio.format.run_report, shardio.tools.info\n"
        "import shardio.write.shard_writer\n"
        # xxhash too: it checks xxh3_128 checksums only when one is taken (verify, a download, the writer)
        "bad = [m for m in ('PIL', 'ray', 'yaml', 'typer', 'rich', 'webdataset', 'preprocess', 'xxhash')\n"
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


def test_a_reader_only_install_reads_a_dataset_with_numpy_and_torch_alone(tmp_path):
    """What a training image installs (numpy + torch): open, shuffle, batch, normalise and check sizes; a
    checksum verification needs xxhash and says how to install it."""
    directory = str(tmp_path / "ds")
    make_dataset(directory)  # 117 self-identifying samples, 15 shards (written here, with xxhash)
    code = _BLOCKER + f"""
import sys
import torch
from shardio import DeviceLoader, ShardDataset, open_dataset
from shardio.errors import MissingExtra
snapshot = open_dataset({directory!r})
assert len(snapshot) == 117, len(snapshot)
seen = []
for batch in DeviceLoader(ShardDataset({directory!r}, 16, shuffle=True, seed=0, drop_last=False), "cpu"):
    assert batch["image"].dtype == torch.float32 and batch["image"].shape[1:] == (3, 8, 8)
    seen += batch["cls"].tolist()
assert sorted(seen) == list(range(117)), sorted(seen)
try:
    open_dataset({directory!r}, verify=True)
except MissingExtra as e:
    assert "pip install xxhash" in str(e), e
else:
    raise AssertionError("verify=True without xxhash did not say what to install")
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {NOT_IN_A_READER_INSTALL!r})
assert not loaded, loaded
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_shardio_command_without_the_cli_extra_says_what_to_install():
    """typer is the `cli` extra, not core: on a reader-only install the command names the extra in one
    line and exits 2, as the console script runs it (its module once failed to import: two tracebacks)."""
    code = _BLOCKER + """
from shardio.errors import MissingExtra
try:
    import shardio.tools.commands
except MissingExtra as e:
    assert "pip install 'shardio[cli]'" in str(e), e
else:
    raise AssertionError("shardio.tools.commands imported without typer")
from shardio.tools.cli import main  # what the `shardio` console script does
raise SystemExit(main())
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the `shardio` command needs the cli extra"), lines
    assert "pip install 'shardio[cli]'" in lines[0]
