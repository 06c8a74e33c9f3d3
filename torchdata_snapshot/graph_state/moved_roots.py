"""A data directory that moved: a checkpoint restored onto ``FileLister`` s whose roots are elsewhere.

A checkpoint records the roots each ``FileLister`` was given (among its arguments, see
``checkpoint.arguments``) and, per worker, the files a restore reads again (their paths, sizes and
modification times) and the states of its readers and listers, paths included. A pipeline
built again on a data directory that was moved or copied lists other roots. A root of a
``FileLister`` (the same DataPipe of the same pipeline, with as many roots) that is another
path now is taken to have *moved* there; the restore then checks, before any worker starts,
that every file the checkpoint reads again under the old root is under the new one by the same
name below the root, with the same size and modification time (a move keeps both; a copy keeps
the time when asked to: ``cp -a``, ``rsync -a``, ``shutil.copytree``). A file that is missing or
differs raises :class:`~torchdata_snapshot.ChangedFileError` naming each one. Otherwise the
checkpoint is rewritten as though it had been taken there (every path under an old root, in
the recorded arguments, the files to check and the workers' graph states, is put under the new
root) and restores as usual: the workers check those files again, and each ``FileLister`` that
its listing names the same files below the root before its position.

A move does not carry over into the items themselves: an item that holds its file's path (such
as ``readlines()``'s ``(path, line)``, unless ``return_path=False``) is another item under the
new root, and the replay after a captured state refuses it with
:class:`~torchdata_snapshot.ReplayDivergenceError`, as it refuses any other change of the data.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

from torch.utils.data.datapipes.iter.filelister import FileListerIterDataPipe
from torchdata.dataloader2.graph import DataPipe

from torchdata_snapshot._errors import ChangedFileError
from torchdata_snapshot.checkpoint.format import Checkpoint
from torchdata_snapshot.checkpoint.identity import GraphIdentity
from torchdata_snapshot.core.graph import graph_datapipes
from torchdata_snapshot.graph_state.file_origins import (
    ArchiveMemberOrigin,
    DecompressedOrigin,
    FileOrigin,
    Origin,
    Reopen,
    map_nested,
    pack_opened,
    unpack_opened,
)
from torchdata_snapshot.graph_state.graph_state import rewrite_graph_state

__all__ = ["MovedRoot", "moved_roots", "resumed_where_moved"]

#: How many of the files that differ a refusal names (it counts the others).
_NAMED_FILES = 8


@dataclass(frozen=True)
class MovedRoot:
    """Root ``old`` of the checkpoint's DataPipe ``key`` (a ``FileLister``) is ``new`` now."""

    key: str
    old: str
    new: str

    def moved(self, path: str) -> Optional[str]:
        """``path`` under ``new`` if it is ``old`` or below it, else ``None``. A relative root
        also moves the absolute paths a ``FileLister(abspath=True)`` lists below it."""
        pairs = [(self.old, self.new)]
        if not os.path.isabs(self.old):
            pairs.append((os.path.abspath(self.old), os.path.abspath(self.new)))
        for old, new in pairs:
            if path == old:
                return new
            prefix = old.rstrip(os.sep) + os.sep
            if path.startswith(prefix):
                return os.path.join(new, path[len(prefix) :])
        return None


def moved_roots(state: Checkpoint, datapipe: DataPipe, graph: GraphIdentity) -> Tuple[MovedRoot, ...]:
    """The roots of ``datapipe``'s ``FileLister`` s (``graph``: its identity) that are other paths
    than those ``state`` recorded for them, the same DataPipes of the same pipeline with as many
    roots; none when the pipelines differ otherwise (the restore refuses them) or ``state`` did
    not record the roots."""
    recorded, current = state.graph.arguments, graph.arguments
    if state.graph.fingerprint != graph.fingerprint or recorded is None or current is None:
        return ()
    moves: List[MovedRoot] = []
    for key, dp in graph_datapipes(datapipe):
        if type(dp) is not FileListerIterDataPipe:
            continue
        old, new = recorded.get(key, {}).get("root"), current.get(key, {}).get("root")
        if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
            moves.extend(MovedRoot(key, o, n) for o, n in zip(old, new) if o != n)
    return tuple(moves)


def resumed_where_moved(state: Checkpoint, moves: Tuple[MovedRoot, ...]) -> Checkpoint:
    """``state`` as though it had been taken with each root where ``moves`` put it, once every
    file it reads again under those roots was found the same there; raises
    :class:`ChangedFileError` naming the files that are missing or differ."""
    if not moves:
        return state
    mover = _Mover(moves)
    workers = tuple(
        replace(
            worker,
            opened=tuple(mover.opened(blob) for blob in worker.opened),
            state=None
            if worker.state is None
            else (worker.state[0], rewrite_graph_state(worker.state[1], mover.value), worker.state[2]),
        )
        for worker in state.workers
    )
    mover.check()
    arguments = dict(state.graph.arguments or {})
    for move in moves:
        roots = [move.new if root == move.old else root for root in arguments[move.key]["root"]]
        arguments[move.key] = {**arguments[move.key], "root": roots}
    return replace(state, graph=replace(state.graph, arguments=arguments), workers=workers)


