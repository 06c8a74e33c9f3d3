"""Readers resumed from captured states: files opened and parsed after sharding restore without
replaying the epoch, and a file that changed between the checkpoint and the restore is refused
with ``ChangedFileError`` naming it (instead of handing out other records)."""

from __future__ import annotations

import functools
import multiprocessing
import os
import re
import tempfile
import unittest
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
from conftest import START_METHODS
from pipelines import (
    CONTEXT,
    _write_lines,
    _write_samples,
    line_and_length,
    moved_onto,
    read_sample,
    rs,
    take,
)
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import TestCase, instantiate_parametrized_tests, parametrize
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import FileLister, IterableWrapper

from torchdata_snapshot import ChangedFileError, ReplayDivergenceError, StateRestoreError
from torchdata_snapshot._errors import RemoteTraceback
from torchdata_snapshot.core.graph import graph_datapipes
from torchdata_snapshot.graph_state.graph_state import GraphState

SHARDS, RECORDS = 4, 60


def lines(root: Path) -> Any:
    files = FileLister(str(root), masks="*.txt").shuffle().sharding_filter()
    return files.open_files().readlines(return_path=False).map(line_and_length)


def samples(root: Path) -> Any:
    files = FileLister(str(root), masks="*.tar").shuffle().sharding_filter()
    return files.open_files("b").load_from_tar().webdataset().map(read_sample)


KINDS: Dict[str, Any] = {"txt": (_write_lines, lines), "tar": (_write_samples, samples)}


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


def listed_in_order(root: Path) -> Any:
    """Files in the lister's order (no shuffle): where the lister stands in its listing matters."""
    files = FileLister(str(root), masks="*.txt").sharding_filter()
    return files.open_files().readlines(return_path=False).map(line_and_length)


LISTING_CHANGES: Dict[str, Callable[[Path], None]] = {
    "a file added before the position": lambda root: _write_lines(9, range(1000, 1010), str(root / "a.txt")),
    "a file read before the position removed": lambda root: os.remove(root / "shard0.txt"),
    "a file renamed": lambda root: os.rename(root / "shard1.txt", root / "shard1b.txt"),
}


def _taken_then_moved(tmp_path: Path, kind: str, k: int) -> Tuple[List[Any], List[Any], Any, Path]:
    """The epoch of ``kind`` files in ``tmp_path/data``, its first ``k`` items, and the state
    taken after them; the directory is then moved to ``tmp_path/moved`` (returned)."""
    data, moved = tmp_path / "data", tmp_path / "moved"
    data.mkdir()
    written(data, kind)
    reference = loader(data, kind)
    epoch = list(reference)
    reference.shutdown()
    dl = loader(data, kind)
    try:
        head = take(iter(dl), k)
        state = dl.state_dict()
    finally:
        dl.shutdown()
    os.rename(data, moved)
    return epoch, head, state, moved


def moved_onto_root(state: Any, root: Path, kind: str) -> DataLoader2:
    """A loader restoring ``state`` onto the pipeline built on ``root`` instead of the pickled one."""
    return DataLoader2.from_state(moved_onto(state, KINDS[kind][1](root)), rs(2))


#: Files of the "user is in this file" checks: 4 shards of 10 lines, 2 workers without a shuffle,
#: so worker 0 reads shard0 then shard2, worker 1 shard1 then shard3, one item of each in turn.
_IN_FILE_SHARDS, _IN_FILE_LINES = 4, 10


def _in_file_pipeline(root: str) -> Any:
    return FileLister(root, masks="*.txt").sharding_filter().open_files().readlines()


def _partly_received(head: List[Any]) -> List[str]:
    """The files of which ``head`` (``(path, line)`` items) holds some lines but not all, in the
    order their last received line came."""
    counts = Counter(path for path, _ in head)
    last = {path: i for i, (path, _) in enumerate(head)}
    return sorted((p for p, n in counts.items() if n < _IN_FILE_LINES), key=last.__getitem__)


