"""Readers resumed from captured states: files opened and parsed after sharding restore without
replaying the epoch, and a file that changed between the checkpoint and the restore is refused
with ``ChangedFileError`` naming it (instead of handing out other records)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest
from pipelines import _write_lines, _write_samples, line_and_length, read_sample, rs, take
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import FileLister, IterableWrapper

from torchdata_snapshot import ChangedFileError, StateRestoreError
from torchdata_snapshot._graph import graph_datapipes
from torchdata_snapshot._graph_state import GraphState

SHARDS, RECORDS = 4, 60


def lines(root: Path) -> Any:
    files = FileLister(str(root), masks="*.txt").shuffle().sharding_filter()
    return files.open_files().readlines(return_path=False).map(line_and_length)


def samples(root: Path) -> Any:
    files = FileLister(str(root), masks="*.tar").shuffle().sharding_filter()
    return files.open_files("b").load_from_tar().webdataset().map(read_sample)


KINDS: Dict[str, Any] = {"txt": (_write_lines, lines), "tar": (_write_samples, samples)}


@pytest.fixture(params=sorted(KINDS))
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def written(root: Path, kind: str) -> List[Path]:
    write = KINDS[kind][0]
    paths = [root / f"shard{shard}.{kind}" for shard in range(SHARDS)]
    for shard, path in enumerate(paths):
        write(shard, range(shard, RECORDS, SHARDS), str(path))
    return paths


def loader(root: Path, kind: str) -> DataLoader2:
    dl = DataLoader2(KINDS[kind][1](root), reading_service=rs(2))
    dl.seed(3)
    return dl


def appended(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"\n")


def touched(path: Path) -> None:
    """Same size and content, another modification time."""
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


CHANGES: Dict[str, Callable[[Path], None]] = {"appended": appended, "touched": touched, "deleted": os.remove}


def test_files_opened_after_sharding_resume_from_captured_states_exactly(tmp_path: Path, kind: str) -> None:
    written(tmp_path, kind)
    reference = loader(tmp_path, kind)
    epoch = list(reference)
    reference.shutdown()
    for k in (1, len(epoch) // 2, len(epoch) - 1):
        dl = loader(tmp_path, kind)
        it = iter(dl)
        head = take(it, k)
        assert all(s.stateful for s in dl.reading_service.snapshot()), "readers are resumable"
        state = dl.state_dict()
        dl.shutdown()
        again = DataLoader2.from_state(state, rs(2))
        try:
            assert head + list(again) == epoch, k
        finally:
            again.shutdown()


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("position", [3, RECORDS // 2, RECORDS - 1])
def test_a_file_changed_between_save_and_restore_is_refused_naming_it(
    tmp_path: Path, kind: str, change: str, position: int
) -> None:
    """At any position after the workers' first captured states (their second item): the file
    a captured state was reading is checked before anything is read again."""
    paths = written(tmp_path, kind)
    dl = loader(tmp_path, kind)
    it = iter(dl)
    take(it, position)
    state = dl.state_dict()
    dl.shutdown()
    for path in paths:  # whichever files the workers were reading
        CHANGES[change](path)
    again = DataLoader2.from_state(state, rs(2))
    try:
        with pytest.raises(ChangedFileError) as raised:
            list(again)
        assert any(str(path) in str(raised.value) for path in paths), raised.value
        assert isinstance(raised.value, StateRestoreError)
    finally:
        again.shutdown()
    assert again.reading_service._finalized, "the service is shut down, its workers gone"


def test_a_file_changed_on_an_fsspec_filesystem_is_refused(tmp_path: Path) -> None:
    import fsspec

    memory = fsspec.filesystem("memory")
    uris = [f"memory://{tmp_path.name}/{i}.txt" for i in range(3)]
    for i, uri in enumerate(uris):
        memory.pipe(uri[len("memory://") :], "".join(f"line {i} {j}\n" for j in range(5)).encode())

    def build() -> Any:
        return IterableWrapper(uris).open_files_by_fsspec().readlines()

    graph, state = GraphState().make_resumable(build()), GraphState()
    it = iter(graph)
    take(it, 2)
    blob = state.capture(graph_datapipes(graph))
    memory.pipe(uris[0][len("memory://") :], b"other\n")
    with pytest.raises(ChangedFileError, match=uris[0]):
        GraphState().load(graph_datapipes(GraphState().make_resumable(build())), blob)


@pytest.mark.parametrize("stateful", [True, False])
def test_files_opened_after_sharding_resume_elastically_each_record_once(
    tmp_path: Path, kind: str, stateful: bool
) -> None:
    """2 workers resumed as 3 (``elastic=True``), batches of 4 records: a new worker opens the
    file (archive) an old one was in the middle of and skips the records the user had; every
    record of the epoch is delivered exactly once. Without captured states (``stateful=False``)
    the readers are counted all the same."""
    written(tmp_path, kind)

    def batched(workers: int) -> DataLoader2:
        return DataLoader2(KINDS[kind][1](tmp_path).batch(4), reading_service=rs(workers, stateful=stateful))

    reference = batched(2)
    reference.seed(3)
    epoch = [record for batch in reference for record in batch]
    reference.shutdown()
    assert len(set(epoch)) == len(epoch) == RECORDS
    for k in (1, 5, RECORDS // 4 - 1):
        dl = batched(2)
        dl.seed(3)
        try:
            head = [record for batch in take(iter(dl), k) for record in batch]
            state = dl.state_dict()
        finally:
            dl.shutdown()
        resumed = DataLoader2.from_state(state, rs(3, elastic=True, stateful=stateful))
        try:
            rest = [record for batch in resumed for record in batch]
        finally:
            resumed.shutdown()
        assert Counter(head + rest) == Counter(epoch), f"resumed at {k}: not each record exactly once"


def listed_in_order(root: Path) -> Any:
    """Files in the lister's order (no shuffle): where the lister stands in its listing matters."""
    files = FileLister(str(root), masks="*.txt").sharding_filter()
    return files.open_files().readlines(return_path=False).map(line_and_length)


