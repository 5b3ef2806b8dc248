"""moto's S3 server for the benchmarks that use an object store: a real endpoint over HTTP on loopback.

bench_object.py and chaos.py start one (S3Server(log_path)), make their buckets
through its boto3 client, and stop() it on the way out, also when they fail.
Run as scripts, benchmarks import it from this directory.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import boto3
from daemon import free_port

READY_TIMEOUT_S = 60.0
S3_KEY = "ckptd-bench"  # moto takes any credentials


class S3Server:
    """moto's S3 server in a child process on a loopback port, with its log in a file."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.endpoint = f"http://127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", self.endpoint.rsplit(":", 1)[1]],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        ready = threading.Event()
        threading.Thread(target=self._drain_log, args=(ready,), daemon=True).start()
        if not ready.wait(READY_TIMEOUT_S) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError(f"moto server did not start:\n{self.log()}")
        self.client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=S3_KEY,
            aws_secret_access_key=S3_KEY,
            region_name="us-east-1",
        )

    def _drain_log(self, ready: threading.Event) -> None:
        assert self.proc.stderr is not None
        with open(self.log_path, "ab") as log:
            for line in self.proc.stderr:  # werkzeug says where it listens once the socket is bound
                log.write(line)
                log.flush()
                if b"Running on" in line:
                    ready.set()
        ready.set()  # exited: the caller looks at why

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"key": S3_KEY, "secret": S3_KEY, "client_kwargs": {"endpoint_url": self.endpoint}}

    def new_bucket(self, what: str) -> str:
        """Create a bucket for one measurement and return its name."""
        name = f"bench-{what}-{uuid.uuid4().hex[:8]}"
        self.client.create_bucket(Bucket=name)
        return name

    def stored_bytes(self, bucket: str) -> int:
        """Return the bytes of every object in a bucket."""
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        return sum(o["Size"] for page in pages for o in page.get("Contents", []))

    def drop_bucket(self, bucket: str) -> None:
        """Remove a bucket with its objects and unfinished uploads, so moto lets go of their memory."""
        for u in self.client.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
            self.client.abort_multipart_upload(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for o in page.get("Contents", []):
                self.client.delete_object(Bucket=bucket, Key=o["Key"])
        self.client.delete_bucket(Bucket=bucket)

    def peak_rss_bytes(self) -> int:
        """Return the most resident memory the server has held (VmHWM), 0 if unknown."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
