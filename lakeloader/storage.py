"""Small helpers over fsspec filesystems shared by every stage."""

from __future__ import annotations

import difflib
import errno
import hashlib
import logging
import os
import sys
import time
import urllib.parse
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import fsspec
from fsspec.core import url_to_fs

from lakeloader.contracts.errors import BucketNotFoundError, LakeWriteError, StorageUnavailableError

log = logging.getLogger(__name__)
T = TypeVar("T")


def _transient_types() -> tuple[type[BaseException], ...]:
    """The connection-level errors a retry may cure: the standard library's, and those of the
    object-store clients (botocore, aiohttp) this process has imported. A client never imported
    raised nothing, and importing aiohttp only to name its errors cost ~130 ms of every process's
    start (its SSL context is made on import), workers' included."""
    types: list[type[BaseException]] = [ConnectionError, TimeoutError]
    boto = sys.modules.get("botocore.exceptions")
    if boto is not None:
        types += [boto.EndpointConnectionError, boto.ConnectTimeoutError, boto.ReadTimeoutError,
                  boto.ConnectionClosedError]
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None:
        types.append(aiohttp.ClientConnectionError)
    return tuple(types)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a connection-level failure that a
    retry may cure, as opposed to a missing file, a permission problem or bad data."""
    transient = _transient_types()
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (FileNotFoundError, PermissionError, IsADirectoryError)):
            return False
        if isinstance(seen, transient):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def with_retries(call: Callable[[], T], *, what: str, deadline: float,
                 on_retry: Callable[[], None] | None = None) -> T:
    """``call()``, retried with exponential backoff while it fails with transient storage errors,
    for at most ``deadline`` seconds; then :class:`StorageUnavailableError` naming ``what``."""
    started = time.monotonic()
    delay = 0.25
    while True:
        try:
            return call()
        except Exception as exc:
            if not is_transient(exc):
                raise
            waited = time.monotonic() - started
            if waited + delay > deadline:
                raise StorageUnavailableError(
                    f"{what}: storage unreachable for {waited:.0f}s ({type(exc).__name__}: {exc}). "
                    "Check the endpoint and credentials, then re-run (builds resume, readers restore "
                    "from their saved step), or raise io_retry_deadline in the config."
                ) from exc
            log.warning("%s: %s; retrying in %.1fs", what, exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 8.0)
            if on_retry is not None:
                on_retry()


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is the local filesystem."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocols or "local" in protocols


def sha256_of(handle: Any, block_size: int = 8 << 20) -> str:
    """Hex sha256 of everything an open binary file yields from its current position on."""
    digest = hashlib.sha256()
    while block := handle.read(block_size):
        digest.update(block)
    return digest.hexdigest()


def write_atomically(url: str, data: bytes, storage_options: dict[str, Any]) -> None:
    """Write ``data`` so readers see either no file or the whole file (rename; one PUT remotely)."""
    fs, path = url_to_fs(url, **storage_options)
    if not is_local(fs):
        fs.pipe_file(path, data)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        remove_quietly(temporary)  # a full disk must not also keep the partial file
        raise


def remove_quietly(path: str) -> None:
    """Delete the local file ``path`` if it exists (cleanup on an error path: never raises)."""
    try:
        os.remove(path)
    except OSError:
        pass


def write_failure(what: str, path: str, exc: BaseException) -> LakeWriteError:
    """A :class:`LakeWriteError` for an OS error writing ``path``: says what failed and what to do."""
    reason = getattr(exc, "strerror", None) or str(exc)
    code = getattr(exc, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        advice = "free space there (or point `lake:` at a larger disk)"
    elif code == errno.EROFS:
        advice = "the file system is read-only: remount it read-write or point `lake:` at a writable folder"
    elif code in (errno.EACCES, errno.EPERM):
        advice = "give this user write permission there or point `lake:` at a writable folder"
    else:
        advice = "fix the path (or point `lake:` at a writable folder)"
    return LakeWriteError(f"{what}: cannot write {path}: {reason}. {advice[0].upper()}{advice[1:]}, then re-run "
                          "`lakeloader build CONFIG` (it resumes from the committed chunks)")


def missing_bucket(fs: fsspec.AbstractFileSystem, root: str, what: str) -> BucketNotFoundError | None:
    """The error for ``what`` (a lake at ``root`` on ``fs``) when its object-store bucket does not
    exist; None when it does, when ``fs`` has no buckets, or when a probe cannot tell."""
    if is_local(fs):
        return None
    bucket = root.strip("/").split("/", 1)[0]
    try:
        if not bucket or fs.exists(bucket):
            return None
    except Exception:   # a probe that cannot answer leaves the caller's own error standing
        return None
    return BucketNotFoundError(
        f"{what}: bucket {bucket!r} does not exist (or these credentials cannot see it): create it, or "
        "correct `lake:` or `storage_options` in the config")


S3_PROTOCOLS = ("s3", "s3a")
# Options fsspec takes for every filesystem (its instance and listings caches).
_FSSPEC_OPTIONS = ("skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths")
_OPTION_MAPPINGS = ("client_kwargs", "config_kwargs", "s3_additional_kwargs")
_OPTION_STRINGS = ("endpoint_url", "key", "secret", "token", "username", "password", "profile")
_CLIENT_TWICE = {"endpoint_url": "endpoint_url", "key": "aws_access_key_id", "secret": "aws_secret_access_key",
                 "token": "aws_session_token"}
_RETRIES = {"max_attempts": "an int >= 0", "total_max_attempts": "an int >= 1", "mode": "legacy, standard or adaptive"}
_MODEL_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "string": ((str,), "a string"), "integer": ((int,), "an integer"), "long": ((int,), "an integer"),
    "boolean": ((bool,), "true or false")}
OptionProblem = tuple[tuple[str, ...], str]


def _parameters(function: Callable[..., Any], *leave_out: str) -> list[str]:
    """The named parameters of ``function`` but ``self``, ``*args``, ``**kwargs`` and ``leave_out``."""
    import inspect

    return [name for name, parameter in inspect.signature(function).parameters.items()
            if name not in ("self", *leave_out) and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)]


def _unknown(keys: list[Any], allowed: list[str], where: tuple[str, ...], of: str) -> OptionProblem | None:
    for key in keys:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            guess = f" (did you mean {close[0]}?)" if close else ""
            return (*where, str(key)), f"unknown {of} option{guess}; allowed: {', '.join(sorted(allowed))}"
    return None


def _endpoint_problem(value: Any, where: tuple[str, ...]) -> OptionProblem | None:
    parts = urllib.parse.urlsplit(value) if isinstance(value, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        return where, "not a URL: give the object store's address as http(s)://host[:port]"
    return None


def s3_options_problem(options: Mapping[str, Any]) -> OptionProblem | None:
    """The first of ``options`` (the fsspec options of s3:// URLs) that s3fs or botocore would fail
    on at the first request: its key path and what is allowed there; None if every one fits. A
    problem never quotes a value (they hold credentials)."""
    import aiobotocore.session
    import botocore.session
    import s3fs

    allowed = [*_parameters(s3fs.S3FileSystem.__init__, "loop", "asynchronous", "session"),
               *_parameters(aiobotocore.session.AioSession.__init__), *_FSSPEC_OPTIONS]
    problem = _unknown(list(options), allowed, (), "storage")
    for key in _OPTION_MAPPINGS:
        if problem is None and options.get(key) is not None and not isinstance(options[key], Mapping):
            problem = (key,), "must be a mapping of option: value"
    for key in _OPTION_STRINGS:
        if problem is None and options.get(key) is not None and not isinstance(options[key], str):
            problem = (key,), "must be a string"
    if problem is None and options.get("endpoint_url") is not None:
        problem = _endpoint_problem(options["endpoint_url"], ("endpoint_url",))
    client = options.get("client_kwargs") or {}
    if problem is None:
        problem = _unknown(list(client), _parameters(botocore.session.Session.create_client, "service_name", "config"),
                           ("client_kwargs",), "client_kwargs")
    if problem is None and client.get("endpoint_url") is not None:
        problem = _endpoint_problem(client["endpoint_url"], ("client_kwargs", "endpoint_url"))
    for option, argument in _CLIENT_TWICE.items():   # s3fs passes both to botocore: it refuses a clash
        if problem is None and options.get(option) is not None and client.get(argument) not in (None, options[option]):
            problem = ("client_kwargs", argument), f"differs from storage_options.{option}, which sets it too: keep one"
    return (problem or _config_problem(options.get("config_kwargs") or {})
            or _request_problem(options.get("s3_additional_kwargs") or {}))


def _config_problem(config: Mapping[str, Any]) -> OptionProblem | None:
    """The first problem of ``config_kwargs`` (botocore's client Config)."""
    from aiobotocore.config import AioConfig
    from botocore.config import Config

    where = ("config_kwargs",)
    problem = _unknown(list(config), [*Config.OPTION_DEFAULTS, *_parameters(AioConfig.__init__)], where, "config_kwargs")
    if problem is not None:
        return problem
    retries = config.get("retries")
    if retries is not None:
        allowed = "; ".join(f"{key}: {kind}" for key, kind in _RETRIES.items())
        if not isinstance(retries, Mapping):
            return (*where, "retries"), f"must be a mapping ({allowed}), e.g. {{max_attempts: 5}}"
        unknown = _unknown(list(retries), list(_RETRIES), (*where, "retries"), "retries")
        if unknown is not None:
            return unknown
        for key in ("max_attempts", "total_max_attempts"):
            if key in retries and (not isinstance(retries[key], int) or isinstance(retries[key], bool)):
                return (*where, "retries", key), f"must be {_RETRIES[key]}"
    try:
        AioConfig(**config)
    except Exception as exc:   # botocore's own checks (retry mode, attempts, addressing style)
        return where, f"botocore refuses these settings ({type(exc).__name__}); see botocore.config.Config"
    return None


def _request_problem(extra: Mapping[str, Any]) -> OptionProblem | None:
    """The first problem of ``s3_additional_kwargs`` (parameters added to every S3 request that
    takes them): a name no S3 request takes, or a value of the wrong type or not one of its values."""
    import botocore.session

    if not extra:
        return None
    model = botocore.session.get_session().get_service_model("s3")   # ~0.1 s: only when there are some
    shapes: dict[str, Any] = {}
    for operation in model.operation_names:
        shape = model.operation_model(operation).input_shape
        for name, member in (shape.members.items() if shape is not None else ()):
            shapes.setdefault(name, member)
    for key, value in extra.items():
        where = ("s3_additional_kwargs", str(key))
        shape = shapes.get(key)
        if shape is None:
            return where, "no S3 request takes this parameter (names as in the S3 API, e.g. ServerSideEncryption, ACL)"
        types, described = _MODEL_TYPES.get(shape.type_name, (None, ""))
        if types is not None and (not isinstance(value, types) or (bool not in types and isinstance(value, bool))):
            return where, f"must be {described}"
        values = getattr(shape, "enum", None)   # string shapes only
        if values and value not in values:
            return where, f"must be one of {', '.join(values)}"
    return None