LISTING_CHANGES: Dict[str, Callable[[Path], None]] = {
    "a file added before the position": lambda root: _write_lines(9, range(1000, 1010), str(root / "a.txt")),
    "a file read before the position removed": lambda root: os.remove(root / "shard0.txt"),
    "a file renamed": lambda root: os.rename(root / "shard1.txt", root / "shard1b.txt"),
}


@pytest.mark.parametrize("change", sorted(LISTING_CHANGES))
def test_a_directory_listing_changed_between_save_and_restore_is_refused_naming_it(
    tmp_path: Path, change: str
) -> None:
    """The workers' listers had handed on the first files of the listing: counting into another
    listing would skip or repeat whole files, so the restore names the directory instead. (An
    elastic resume does not check files: see the elastic page.)"""
    written(tmp_path, "txt")
    # A state after every item: the readers' files are their second ones, which stay unchanged.
    dl = DataLoader2(listed_in_order(tmp_path), reading_service=rs(2, max_items_between_captures=1))
    try:
        take(iter(dl), RECORDS // 2 + 4)
        state = dl.state_dict()
    finally:
        dl.shutdown()
    LISTING_CHANGES[change](tmp_path)
    again = DataLoader2.from_state(state, rs(2))
    try:
        with pytest.raises(ChangedFileError, match=f"{tmp_path} lists other files than when the state"):
            list(again)
    finally:
        again.shutdown()


def test_a_file_added_after_the_listers_position_is_read_as_it_is_now(tmp_path: Path) -> None:
    written(tmp_path, "txt")
    reference = DataLoader2(listed_in_order(tmp_path), reading_service=rs(2))
    epoch = list(reference)
    reference.shutdown()
    dl = DataLoader2(listed_in_order(tmp_path), reading_service=rs(2))
    try:
        head = take(iter(dl), 5)  # the workers are in their first file
        state = dl.state_dict()
    finally:
        dl.shutdown()
    _write_lines(9, range(1000, 1010), str(tmp_path / "shard9.txt"))  # listed last
    again = DataLoader2.from_state(state, rs(2))
    try:
        rest = list(again)
    finally:
        again.shutdown()
    new = [record for record in rest if record not in epoch]
    assert [record for record in head + rest if record in epoch] == epoch
    assert len(new) == 10, "the new file's records are read after the others"
