"""Google Cloud Storage and Azure Blob beside S3, against each cloud's emulator (fake-gcs-server, Azurite)
and SeaweedFS: the commit's two preconditions proven on the store itself (create-if-absent,
replace-if-unchanged), a store that ignores either refused before anything is written, the errors a user
meets (wrong key, missing container, nothing at the endpoint), and the reader with a bounded cache.

fake-gcs-server does not serve GCS's XML object upload (``PUT /BUCKET/NAME``), the request obstore makes
for every write, and its JSON media upload ignores ``ifGenerationMatch=0``: a commit there is refused
(``UnsupportedStore``), and GCS datasets are seeded through the JSON API to test reading.
"""

from __future__ import annotations

import http.server
import json
import os
import threading

import pytest
import torch

from shardio import errors
from shardio.read.dataset import ShardDataset
from shardio.store.backends import for_path
from shardio.write import directory as dataset_dir
from shardio.format import Manifest
from tests.dataset_fixtures import indices, make_dataset


class IgnoringPreconditions:
    """obstore with ``put``'s precondition dropped (``create``, or a conditional replace): a store that
    accepts every PUT, as some S3-compatible servers and emulators do."""

    def __init__(self, real, ignore: str) -> None:
        self._real, self._ignore = real, ignore
        self.exceptions = real.exceptions

    def put(self, store, key, data, mode="overwrite", **kwargs):
        ignored = (mode == "create") if self._ignore == "create" else isinstance(mode, dict)
        return self._real.put(store, key, data, mode="overwrite" if ignored else mode, **kwargs)

    def __getattr__(self, name):
        return getattr(self._real, name)


def test_create_if_absent_and_replace_if_unchanged_are_enforced(writable_cloud_bucket):
    bucket = writable_cloud_bucket
    store = for_path(bucket.url())
    path = bucket.url("ds/manifests/0000000001.json")
    version = store.publish_new(path, b"first")
    assert version
    with pytest.raises(FileExistsError):
        store.publish_new(path, b"second")  # the store refused the second create
    assert store.publish_new(path, b"first") == version  # a retried create that had landed: success
    assert store.read_versioned(path) == (b"first", version)
    newer = store.publish(path, b"third", if_version=version)
    with pytest.raises(errors.CommitConflict, match="changed since this run read it"):
        store.publish(path, b"stale", if_version=version)  # the store refused the stale replace
    assert store.read_versioned(path) == (b"third", newer)
    store.check_conditional_writes(bucket.url("ds"))  # the probe passes, and leaves nothing behind
    assert bucket.keys("ds") == ["manifests/0000000001.json"]


@pytest.mark.parametrize("size", [0, 1, 16 << 20, (16 << 20) + 1, 40 << 20])
def test_an_upload_of_any_size_reads_back_whole(writable_cloud_bucket, tmp_path, size):
    """A file is uploaded from its mapped pages: empty, one byte, one part exactly, one byte over (multipart)."""
    local = tmp_path / "shard.npy"
    data = os.urandom(size)
    local.write_bytes(data)
    url = writable_cloud_bucket.url("ds/shards/a.npy")
    store = for_path(url)
    assert store.upload(str(local), url)
    assert store.info(url).size == size
    assert store.read_bytes(url) == data
    local.unlink()  # the map is gone: the file goes as any other


@pytest.mark.parametrize("ignore,named", [("create", "create-if-absent"), ("replace", "replace-if-unchanged")])
def test_a_store_ignoring_either_precondition_is_refused_before_anything_is_written(
        writable_cloud_bucket, monkeypatch, ignore, named):
    bucket = writable_cloud_bucket
    store = for_path(bucket.url())
    monkeypatch.setattr(store, "_ob", IgnoringPreconditions(store._ob, ignore))
    with pytest.raises(errors.UnsupportedStore, match=f"ignores conditional writes \\({named}\\)"):
        with dataset_dir.writing(bucket.url("ds")):  # what a run does first
            dataset_dir.commit(bucket.url("ds"), Manifest(shape=(8, 8, 3), config={}, versions={}))
    assert bucket.keys("ds") == []


