"""S3 backend against moto's HTTP server on 127.0.0.1, through boto3.

Faults are injected with botocore ``before-send`` hooks, which sit below the retry
logic, so every injected answer goes through the same retries a real one would.
"""

from __future__ import annotations

import base64
import hashlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from botocore.awsrequest import AWSResponse
from prometheus_client import CollectorRegistry

from service.metrics import StorageMetrics
from service.storage import (
    AlreadyExistsError,
    IntegrityError,
    NotFoundError,
    StorageConfigError,
    StorageError,
    StorageUnavailableError,
    open_backend,
    open_storage,
)
from service.storage.base import Source
from service.storage.expiry import EXPIRES_AT_TAG, TTL_DAYS_TAG
from service.storage.s3 import S3Storage, parse_s3_url
from tests.conftest import s3_settings
from tests.storage.contract import BIG, Plant, StorageContract, fresh_key, payload

MIB = 1024 * 1024

# moto's server answers each request in Python: the contract and the fault cases take
# about a minute of a worker's time, so `make test` runs them, not `make test-fast`
# (the same contract runs there on local disk).
pytestmark = pytest.mark.slow


class TestS3Contract(StorageContract):
    # moto checks If-None-Match, then stores, in two steps that two of its request
    # threads interleave: both racing puts succeed. S3 decides the race atomically.
    racy_create_only = "moto does not settle If-None-Match atomically"

    @pytest.fixture
    async def storage(self, s3_endpoint: str, s3_bucket: str) -> AsyncIterator[S3Storage]:
        settings = s3_settings(s3_endpoint, s3_bucket, multipart_threshold=MIB, part_size=5 * MIB)
        backend = open_backend(settings)
        assert isinstance(backend, S3Storage)
        yield backend
        await backend.close()

    @pytest.fixture
    def plant(self, storage: S3Storage, s3_admin: Any) -> Plant:
        async def plant(name: str, data: bytes) -> None:  # another client of the bucket
            s3_admin.put_object(Bucket=storage.bucket, Key=f"{storage.prefix}/{name}", Body=data)

        return plant


class _Raw:
    def __init__(self, body: bytes) -> None:
        self._body = body

    def stream(self, **_kwargs: Any) -> Any:
        yield self._body


class Fault:
    """Answers the first ``times`` attempts of one S3 operation with an error."""

    def __init__(self, status: int, code: str, times: int = 10**9) -> None:
        self.status, self.code, self.times = status, code, times
        self.attempts = 0

    def __call__(self, request: Any, **_kwargs: Any) -> AWSResponse | None:
        self.attempts += 1
        if self.attempts > self.times:
            return None
        body = f"<Error><Code>{self.code}</Code><Message>injected</Message></Error>".encode()
        return AWSResponse(request.url, self.status, {}, _Raw(body))


class Recorder:
    """Counts attempts of one operation and keeps their requests, letting them through."""

    def __init__(self) -> None:
        self.requests: list[Any] = []

    def __call__(self, request: Any, **_kwargs: Any) -> None:
        self.requests.append(request)


@pytest.fixture
async def s3(s3_endpoint: str, s3_bucket: str) -> AsyncIterator[S3Storage]:
    settings = s3_settings(s3_endpoint, s3_bucket, multipart_threshold=MIB, part_size=5 * MIB)
    backend = S3Storage.from_settings(settings.url, settings)
    yield backend
    await backend.close()


def header(request: Any, name: str) -> str:
    value = request.headers[name]
    return value.decode() if isinstance(value, bytes) else str(value)


def body_of(request: Any) -> bytes:
    body = request.body
    if isinstance(body, bytes | bytearray):
        return bytes(body)
    body.seek(0)
    data: bytes = body.read()
    body.seek(0)
    return data


def hook(storage: S3Storage, operation: str, handler: Any) -> None:
    storage.client.meta.events.register(f"before-send.s3.{operation}", handler)


def assert_no_object_and_no_upload(s3: S3Storage, admin: Any, key: str) -> None:
    listing = admin.list_objects_v2(Bucket=s3.bucket)
    assert listing.get("KeyCount", 0) == 0, listing.get("Contents")
    assert admin.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", []) == []


async def test_slowdown_then_success_is_retried_and_counted(s3_endpoint: str, s3_bucket: str):
    metrics = StorageMetrics(registry := CollectorRegistry(), "s3")
    settings = s3_settings(s3_endpoint, s3_bucket, max_attempts=4)
    storage = open_storage(settings, metrics)
    inner = storage.inner  # type: ignore[attr-defined]
    fault = Fault(503, "SlowDown", times=2)
    hook(inner, "PutObject", fault)
    key = fresh_key()
    ref = await storage.put(key, b"hello")
    assert fault.attempts == 3
    assert await storage.get(key) == b"hello"
    assert ref.size == 5
    assert storage.retries == 2
    assert registry.get_sample_value("hsx_storage_retries_total", {"backend": "s3"}) == 2
    assert registry.get_sample_value("hsx_storage_written_bytes_total", {"backend": "s3"}) == 5
    await storage.close()


