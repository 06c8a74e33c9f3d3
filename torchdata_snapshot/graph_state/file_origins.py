"""Streams that can be opened again: how a captured state refers to an open file.

A reader DataPipe's state at a yield point includes the element it is reading, typically
``(path, stream)``. A stream cannot be captured, but where it came from can: in a graph that
resumes from captured states, the openers (``FileOpener``, ``FSSpecFileOpener``) and the
DataPipes that make streams out of streams (``decompress``, ``load_from_xz``, ``load_from_bz2``,
``load_from_tar``, ``load_from_zip``) give each ``StreamWrapper`` they yield an *origin* (see
:func:`with_origin`): a small frozen description that ``open()`` opens again, at the start of
the stream. :func:`describe` replaces the streams of an element by their origins; :func:`rebuild`
opens them again.

An origin records the size and modification time a file had when it was first opened; opening
it again after either changed raises :class:`~torchdata_snapshot.ChangedFileError` naming the
file, instead of handing out other records. The files an item's production opened travel with
it as a packed record (:func:`pack_opened`), which a restore checks before it replays
(:func:`check_opened`): a file opened after the captured state it loads is checked too.
"""

from __future__ import annotations

import io
import os
import pickle
import tarfile
import zipfile
from dataclasses import dataclass
from typing import IO, Any, Callable, Dict, Optional, Sequence, Tuple, Union

from torch.utils.data.datapipes.utils.common import StreamWrapper

from torchdata_snapshot._compat.datapipes import decompressor_of
from torchdata_snapshot._errors import ChangedFileError, StateCaptureError, StateRestoreError

__all__ = [
    "ArchiveMemberOrigin",
    "DecompressedOrigin",
    "FileOrigin",
    "Origin",
    "Reopen",
    "check_described",
    "check_opened",
    "describe",
    "file_origin",
    "map_nested",
    "origin_of",
    "pack_opened",
    "rebuild",
    "unpack_opened",
    "with_origin",
]