def test_the_gcs_emulator_does_not_enforce_its_upload_precondition_and_a_commit_there_is_refused(gcs_server):
    bucket = gcs_server.new_bucket()
    # What the emulator does with GCS's own precondition on its JSON media upload: ignores it.
    gcs_server.put_bytes(bucket, "ds/x", b"first", if_generation_match=0)
    gcs_server.put_bytes(bucket, "ds/x", b"second", if_generation_match=0)
    assert gcs_server.get_bytes(bucket, "ds/x") == b"second"
    # obstore's upload (the XML API, with x-goog-if-generation-match) is not served at all: refused, named.
    with pytest.raises(errors.UnsupportedStore) as caught:
        with dataset_dir.writing(f"gs://{bucket}/ds"):
            dataset_dir.commit(f"gs://{bucket}/ds", Manifest(shape=(8, 8, 3), config={}, versions={}))
    message = str(caught.value)
    assert message.startswith(f"gs://{bucket}/ds: {gcs_server.endpoint} does not take Google Cloud Storage's "
                              "object upload")
    assert "HTTP 400 Bad Request)" in message and "nothing was written" in message
    assert gcs_server.list_keys(bucket, "ds/") == ["ds/x"]


def test_azure_errors_name_the_url_the_endpoint_and_a_fix(azure_server, monkeypatch):
    container = azure_server.new_bucket()
    url = f"az://{container}/ds/manifest.json"
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", "AAAA" + azure_server.env()["AZURE_STORAGE_ACCOUNT_KEY"][4:])
    from shardio.store.azure import AzureStorage

    with pytest.raises(errors.StorageAccessError) as caught:
        AzureStorage().info(url)
    message = str(caught.value)
    assert message.startswith(f"{url}: HEAD refused by http://127.0.0.1:{azure_server.port} (AZURE_ENDPOINT): "
                              "HTTP 403")
    assert "HINT: check the credentials (AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY" in message
    monkeypatch.undo()
    with pytest.raises(errors.StorageAccessError, match="does not exist .*az storage container create"):
        AzureStorage().info("az://no-such-container/ds/manifest.json")
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_NAME")
    monkeypatch.delenv("AZURE_ENDPOINT")
    with pytest.raises(errors.StorageAccessError, match="no Azure storage account named on this machine.*HINT: set "
                                                         "AZURE_STORAGE_ACCOUNT_NAME"):
        AzureStorage().info(url)


def test_a_missing_buckets_error_and_its_create_command_name_the_endpoint_they_were_given(writable_cloud_bucket):
    """The endpoint as configured (Azurite's names the account: http://HOST:PORT/devstoreaccount1) in the
    message and in the command that creates the bucket: without it the command targets the cloud itself."""
    server = writable_cloud_bucket.server
    url = f"{server.scheme}://no-such-bucket-here/ds/manifest.json"
    with pytest.raises(errors.StorageAccessError) as caught:
        for_path(url).info(url)
    message = str(caught.value)
    assert f"failed at {server.endpoint} (" in message and "does not exist there" in message, message
    hint = message.split("HINT:", 1)[1]
    assert "no-such-bucket-here" in hint and server.endpoint in hint, message


