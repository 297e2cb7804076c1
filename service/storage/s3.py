"""S3 backend (``s3://bucket/prefix``), through one shared boto3 client.

Small objects go as one PutObject; larger ones as a multipart upload whose parts go in
parallel and which is aborted on any failure, so S3 never shows a partial object (it
publishes only at CompleteMultipartUpload). Every request carries a checksum the store
verifies; the whole object's SHA-256 is also kept as user metadata (``x-amz-meta-sha256``)
so ``head`` reports it and ``get`` checks it. Credentials come only from the standard
AWS chain.

An object that expires (``put(..., expires_at=)``) carries its expiry twice, both set in
the same request that publishes it (PutObject, or CreateMultipartUpload for a
multipart one), so it never exists without them: as object tags, ``hsx-expires-at``
(unix seconds) and ``hsx-ttl-days`` (whole days, rounded up), which bucket lifecycle
rules filter on to delete the bytes (deploy/helm/hsx/README.md); and as user metadata
``x-amz-meta-hsx-expires-at``, which HeadObject and GetObject return with no extra
request (tags need a GetObjectTagging each), so ``head``/``get`` answer NotFoundError
at once once it has passed. A writer that loses a create-only race (``If-None-Match:
*``) stores nothing, so it cannot change the winner's expiry (issue 58). A listing
HEADs the page's objects to leave expired ones out: one request per listed object, in
parallel.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import threading
from collections.abc import Sequence
from datetime import UTC
from typing import Any
from urllib.parse import urlencode, urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from service.config import S3StorageSettings, StorageSettings
from service.storage.base import (
    AlreadyExistsError,
    IntegrityError,
    InvalidKeyError,
    NotFoundError,
    ObjectInfo,
    ObjectPage,
    ObjectRef,
    Source,
    StorageConfigError,
    StorageError,
    StorageUnavailableError,
    ThreadedStorage,
)
from service.storage.expiry import EXPIRES_AT_TAG, TTL_DAYS_TAG, is_expired, ttl_days
from service.storage.keys import validate_key
from service.threads import named_pool

log = logging.getLogger(__name__)

_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_EXISTS = {"412", "PreconditionFailed", "ConditionalRequestConflict"}
_CONFIG = {
    "NoSuchBucket",
    "AccessDenied",
    "403",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AllAccessDisabled",
    "InvalidBucketName",
}
SHA256_META = "sha256"
#: DeleteObjects takes at most this many keys.
DELETE_BATCH = 1000


def parse_s3_url(url: str) -> tuple[str, str]:
    """Split ``s3://bucket/prefix`` into bucket and prefix (no trailing slash)."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise ValueError(f"not an s3://bucket/prefix URL: {url!r}")
    prefix = parts.path.strip("/")
    if prefix:
        validate_key(prefix)
    return parts.netloc, prefix


def make_client(options: S3StorageSettings, pool_size: int) -> Any:
    """A boto3 S3 client configured from settings (retries, timeouts, checksums)."""
    config = Config(
        region_name=options.region,
        # total_max_attempts counts the first try; botocore's max_attempts would not.
        retries={"mode": options.retry_mode, "total_max_attempts": options.max_attempts},
        connect_timeout=options.connect_timeout_s,
        read_timeout=options.read_timeout_s,
        max_pool_connections=pool_size,
        s3={"addressing_style": options.addressing_style},
        request_checksum_calculation=options.checksum_mode,
        response_checksum_validation=options.checksum_mode,
        signature_version="s3v4",
    )
    return boto3.session.Session().client("s3", endpoint_url=options.endpoint_url, config=config)


