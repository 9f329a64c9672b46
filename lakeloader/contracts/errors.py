"""Errors a user can cause, each saying what was wrong, where, and what to do."""

from __future__ import annotations


class LakeloaderError(Exception):
    """Base class of every error lakeloader raises on purpose."""


class ConfigError(LakeloaderError):
    """The config is invalid: the message names the file, line and key."""


class SourceError(LakeloaderError):
    """A source file is missing or unreadable."""


class InputError(LakeloaderError):
    """A record of a source is unusable; the message names the file and line/row.

    Raised inside Dask tasks, so it must stay picklable: the message is its only argument.
    """


class CatalogLockedError(LakeloaderError):
    """Another process holds the lake's catalog for writing."""


class CatalogError(LakeloaderError):
    """The catalog is missing, from another version, or inconsistent with the lake."""


class CatalogNotPublishedError(CatalogError):
    """The lake has no published catalog snapshot yet (its first build has not published one)."""


class CatalogIntegrityError(CatalogError):
    """A file of the lake's published catalog (its pointer, a snapshot, a reader index) is damaged
    or was altered: it fails its checksum, is not as lakeloader writes it, or names a path outside
    the lake. The message names the file and what to do."""


class ChunkIntegrityError(LakeloaderError):
    """A chunk file is missing or does not match its catalog record."""


class StorageUnavailableError(LakeloaderError):
    """Object storage stayed unreachable past the configured retry deadline."""


class BucketNotFoundError(LakeloaderError):
    """The object-store bucket of a lake's URL does not exist (or the credentials cannot see it)."""


class SchedulerError(LakeloaderError):
    """A build's Dask scheduler could not be reached, or was lost while the build ran: the message
    names it, says what was kept and what to do (a re-run resumes from the committed chunks)."""


class BuildInterrupted(KeyboardInterrupt):
    """A build stopped by Ctrl-C (SIGINT) after recording itself interrupted: the message says
    what it committed and that a re-run resumes. Still a KeyboardInterrupt for callers."""


class StepRangeError(LakeloaderError, IndexError):
    """A step outside the batches the loader has: the message names the valid range."""


class LakeWriteError(LakeloaderError):
    """Writing into the lake or its catalog failed (disk full, read-only, no permission); the
    message names the file and what to do. Raised inside Dask tasks: the message is its only argument."""


class QueryLimitError(CatalogError):
    """A query on the catalog ran past a limit of the config's ``sql`` section (its time or
    memory) and was stopped; the message names the key to raise."""