def test_gcs_errors_name_the_url_the_endpoint_and_a_fix(gcs_server, tmp_path, monkeypatch):
    from shardio.store.gcs import GCSStorage

    key = tmp_path / "key.json"
    key.write_text('{"gcs_base_url": "http://127.0.0.1:9", "disable_oauth": true, "client_email": "", '
                   '"private_key": "", "private_key_id": ""}')
    monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT_PATH", str(key))
    monkeypatch.setattr("shardio.store.gcs.retry_config", lambda: {"max_retries": 0})
    with pytest.raises(errors.StorageUnavailable) as caught:
        GCSStorage().info("gs://bkt/ds/manifest.json")
    message = str(caught.value)
    assert message.startswith("gs://bkt/ds/manifest.json: HEAD failed at http://127.0.0.1:9 (the key file's "
                              "gcs_base_url)")
    assert "HINT: nothing answered at http://127.0.0.1:9" in message
    for name in ("GOOGLE_SERVICE_ACCOUNT_PATH", "GOOGLE_SERVICE_ACCOUNT", "GOOGLE_SERVICE_ACCOUNT_KEY",
                 "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no application default credentials
    monkeypatch.setattr("shardio.store.gcs.socket.getaddrinfo", lambda *a: (_ for _ in ()).throw(OSError()))
    with pytest.raises(errors.StorageAccessError, match="no Google Cloud credentials on this machine.*HINT: run "
                                                         "`gcloud auth application-default login`"):
        GCSStorage().info("gs://bkt/ds/manifest.json")


def test_the_reader_with_a_bounded_cache_reads_every_cloud_as_the_local_copy(cloud_bucket, tmp_path):
    local = str(tmp_path / "local")
    make_dataset(local, inputs=(40, 45, 32), samples_per_shard=8, height=16, width=16)
    remote = cloud_bucket.upload_dir(local)
    shard = max(e.bytes + e.meta_bytes for e in dataset_dir.load_current(local).shards)
    settings = {"shuffle": True, "seed": 3, "shuffle_window": 3, "shuffle_block": 4, "drop_last": False}
    here = list(ShardDataset(local, 8, **settings))
    with pytest.warns(UserWarning, match="more than once an epoch"):  # 5 of 15 shards fit: evictions
        there = ShardDataset(remote, 8, cache_dir=str(tmp_path / "cache"), cache_limit=5 * shard, **settings)
    got = list(there)
    assert len(got) == len(here)
    for a, b in zip(here, got):
        assert torch.equal(a["image"], b["image"]) and a["__key__"] == b["__key__"]
        indices(b)
    stats = there.cache_stats()
    assert 0 < stats["peak_bytes"] <= 5 * shard and stats["evictions"] > 0


@pytest.mark.ray
def test_tars_in_any_cloud_give_the_same_shard_bytes_as_on_disk(ray_cluster, cloud_bucket, tars, tmp_path):
    """The job's inputs from each cloud (globbed by a LIST, read in ranged GETs): the same shards, byte for
    byte, as from local disk; the ETag each was read at is kept for the next run."""
    from preprocess.config import JobConfig
    from preprocess.job import RunOptions, run_job
    from tests.legacy_format import legacy_doc

    config = JobConfig(height=16, width=16, samples_per_shard=4)
    for i, count in enumerate((5, 9, 7)):
        path = tars.make(f"{i:05d}.tar", range(i * 20, i * 20 + count))
        cloud_bucket.server.put_file(cloud_bucket.name, f"in/{i:05d}.tar", path)
    out_disk, out_cloud = str(tmp_path / "from-disk"), str(tmp_path / "from-cloud")
    for inputs, out in ((f"{tars.directory}/*.tar", out_disk), (cloud_bucket.url("in/*.tar"), out_cloud)):
        report = run_job(RunOptions(inputs=[inputs], output=out, config=config))
        assert report.exit_code == 0 and report.samples_written == 21, report.inputs_failed
    on_disk, from_cloud = legacy_doc(out_disk), legacy_doc(out_cloud)
    assert len(on_disk["shards"]) == len(from_cloud["shards"]) == 2 + 3 + 2
    for disk, cloud in zip(on_disk["shards"], from_cloud["shards"]):
        assert os.path.basename(disk["input"]) == os.path.basename(cloud["input"])
        assert (disk["xxh3_128"], disk["samples"]) == (cloud["xxh3_128"], cloud["samples"])  # the same bytes
    entry = from_cloud["inputs"][cloud_bucket.url("in/00001.tar")]
    assert entry["etag"] and entry["samples"] == 9  # the version it was read at, for the next run


def test_verify_streams_the_listing_and_names_a_truncated_and_a_missing_shard(cloud_bucket, tmp_path,
                                                                                monkeypatch):
    """``preprocess verify`` on a bucket: the shards' sizes come from the listing a page at a time (here 4
    objects), never from one list of every file, and every problem is still found."""
    import shardio.store.object_store as object_store
    from preprocess.verify import verify_dataset

    local = str(tmp_path / "local")
    manifest = make_dataset(local, inputs=(40, 45, 32), samples_per_shard=8)
    cut, gone = manifest.shards[3], manifest.shards[11]
    with open(os.path.join(local, cut.path), "r+b") as f:
        f.truncate(cut.bytes - 5)
    os.remove(os.path.join(local, gone.meta_path))
    url = cloud_bucket.upload_dir(local)
    monkeypatch.setattr(object_store, "_LIST_PAGE", 4)

    def whole_listing(*args, **kwargs):
        raise AssertionError("the whole folder listed at once")

    monkeypatch.setattr(object_store.ObjectStorage, "list_files", whole_listing)
    result = verify_dataset(url)
    problems = sorted(bad.problem for bad in result.bad)
    assert problems == sorted([f"{url}/{cut.path}: {cut.bytes - 5} bytes, the manifest says {cut.bytes} "
                               "(truncated or overwritten)",
                               f"{url}/{gone.meta_path}: listed in the manifest but missing"])


GOOGLE_VARIABLES = ("GOOGLE_SERVICE_ACCOUNT_PATH", "GOOGLE_SERVICE_ACCOUNT", "GOOGLE_SERVICE_ACCOUNT_KEY",
                    "GOOGLE_APPLICATION_CREDENTIALS")
SERVICE_ACCOUNT = {"type": "service_account", "client_email": "a@b.iam.gserviceaccount.com",
                   "private_key_id": "1"}


def google_credentials(tmp_path, monkeypatch, variable: str, content: str | bytes | None) -> str:
    """Only ``variable`` set, to a file holding ``content`` (None: no such file; the variable itself when
    it holds a key's JSON); no application default credentials. Returns what the message must name."""
    for name in GOOGLE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    if variable == "GOOGLE_SERVICE_ACCOUNT_KEY":
        monkeypatch.setenv(variable, content)
        return variable
    path = tmp_path / "key.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    monkeypatch.setenv(variable, str(path))
    return str(path)


@pytest.mark.parametrize("variable, content, says", [
    ("GOOGLE_SERVICE_ACCOUNT_PATH", None, "which does not exist"),
    ("GOOGLE_SERVICE_ACCOUNT_PATH", "", "which is empty"),
    ("GOOGLE_SERVICE_ACCOUNT_PATH", "{not json", "which is not JSON"),
    ("GOOGLE_SERVICE_ACCOUNT_PATH", b"\x30\x82\x0a\xff\xfe", "which is not JSON"),  # a .p12 key
    ("GOOGLE_SERVICE_ACCOUNT_PATH", '["a list"]', "which is JSON but not an object"),
    ("GOOGLE_SERVICE_ACCOUNT_PATH", '{"type": "service_account"}', "missing field `private_key`"),
    ("GOOGLE_SERVICE_ACCOUNT_PATH", json.dumps({**SERVICE_ACCOUNT, "private_key": "not a PEM key"}),
     "Error reading pem file"),
    ("GOOGLE_APPLICATION_CREDENTIALS", None, "which does not exist"),
    ("GOOGLE_APPLICATION_CREDENTIALS", '{"client_email": "a@b"}', 'which has no "type" field: expected '
                                                                   '"service_account"'),
    ("GOOGLE_APPLICATION_CREDENTIALS", '{"type": "external_account"}', "\"type\" is 'external_account'"),
    ("GOOGLE_SERVICE_ACCOUNT_KEY", "", "GOOGLE_SERVICE_ACCOUNT_KEY is set but empty; HINT: unset it"),
    ("GOOGLE_SERVICE_ACCOUNT_KEY", "{not json", "GOOGLE_SERVICE_ACCOUNT_KEY (a key's JSON) is not JSON"),
])
def test_an_unusable_google_key_is_a_usage_error_naming_the_variable_and_the_file(tmp_path, monkeypatch,
                                                                                  variable, content, says):
    from shardio.store.gcs import GCSStorage

    named = google_credentials(tmp_path, monkeypatch, variable, content)
    monkeypatch.setattr("shardio.store.gcs.socket.getaddrinfo", lambda *a: (_ for _ in ()).throw(OSError()))
    with pytest.raises(errors.StorageAccessError) as caught:
        GCSStorage().info("gs://unusable-key-bkt/ds/manifest.json")
    message = str(caught.value)
    assert errors.exit_code(caught.value) == 2
    assert message.startswith("gs://unusable-key-bkt: ")
    assert variable in message and named in message and says in message
    assert "HINT:" in message


def test_a_google_key_file_and_a_key_in_the_environment_both_set_are_refused(tmp_path, monkeypatch):
    from shardio.store.gcs import GCSStorage

    google_credentials(tmp_path, monkeypatch, "GOOGLE_SERVICE_ACCOUNT_PATH", json.dumps(SERVICE_ACCOUNT))
    monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT_KEY", json.dumps(SERVICE_ACCOUNT))
    with pytest.raises(errors.StorageAccessError,
                       match="both GOOGLE_SERVICE_ACCOUNT_PATH .* and GOOGLE_SERVICE_ACCOUNT_KEY .* are set; "
                             "HINT: unset one"):
        GCSStorage().is_dir("gs://unusable-key-bkt/ds")


def test_a_reader_meets_an_unusable_google_key_as_the_products_error(tmp_path, monkeypatch):
    google_credentials(tmp_path, monkeypatch, "GOOGLE_SERVICE_ACCOUNT_PATH", None)
    with pytest.raises(errors.StorageAccessError,
                       match="GOOGLE_SERVICE_ACCOUNT_PATH names the key file .*which does not exist"):
        ShardDataset("gs://unusable-key-bkt/ds", batch_size=4)


@pytest.mark.parametrize("variable, value, says", [
    ("AZURE_STORAGE_ACCOUNT_KEY", "not base64!",
     "AZURE_STORAGE_ACCOUNT_KEY is not an account key: not base64"),
    ("AZURE_STORAGE_ACCESS_KEY", "a b c", "AZURE_STORAGE_ACCESS_KEY is not an account key: not base64"),
    ("AZURE_STORAGE_SAS_TOKEN", "%%%", "(AZURE_STORAGE_SAS_TOKEN): Missing component in SAS query pair"),
    ("AZURE_FEDERATED_TOKEN_FILE", "/nonexistent/token",
     "AZURE_FEDERATED_TOKEN_FILE names '/nonexistent/token', which is not a file"),
])
def test_unusable_azure_credentials_are_a_usage_error_naming_the_variable(monkeypatch, variable, value, says):
    from shardio.store.azure import AzureStorage

    for name in ("AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN", "AZURE_CLIENT_SECRET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "acct")
    monkeypatch.setenv("AZURE_ENDPOINT", "http://127.0.0.1:9/acct")
    monkeypatch.setenv(variable, value)
    with pytest.raises(errors.StorageAccessError) as caught:
        AzureStorage().info("az://unusable-key-container/ds/manifest.json")
    assert errors.exit_code(caught.value) == 2
    assert str(caught.value).startswith("az://unusable-key-container: ") and says in str(caught.value)
    if variable != "AZURE_FEDERATED_TOKEN_FILE":
        assert value not in str(caught.value)  # a secret is named, never shown


@pytest.fixture
def token_service():
    """A local OAuth token endpoint that refuses every request as Microsoft's does a wrong client secret."""
    class Refusing(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length", 0)))
            body = b'{"error":"invalid_client","error_description":"AADSTS7000215: Invalid client secret."}'
            self.send_response(400)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join()


def test_a_service_principal_the_token_service_refuses_is_a_usage_error(token_service, monkeypatch):
    from shardio.store.azure import AzureStorage

    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_KEY", raising=False)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "acct")
    monkeypatch.setenv("AZURE_ENDPOINT", "http://127.0.0.1:9/acct")
    for name, value in (("AZURE_CLIENT_ID", "app"), ("AZURE_CLIENT_SECRET", "wrong"),
                        ("AZURE_TENANT_ID", "tenant"), ("AZURE_AUTHORITY_HOST", token_service)):
        monkeypatch.setenv(name, value)
    with pytest.raises(errors.StorageAccessError) as caught:
        AzureStorage().info("az://token-refused-container/ds/manifest.json")
    assert str(caught.value).startswith(
        f"az://token-refused-container/ds/manifest.json: HEAD refused by {token_service} (not the store: a "
        "credential service): HTTP 400 Bad Request (invalid_client); HINT: check the credentials")
