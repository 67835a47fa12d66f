"""A real S3-protocol server for the tests: moto in server mode, on 127.0.0.1, on a free port.

No MinIO server can be installed on the test machines, so the S3 blob store is tested
against moto's S3 over real HTTP (signatures, multipart uploads, ranged GETs and all),
the way it talks to MinIO in docker-compose.yml. The server runs in a thread of the test
process; service processes the tests start reach it over loopback like any S3 endpoint.
Registered from tests/conftest.py (`pytest_plugins`).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import pytest

ACCESS_KEY = "lastgood-test"
SECRET_KEY = "lastgood-test-secret-key"
REGION = "us-east-1"


@dataclass(frozen=True)
class S3Server:
    endpoint: str  # host:port
    access_key = ACCESS_KEY  # class attributes: a server with other credentials overrides them
    secret_key = SECRET_KEY

    def client(self):
        from minio import Minio

        return Minio(endpoint=self.endpoint, access_key=self.access_key, secret_key=self.secret_key, secure=False,
                     region=REGION)

    def make_bucket(self, stem: str = "lg") -> str:
        name = f"{stem}-{uuid.uuid4().hex[:12]}"
        self.client().make_bucket(bucket_name=name)
        return name

    def url(self, bucket: str, prefix: str = "") -> str:
        path = f"/{prefix}" if prefix else ""
        return f"s3://{bucket}{path}?endpoint={self.endpoint}&secure=false&region={REGION}"

    def env(self, bucket: str) -> dict[str, str]:
        """The service's settings for a blob store in `bucket`."""
        return {"LASTGOOD_BLOB_URL": self.url(bucket), "LASTGOOD_S3_ACCESS_KEY": self.access_key,
                "LASTGOOD_S3_SECRET_KEY": self.secret_key}

    def store(self, bucket: str, **kw):
        from lastgood_service.blobstore.s3 import S3BlobStore

        return S3BlobStore(bucket=bucket, endpoint=self.endpoint, access_key=self.access_key, secret_key=self.secret_key,
                           secure=False, region=REGION, **kw)

    def empty_bucket(self, bucket: str) -> None:
        """Delete every object and abort every upload (moto keeps them in this process's memory)."""
        c = self.client()
        for obj in c.list_objects(bucket_name=bucket, recursive=True):
            c.remove_object(bucket_name=bucket, object_name=obj.object_name)
        for up in c._list_multipart_uploads(bucket_name=bucket).uploads:
            c._abort_multipart_upload(bucket_name=bucket, object_name=up.object_name, upload_id=up.upload_id)


@pytest.fixture(scope="session")
def s3_server():
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as e:  # pragma: no cover - depends on the machine
        msg = f"moto[server] is not installed ({e}); pip install -r requirements-dev.txt"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield S3Server(f"{host}:{port}")
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh, empty bucket on the session's S3 server; emptied again afterwards."""
    bucket = s3_server.make_bucket()
    yield bucket
    s3_server.empty_bucket(bucket)