@instantiate_parametrized_tests
class TestEveryFileReadAgainIsChecked(TestCase):
    """A restore checks every file of which the user received part, whatever the captured state
    it loads: one the state names, and one opened after it (a file the user has the first lines
    of, opened after the latest capture before the position, is read again by the replay from
    that capture). Appended to, it is refused with ``ChangedFileError`` naming it, instead of
    handing out the appended lines."""

    #: ``k`` items received: before the workers' first capture (the first line of shard0), at a
    #: file boundary (the first line of shard2), in the middle of a file opened after the latest
    #: capture (shards 2 and 3) and in the last file (shard3, one line short).
    POSITIONS = {"before_first_capture": 1, "file_boundary": 21, "mid_file": 29, "last_file": 39}

    def setUp(self) -> None:
        directory = tempfile.TemporaryDirectory()
        self.addCleanup(directory.cleanup)
        self.root = directory.name
        for shard in range(_IN_FILE_SHARDS):
            path = os.path.join(self.root, f"shard{shard}.txt")
            _write_lines(shard, range(shard, _IN_FILE_SHARDS * _IN_FILE_LINES, _IN_FILE_SHARDS), path)

    def _service(self, context: str, max_items_between_captures: int) -> Any:
        return rs(2, multiprocessing_context=context, max_items_between_captures=max_items_between_captures)

    def _states_at(self, positions: List[int], service: Any) -> Tuple[List[Any], Dict[int, Any]]:
        dl = DataLoader2(_in_file_pipeline(self.root), reading_service=service)
        try:
            epoch, states = [], {}
            for item in dl:
                epoch.append(item)
                if len(epoch) in positions:
                    states[len(epoch)] = dl.state_dict()
            self.assertTrue(all(s.stateful for s in dl.reading_service.snapshot()), "readers are resumable")
        finally:
            dl.shutdown()
        return epoch, states

    def _restored(self, state: Any, service: Any) -> List[Any]:
        dl = DataLoader2.from_state(state, service)
        try:
            return list(dl)
        finally:
            dl.shutdown()

    def _check(self, context: str, max_items_between_captures: int) -> None:
        service = functools.partial(self._service, context, max_items_between_captures)
        epoch, states = self._states_at(list(self.POSITIONS.values()), service())
        for where, k in self.POSITIONS.items():
            changed = _partly_received(epoch[:k])[-1]  # the file the user is in
            with open(changed, "rb") as f:
                content, stat = f.read(), os.fstat(f.fileno())
            with open(changed, "a") as f:
                f.write("a line the uninterrupted run never read\n")
            with self.assertRaises(ChangedFileError, msg=where) as raised:
                self._restored(states[k], service())
            self.assertIn(changed, str(raised.exception), where)
            with open(changed, "wb") as f:  # as it was: the same size and modification time
                f.write(content)
            os.utime(changed, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        k = self.POSITIONS["mid_file"]
        self.assertEqual(epoch[:k] + self._restored(states[k], service()), epoch, "unchanged: exact")

    @parametrize("context", START_METHODS)
    def test_the_file_the_user_is_in_is_checked_at_every_position(self, context: str) -> None:
        self._check(context, max_items_between_captures=1000)

    def test_the_file_opened_right_after_a_capture_of_every_item_is_checked(self) -> None:
        """``max_items_between_captures=1``: the state before the first line of a file ends the
        file before; the file itself is only in what the item after it opened."""
        self._check(CONTEXT, max_items_between_captures=1)


class TestReaders(SuiteTestCase):
    @parametrize("kind", sorted(KINDS))
    def test_files_opened_after_sharding_resume_from_captured_states_exactly(self, kind: str) -> None:
        written(self.tmp_path, kind)
        reference = loader(self.tmp_path, kind)
        epoch = list(reference)
        reference.shutdown()
        for k in (1, len(epoch) // 2, len(epoch) - 1):
            dl = loader(self.tmp_path, kind)
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

    @parametrize("change", sorted(CHANGES))
    @parametrize("position", [3, RECORDS // 2, RECORDS - 1])
    @parametrize("kind", sorted(KINDS))
    def test_a_file_changed_between_save_and_restore_is_refused_naming_it(
        self, kind: str, change: str, position: int
    ) -> None:
        """At any position after the workers' first captured states (their second item): the file
        a captured state was reading is checked before anything is read again."""
        paths = written(self.tmp_path, kind)
        dl = loader(self.tmp_path, kind)
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
            assert "\n" not in str(raised.value), "one short message, raised in the main process"
            what_to_do = {
                "deleted": "is gone (No such file or directory): put it back, or resume from a checkpoint "
                "taken without it; if the data moved, build the pipeline on its new directory and resume "
                "with torchdata_snapshot.load_state_dict(dataloader, state)",
                "appended": "put the file back as it was, or resume from a checkpoint taken since it changed",
            }
            assert what_to_do.get(change, what_to_do["appended"]) in str(raised.value), "what to do"
            assert isinstance(raised.value.__cause__, RemoteTraceback), "the worker's traceback is its cause"
            assert "Traceback (most recent call last)" in str(raised.value.__cause__)
        finally:
            again.shutdown()
        assert again.reading_service._finalized, "the service is shut down, its workers gone"

    def test_a_file_changed_on_an_fsspec_filesystem_is_refused(self) -> None:
        import fsspec

        memory = fsspec.filesystem("memory")
        uris = [f"memory://{self.tmp_path.name}/{i}.txt" for i in range(3)]
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

    @parametrize("stateful", [True, False])
    @parametrize("kind", sorted(KINDS))
    def test_files_opened_after_sharding_resume_elastically_each_record_once(
        self, kind: str, stateful: bool
    ) -> None:
        """2 workers resumed as 3 (``elastic=True``), batches of 4 records: a new worker opens the
        file (archive) an old one was in the middle of and skips the records the user had; every
        record of the epoch is delivered exactly once. Without captured states (``stateful=False``)
        the readers are counted all the same."""
        written(self.tmp_path, kind)

        def batched(workers: int) -> DataLoader2:
            return DataLoader2(
                KINDS[kind][1](self.tmp_path).batch(4), reading_service=rs(workers, stateful=stateful)
            )

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

    @parametrize("change", sorted(LISTING_CHANGES))
    def test_a_directory_listing_changed_between_save_and_restore_is_refused_naming_it(
        self, change: str
    ) -> None:
        """The workers' listers had handed on the first files of the listing: counting into another
        listing would skip or repeat whole files, so the restore names the directory instead. (An
        elastic resume does not check files: see the elastic page.)"""
        written(self.tmp_path, "txt")
        # A state after every item: the readers' files are their second ones, which stay unchanged.
        dl = DataLoader2(listed_in_order(self.tmp_path), reading_service=rs(2, max_items_between_captures=1))
        try:
            take(iter(dl), RECORDS // 2 + 4)
            state = dl.state_dict()
        finally:
            dl.shutdown()
        LISTING_CHANGES[change](self.tmp_path)
        again = DataLoader2.from_state(state, rs(2))
        try:
            with pytest.raises(
                ChangedFileError, match=f"{self.tmp_path} lists other files than when the state"
            ) as raised:
                list(again)
            assert (
                "put its files back as they were, or resume from a checkpoint taken since they changed"
                in (str(raised.value))
            )
        finally:
            again.shutdown()

    def test_a_file_added_after_the_listers_position_is_read_as_it_is_now(self) -> None:
        written(self.tmp_path, "txt")
        reference = DataLoader2(listed_in_order(self.tmp_path), reading_service=rs(2))
        epoch = list(reference)
        reference.shutdown()
        dl = DataLoader2(listed_in_order(self.tmp_path), reading_service=rs(2))
        try:
            head = take(iter(dl), 5)  # the workers are in their first file
            state = dl.state_dict()
        finally:
            dl.shutdown()
        _write_lines(9, range(1000, 1010), str(self.tmp_path / "shard9.txt"))  # listed last
        again = DataLoader2.from_state(state, rs(2))
        try:
            rest = list(again)
        finally:
            again.shutdown()
        new = [record for record in rest if record not in epoch]
        assert [record for record in head + rest if record in epoch] == epoch
        assert len(new) == 10, "the new file's records are read after the others"

    @parametrize("k", [1, RECORDS // 2, RECORDS - 1])
    def test_a_data_directory_that_moved_resumes_exactly_there(self, k: int) -> None:
        epoch, head, state, moved = _taken_then_moved(self.tmp_path, "txt", k)
        again = moved_onto_root(state, moved, "txt")
        try:
            assert head + list(again) == epoch
            state_there = again.state_dict()["reading_service_state"]
        finally:
            again.shutdown()
        assert str(self.tmp_path / "data") not in str(state_there), "its checkpoints are of the new directory"

    def test_files_missing_where_the_data_moved_are_refused_naming_them_before_any_worker_starts(
        self,
    ) -> None:
        _, _, state, moved = _taken_then_moved(self.tmp_path, "txt", RECORDS // 2)
        for path in moved.iterdir():
            os.remove(path)
        children = set(multiprocessing.active_children())
        again = moved_onto_root(state, moved, "txt")
        try:
            with pytest.raises(ChangedFileError) as raised:
                iter(again)
            assert set(multiprocessing.active_children()) == children, "no worker was started"
        finally:
            again.shutdown()
        message = str(raised.value)
        assert message.startswith(f"the data moved ({self.tmp_path / 'data'} to {moved}), but "), message
        assert re.search(f"{moved / 'shard'}[0-9].txt is missing", message), "it names the files"

    def test_items_that_hold_a_path_of_the_data_that_moved_are_other_items_and_refused(self) -> None:
        """A tar member's path, and the WebDataset key made of it, hold the directory: under the new
        root they are other items, which the replay's check refuses."""
        _, _, state, moved = _taken_then_moved(self.tmp_path, "tar", RECORDS // 2)
        again = moved_onto_root(state, moved, "tar")
        try:
            with pytest.raises(ReplayDivergenceError, match="replayed differently"):
                list(again)
        finally:
            again.shutdown()


instantiate_parametrized_tests(TestReaders)


if __name__ == "__main__":
    unittest.main()
