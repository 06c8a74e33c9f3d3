"""A data directory that moved: which roots moved, the check of the files a checkpoint reads
again there, and the checkpoint rewritten as though it had been taken there."""

from __future__ import annotations

import functools
import os
import pickle
import shutil
import unittest
from pathlib import Path
from typing import Any, List, Tuple

import pytest
from suite_case import SuiteTestCase
from torch.utils.data.datapipes.utils.common import StreamWrapper
from torchdata.dataloader2.random import SeedGenerator
from torchdata.datapipes.iter import FileLister

from torchdata_snapshot._errors import ChangedFileError
from torchdata_snapshot.checkpoint.format import Checkpoint, WorkerPosition
from torchdata_snapshot.checkpoint.identity import graph_identity
from torchdata_snapshot.checkpoint.rng_states import packed_global_rng_state
from torchdata_snapshot.checkpoint.seeds import seed_state
from torchdata_snapshot.graph_state.file_origins import (
    FileOrigin,
    describe,
    file_origin,
    pack_opened,
    unpack_opened,
    with_origin,
)
from torchdata_snapshot.graph_state.graph_state import unpack_graph_state
from torchdata_snapshot.graph_state.moved_roots import (
    MovedRoot,
    described_files,
    moved_roots,
    resumed_where_moved,
)

NAMES = ("a.txt", "b.txt", "c.txt")


def lister(root: Any) -> Any:
    return FileLister(root, masks="*.txt").sharding_filter().open_files().readlines()


def opened(path: Path) -> FileOrigin:
    with open(path) as f:
        return file_origin(str(path), "r", None, f)


def checkpoint(root: Path) -> Checkpoint:
    """A checkpoint of ``lister(root)`` whose worker reads ``b.txt`` again (its captured state is
    in it) and ``c.txt`` (opened after that state), as a worker reports them."""
    reading = with_origin(StreamWrapper(open(root / "b.txt")), opened(root / "b.txt"))  # noqa: SIM115
    try:
        element = describe((str(root / "b.txt"), reading))
    finally:
        reading.close()
    states = {
        "__global_rng__": packed_global_rng_state(),
        "0:ResumableReader": {"reading": True, "element": element, "taken": 1},
        "3:ResumableFileLister": {"root": str(root), "yielded": 2, "listed": "0" * 32},
    }
    blob = pickle.dumps(states)
    worker = WorkerPosition(
        delivered=4, state=(2, blob, None), opened=(pack_opened([opened(root / "c.txt")]),)
    )
    return Checkpoint(
        num_workers=1,
        graph=graph_identity(lister(str(root))),
        epoch=0,
        status="in_epoch",
        seed=seed_state(SeedGenerator(0)),
        delivered=4,
        workers=(worker,),
    )


def paths_in(state: Checkpoint) -> List[str]:
    worker = state.workers[0]
    assert worker.state is not None
    states = unpack_graph_state(worker.state[1])
    files = [origin.path for blob in worker.opened for origin in unpack_opened(blob)]
    files += [origin.path for origin in described_files(states["0:ResumableReader"])]
    return [*files, states["0:ResumableReader"]["element"][0], states["3:ResumableFileLister"]["root"]]


class TestMovedRoots(SuiteTestCase):
    @functools.cached_property
    def roots(self) -> Tuple[Path, Path]:
        """A data directory ``old`` and its copy ``new``, with the files' modification times."""
        old = self.tmp_path / "old"
        old.mkdir()
        for name in NAMES:
            (old / name).write_text(f"the lines of {name}\n" * 3)
        shutil.copytree(old, self.tmp_path / "new")
        return old, self.tmp_path / "new"

    def test_a_path_moves_when_it_is_the_root_or_below_it(self) -> None:
        move = MovedRoot("3:FileListerIterDataPipe", "/data/old/", "/mnt/new")
        assert move.moved("/data/old") is None  # (the root as given: "/data/old/")
        assert move.moved("/data/old/") == "/mnt/new"
        assert move.moved("/data/old/sub/a.txt") == "/mnt/new/sub/a.txt"
        assert move.moved("/data/older/a.txt") is None
        relative = MovedRoot("3:FileListerIterDataPipe", "data", "copy")
        assert relative.moved("data/a.txt") == "copy/a.txt"
        assert relative.moved(os.path.abspath("data/a.txt")) == os.path.abspath("copy/a.txt")
        assert relative.moved("database/a.txt") is None

    def test_the_roots_that_moved_are_those_of_the_same_lister_with_as_many_roots(self) -> None:
        old, new = self.roots
        state = checkpoint(old)
        moved = lister(str(new))
        assert moved_roots(state, moved, graph_identity(moved)) == (
            MovedRoot("3:FileListerIterDataPipe", str(old), str(new)),
        )
        same = lister(str(old))
        assert moved_roots(state, same, graph_identity(same)) == ()
        more = lister([str(new), str(old)])
        assert moved_roots(state, more, graph_identity(more)) == (), (
            "another number of roots is another pipeline"
        )
        other = FileLister(str(new), masks="*.txt").sharding_filter().open_files().readlines().batch(2)
        assert moved_roots(state, other, graph_identity(other)) == (), "another pipeline"

    def test_a_checkpoint_resumes_where_its_files_moved_when_they_are_the_same(self) -> None:
        old, new = self.roots
        state = checkpoint(old)
        pipeline = lister(str(new))
        graph = graph_identity(pipeline)
        resumed = resumed_where_moved(state, moved_roots(state, pipeline, graph))
        assert paths_in(resumed) == [str(new / "c.txt"), str(new / "b.txt"), str(new / "b.txt"), str(new)]
        resumed.check_graph(graph)  # the self.roots it records are the pipeline's now
        assert Checkpoint.from_plain(resumed.to_plain()) == resumed, "it is a checkpoint like any other"
        assert paths_in(state) == [str(old / "c.txt"), str(old / "b.txt"), str(old / "b.txt"), str(old)]

    def test_the_files_that_are_not_the_same_where_they_moved_are_named(self) -> None:
        old, new = self.roots
        state = checkpoint(old)
        os.remove(new / "b.txt")
        with open(new / "c.txt", "a") as f:
            f.write("one more\n")
        pipeline = lister(str(new))
        with pytest.raises(ChangedFileError) as raised:
            resumed_where_moved(state, moved_roots(state, pipeline, graph_identity(pipeline)))
        message = str(raised.value)
        assert message.startswith(
            f"the data moved ({old} to {new}), but 2 of the files the checkpoint reads again are not the "
            f"same there: {new / 'c.txt'} has 66 bytes, had 57 and was modified "
        ), message
        assert f"; {new / 'b.txt'} is missing. Copy the files keeping their modification times" in message

    def test_a_copy_that_did_not_keep_the_modification_times_is_named(self) -> None:
        old, new = self.roots
        state = checkpoint(old)
        stat = os.stat(new / "b.txt")
        os.utime(new / "b.txt", ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))
        pipeline = lister(str(new))
        with pytest.raises(
            ChangedFileError, match=f"is not the same there: {new / 'b.txt'} was modified .*, .* then"
        ):
            resumed_where_moved(state, moved_roots(state, pipeline, graph_identity(pipeline)))


if __name__ == "__main__":
    unittest.main()
