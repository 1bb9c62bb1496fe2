"""A real S3 server for the tests: moto's `moto_server` process on a free loopback port, one per
test process (xdist worker), stopped by its PID. Each test gets its own bucket."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.sshbox import free_port

MOTO = Path(sys.executable).with_name("moto_server")
# Any keys do for moto; these stand for the user's, and no test output may ever show them.
KEY_ID = "AKIABOXWARDENTEST0001"
SECRET = "s3cret/NEVER-SHOWN+k9Qw2"


@dataclass
class S3Server:
    endpoint: str
    proc: subprocess.Popen[bytes]

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=KEY_ID,
            aws_secret_access_key=SECRET,
            config=Config(
                request_checksum_calculation="when_required", response_checksum_validation="when_required"
            ),
        )

    def bucket(self) -> str:
        name = f"bwt-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def url(self, bucket: str, prefix: str = "durable") -> str:
        return f"s3://{bucket}/{prefix}?endpoint_url={self.endpoint}&region=us-east-1&addressing_style=path"


def write_credentials(path: Path) -> Path:
    path.write_text(f"[default]\naws_access_key_id = {KEY_ID}\naws_secret_access_key = {SECRET}\n")
    path.chmod(0o600)
    return path


def _answers(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(endpoint + "/moto-api/", timeout=2):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def running_s3(log: Path) -> Iterator[S3Server]:
    from tests.conftest import wait_until  # conftest imports this module: not at the top

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [str(MOTO), "-H", "127.0.0.1", "-p", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET},
        )
    try:

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"moto_server exited with {proc.returncode}: see {log}")
            return _answers(endpoint)

        wait_until(ready, timeout=30, what="moto_server to answer")
        yield S3Server(endpoint, proc)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """moto's S3 server for this test process (started on first use, stopped at the end)."""
    with running_s3(tmp_path_factory.mktemp("moto") / "moto.log") as server:
        yield server
