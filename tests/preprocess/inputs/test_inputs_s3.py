"""INPUT URLs on a real S3 server: brace ranges, globs, ``**``, mixed with local paths, by the glob rule;
found by LIST (one per folder), never by a HEAD per tar, each with its fingerprint from the listing."""

from __future__ import annotations

import os

import pytest

from preprocess.inputs.resolve import InputFingerprint, resolve_inputs
from shardio.errors import NoInputsMatched, StorageAccessError, UnsupportedInput
from shardio.store.s3 import S3Storage


@pytest.fixture
def requests(monkeypatch) -> dict[str, int]:
    """Counts of the storage calls that cost requests (LIST, HEAD, GET), made by the code under test."""
    counts = {"list_files": 0, "info": 0, "read_range": 0, "open_read": 0, "download": 0, "is_dir": 0}
    for name in counts:
        real = getattr(S3Storage, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(S3Storage, name, counted)
    return counts


def _put(s3_server, bucket: str, keys: list[str], body: bytes = b"x" * 1000) -> None:
    client = s3_server.client()
    for key in keys:
        client.put_object(Bucket=bucket, Key=key, Body=body)


def test_a_brace_range_over_a_folder_is_one_list_and_no_head(s3_server, s3_bucket, requests):
    _put(s3_server, s3_bucket, [f"laion/{i:05d}.tar" for i in range(30)] + ["laion/_stats.json", "other/1.tar"])
    resolved = resolve_inputs([f"s3://{s3_bucket}/laion/{{00000..00029}}.tar"])
    assert resolved.paths == [f"s3://{s3_bucket}/laion/{i:05d}.tar" for i in range(30)]
    assert resolved.failed == [] and resolved.ignored == []
    assert requests["list_files"] == 1 and requests["info"] == 0
    head = S3Storage().info(resolved.paths[0])
    assert resolved.listed[resolved.paths[0]] == InputFingerprint(1000, head.mtime_ns, head.version)
    assert head.version  # the ETag


def test_globs_take_tars_only_and_star_stays_in_its_folder(s3_server, s3_bucket, requests):
    _put(s3_server, s3_bucket, ["drop/a.tar", "drop/b.tar.gz", "drop/_stats.json", "drop/.hidden.tar",
                                "drop/sub/c.tar", "drop/sub/deeper/d.tar", "dropx/e.tar"])
    url = f"s3://{s3_bucket}"
    resolved = resolve_inputs([f"{url}/drop/*.tar*"])
    assert resolved.paths == [f"{url}/drop/a.tar", f"{url}/drop/b.tar.gz"]
    assert resolved.ignored == [] and requests["list_files"] == 1
    flat = resolve_inputs([f"{url}/drop/*"])
    assert flat.ignored == [f"{url}/drop/_stats.json"]  # counted, not a failed input
    deep = resolve_inputs([f"{url}/drop/**/*.tar"])  # "**/" matches no folder too, as glob's does
    assert deep.paths == [f"{url}/drop/a.tar", f"{url}/drop/sub/c.tar", f"{url}/drop/sub/deeper/d.tar"]
    one_level = resolve_inputs([f"{url}/drop/*/*.tar"])
    assert one_level.paths == [f"{url}/drop/sub/c.tar"]
    assert all(path in deep.listed for path in deep.paths)
    assert requests["info"] == 0


def test_local_and_remote_inputs_mix_and_a_url_stays_a_url(s3_server, s3_bucket, tars):
    local = tars.make("local.tar", range(2))
    _put(s3_server, s3_bucket, ["x/remote.tar"])
    resolved = resolve_inputs([f"s3://{s3_bucket}/x/remote.tar", f"{tars.directory}/*.tar"])
    assert resolved.paths == sorted([local, f"s3://{s3_bucket}/x/remote.tar"])
    remote = f"s3://{s3_bucket}/x/remote.tar"
    assert sorted(resolved.listed) == resolved.paths  # each with its fingerprint from its listing
    assert resolved.listed[remote].etag and not resolved.listed[local].etag
    assert resolved.listed[local] == (os.stat(local).st_size, os.stat(local).st_mtime_ns, "")


def test_the_glob_rule_holds_for_urls(s3_server, s3_bucket):
    _put(s3_server, s3_bucket, ["laion/00000.tar", "laion/00002.tar", "laion/_stats.json"])
    url = f"s3://{s3_bucket}/laion"
    with pytest.raises(NoInputsMatched, match="matched no input .only 1 other file"):
        resolve_inputs([f"{url}/*.json"])
    with pytest.raises(NoInputsMatched, match="matched no input"):
        resolve_inputs([f"s3://{s3_bucket}/empty/*.tar"])  # an unmounted drop never looks empty
    with pytest.raises(NoInputsMatched, match="glob in the bucket name"):
        resolve_inputs(["s3://bu*cket/x.tar"])
    partial = resolve_inputs([f"{url}/{{00000..00002}}.tar"])  # a member of a range that matched others
    assert partial.paths == [f"{url}/00000.tar", f"{url}/00002.tar"]
    assert partial.failed == [{"input": f"{url}/00001.tar", "reason": "no such object"}]
    named = resolve_inputs([f"{url}/missing.tar", url])  # named explicitly: a failed input, exit 1
    assert named.paths == [] and named.failed == [
        {"input": f"{url}/missing.tar", "reason": "no such object"},
        {"input": url, "reason": "is a folder with no image file named .jpg, .jpeg, .png or .webp "
                                 "(image_extensions); for the tar files in it, pass FOLDER/*.tar"},
    ]


def test_a_missing_bucket_is_a_clear_usage_error(s3_server):
    with pytest.raises(StorageAccessError, match="does not exist"):
        resolve_inputs(["s3://no-such-bucket-shardio/laion/*.tar"])


def test_the_cli_refuses_a_url_glob_that_matches_nothing_before_touching_the_output(s3_server, s3_bucket):
    from typer.testing import CliRunner

    from preprocess.cli import app

    _put(s3_server, s3_bucket, ["laion/_stats.json"])
    out = f"s3://{s3_bucket}/out"
    result = CliRunner().invoke(app, ["run", f"s3://{s3_bucket}/laion/*.tar", "--output", out, "-q"])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert f"s3://{s3_bucket}/laion/*.tar: matched no input" in said and "nothing was read, written" in said
    assert s3_server.list_keys(s3_bucket, "out") == []


def test_an_object_no_source_reads_is_refused_after_one_ranged_get(s3_server, s3_bucket, requests, tars):
    """A named object whose name claims no kind is told by its first 512 bytes (one ranged GET); a tar named
    ``shard-000`` is taken, ``notes.txt`` refused before anything is touched; a ``.tar`` costs no GET."""
    client = s3_server.client()
    client.put_object(Bucket=s3_bucket, Key="in/shard-000", Body=open(tars.make("a.tar", range(2)), "rb").read())
    client.put_object(Bucket=s3_bucket, Key="in/b.tar", Body=open(tars.make("b.tar", range(2)), "rb").read())
    _put(s3_server, s3_bucket, ["in/notes.txt"], b"remember to buy milk\n" * 100)
    taken = [f"s3://{s3_bucket}/in/shard-000", f"s3://{s3_bucket}/in/b.tar"]
    assert resolve_inputs(taken).paths == sorted(taken)
    assert requests["read_range"] == 1 and requests["open_read"] == requests["download"] == 0
    with pytest.raises(UnsupportedInput, match=rf"s3://{s3_bucket}/in/notes.txt: text, not an input preprocess"):
        resolve_inputs([*taken, f"s3://{s3_bucket}/in/notes.txt"])
