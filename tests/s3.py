"""A real S3 API for the tests: moto's server (``moto_server``) in its own process on a free
loopback port, started once per session and stopped at its end. Registered as a pytest plugin
in conftest.py.

``storage_url`` runs a test on each store: ``file`` (the default directories) and ``s3`` (a
fresh bucket on that server), so one test proves both."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from service.files.storage import Storage, StorageConfig, open_storage, s3_client
from service.settings import Settings

MOTO_SERVER = str(Path(sys.executable).parent / "moto_server")
# moto accepts any credentials; these keep boto3 from looking for real ones.
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "halfway-test",
    "AWS_SECRET_ACCESS_KEY": "halfway-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    process: subprocess.Popen[bytes]

    def env(self) -> dict[str, str]:
        """What a worker process needs to reach it."""
        return {**CREDENTIALS, "HALFWAY_S3_ENDPOINT_URL": self.endpoint}

    def new_bucket(self) -> str:
        name = f"halfway-{uuid.uuid4().hex[:12]}"
        s3_client(self.endpoint, "us-east-1").create_bucket(Bucket=name)
        return name


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    from tests.live import free_port

    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    port = free_port()
    log = (tmp_path_factory.mktemp("moto") / "moto.log").open("wb")
    process = subprocess.Popen(
        [MOTO_SERVER, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{endpoint}/moto-api/", timeout=1)
                break
            except httpx.TransportError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)
        yield S3Server(endpoint, process)
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(params=["file", "s3"])
def storage_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


@pytest.fixture
def storage_settings(
    storage_kind: str, settings: Settings, request: pytest.FixtureRequest
) -> Settings:
    """The test's settings on the store ``storage_kind`` names."""
    if storage_kind == "file":
        return settings
    server: S3Server = request.getfixturevalue("s3_server")
    return settings.model_copy(
        update={
            "storage_url": f"s3://{server.new_bucket()}/team",
            "s3_endpoint_url": server.endpoint,
        }
    )


@pytest.fixture
def storage(storage_kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Storage:
    """Both stores of one deployment, without a database (for tests of storage alone)."""
    url = None
    endpoint = None
    if storage_kind == "s3":
        server: S3Server = request.getfixturevalue("s3_server")
        url, endpoint = f"s3://{server.new_bucket()}/team", server.endpoint
    config = StorageConfig(
        url=url,
        artifact_dir=str(tmp_path / "artifacts"),
        data_dir=str(tmp_path / "data"),
        code_dir=str(tmp_path / "code"),
        s3_endpoint_url=endpoint,
    )
    return open_storage(config)
