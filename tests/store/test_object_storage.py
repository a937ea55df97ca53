"""The object-storage backend (``shardio.store.s3``) against a real S3 server: the guarantees the
dataset-directory protocol needs (conditional create, If-Match, atomic upload, listing), the errors a
user meets (wrong credentials, missing bucket, missing extra), and the lease that replaces flock."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time

import pytest
import xxhash

from shardio import errors

from shardio.store import lease

from shardio.store.paths import normalize
from shardio.store.s3 import S3Storage


@pytest.fixture
def store(s3_server) -> S3Storage:
    return S3Storage()  # a fresh client: reads the AWS variables now in the environment


def test_conditional_create_and_if_match_refuse_a_second_writer(store, s3_bucket):
    path = f"s3://{s3_bucket}/ds/manifests/0000000001.json"
    etag = store.publish_new(path, b"first")
    assert etag
    with pytest.raises(FileExistsError):
        store.publish_new(path, b"second")
    assert store.publish_new(path, b"first") == etag  # a retried create that had landed: success
    data, version = store.read_versioned(path)
    assert (data, version) == (b"first", etag)
    newer = store.publish(path, b"third", if_version=etag)
    with pytest.raises(errors.CommitConflict, match="changed since this run read it"):
        store.publish(path, b"stale", if_version=etag)  # another writer's commit is never overwritten
    assert store.read_versioned(path) == (b"third", newer)


def test_listing_info_ranges_and_removal(store, s3_bucket, tmp_path):
    root = f"s3://{s3_bucket}/ds"
    for name, data in [("a.json", b"{}"), ("shards/x.npy", b"0123456789"), ("shards/y.npy", b"abc")]:
        store.publish(store.join(root, name), data)
    assert store.list_dir(root) == ["a.json", "shards"]
    assert store.list_dir(root + "/shards") == ["x.npy", "y.npy"]
    assert store.list_dir(root + "/none") == []
    listed = store.list_files(root, recursive=True)
    assert [(f.path, f.size) for f in listed] == [(f"{root}/a.json", 2), (f"{root}/shards/x.npy", 10),
                                                  (f"{root}/shards/y.npy", 3)]
    assert all(f.version and f.mtime_ns > 0 for f in listed)
    info = store.info(f"{root}/shards/x.npy")
    assert info == listed[1]  # HEAD and LIST agree on size and ETag
    assert store.read_range(f"{root}/shards/x.npy", 3, 4) == b"3456"
    with store.open_read(f"{root}/shards/x.npy") as f:
        f.seek(5)
        assert f.read(3) == b"567"
    assert store.exists(root) and store.is_dir(root) and not store.is_file(root)
    assert store.is_file(f"{root}/a.json") and not store.exists(f"{root}/nothing")
    with pytest.raises(FileNotFoundError):
        store.info(f"{root}/nothing")
    store.remove(f"{root}/a.json")
    store.remove(f"{root}/a.json")  # a missing object is not an error
    assert not store.exists(f"{root}/a.json")


def test_a_large_upload_is_multipart_whole_and_downloads_back(store, s3_bucket, tmp_path):
    local = tmp_path / "big.npy"
    data = os.urandom(40 << 20)  # three 16 MB parts
    local.write_bytes(data)
    url = f"s3://{s3_bucket}/ds/shards/big.npy"
    etag = store.upload(str(local), url)
    assert etag.strip('"').endswith("-3")  # a multipart ETag: parts were uploaded, then completed
    back = tmp_path / "back.npy"
    assert store.download(url, str(back), "xxh3_128") == xxhash.xxh3_128(data).hexdigest()  # hashed on the way
    assert back.read_bytes() == data
    assert store.checksum(url, "xxh3_128") == xxhash.xxh3_128(data).hexdigest()
    assert store.checksum(url, "sha256") == hashlib.sha256(data).hexdigest()  # shards written before xxh3_128


@pytest.mark.parametrize("size", [10, 20 << 20])
def test_an_upload_the_store_refuses_is_an_error_naming_the_url(s3_server, s3_bucket, tmp_path, size,
                                                                monkeypatch):
    local = tmp_path / "shard.npy"
    local.write_bytes(b"x" * size)
    url = f"s3://{s3_bucket}/ds/shards/a.npy"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(errors.StorageAccessError, match=f"^{url}: PUT refused"):
        S3Storage().upload(str(local), url)
    local.write_bytes(b"y")  # the file was let go: written, then uploaded again elsewhere
    assert local.read_bytes() == b"y"


@pytest.mark.parametrize("size", [10, 20 << 20])
def test_a_file_that_cannot_be_mapped_is_uploaded_through_reads(store, s3_bucket, tmp_path, size, monkeypatch):
    import shardio.store.object_store

    def refuse(*args, **kwargs):
        raise OSError(19, "No such device")  # what a filesystem without maps answers

    monkeypatch.setattr(shardio.store.object_store.mmap, "mmap", refuse)
    local = tmp_path / "shard.npy"
    data = os.urandom(size)
    local.write_bytes(data)
    url = f"s3://{s3_bucket}/ds/shards/a.npy"
    store.upload(str(local), url)
    assert store.read_bytes(url) == data


def test_an_upload_failing_while_the_client_holds_its_bytes_raises_that_failure(store, s3_bucket, tmp_path,
                                                                                monkeypatch):
    """The file's map cannot close while the client still holds part of it (a request failed mid-way): the
    upload's own error is raised, not the map's."""
    held = []

    class Holding:
        def __init__(self, real):
            self.real = real

        def put(self, store, key, data, **kwargs):
            held.append(memoryview(data)[:10])
            raise RuntimeError("the connection was reset")

        def __getattr__(self, name):
            return getattr(self.real, name)

    monkeypatch.setattr(store, "_ob", Holding(store._ob))
    local = tmp_path / "shard.npy"
    local.write_bytes(b"x" * 100)
    with pytest.raises(RuntimeError, match="the connection was reset"):
        store.upload(str(local), f"s3://{s3_bucket}/ds/shards/a.npy")
    assert bytes(held[0]) == b"x" * 10
    held.clear()


def test_staging_is_local_scratch_and_promote_uploads_then_removes_it(store, s3_bucket, tmp_path, monkeypatch):
    import shardio.store.scratch

    monkeypatch.setenv("SHARDIO_SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setattr(shardio.store.scratch, "_SCRATCH", None)
    url = f"s3://{s3_bucket}/ds/shards/s-00000.npy"
    fd, staged = store.create_temp(url)
    assert staged.startswith(str(tmp_path / "scratch" / f"shardio-scratch-{os.getuid()}" / f"{os.getpid()}-"))
    with os.fdopen(fd, "wb") as f:
        f.write(b"pixels")
    assert not store.exists(url)  # nothing visible before the promote
    store.promote(staged, url)
    assert store.read_bytes(url) == b"pixels" and not os.path.exists(staged)


def test_wrong_credentials_are_a_clear_usage_error_within_seconds(s3_server, s3_bucket, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    started = time.monotonic()
    with pytest.raises(errors.StorageAccessError) as caught:
        S3Storage().list_dir(f"s3://{s3_bucket}/ds")
    assert time.monotonic() - started < 10  # not retried: no retry can fix a refused key
    assert errors.exit_code(caught.value) == 2
    assert str(caught.value).startswith(
        f"s3://{s3_bucket}/ds: LIST refused by {s3_server.endpoint} (AWS_ENDPOINT_URL): HTTP 403 Forbidden")
    assert str(caught.value).endswith(
        "HINT: check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE) on this "
        "machine and the bucket's policy")


def test_a_missing_bucket_is_named_not_reported_as_a_missing_file(store, s3_server):
    url = "s3://no-such-bucket-here/ds/manifest.json"
    create = f"HINT: create it first (shardio never creates buckets), e.g. `aws s3 mb s3://no-such-bucket-here " \
             f"--endpoint-url {s3_server.endpoint}`"
    with pytest.raises(errors.StorageAccessError, match="bucket 'no-such-bucket-here' does not exist") as caught:
        store.info(url)
    assert create in str(caught.value)
    with pytest.raises(errors.StorageAccessError, match="does not exist") as caught:
        store.list_dir("s3://no-such-bucket-here/ds")
    assert create in str(caught.value)


@pytest.fixture
def fast_retries(monkeypatch):
    """One retry instead of a minute of them: the tests below fail on purpose."""
    import shardio.store.s3 as backend

    real = backend._store_options

    def fast():
        options = real()
        options["retry_config"]["max_retries"] = 1
        return options

    monkeypatch.setattr(backend, "_store_options", fast)


@pytest.mark.parametrize("write", ["put", "create"])
def test_a_server_that_refuses_connections_for_three_seconds_is_ridden_out(write, s3_server, s3_bucket, monkeypatch):
    """A restart closes the port for seconds: a write (a plain one, and a conditional create such as a
    commit's manifest) started while it is closed is retried until it answers again."""
    import threading

    from tests.fault_proxy import FaultProxy

    proxy = FaultProxy(s3_server.ports["s3"])
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        store = S3Storage()
        proxy.go_down()
        outcome: list[BaseException | None] = []
        path = f"s3://{s3_bucket}/ds/manifest.json"

        def written() -> None:
            try:
                store.publish_new(path, b"{}") if write == "create" else store.publish(path, b"{}")
                outcome.append(None)
            except BaseException as e:  # noqa: BLE001 - handed to the test's thread
                outcome.append(e)

        writer = threading.Thread(target=written)
        writer.start()
        time.sleep(3.0)  # the retries' floor is 10 s (50 x 200 ms): this outage never outlasts them
        proxy.come_back()
        writer.join(120)
        assert outcome == [None]
        assert S3Storage().read_bytes(path) == b"{}"
    finally:
        proxy.close()


def test_an_unreachable_store_fails_naming_url_endpoint_cause_and_fix(monkeypatch, s3_server, fast_retries):
    from tests.s3_server import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    with pytest.raises(errors.StorageUnavailable) as caught:
        S3Storage().info("s3://bkt/x")
    assert str(caught.value) == (
        f"s3://bkt/x: HEAD failed at {endpoint} (AWS_ENDPOINT_URL) after retries: network error: tcp connect "
        f"error: Connection refused; HINT: nothing answered at {endpoint}: check AWS_ENDPOINT_URL (host, port, "
        "http vs https) and that the server is running and reachable from this machine")


def test_an_unknown_host_names_the_dns_error(monkeypatch, s3_server, fast_retries):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://no-such-host.invalid:9000")
    with pytest.raises(errors.StorageUnavailable,
                       match=r"s3://bkt/x: LIST failed at http://no-such-host.invalid:9000 \(AWS_ENDPOINT_URL\) "
                             r"after retries: network error: dns error: .*HINT: nothing answered"):
        S3Storage().list_dir("s3://bkt/x")


def test_a_missing_endpoint_says_the_request_went_to_aws_and_how_to_point_elsewhere(monkeypatch, s3_server,
                                                                                   s3_bucket, fast_retries):
    # The case: SeaweedFS credentials, AWS_ENDPOINT_URL forgotten. Without network the request
    # fails in DNS; with it, AWS refuses the key (403): either way the message says where it went and why.
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    with pytest.raises((errors.StorageUnavailable, errors.StorageAccessError)) as caught:
        S3Storage().info(f"s3://{s3_bucket}/ds/manifest.json")
    message = str(caught.value)
    assert message.startswith(f"s3://{s3_bucket}/ds/manifest.json: HEAD ")
    assert "amazonaws.com (AWS S3 itself: no AWS_ENDPOINT_URL is set)" in message
    assert ("network error: " in message) or ("HTTP 403" in message)
    assert "HINT: if the bucket is on another server (MinIO, SeaweedFS, R2, an emulator), set " \
           "AWS_ENDPOINT_URL=http(s)://HOST:PORT" in message
    assert "Generic S3 error" not in message


def test_an_endpoint_that_is_no_s3_server_is_not_reported_as_a_missing_file(monkeypatch, s3_server, fast_retries):
    # SeaweedFS's master answers HTTP but is no S3 endpoint (a port mixed up).
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{s3_server.ports['master']}")
    master = f"http://127.0.0.1:{s3_server.ports['master']}"
    with pytest.raises(errors.StorageUnavailable) as caught:
        S3Storage().info("s3://bkt/x")
    assert str(caught.value) == (
        f"s3://bkt/x: listing the bucket failed at {master} (AWS_ENDPOINT_URL): HTTP 404 Not Found, with no "
        f"AWS S3 error in the answer; HINT: check that {master} is the AWS S3 API's address (AWS_ENDPOINT_URL), "
        "not another service's port")


def test_without_the_extra_a_url_says_what_to_install():
    code = ("import sys; sys.modules['obstore'] = None\n"
            "from shardio import errors\nfrom shardio.store.backends import for_path\n"
            "try:\n    for_path('s3://b/ds')\n"
            "except errors.MissingExtra as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install 'shardio[s3]'" in out


# --- the lease -----------------------------------------------------------------------------------------


def test_a_held_lease_refuses_a_second_holder_and_is_released(store, s3_bucket):
    path = f"s3://{s3_bucket}/ds/.lock"
    with lease.lease(store, path):
        with pytest.raises(errors.OutputLocked, match="another run is writing this output"):
            with lease.lease(store, path):
                pass
    assert not store.exists(path)  # released
    with lease.lease(store, path):
        pass


def test_an_expired_lease_is_taken_over_and_its_old_holder_learns_it_lost(store, s3_bucket, monkeypatch):
    monkeypatch.setenv("SHARDIO_LEASE_SECONDS", "3600")
    path = f"s3://{s3_bucket}/ds/.lock"
    first = lease._acquire(store, path, wait=False, ttl_s=3600, poll_s=0.1)
    first._stop.set()  # a holder paused (or dead): it no longer renews
    first._thread.join()
    # Its lease expires (here: rewritten as expired, as time would do).
    doc = json.loads(store.read_bytes(path))
    doc["expires"] = time.time() - 1
    store.publish(path, json.dumps(doc).encode(), if_version=first.etag)
    with lease.lease(store, path) as second:
        second.check()
        # The first holder wakes up: its renewal is refused (If-Match on its own, now stale, ETag).
        with pytest.raises(errors.CommitConflict):
            store.publish(path, b"{}", if_version=first.etag)


def test_a_dead_holder_on_this_host_is_taken_over_at_once(store, s3_bucket):
    path = f"s3://{s3_bucket}/ds/.lock"
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                           text=True, check=True)
    dead_pid = int(child.stdout)
    store.publish_new(path, json.dumps({"holder": f"pid {dead_pid}", "host": os.uname().nodename,
                                        "pid": dead_pid, "expires": time.time() + 3600}).encode())
    with lease.lease(store, path) as handle:  # no waiting for the hour-long expiry
        handle.check()


def test_a_lost_lease_refuses_the_commit(store, s3_bucket, monkeypatch):
    monkeypatch.setenv("SHARDIO_LEASE_SECONDS", "0.6")  # renewals every 0.2 s
    path = f"s3://{s3_bucket}/ds/.lock"
    with lease.lease(store, path) as handle:
        # Another run takes the lease over (as after an expiry): our next renewal is refused.
        store.publish(path, json.dumps({"holder": "someone else", "expires": time.time() + 3600}).encode())
        deadline = time.monotonic() + 30
        while handle.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(errors.OutputLocked, match="taken over by another run"):
            handle.check()
    assert json.loads(store.read_bytes(path))["holder"] == "someone else"  # never deleted by the loser


def test_wait_queues_behind_a_live_holder(store, s3_bucket):
    path = f"s3://{s3_bucket}/ds/.lock"
    holder = lease._acquire(store, path, wait=False, ttl_s=60, poll_s=0.1)
    import threading

    got = threading.Event()

    def waiter() -> None:
        with lease.lease(store, path, wait=True, poll_s=0.05):
            got.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    assert not got.wait(0.5)  # still queued while the holder lives
    holder.release()
    thread.join(30)
    assert got.is_set()


def test_a_store_that_ignores_conditional_writes_is_refused_before_any_lock(store, s3_bucket, monkeypatch):
    real_put = store._ob.put

    class IgnoresConditions:  # a server that accepts If-None-Match and overwrites anyway
        def __getattr__(self, name):
            return getattr(type(store._ob), name, None) or getattr(__import__("obstore"), name)

    ignoring = IgnoresConditions()
    ignoring.put = lambda s, key, data, mode=None, **kw: real_put(s, key, data, **kw)  # type: ignore[attr-defined]
    ignoring.exceptions = store._ob.exceptions  # type: ignore[attr-defined]
    monkeypatch.setattr(store, "_ob", ignoring)
    with pytest.raises(errors.UnsupportedStore, match="ignores conditional writes"):
        store.check_conditional_writes(f"s3://{s3_bucket}/ds")
    assert store.list_dir(f"s3://{s3_bucket}/ds") == []  # the probe object is gone, no lock was taken


def test_a_bucket_root_is_a_directory_never_an_object(store, s3_bucket):
    root = f"s3://{s3_bucket}"
    with pytest.raises(FileNotFoundError):
        store.info(root)  # a HEAD on the bucket answers 200: it must not read as "a file"
    assert not store.is_file(root) and not store.exists(root)
    store.publish(f"{root}/manifest.json", b"{}")
    assert store.exists(root) and store.is_dir(root) and store.list_dir(root) == ["manifest.json"]
    assert normalize(root + "/") == root and normalize(root + "/ds/") == root + "/ds"


def test_a_machine_without_credentials_is_told_so_at_once(monkeypatch, s3_server, s3_bucket):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role here: boto3 need not ask
    started = time.monotonic()
    with pytest.raises(errors.StorageAccessError,
                       match=rf"s3://{s3_bucket}: no S3 credentials on this machine .*--pass-credentials"):
        S3Storage().info(f"s3://{s3_bucket}/ds/manifest.json")
    assert time.monotonic() - started < 10


def test_a_create_refused_by_an_object_deleted_before_it_is_read_is_an_exists_the_caller_retries(store, s3_bucket,
                                                                                                 monkeypatch):
    """The lease's waiter: its create is refused, the holder releases, then the read of the refusing object
    finds nothing. That is 'exists' (try again), never a FileNotFoundError that kills the waiter."""
    path = f"s3://{s3_bucket}/ds/.lock"
    store.publish_new(path, b"holder")
    real_read = store.read_versioned

    def released_meanwhile(target):
        store.remove(target)
        return real_read(target)

    monkeypatch.setattr(store, "read_versioned", released_meanwhile)
    with pytest.raises(FileExistsError):
        store.publish_new(path, b"waiter")
    monkeypatch.undo()
    with lease.lease(store, path, wait=True, poll_s=0.05):  # and the next try takes it
        assert json.loads(store.read_versioned(path)[0])["pid"] == os.getpid()


@pytest.mark.parametrize("setting, says", [
    ({"AWS_PROFILE": "no-such-profile"},
     "AWS_PROFILE names the profile 'no-such-profile', which is in neither {config} nor {credentials}; "
     "HINT: name one"),
    ({"AWS_PROFILE": ""}, "AWS_PROFILE is set but empty; HINT: unset it"),
    ({"AWS_CONFIG_FILE": "{bad_config}"},
     "Unable to parse config file: {bad_config} (not an AWS config file"),
    ({"AWS_ACCESS_KEY_ID": "AKIA"},
     "AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not; HINT: set both"),
    ({"AWS_SECRET_ACCESS_KEY": "secret"}, "AWS_SECRET_ACCESS_KEY is set but AWS_ACCESS_KEY_ID is not"),
])
def test_an_unusable_aws_profile_or_half_a_key_is_a_usage_error_naming_it(tmp_path, monkeypatch, setting,
                                                                          says):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    config, credentials = tmp_path / "config", tmp_path / "credentials"
    config.write_text("[default]\nregion = us-east-1\n")
    credentials.write_text("")
    bad_config = tmp_path / "bad-config"
    bad_config.write_text("[default\nregion\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    names = {"config": str(config), "credentials": str(credentials), "bad_config": str(bad_config)}
    for name, value in setting.items():
        monkeypatch.setenv(name, value.format(**names))
    with pytest.raises(errors.StorageAccessError) as caught:
        S3Storage().info("s3://unusable-profile-bkt/ds/manifest.json")
    assert errors.exit_code(caught.value) == 2
    assert str(caught.value).startswith("s3://unusable-profile-bkt: unusable AWS ")
    assert says.format(**names) in str(caught.value)
    assert "secret" not in str(caught.value).replace("SECRET", "")  # a secret is named, never shown


def test_what_a_cluster_is_given_from_a_missing_profile_is_the_same_usage_error(tmp_path, monkeypatch):
    from shardio.store.s3 import carried_settings, driver_credentials

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    for given in (carried_settings, driver_credentials):  # --pass-credentials, the tasks' settings
        with pytest.raises(errors.StorageAccessError, match="AWS_PROFILE names the profile 'no-such-profile'"):
            given()
