"""The artifacts' object store, as GitLab's ``gitlab.yml`` configures it, and a client that removes objects from it.

GitLab's ``DeletedObjectUploader`` (``storage_location :artifacts``) removes a ``ci_deleted_objects`` row's file at
``<bucket prefix>/<store_dir>/<file>`` in the artifacts bucket (``ObjectStorage::Concern#store_path``). Its settings
are either ``artifacts.object_store`` (``remote_directory``, ``connection``) or the consolidated ``object_store``
(``connection``, ``objects.artifacts.bucket``), chosen as ``config/object_store_settings.rb`` chooses; a bucket
written ``bucket/prefix`` is split as ``ObjectStoreSettings.split_bucket_prefix`` splits it.

``provider: AWS`` (S3 and S3-compatible stores: MinIO, Ceph RGW, Google's interoperability endpoint) goes through
boto3: AWS's own client, kept in step with S3, that takes any ``endpoint``, path-style addressing, and the
instance-profile credential chain (``use_iam_profile``) as GitLab's fog-aws does. ``Google`` and ``AzureRM`` are
named as not supported; their rows are left.

Secrets (access keys) are held only by :class:`ObjectStore` (never in its ``repr``) and the client; errors and
:meth:`ObjectStore.describe` name the bucket, prefix and endpoint only.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .config_files import ENV_CONFIG_DIR, SECTION, ConfigFileError, production

AWS, GOOGLE, AZURE = "AWS", "Google", "AzureRM"  # ObjectStorage::Config's providers
# ObjectStoreSettings::WORKHORSE_ACCELERATED_TYPES: a type among these whose own enabled connection differs from the
# consolidated one turns the consolidated settings off for every type.
ACCELERATED_TYPES = ("artifacts", "external_diffs", "lfs", "uploads", "packages", "dependency_proxy",
                     "terraform_state")
# split_bucket_prefix refuses a bucket whose '/' and '.' would read as a path: "./x", "a/../b", "a/."
_BAD_BUCKET = (re.compile(r"\A\.*/"), re.compile(r"/\.*/"), re.compile(r"/\.*\Z"))

ENV_PREFIX = "CI_CLEANUP_ARTIFACTS_OBJECT_STORE_"
ENV_BUCKET = ENV_PREFIX + "BUCKET"  # "bucket" or "bucket/prefix", as GitLab's bucket / remote_directory
ENV_NAMES = ("PROVIDER", "BUCKET", "REGION", "ENDPOINT", "PATH_STYLE", "ACCESS_KEY_ID", "SECRET_ACCESS_KEY",
             "SESSION_TOKEN")
WORKERS = 16  # requests under way at once: each object is a HEAD and a DELETE, as fog removes one key at a time


@dataclass(frozen=True)
class ObjectStore:
    """The artifacts bucket and how to reach it. ``source`` says where it was read (a file, or the environment)."""

    provider: str
    bucket: str
    prefix: str | None
    source: str
    region: str | None = None
    endpoint: str | None = None
    path_style: bool = False
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)

    @property
    def supported(self) -> bool:
        return self.provider == AWS

    def key(self, store_dir: str, file: str) -> str:
        """``with_bucket_prefix(File.join(store_dir, file))``: Ruby's File.join, one '/' at each joint."""
        return _join(*([self.prefix] if self.prefix else []), store_dir, file)

    def where(self) -> str:
        """The bucket, prefix and endpoint, for a line of the run: never a key."""
        at = self.endpoint or (f"S3 region {self.region}" if self.region else "S3")
        return f"bucket {self.bucket!r}" + (f" prefix {self.prefix!r}" if self.prefix else "") + f" at {at}"

    def describe(self) -> dict[str, object]:
        """What a run shows of the store (metadata): no secret."""
        return {"provider": self.provider, "bucket": self.bucket, "prefix": self.prefix or "",
                "endpoint": self.endpoint or "", "region": self.region or "", "path_style": self.path_style,
                "credentials": "access key" if self.access_key_id else "default chain (instance profile, AWS_*)",
                "read_from": self.source}


def _join(*parts: str) -> str:
    joined = parts[0]
    for part in parts[1:]:
        joined = joined.rstrip("/") + "/" + part.lstrip("/")
    return joined


def split_bucket_prefix(bucket: str, where: str) -> tuple[str, str | None]:
    """``ObjectStoreSettings.split_bucket_prefix``: ``"bucket/some/prefix"`` -> ``("bucket", "some/prefix")``."""
    if any(pattern.search(bucket) for pattern in _BAD_BUCKET):
        raise ConfigFileError(f"{where}: invalid bucket (a '/' with '.' reads as a path)")
    name, _, prefix = bucket.partition("/")
    return name, prefix or None


# gitlab.yml