class S3Storage(ThreadedStorage):
    """Objects in one bucket under an optional prefix."""

    scheme = "s3"

    def __init__(
        self,
        bucket: str,
        prefix: str,
        options: S3StorageSettings,
        *,
        create_only: bool = True,
        io_threads: int = 8,
    ) -> None:
        self.bucket, self.prefix, self.options = bucket, prefix, options
        self.create_only = create_only
        # Every io thread may run a multipart upload with max_concurrency parts at once.
        super().__init__(io_threads, "hsx-s3")
        self._parts = named_pool(options.max_concurrency, "hsx-s3-part")
        self.client = make_client(options, pool_size=io_threads + options.max_concurrency)
        self._retries = 0
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_settings(cls, url: str, settings: StorageSettings) -> S3Storage:
        """Build from ``s3://bucket/prefix`` and the storage settings."""
        bucket, prefix = parse_s3_url(url)
        return cls(
            bucket,
            prefix,
            settings.s3,
            create_only=settings.create_only,
            io_threads=settings.io_threads,
        )

    @property
    def retries(self) -> int:
        return self._retries

    def object_name(self, key: str) -> str:
        """The S3 key that holds ``key`` (the URL's prefix joined in front)."""
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self.object_name(key)}"

    def presigned_url(self, key: str) -> str:
        """A short-lived GET URL for ``key`` (lifetime: ``presign_expiry_s``)."""
        return str(
            self.client.generate_presigned_url(
                "get_object",
                Params={"Bucket": self.bucket, "Key": self.object_name(key)},
                ExpiresIn=self.options.presign_expiry_s,
            )
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await super().close()
        self._parts.shutdown(wait=True)
        self.client.close()

    # -- blocking work ------------------------------------------------------------------

    def _call(self, operation: str, key: str, **params: Any) -> dict[str, Any]:
        """One client call, with its retries counted and its errors mapped to ours."""
        try:
            response: dict[str, Any] = getattr(self.client, operation)(**params)
        except ClientError as exc:
            self._count_retries(dict(exc.response))
            raise _client_error(exc, operation, key) from exc
        except BotoCoreError as exc:
            raise StorageUnavailableError(
                f"s3 {operation} failed: {exc}", operation=operation, key=key
            ) from exc
        self._count_retries(response)
        return response

    def _count_retries(self, response: dict[str, Any]) -> None:
        attempts = response.get("ResponseMetadata", {}).get("RetryAttempts", 0)
        if attempts:
            with self._lock:
                self._retries += attempts

    def _checksum_args(self, piece: bytes | memoryview) -> dict[str, Any]:
        algorithm = self.options.checksum_algorithm
        if algorithm == "NONE":
            return {}
        if algorithm == "SHA256":
            # Computed here rather than by botocore: one less pass over the bytes.
            digest = base64.b64encode(hashlib.sha256(piece).digest()).decode()
            return {"ChecksumSHA256": digest}
        return {"ChecksumAlgorithm": algorithm}

    def _publish(self, key: str, source: Source, expires_at: int | None) -> ObjectRef:
        try:
            return self._publish_once(key, source, expires_at)
        except AlreadyExistsError:
            # An expired object is gone for readers, though S3 keeps it until the
            # lifecycle rule runs: its key may be published again (a custom_id retried
            # after expiry). Rare, so checked only after a refusal, not before each put.
            if not self._free_if_expired(key):
                raise
            return self._publish_once(key, source, expires_at)

    def _free_if_expired(self, key: str) -> bool:
        """Whether ``key`` may be tried again: its object has expired and is gone now.

        The delete is conditional on the expired object's ETag (``If-Match``): another
        replica may have replaced it with a fresh object since the HEAD, which a plain
        delete would remove after its writer was told it was stored (issue 58). That
        object then refuses this writer (AlreadyExistsError); the create-only put that
        follows decides between writers that both found the key free.
        """
        name = self.object_name(key)
        try:
            response = self._call("head_object", key, Bucket=self.bucket, Key=name)
        except NotFoundError:
            return True  # removed since the refusal
        if not _expired(response):
            return False
        with contextlib.suppress(NotFoundError):  # another writer removed it first
            self._call("delete_object", key, Bucket=self.bucket, Key=name, IfMatch=response["ETag"])
        return True

    def _publish_once(self, key: str, source: Source, expires_at: int | None) -> ObjectRef:
        name = self.object_name(key)
        sha256 = source.sha256()
        common: dict[str, Any] = {"Bucket": self.bucket, "Key": name}
        metadata = {SHA256_META: sha256}
        if expires_at is not None:
            metadata[EXPIRES_AT_TAG] = str(expires_at)
            tags = {EXPIRES_AT_TAG: expires_at, TTL_DAYS_TAG: ttl_days(expires_at)}
            common["Tagging"] = urlencode(tags)
        conditional = {"IfNoneMatch": "*"} if self.create_only else {}
        if source.size <= self.options.multipart_threshold:
            body = bytes(source.read(0, source.size))
            self._call(
                "put_object",
                key,
                **common,
                **conditional,
                **self._checksum_args(body),
                Body=body,
                Metadata=metadata,
                ContentType="application/octet-stream",
            )
        else:
            self._multipart(key, source, metadata, common, conditional)
        return ObjectRef(key, self.uri(key), source.size, sha256)

    def _multipart(
        self,
        key: str,
        source: Source,
        metadata: dict[str, str],
        create: dict[str, Any],
        conditional: dict[str, str],
    ) -> None:
        algorithm = self.options.checksum_algorithm
        create_args = {} if algorithm == "NONE" else {"ChecksumAlgorithm": algorithm}
        upload = self._call(
            "create_multipart_upload",
            key,
            **create,
            **create_args,
            Metadata=metadata,
            ContentType="application/octet-stream",
        )
        upload_id = upload["UploadId"]
        # Tags are given once, at creation; the other calls take bucket and key only.
        common = {"Bucket": create["Bucket"], "Key": create["Key"]}
        try:
            parts = self._upload_parts(key, source, upload_id, common)
            self._call(
                "complete_multipart_upload",
                key,
                **common,
                **conditional,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )
        except BaseException:
            self._abort(key, upload_id, common)
            raise

    def _upload_parts(
        self, key: str, source: Source, upload_id: str, common: dict[str, Any]
    ) -> list[dict[str, Any]]:
        size = self.options.part_size
        offsets = range(0, source.size, size)

        def upload(number: int, offset: int) -> dict[str, Any]:
            body = bytes(source.read(offset, size))
            response = self._call(
                "upload_part",
                key,
                **common,
                **self._checksum_args(body),
                UploadId=upload_id,
                PartNumber=number,
                Body=body,
            )
            part = {"PartNumber": number, "ETag": response["ETag"]}
            part.update({k: v for k, v in response.items() if k.startswith("Checksum")})
            return part

        futures = [self._parts.submit(upload, n, off) for n, off in enumerate(offsets, start=1)]
        try:
            return [future.result() for future in futures]
        finally:
            # On the first failure, stop parts not yet started; wait for the rest so
            # none is uploaded after the abort.
            for future in futures:
                future.cancel()
            for future in futures:
                if not future.cancelled():
                    future.exception()

    def _abort(self, key: str, upload_id: str, common: dict[str, Any]) -> None:
        try:
            self._call("abort_multipart_upload", key, **common, UploadId=upload_id)
        except StorageError:
            # The bucket's AbortIncompleteMultipartUpload lifecycle rule is the backstop.
            log.exception("could not abort multipart upload %s for %s", upload_id, key)

    def _get(self, key: str) -> bytes:
        response = self._call("get_object", key, Bucket=self.bucket, Key=self.object_name(key))
        if _expired(response):
            response["Body"].close()  # not a byte of it read
            raise NotFoundError("object expired", operation="get", key=key)
        body: bytes = response["Body"].read()
        expected = response.get("Metadata", {}).get(SHA256_META)
        if expected and hashlib.sha256(body).hexdigest() != expected:
            raise IntegrityError(
                "object bytes do not match their SHA-256", operation="get", key=key
            )
        return body

    def _head(self, key: str) -> ObjectRef:
        response = self._call("head_object", key, Bucket=self.bucket, Key=self.object_name(key))
        if _expired(response):
            raise NotFoundError("object expired", operation="head", key=key)
        sha256 = response.get("Metadata", {}).get(SHA256_META, "")
        return ObjectRef(key, self.uri(key), int(response["ContentLength"]), sha256)

    def _delete(self, key: str) -> None:
        # S3 answers 204 for a missing key too, so delete is idempotent by itself.
        self._call("delete_object", key, Bucket=self.bucket, Key=self.object_name(key))

    async def delete_many(self, keys: Sequence[str]) -> None:
        """DeleteObjects, 1000 keys a request (quiet: only failures come back)."""
        names = [self.object_name(key) for key in keys]  # validates every key first
        for start in range(0, len(names), DELETE_BATCH):
            await self._run(self._delete_batch, names[start : start + DELETE_BATCH])

    def _delete_batch(self, names: list[str]) -> None:
        objects = [{"Key": name} for name in names]
        first = names[0] if names else ""
        response = self._call(
            "delete_objects", first, Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True}
        )
        errors = response.get("Errors") or []
        if errors:
            error = errors[0]
            raise StorageError(
                f"s3 delete_objects failed for {len(errors)} keys: "
                f"{error.get('Code', '')}: {error.get('Message', '')}",
                operation="delete",
                key=str(error.get("Key", "")),
            )

    def _list(self, prefix: str, limit: int, after: str | None) -> ObjectPage:
        base = f"{self.prefix}/" if self.prefix else ""
        params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base + prefix, "MaxKeys": limit}
        if after is not None:
            params["StartAfter"] = base + after
        response = self._call("list_objects_v2", prefix, **params)
        contents = response.get("Contents", [])
        objects = tuple(
            ObjectInfo(
                item["Key"][len(base) :], int(item["Size"]), item["LastModified"].astimezone(UTC)
            )
            for item in contents
            if _is_key(item["Key"][len(base) :])
        )
        objects = self._unexpired(objects)
        # The cursor is the last key S3 returned, so foreign keys skipped above do not
        # make the next page start over.
        more = bool(response.get("IsTruncated")) and bool(contents)
        return ObjectPage(objects, contents[-1]["Key"][len(base) :] if more else None)

    def _unexpired(self, objects: tuple[ObjectInfo, ...]) -> tuple[ObjectInfo, ...]:
        """``objects`` but those expired (or deleted since listed): a HEAD each, in
        parallel, since a listing carries neither tags nor metadata."""

        def alive(info: ObjectInfo) -> bool:
            try:
                self._head(info.key)
            except NotFoundError:
                return False
            return True

        kept = zip(objects, self._parts.map(alive, objects), strict=True)
        return tuple(info for info, ok in kept if ok)

    def _ping(self) -> None:
        try:
            self._call("head_bucket", "", Bucket=self.bucket)
        except StorageError as exc:
            raise StorageUnavailableError(
                f"bucket {self.bucket!r} is not reachable: {exc}"
            ) from exc


def _expired(response: dict[str, Any]) -> bool:
    """Whether a HeadObject/GetObject response is of an object whose expiry passed."""
    recorded = response.get("Metadata", {}).get(EXPIRES_AT_TAG)
    try:
        return is_expired(None if recorded is None else int(recorded))
    except ValueError:
        return False  # not ours to judge: never vanish an object on a bad header


def _is_key(name: str) -> bool:
    try:
        validate_key(name)
    except InvalidKeyError:
        return False
    return True


def _client_error(exc: ClientError, operation: str, key: str) -> StorageError:
    error = exc.response.get("Error", {})
    code = str(error.get("Code", ""))
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    message = f"s3 {operation} failed: {code or status}: {error.get('Message', '')}".rstrip(": ")
    if code in _NOT_FOUND:
        return NotFoundError(message, operation=operation, key=key)
    if code in _EXISTS:
        return AlreadyExistsError(message, operation=operation, key=key)
    if code in _CONFIG:
        return StorageConfigError(message, operation=operation, key=key)
    if status >= 500 or code in {"SlowDown", "RequestTimeout", "Throttling"}:
        return StorageUnavailableError(message, operation=operation, key=key)
    return StorageError(message, operation=operation, key=key)