async def test_slowdown_on_every_attempt_fails_clearly(s3: S3Storage, s3_admin: Any) -> None:
    fault = Fault(503, "SlowDown")
    hook(s3, "PutObject", fault)
    key = fresh_key()
    with pytest.raises(StorageUnavailableError, match="SlowDown") as info:
        await s3.put(key, b"hello")
    assert info.value.operation == "put_object"
    assert fault.attempts == s3.options.max_attempts == 3
    assert_no_object_and_no_upload(s3, s3_admin, key)


@pytest.mark.parametrize("operation", ["UploadPart", "CompleteMultipartUpload"])
async def test_failed_multipart_is_aborted(s3: S3Storage, s3_admin: Any, operation: str) -> None:
    fault = Fault(400, "InvalidPart" if operation.startswith("Complete") else "InvalidRequest")
    hook(s3, operation, fault)
    key = fresh_key()
    with pytest.raises(StorageError, match="injected"):
        await s3.put(key, payload(BIG))
    assert fault.attempts >= 1
    assert_no_object_and_no_upload(s3, s3_admin, key)
    with pytest.raises(NotFoundError):
        await s3.head(key)


async def test_multipart_part_5xx_exhausts_retries_then_aborts(s3: S3Storage, s3_admin: Any):
    fault = Fault(500, "InternalError")
    hook(s3, "UploadPart", fault)
    with pytest.raises(StorageUnavailableError, match="InternalError"):
        await s3.put(fresh_key(), payload(BIG))
    assert fault.attempts >= s3.options.max_attempts
    assert_no_object_and_no_upload(s3, s3_admin, "")


async def test_missing_bucket_fails_after_one_attempt(s3_endpoint: str) -> None:
    settings = s3_settings(s3_endpoint, "no-such-bucket-hsx")
    storage = S3Storage.from_settings(settings.url, settings)
    attempts = Recorder()
    hook(storage, "PutObject", attempts)
    with pytest.raises(StorageConfigError, match="NoSuchBucket"):
        await storage.put(fresh_key(), b"x")
    assert len(attempts.requests) == 1
    with pytest.raises(StorageUnavailableError, match="no-such-bucket-hsx"):
        await storage.ping()
    await storage.close()


async def test_access_denied_fails_after_one_attempt(s3: S3Storage, s3_admin: Any) -> None:
    fault = Fault(403, "AccessDenied")
    hook(s3, "PutObject", fault)
    with pytest.raises(StorageConfigError, match="AccessDenied"):
        await s3.put(fresh_key(), b"x")
    assert fault.attempts == 1
    assert_no_object_and_no_upload(s3, s3_admin, "")


async def test_sha256_checksum_is_sent_with_put_and_parts(s3: S3Storage) -> None:
    puts, parts = Recorder(), Recorder()
    hook(s3, "PutObject", puts)
    hook(s3, "UploadPart", parts)
    small, big = payload(1000), payload(BIG)
    await s3.put(fresh_key(), small)
    await s3.put(fresh_key(), big)
    expected = base64.b64encode(hashlib.sha256(small).digest()).decode()
    assert header(puts.requests[0], "x-amz-checksum-sha256") == expected
    assert len(parts.requests) == 3
    for request in parts.requests:
        digest = base64.b64encode(hashlib.sha256(body_of(request)).digest()).decode()
        assert header(request, "x-amz-checksum-sha256") == digest


async def test_minio_compatible_mode(s3_endpoint: str, s3_bucket: str) -> None:
    """Path-style addressing, no checksum headers: what MinIO-class stores accept."""
    settings = s3_settings(
        s3_endpoint,
        s3_bucket,
        addressing_style="path",
        checksum_mode="when_required",
        checksum_algorithm="NONE",
    )
    storage = S3Storage.from_settings(settings.url, settings)
    puts = Recorder()
    hook(storage, "PutObject", puts)
    key = fresh_key()
    await storage.put(key, b"minio")
    assert await storage.get(key) == b"minio"
    request = puts.requests[0]
    assert f"/{s3_bucket}/data/{key}" in request.url
    assert not any(h.lower().startswith("x-amz-checksum") for h in request.headers)
    assert "x-amz-sdk-checksum-algorithm" not in {h.lower() for h in request.headers}
    await storage.close()


async def test_corrupted_object_fails_integrity_check(s3: S3Storage, s3_admin: Any) -> None:
    key = fresh_key()
    s3_admin.put_object(
        Bucket=s3.bucket, Key=s3.object_name(key), Body=b"tampered", Metadata={"sha256": "00" * 32}
    )
    with pytest.raises(IntegrityError):
        await s3.get(key)