def _mapping(value: object, path: Path, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigFileError(f"{path}: {where} is not a mapping")
    return value


def _truthy(value: object) -> bool:
    """``Gitlab::Utils.to_boolean``: true, "true", "yes", "1" ... are true."""
    return value is True or str(value).strip().lower() in ("true", "t", "yes", "y", "1", "on")


def _use_consolidated(settings: dict, path: Path) -> bool:
    """``ObjectStoreSettings#use_consolidated_settings?``: object_store enabled with a connection, and no accelerated
    type with its own enabled connection that differs."""
    common = _mapping(settings.get("object_store"), path, f"{SECTION}.object_store")
    if not common.get("enabled") or not common.get("connection"):
        return False
    for store_type in ACCELERATED_TYPES:
        own = _mapping(_mapping(settings.get(store_type), path, f"{SECTION}.{store_type}").get("object_store"),
                       path, f"{SECTION}.{store_type}.object_store")
        if own.get("enabled") and own.get("connection") and own["connection"] != common["connection"]:
            return False
    return True


def _artifacts_settings(settings: dict, path: Path) -> tuple[dict, str, str] | None:
    """The artifacts' object_store after ``ObjectStoreSettings#parse!``: (settings, bucket, the section read)."""
    artifacts = _mapping(settings.get("artifacts"), path, f"{SECTION}.artifacts")
    if artifacts.get("enabled") is False:
        return None
    if _use_consolidated(settings, path):
        common = settings["object_store"]
        objects = _mapping(common.get("objects"), path, f"{SECTION}.object_store.objects")
        overrides = _mapping(objects.get("artifacts"), path, f"{SECTION}.object_store.objects.artifacts")
        if overrides.get("enabled", True):
            if not overrides.get("bucket"):
                raise ConfigFileError(f"{path}: {SECTION}.object_store.objects.artifacts.bucket is missing (Object "
                                      "storage for artifacts must have a bucket specified)")
            return common, str(overrides["bucket"]), f"{SECTION}.object_store"
    own = _mapping(artifacts.get("object_store"), path, f"{SECTION}.artifacts.object_store")
    if not own.get("enabled"):
        return None
    where = f"{SECTION}.artifacts.object_store"
    if not own.get("remote_directory"):
        raise ConfigFileError(f"{path}: {where}.remote_directory is missing")
    return own, str(own["remote_directory"]), where


def _text(connection: dict, key: str, path: Path, where: str) -> str | None:
    value = connection.get(key)
    if value is None or value == "":
        return None
    if isinstance(value, dict | list):
        raise ConfigFileError(f"{path}: {where}.{key} is a {type(value).__name__}, expected a string")
    return str(value)


def _endpoint(connection: dict, path: Path, where: str) -> str | None:
    """fog-aws: ``endpoint``, else ``scheme://host:port`` when a ``host`` is given (default: AWS's own)."""
    endpoint = _text(connection, "endpoint", path, where)
    host = _text(connection, "host", path, where)
    if endpoint or not host:
        return endpoint
    port = _text(connection, "port", path, where)
    return f"{_text(connection, 'scheme', path, where) or 'https'}://{host}" + (f":{port}" if port else "")


def from_gitlab_yml(config_dir: str | Path) -> ObjectStore | None:
    """The artifacts' object store of ``<config_dir>/gitlab.yml`` (``production:``); None when there is no such file
    or GitLab keeps artifacts on local storage. Errors name the file and the key, never a value."""
    path = Path(config_dir) / "gitlab.yml"
    settings = production(path)
    if settings is None:
        return None
    settings = _mapping(settings, path, SECTION)
    found = _artifacts_settings(settings, path)
    if found is None:
        return None
    options, bucket_text, section = found
    bucket, prefix = split_bucket_prefix(bucket_text, f"{path}: {section}'s bucket")
    where = f"{section}.connection"
    connection = _mapping(options.get("connection"), path, where)
    iam = _truthy(connection.get("use_iam_profile", False))
    return ObjectStore(
        provider=_text(connection, "provider", path, where) or "", bucket=bucket, prefix=prefix,
        source=f"{path} ({section})",
        region=_text(connection, "region", path, where), endpoint=_endpoint(connection, path, where),
        path_style=_truthy(connection.get("path_style", False)),
        # use_iam_profile: no keys, so boto3 takes its default chain (the instance profile among it)
        access_key_id=None if iam else _text(connection, "aws_access_key_id", path, where),
        secret_access_key=None if iam else _text(connection, "aws_secret_access_key", path, where),
        session_token=_text(connection, "aws_session_token", path, where),
    )


def from_environment(environ: Mapping[str, str]) -> ObjectStore | None:
    """``CI_CLEANUP_ARTIFACTS_OBJECT_STORE_*``, for an installation without GitLab's config folder; None unless the
    bucket is set. Keys unset: boto3's default chain (``AWS_*`` variables, the instance profile)."""
    value = {name: environ.get(ENV_PREFIX + name) or None for name in ENV_NAMES}
    if value["BUCKET"] is None:
        stray = [ENV_PREFIX + name for name in ENV_NAMES if value[name] is not None]
        if stray:
            raise ConfigFileError(f"{stray[0]} is set but {ENV_BUCKET} is not: set the artifacts bucket too")
        return None
    bucket, prefix = split_bucket_prefix(value["BUCKET"], ENV_BUCKET)
    return ObjectStore(
        provider=value["PROVIDER"] or AWS, bucket=bucket, prefix=prefix, source=f"environment ({ENV_PREFIX}*)",
        region=value["REGION"], endpoint=value["ENDPOINT"], path_style=_truthy(value["PATH_STYLE"] or False),
        access_key_id=value["ACCESS_KEY_ID"], secret_access_key=value["SECRET_ACCESS_KEY"],
        session_token=value["SESSION_TOKEN"],
    )


def artifacts_object_store(environ: Mapping[str, str] = os.environ) -> ObjectStore | None:
    """The environment's settings when set (they override, as for the databases), else GitLab's ``gitlab.yml`` in
    ``CI_CLEANUP_GITLAB_CONFIG_DIR``, else None: no object store."""
    store = from_environment(environ)
    if store is None and environ.get(ENV_CONFIG_DIR):
        store = from_gitlab_yml(environ[ENV_CONFIG_DIR])
    return store


# The client


class ObjectFailed(Exception):
    """An object that could not be removed (or looked at); the message names the bucket and endpoint, no secret."""


class S3Objects:
    """Removes objects from an ``AWS`` store through boto3, as fog-aws's ``File#destroy`` does: one DELETE per key,
    which S3 answers alike for a key that exists and one that does not. A HEAD before it tells the two apart for the
    run's counts; the DELETE decides: its success means the object is gone (a missing bucket fails it, where a HEAD
    would only say 404)."""

    def __init__(self, store: ObjectStore, *, timeout_seconds: float = 5.0):
        import boto3
        from botocore.config import Config

        self.store = store
        session = boto3.session.Session(
            aws_access_key_id=store.access_key_id, aws_secret_access_key=store.secret_access_key,
            aws_session_token=store.session_token, region_name=store.region or "us-east-1")
        config = Config(
            s3={"addressing_style": "path" if store.path_style else "auto"},
            connect_timeout=timeout_seconds, read_timeout=timeout_seconds,
            retries={"total_max_attempts": 2, "mode": "standard"}, max_pool_connections=WORKERS,
            # S3-compatible stores (older MinIO, Ceph) refuse the CRC checksums botocore now sends by default
            request_checksum_calculation="when_required", response_checksum_validation="when_required",
        )
        self._client = session.client("s3", endpoint_url=store.endpoint, config=config)
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="object-store")

    def close(self) -> None:
        self._pool.shutdown()
        self._client.close()

    def __enter__(self) -> S3Objects:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _failure(self, error: Exception, doing: str) -> ObjectFailed:
        from botocore.exceptions import ClientError

        if isinstance(error, ClientError):
            code = error.response.get("Error", {}).get("Code") or error.response.get(
                "ResponseMetadata", {}).get("HTTPStatusCode")
            reason = f"{code}" + (f" ({error.response['Error']['Message']})"
                                  if error.response.get("Error", {}).get("Message") else "")
        else:
            reason = type(error).__name__
        return ObjectFailed(f"{doing} failed in {self.store.where()}: {reason}")

    def exists(self, key: str) -> bool:
        """HEAD: True if the object is there, False on 404 (or a missing bucket); ObjectFailed otherwise."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._client.head_object(Bucket=self.store.bucket, Key=key)
        except ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return False
            raise self._failure(e, "HEAD") from None
        except BotoCoreError as e:
            raise self._failure(e, "HEAD") from None
        return True

    def remove(self, key: str) -> bool:
        """DELETE the object; True if it was there (removed), False if it was already missing; ObjectFailed if the
        store did not confirm it gone."""
        from botocore.exceptions import BotoCoreError, ClientError

        present = self.exists(key)
        try:
            self._client.delete_object(Bucket=self.store.bucket, Key=key)
        except (ClientError, BotoCoreError) as e:
            raise self._failure(e, "DELETE") from None
        return present

    def check_bucket(self) -> None:
        """HEAD the bucket (a dry run's check that a DELETE could succeed); ObjectFailed if it cannot be reached."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._client.head_bucket(Bucket=self.store.bucket)
        except (ClientError, BotoCoreError) as e:
            raise self._failure(e, "HEAD bucket") from None

    def map(self, function, keys: list[str], seconds: float | None = None) -> list[bool | ObjectFailed]:
        """``function`` (:meth:`remove` or :meth:`exists`) on every key, WORKERS at a time: each key's result, or its
        failure, in order. A failure never stops the others; a key not started within ``seconds`` fails."""
        deadline = None if seconds is None else time.monotonic() + seconds

        def one(key: str) -> bool | ObjectFailed:
            if deadline is not None and time.monotonic() > deadline:
                return ObjectFailed(f"not tried in {self.store.where()}: the batch's {seconds:g} s ran out")
            try:
                return function(key)
            except ObjectFailed as e:
                return e

        return list(self._pool.map(one, keys))