def _fsspec_fingerprint(info: Dict[str, Any]) -> Tuple[Any, Any]:
    """``(size, modification time)`` of an fsspec ``info()``; filesystems name the time differently."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        if info.get(key) is not None:
            return info.get("size"), str(info[key])
    return info.get("size"), None


@dataclass(frozen=True)
class FileOrigin:
    """A file ``FileOpener`` (``fsspec=None``) or ``FSSpecFileOpener`` (``fsspec``: its connection
    and open keyword arguments) opened, with its size and modification time at that moment."""

    path: str
    mode: str
    encoding: Optional[str]
    fingerprint: Tuple[Any, Any]  # (size, modification time)
    fsspec: Optional[Tuple[Tuple[Tuple[str, Any], ...], Tuple[Tuple[str, Any], ...]]] = None

    def _filesystem(self) -> Tuple[Any, str]:
        import fsspec

        assert self.fsspec is not None
        return fsspec.core.url_to_fs(self.path, **dict(self.fsspec[0]))

    def current_fingerprint(self) -> Tuple[Any, Any]:
        if self.fsspec is None:
            stat = os.stat(self.path)
            return stat.st_size, stat.st_mtime_ns
        fs, path = self._filesystem()
        return _fsspec_fingerprint(fs.info(path))

    def check(self) -> None:
        """Raise :class:`ChangedFileError` if the file is gone or its size or time changed."""
        try:
            now = self.current_fingerprint()
        except OSError as e:  # FileNotFoundError among them
            raise ChangedFileError(
                f"{self.path} was read before the checkpoint and is gone ({e.strerror or e}): put it back, "
                "or resume from a checkpoint taken without it; if the data moved, build the pipeline on "
                "its new directory and resume with torchdata_snapshot.load_state_dict(dataloader, state)"
            ) from e
        if now != self.fingerprint:
            raise ChangedFileError(
                f"{self.path} changed since it was read before the checkpoint (size and modification time "
                f"{self.fingerprint} then, {now} now): resuming would hand out other records; put the "
                "file back as it was, or resume from a checkpoint taken since it changed"
            )

    def open(self) -> StreamWrapper:
        self.check()
        if self.fsspec is None:
            return StreamWrapper(open(self.path, self.mode, encoding=self.encoding))  # noqa: SIM115
        fs, path = self._filesystem()
        return StreamWrapper(fs.open(path, self.mode, **dict(self.fsspec[1])))


@dataclass(frozen=True)
class DecompressedOrigin:
    """The stream ``decompress`` made of the stream ``inner`` (``file_type``: torchdata's name)."""

    inner: Origin
    file_type: str

    def check(self) -> None:
        self.inner.check()

    def open(self) -> StreamWrapper:
        return _child(self.inner.open(), lambda inner: decompressor_of(self.file_type)(inner))


@dataclass(frozen=True)
class ArchiveMemberOrigin:
    """Member ``name`` of the tar (``tar_mode``, torchdata's ``mode``) or zip archive ``archive``."""

    archive: Origin
    name: str
    tar_mode: Optional[str] = None  # None: a zip archive

    def check(self) -> None:
        self.archive.check()

    def open(self) -> StreamWrapper:
        return _child(self.archive.open(), self._extract)

    def _extract(self, stream: StreamWrapper) -> IO:
        if self.tar_mode is None:
            with_members = zipfile.ZipFile(stream)
            for info in with_members.infolist():
                if os.path.normpath(info.filename) == self.name:
                    return with_members.open(info)
        else:
            # A stream archive (not seekable) can only extract the member it is at.
            seekable = getattr(stream, "seekable", lambda: False)()
            mode = self.tar_mode if seekable else self.tar_mode.replace(":", "|")
            open_tar: Any = tarfile.open  # its overloads want a literal mode
            archive = open_tar(fileobj=stream, mode=mode)
            for member in archive:
                if os.path.normpath(member.name) == self.name:
                    extracted = archive.extractfile(member)
                    if extracted is not None:
                        return extracted
        raise ChangedFileError(f"member {self.name} is no longer in {self.archive}")


Origin = Union[FileOrigin, DecompressedOrigin, ArchiveMemberOrigin]


def _child(parent: StreamWrapper, make: Callable[[StreamWrapper], IO]) -> StreamWrapper:
    """The stream ``make`` makes of ``parent``, which it closes when it is closed (as the readers'
    decompress and archive loaders chain their streams)."""
    try:
        child = StreamWrapper(make(parent), parent)
    finally:
        parent.autoclose()
    return child


def with_origin(stream: StreamWrapper, origin: Origin) -> StreamWrapper:
    """``stream``, knowing where it came from (an attribute of its own: ``StreamWrapper`` hands
    unknown attributes on to the file it wraps)."""
    stream.origin = origin  # type: ignore[attr-defined]
    return stream


def origin_of(value: Any) -> Optional[Origin]:
    """The origin of a stream :func:`with_origin` gave one, else ``None``."""
    return vars(value).get("origin") if isinstance(value, StreamWrapper) else None


def file_origin(path: str, mode: str, encoding: Optional[str], file: Any, fsspec: Any = None) -> FileOrigin:
    """The origin of ``file``, just opened from ``path``: its size and time from the open file
    itself where it can tell them (no second request to a remote filesystem)."""
    if fsspec is None:
        stat = os.fstat(file.fileno())
        return FileOrigin(path, mode, encoding, (stat.st_size, stat.st_mtime_ns))
    details = getattr(file, "details", None)
    if not isinstance(details, dict):
        fs, fs_path = FileOrigin(path, mode, encoding, (None, None), fsspec)._filesystem()
        details = fs.info(fs_path)
    return FileOrigin(path, mode, encoding, _fsspec_fingerprint(details), fsspec)


def pack_opened(origins: Sequence[FileOrigin]) -> bytes:
    """The files an item's production opened, as a worker sends them (see :func:`check_opened`)."""
    return pickle.dumps(tuple(origins), protocol=pickle.HIGHEST_PROTOCOL)


def unpack_opened(blob: bytes) -> Tuple[FileOrigin, ...]:
    """The files of one record :func:`pack_opened` made; :class:`StateRestoreError` if ``blob``
    is not such a record."""
    try:
        origins = pickle.loads(blob)
        if not isinstance(origins, tuple) or not all(isinstance(o, FileOrigin) for o in origins):
            raise ValueError(f"it unpickles to {type(origins).__name__}, not files")
    except Exception as e:
        raise StateRestoreError(
            f"the files a checkpoint recorded cannot be read: {type(e).__name__}: {e}"
        ) from e
    return origins


def check_opened(packed: Sequence[bytes]) -> None:
    """Raise :class:`ChangedFileError` naming the first file of ``packed`` (what
    :func:`pack_opened` made) that is gone, or whose size or modification time changed since it
    was opened; :class:`StateRestoreError` if ``packed`` is not such a record."""
    for blob in packed:
        for origin in unpack_opened(blob):
            origin.check()


@dataclass(frozen=True)
class Reopen:
    """In a described element: the stream that :func:`rebuild` opens again."""

    origin: Origin
    name: Optional[str]


def map_nested(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` with ``leaf`` applied to everything inside its tuples, lists and dicts."""
    if isinstance(value, tuple):
        items = tuple(map_nested(v, leaf) for v in value)
        return type(value)(*items) if hasattr(value, "_fields") else items
    if isinstance(value, list):
        return [map_nested(v, leaf) for v in value]
    if isinstance(value, dict):
        return {k: map_nested(v, leaf) for k, v in value.items()}
    return leaf(value)


def _described(value: Any) -> Any:
    origin = origin_of(value)
    if origin is not None:
        return Reopen(origin, value.name)
    if isinstance(value, (StreamWrapper, io.IOBase)):
        raise StateCaptureError(
            f"a state refers to a stream that cannot be opened again ({value!r:.200}): only streams "
            "of FileOpener, FSSpecFileOpener, decompress, load_from_xz, load_from_bz2, load_from_tar "
            "and load_from_zip can be"
        )
    return value


def describe(value: Any) -> Any:
    """``value`` with each stream that has an origin (inside tuples, lists and dicts) replaced by
    its origin; :class:`StateCaptureError` for any other stream, which cannot be opened again."""
    return map_nested(value, _described)


def _checked(value: Any) -> Any:
    if isinstance(value, Reopen):
        value.origin.check()
    return value


def check_described(value: Any) -> None:
    """Raise :class:`ChangedFileError` if a file a described value refers to changed."""
    map_nested(value, _checked)


def _rebuilt(value: Any) -> Any:
    if not isinstance(value, Reopen):
        return value
    stream = value.origin.open()
    stream.name = value.name
    return with_origin(stream, value.origin)


def rebuild(value: Any) -> Any:
    """The value :func:`describe` described, its streams opened again at their start."""
    return map_nested(value, _rebuilt)
