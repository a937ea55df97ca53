"""What `preprocess run` takes as input and where it may write (issue 11, items 1, 3 and 15): a glob or
brace range that matches nothing, and a --prune of most of the dataset, are refused before anything is
touched; a glob takes only tars; --output that is a file or not writable is a usage error; every file a
run writes is readable by another user (the trainer), as the umask says."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
from typer.testing import CliRunner

from preprocess.cli import app
from preprocess.config import JobConfig
from preprocess.inputs.resolve import resolve_inputs
from shardio.errors import NoInputsMatched, UnsupportedInput
from shardio.store.backends import for_path
from shardio.format import InputEntry, Manifest
from shardio.format.manifests import load_manifest
from shardio.write.shard_writer import write_manifest
from tests.dataset_fixtures import make_dataset

runner = CliRunner()
CONFIG = JobConfig(height=16, width=16, samples_per_shard=8)
FLAGS = ["--size", "16", "--samples-per-shard", "8"]
NOBODY = 65534


def directory_state(directory: str) -> dict[str, bytes]:
    state = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            state[os.path.relpath(path, directory)] = open(path, "rb").read()
    return state


def committed(tars, out: str, samples: dict[str, int]) -> list[str]:
    """A dataset (the run's config) whose inputs ``name -> samples`` are committed tars, with real shards
    of ``samples`` 16×16 samples each: a rerun over them has nothing to process (no Ray)."""
    sizes = tuple(samples.values())
    make_dataset(out, inputs=sizes, height=16, width=16)
    written = load_manifest(out)
    paths = [tars.make(name, range(1)) for name in samples]
    rename = {f"input-{number}.tar": path for number, path in enumerate(paths)}
    manifest = Manifest(shape=(16, 16, 3), config=CONFIG.output_dict(), versions={}, generation=written.generation)
    for entry in written.shards:
        manifest.shards.append(dataclasses.replace(entry, input=rename[entry.input]))
    for old, entry in written.inputs.items():
        size, mtime_ns = for_path(rename[old]).stat_fingerprint(rename[old])
        manifest.inputs[rename[old]] = InputEntry(size=size, mtime_ns=mtime_ns, samples=entry.samples,
                                                  failed=0, shards=entry.shards)
    write_manifest(out, manifest)
    return paths


@pytest.mark.parametrize("pattern", ["/missing/*.tar", "/missing/{000..005}.tar", "{tars}/*.json"])
def test_a_pattern_that_matches_no_tar_is_a_usage_error_and_touches_nothing(tars, tmp_path, pattern):
    out = str(tmp_path / "out")
    committed(tars, out, {"a.tar": 9, "b.tar": 5})
    open(os.path.join(tars.directory, "_stats.json"), "w").write("{}")
    before = directory_state(out)
    result = runner.invoke(app, ["run", pattern.replace("{tars}", tars.directory), "--output", out, "--prune",
                                 "--confirm-large-prune", *FLAGS])
    message = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "matched no input" in message and "nothing was read, written or pruned" in message
    assert directory_state(out) == before, "the dataset (or its reports) changed"


def test_a_prune_of_most_of_the_dataset_needs_confirmation(tars, tmp_path):
    out = str(tmp_path / "out")
    a, b, c, d = committed(tars, out, {"a.tar": 40, "b.tar": 2, "c.tar": 2, "d.tar": 2})
    # A small prune needs no confirmation: d.tar is 1 of 4 inputs, 2 of 46 samples.
    assert runner.invoke(app, ["run", a, b, c, "--output", out, "--prune", *FLAGS, "-q"]).exit_code == 0
    assert list(load_manifest(out).inputs) == [a, b, c]
    before = directory_state(out)
    for keep, numbers in (([b, c], "1 of 3 committed inputs (40 of 44 samples)"),
                          ([a], "2 of 3 committed inputs (4 of 44 samples)")):
        result = runner.invoke(app, ["run", *keep, "--output", out, "--prune", *FLAGS])
        message = " ".join(result.output.split())
        assert result.exit_code == 2, result.output
        assert f"would drop {numbers}" in message and "--confirm-large-prune" in message
        assert directory_state(out) == before
    report = str(tmp_path / "r.json")
    result = runner.invoke(app, ["run", a, "--output", out, "--prune", "--confirm-large-prune", "-q",
                                 "--report", report, *FLAGS])
    assert result.exit_code == 0, result.output
    assert sorted(json.load(open(report))["inputs_pruned"]) == [b, c]
    assert list(load_manifest(out).inputs) == [a]


def test_the_glob_rule(tars, tmp_path):
    a, b = tars.make("a.tar", range(1)), tars.make("b.tar.gz", range(1))
    stats, parquet = tars.path("a_stats.json"), tars.path("a.parquet")
    for path in (stats, parquet):
        open(path, "w").write("{}")
    resolved = resolve_inputs([f"{tars.directory}/*"])
    assert resolved.paths == [a, b] and resolved.ignored == [parquet, stats] and resolved.failed == []
    # Named explicitly, a file no input source reads is refused (test_an_input_no_source_reads_...); a
    # .parquet is taken at its name's word, as a .tar is (a broken one fails as an input).
    with pytest.raises(UnsupportedInput, match="a_stats.json: JSON text, not an input preprocess reads"):
        resolve_inputs([stats])
    assert resolve_inputs([parquet]).paths == [parquet]
    # A brace range with holes: the holes are failed inputs; with nothing at all, a usage error.
    holes = resolve_inputs([f"{tars.directory}/{{a,c}}.tar"])
    assert holes.paths == [a] and [f["reason"] for f in holes.failed] == ["no such file"]
    with pytest.raises(NoInputsMatched, match=r"only 1 other file\(s\)"):
        resolve_inputs([f"{tars.directory}/*.json"])
    # A glob takes another kind than tars only where its own name says that kind.
    spelled = resolve_inputs([f"{tars.directory}/*.{{json,parquet}}"])
    assert spelled.paths == [parquet] and spelled.ignored == [stats]
    # A plain missing path stays a failed input (exit 1), as before.
    assert resolve_inputs([str(tmp_path / "missing.tar")]).failed[0]["reason"] == "no such file"


@pytest.mark.ray
@pytest.mark.parametrize("given", ["a folder", "missing paths"])
def test_a_run_with_no_usable_input_says_why_under_q_and_creates_no_dataset(tars, tmp_path, given):
    tars.make("a.tar", range(1))
    args = [tars.directory] if given == "a folder" else [str(tmp_path / "gone.tar"), str(tmp_path / "gone2.tar")]
    out = tmp_path / "out"
    result = runner.invoke(app, ["run", *args, "--output", str(out), *FLAGS, "-q"])
    message = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    expected = (f"{tars.directory}: is a folder with no image file named .jpg, .jpeg, .png or .webp "
                "(image_extensions); for the tar files in it, pass DIR/*.tar" if given == "a folder"
                else f"{tmp_path / 'gone.tar'}: no such file; {tmp_path / 'gone2.tar'}: no such file")
    assert expected in message and "nothing was read or written" in message, message
    assert not out.exists(), "a dataset (or the output directory) was created for a run that did nothing"


def test_a_run_with_no_usable_input_leaves_an_existing_dataset_untouched(tars, tmp_path):
    out = str(tmp_path / "out")
    committed(tars, out, {"a.tar": 9, "b.tar": 5})
    before = directory_state(out)
    result = runner.invoke(app, ["run", tars.directory, "--output", out, "--prune", "--confirm-large-prune",
                                 *FLAGS, "-q"])
    assert result.exit_code == 2 and "is a folder with no image file" in " ".join(result.output.split()), result.output
    assert directory_state(out) == before, "the dataset (or its reports) changed"


@pytest.mark.parametrize("where", ["the input folder", "a parent of it", "a link to it"])
def test_an_output_that_holds_the_input_tars_is_refused_and_nothing_is_written(tars, tmp_path, where):
    tars.make("a.tar", range(1))
    out = {"the input folder": tars.directory, "a parent of it": str(tmp_path)}.get(where)
    if where == "a link to it":
        out = str(tmp_path / "link")
        os.symlink(tars.directory, out)
    before = directory_state(str(tmp_path))
    result = runner.invoke(app, ["run", f"{tars.directory}/*.tar", "--output", out, *FLAGS, "-q"])
    message = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert f"{out}: --output holds input {tars.made[0]}" in message and "nothing was written" in message, message
    assert directory_state(str(tmp_path)) == before, "the run wrote beside the tars"


def test_an_output_inside_the_input_folder_is_its_own_directory(ray_cluster, tars, tmp_path):
    tars.make("a.tar", range(3))
    out = os.path.join(tars.directory, "shards-16")
    first = runner.invoke(app, ["run", f"{tars.directory}/*", "--output", out, *FLAGS, "-q"])
    assert first.exit_code == 0, first.output
    again = runner.invoke(app, ["run", f"{tars.directory}/*", "--output", out, "-q"])  # its files are no input
    assert again.exit_code == 0, again.output
    assert sorted(os.listdir(tars.directory)) == ["a.tar", "shards-16"]


def test_a_glob_over_an_img2dataset_folder_takes_the_tars_and_counts_the_rest(ray_cluster, tars, tmp_path):
    tars.make("00000.tar", range(0, 3))
    tars.make("00001.tar", range(3, 5))
    for name in ("00000_stats.json", "00001_stats.json", "00000.parquet"):
        open(tars.path(name), "w").write("{}")
    out, report = str(tmp_path / "out"), str(tmp_path / "r.json")
    result = runner.invoke(app, ["run", f"{tars.directory}/*", "--output", out, "--report", report, *FLAGS])
    assert result.exit_code == 0, result.output
    doc = json.load(open(report))
    assert doc["inputs_failed"] == [] and len(doc["inputs_processed"]) == 2
    assert sorted(map(os.path.basename, doc["inputs_ignored"])) == ["00000.parquet", "00000_stats.json",
                                                                    "00001_stats.json"]
    assert "ignored 3 non-tar file(s)" in " ".join(result.output.split())
    # Named explicitly, the .parquet is read as one, and this one fails as an input (it holds no Parquet).
    named = runner.invoke(app, ["run", tars.path("00000.parquet"), "--output", out, *FLAGS, "-q"])
    assert named.exit_code == 1 and "not a readable Parquet file" in " ".join(named.output.split()), named.output


def test_output_that_is_a_file_is_a_usage_error(tars, tmp_path):
    tar = tars.make("a.tar", range(1))
    target = tmp_path / "file"
    target.write_text("not a directory")
    result = runner.invoke(app, ["run", tar, "--output", str(target), *FLAGS])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "is an existing file" in " ".join(result.output.split())
    assert target.read_text() == "not a directory"


def as_user(uid: int, work: Callable[[], Any]) -> Any:
    """Run ``work`` in a forked child with uid/gid ``uid`` (tests run as root); returns its JSON result."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            result = work()
            os.write(write_end, json.dumps(result).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child failed"
    return json.loads(data)


@pytest.fixture
def shared_dir():
    """A directory every user may traverse (pytest's tmp_path is 0700)."""
    directory = tempfile.mkdtemp(prefix="shardio-perm-")
    os.chmod(directory, 0o755)
    yield directory
    shutil.rmtree(directory)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
def test_output_not_writable_by_this_user_is_a_usage_error(shared_dir):
    tar = os.path.join(shared_dir, "a.tar")
    open(tar, "wb").close()
    os.chmod(tar, 0o644)
    existing = os.path.join(shared_dir, "root-owned")
    os.mkdir(existing, 0o755)

    def run_as_nobody() -> list[list[Any]]:
        results = []
        for out in (existing, os.path.join(existing, "new")):
            result = runner.invoke(app, ["run", tar, "--output", out, *FLAGS])
            results.append([result.exit_code, isinstance(result.exception, SystemExit), result.output])
        return results

    for exit_code, clean_exit, output in as_user(NOBODY, run_as_nobody):
        assert exit_code == 2 and clean_exit, output
        message = " ".join(output.split())
        assert "--output" in message and ("not writable" in message or "cannot be created" in message), output
    assert os.listdir(existing) == []


@pytest.mark.ray
@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
def test_every_file_of_a_dataset_is_readable_by_another_user(ray_cluster, tars, tmp_path, shared_dir):
    a = tars.make("a.tar", range(0, 10))
    tars.make("b.tar", range(10, 13))
    out, report = os.path.join(shared_dir, "out"), os.path.join(shared_dir, "run.json")
    previous = os.umask(0o022)
    try:
        assert runner.invoke(app, ["run", f"{tars.directory}/*.tar", "--output", out, *FLAGS, "-q"]).exit_code == 0
        tars.make("a.tar", range(20, 22))  # replaced: a second generation, with retired files
        os.utime(a, ns=(1_800_000_000_000_000_000,) * 2)
        result = runner.invoke(app, ["run", a, "--output", out, "--report", report, *FLAGS, "-q"])
        assert result.exit_code == 0, result.output
    finally:
        os.umask(previous)
    files = [os.path.join(root, name) for root, _, names in os.walk(out) for name in names] + [report]
    kinds = {os.path.relpath(os.path.dirname(f), out).split("/")[0] for f in files}
    assert {"shards", "manifests", "reports", "."} <= kinds, kinds
    assert len(load_manifest(out).retired) == 4
    modes = {os.path.relpath(f, shared_dir): oct(os.stat(f).st_mode & 0o777) for f in files}
    assert set(modes.values()) == {"0o644"}, modes

    def read_everything() -> list[str]:
        problems = []
        for path in files:
            try:
                with open(path, "rb") as f:
                    f.read(1)
            except OSError as e:
                problems.append(f"{path}: {e}")
        return problems

    assert as_user(NOBODY, read_everything) == []


def test_a_url_is_never_turned_into_a_local_path(ray_cluster, s3_bucket, tars, tmp_path, monkeypatch):
    # typer's Path collapsed "s3://bucket/shards" to "s3:/bucket/shards": `run` exited 0 after writing a local
    # folder ./s3:/bucket/shards. A URL goes to the object store; a scheme no backend serves is a usage error
    # that creates nothing.
    tars.make("a.tar", range(2))
    monkeypatch.chdir(tmp_path)
    url = f"s3://{s3_bucket}/shards"
    for args in (["run", tars.made[0], "--output", url, "--ray-address", ray_cluster, "-q"], ["verify", url],
                 ["gc", url]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, (args, result.output)
    for args in (["run", tars.made[0], "--output", "hdfs://bucket/shards"], ["verify", "hdfs://bucket/shards"],
                 ["gc", "hdfs://bucket/shards"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, result.output
        assert "hdfs://bucket/shards" in result.output and "not supported" in result.output
    assert not any(name.startswith(("s3:", "hdfs:")) for name in os.listdir(tmp_path)), "a local folder for a URL"


def test_a_jpeg_run_over_a_raw_dataset_names_both_encodings(tars, tmp_path):
    """A raw dataset stores no encoding key; the refusal once read "encoding: dataset has None"."""
    out = str(tmp_path / "out")
    paths = committed(tars, out, {"a.tar": 3})
    before = directory_state(out)
    result = runner.invoke(app, ["run", *paths, "--output", out, "--encoding", "jpeg", "-q"])
    message = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "encoding: dataset has 'raw', this run 'jpeg'" in message, message
    assert "None" not in message and "quality" not in message, message
    after = directory_state(out)
    after.pop(".lock", None)  # the check is made under the output's lock (an empty file)
    assert after == before


@pytest.mark.parametrize("name, content, looks", [
    ("notes.txt", b"remember to buy milk\n", "text"),
    ("photos.zip", b"PK\x03\x04" + bytes(range(200)), "a zip archive"),
    ("empty", b"", "an empty file"),
])
def test_an_input_no_source_reads_is_refused_before_anything_is_touched(tars, tmp_path, name, content, looks):
    """It once started Ray, printed tarfile's internals ("method gz: ReadError('not a gzip file')"), exited
    1 and committed an empty dataset; beside a good tar too, the run is refused: a mistyped INPUT."""
    good = tars.make("a.tar", range(2))
    bad = tars.path(name)
    open(bad, "wb").write(content)
    out = tmp_path / "out"
    for args in ([bad], [good, bad]):
        result = runner.invoke(app, ["run", *args, "--output", str(out), *FLAGS, "-q"])
        message = " ".join(result.output.split())
        assert result.exit_code == 2, result.output
        assert f"{bad}: {looks}, not an input preprocess reads" in message, message
        assert "INPUT takes: a tar archive of samples" in message and ".tar.gz" in message, message
        assert "nothing was read or written" in message and "Traceback" not in result.output
        assert not out.exists(), "the output was created for a run that could not read its input"


def test_a_tar_whose_name_says_nothing_is_taken_by_its_content(tars):
    """A name that claims no kind is read, not refused: a tar named ``shard-000`` (or a .tar.gz without its
    suffix) is a tar; a ``.tar`` is taken at its name's word (a broken one fails as an input, exit 1)."""
    tar = tars.make("a.tar", range(2))
    plain, packed = tars.path("shard-000"), tars.path("shard-001")
    os.replace(tar, plain)
    import gzip

    open(packed, "wb").write(gzip.compress(open(plain, "rb").read()))
    not_a_tar = tars.path("x.tar")
    open(not_a_tar, "wb").write(b"hello")
    assert resolve_inputs([plain, packed, not_a_tar]).paths == sorted([plain, packed, not_a_tar])