async def test_bytes_corrupted_in_flight_are_caught_on_read(s3: S3Storage) -> None:
    """moto does not verify x-amz-checksum-*; AWS does. Either way our read check holds."""

    def corrupt(request: Any, **_kwargs: Any) -> None:
        request.body = b"X" + body_of(request)[1:]

    hook(s3, "PutObject", corrupt)
    key = fresh_key()
    await s3.put(key, b"hello world")
    with pytest.raises(IntegrityError, match="SHA-256"):
        await s3.get(key)


async def test_objects_live_under_the_url_prefix(s3: S3Storage, s3_admin: Any) -> None:
    key = fresh_key()
    ref = await s3.put(key, b"abc")
    assert ref.uri == f"s3://{s3.bucket}/data/{key}"
    names = [o["Key"] for o in s3_admin.list_objects_v2(Bucket=s3.bucket)["Contents"]]
    assert names == [f"data/{key}"]
    head = s3_admin.head_object(Bucket=s3.bucket, Key=f"data/{key}")
    assert head["Metadata"]["sha256"] == hashlib.sha256(b"abc").hexdigest()


async def test_presigned_get_url_serves_the_object(s3: S3Storage) -> None:
    import urllib.request

    key = fresh_key()
    await s3.put(key, b"presigned bytes")
    url = s3.presigned_url(key)
    assert "X-Amz-Expires=300" in url
    with urllib.request.urlopen(url) as response:
        assert response.read() == b"presigned bytes"


def test_parse_s3_url() -> None:
    assert parse_s3_url("s3://bucket") == ("bucket", "")
    assert parse_s3_url("s3://bucket/a/b/") == ("bucket", "a/b")
    with pytest.raises(ValueError, match="s3://"):
        parse_s3_url("s3:///nobucket")
    with pytest.raises(ValueError, match="not allowed"):
        parse_s3_url("s3://bucket/../x")


# -- expiry tags and batch delete (issue 29) --------------------------------------------


@pytest.mark.parametrize("size", [100, 2 * MIB])  # PutObject, and a multipart upload
async def test_an_expiring_object_carries_its_expiry_tags(
    s3: S3Storage, s3_admin: Any, size: int
) -> None:
    key, expires = fresh_key(), int(time.time()) + 3 * 86400 + 5
    await s3.put(key, payload(size), expires_at=expires)
    name = s3.object_name(key)
    tagging = s3_admin.get_object_tagging(Bucket=s3.bucket, Key=name)
    tags = {t["Key"]: t["Value"] for t in tagging["TagSet"]}
    assert tags == {EXPIRES_AT_TAG: str(expires), TTL_DAYS_TAG: "4"}  # days rounded up
    head = s3_admin.head_object(Bucket=s3.bucket, Key=name)
    assert head["Metadata"][EXPIRES_AT_TAG] == str(expires)  # what head/get check
    forever = fresh_key()
    await s3.put(forever, payload(size))
    assert (
        s3_admin.get_object_tagging(Bucket=s3.bucket, Key=s3.object_name(forever))["TagSet"] == []
    )


async def test_delete_many_is_one_request_per_thousand_keys(s3: S3Storage, s3_admin: Any) -> None:
    keys = [fresh_key("tenant-m") for _ in range(3)]
    for key in keys:
        await s3.put(key, b"x")
    recorder = Recorder()
    hook(s3, "DeleteObjects", recorder)
    await s3.delete_many(keys)
    assert len(recorder.requests) == 1
    assert s3_admin.list_objects_v2(Bucket=s3.bucket).get("KeyCount", 0) == 0


async def test_a_writer_replacing_an_expired_object_never_deletes_a_fresh_one(
    s3: S3Storage, s3_endpoint: str, s3_bucket: str
) -> None:
    # Issue 58, M2: a put over an expired object HEADs it, then deletes it. Another
    # replica may replace it in between; a plain delete then removed that replica's
    # fresh object, which its caller had been told was created. The delete is
    # conditional on the expired object's ETag now: the second writer is refused.
    key = fresh_key()
    await s3.put(key, b"expired", expires_at=int(time.time()) - 1)
    settings = s3_settings(s3_endpoint, s3_bucket)
    other = S3Storage.from_settings(settings.url, settings)
    replaced: list[Any] = []

    def other_replica_first(request: Any, **_kwargs: Any) -> None:
        if not replaced:  # between this writer's HEAD and its DELETE
            replaced.append(other._publish(key, Source(data=b"fresh"), None))

    hook(s3, "DeleteObject", other_replica_first)
    with pytest.raises(AlreadyExistsError):
        await s3.put(key, b"late")
    assert replaced  # the other replica's put ran first
    assert await s3.get(key) == b"fresh"
    await other.close()