class _Mover:
    """Puts paths under the roots they moved to, and notes the files whose path it moved."""

    def __init__(self, moves: Tuple[MovedRoot, ...]) -> None:
        self.moves = moves
        self.files: Dict[Tuple[str, Any], Tuple[FileOrigin, MovedRoot]] = {}

    def path(self, path: str) -> str:
        for move in self.moves:
            moved = move.moved(path)
            if moved is not None:
                return moved
        return path

    def _note(self, before: List[FileOrigin], after: List[FileOrigin]) -> None:
        for old, new in zip(before, after):
            move = next((m for m in self.moves if m.moved(old.path) is not None), None)
            if move is not None:
                self.files.setdefault((new.path, new.fingerprint), (new, move))

    def value(self, value: Any) -> Any:
        """A DataPipe's state, its paths moved."""
        moved = with_paths(value, self.path)
        self._note(described_files(value), described_files(moved))
        return moved

    def opened(self, blob: bytes) -> bytes:
        """A record of opened files (see ``pack_opened``), their paths moved."""
        before = list(unpack_opened(blob))
        after = [with_paths(origin, self.path) for origin in before]
        self._note(before, after)
        return pack_opened(after)

    def check(self) -> None:
        """Raise :class:`ChangedFileError` unless every file noted is the same where it moved."""
        differ = [
            (origin, move, difference)
            for origin, move in self.files.values()
            for difference in [_difference(origin)]
            if difference is not None
        ]
        if not differ:
            return
        moves = sorted({(move.old, move.new) for _, move, _ in differ})
        named = [f"{origin.path} {difference}" for origin, _, difference in differ[:_NAMED_FILES]]
        if len(differ) > _NAMED_FILES:
            named.append(f"and {len(differ) - _NAMED_FILES} more")
        raise ChangedFileError(
            f"the data moved ({', '.join(f'{old} to {new}' for old, new in moves)}), but "
            f"{len(differ)} of the files the checkpoint reads again "
            f"{'is' if len(differ) == 1 else 'are'} not the same there: {'; '.join(named)}. Copy "
            "the files keeping their modification times (moving them does; so do cp -a, rsync -a "
            "and shutil.copytree), or resume with the files the checkpoint was taken with"
        )


def _difference(origin: FileOrigin) -> Optional[str]:
    """How the file differs from when it was read before the checkpoint, or ``None``."""
    try:
        size, time = origin.current_fingerprint()
    except OSError:
        return "is missing"
    size_then, time_then = origin.fingerprint
    differences = []
    if size != size_then:
        differences.append(f"has {size} bytes, had {size_then}")
    if time != time_then:
        differences.append(f"was modified {_shown_time(time)}, {_shown_time(time_then)} then")
    return " and ".join(differences) or None


def _shown_time(time: Any) -> str:
    """A modification time as a message shows it: a local file's (ns since the epoch) in UTC."""
    if isinstance(time, int):
        moment = datetime.datetime.fromtimestamp(time / 1e9, datetime.timezone.utc)
        return moment.isoformat(sep=" ", timespec="microseconds")
    return str(time)


# --- files seen where the data moved (described values are file_origins') --------------------


def files_of(origin: Origin) -> Tuple[FileOrigin, ...]:
    """The file an origin's stream comes from (through its decompressions and archives)."""
    if isinstance(origin, DecompressedOrigin):
        return files_of(origin.inner)
    if isinstance(origin, ArchiveMemberOrigin):
        return files_of(origin.archive)
    return (origin,)


def described_files(value: Any) -> List[FileOrigin]:
    """The files of the streams a described value (see :func:`describe`) refers to, in order."""
    found: List[FileOrigin] = []

    def note(leaf: Any) -> Any:
        if isinstance(leaf, Reopen):
            found.extend(files_of(leaf.origin))
        elif isinstance(leaf, (FileOrigin, DecompressedOrigin, ArchiveMemberOrigin)):
            found.extend(files_of(leaf))
        return leaf

    map_nested(value, note)
    return found


def with_paths(value: Any, path: Callable[[str], str]) -> Any:
    """``value`` (plain data, or a described value) with ``path`` applied to every string inside
    its tuples, lists and dicts and to the path of every file its origins name: the value as it
    would read had its files been where ``path`` puts them (a data directory that moved).
    Anything else, archive members' names among it, stays as it is."""

    def moved_origin(origin: Origin) -> Origin:
        if isinstance(origin, DecompressedOrigin):
            return replace(origin, inner=moved_origin(origin.inner))
        if isinstance(origin, ArchiveMemberOrigin):
            return replace(origin, archive=moved_origin(origin.archive))
        return replace(origin, path=path(origin.path))

    def leaf(value: Any) -> Any:
        if isinstance(value, str):
            return path(value)
        if isinstance(value, Reopen):
            return Reopen(moved_origin(value.origin), None if value.name is None else path(value.name))
        if isinstance(value, (FileOrigin, DecompressedOrigin, ArchiveMemberOrigin)):
            return moved_origin(value)
        return value

    return map_nested(value, leaf)
