"""Resumable readers, on their own: streams that know their origin and open again, a reader
loaded with the state it reported after k items yields the rest exactly, and a file that
changed is refused when the state is loaded."""

from __future__ import annotations

import functools
import gzip
import io
import os
import pickle
import tarfile
import tempfile
import unittest
from typing import Any, List

import pytest
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import TestCase, instantiate_parametrized_tests, parametrize
from torch.utils.data.datapipes.utils.common import StreamWrapper
from torchdata.datapipes.iter import FileOpener, IterableWrapper

from torchdata_snapshot._compat.datapipes import samples_yielded
from torchdata_snapshot._errors import ChangedFileError, StateCaptureError, StateRestoreError
from torchdata_snapshot.graph_state.file_origins import (
    check_opened,
    describe,
    origin_of,
    pack_opened,
    rebuild,
)
from torchdata_snapshot.graph_state.graph_state import resumable
from torchdata_snapshot.graph_state.readers import READER_ADAPTERS, ResumableReader, StreamMaker
from torchdata_snapshot.graph_state.resumable import Resumable


def adapted(dp: Any) -> Any:
    replacement = READER_ADAPTERS[type(dp)].adapt(dp)
    assert replacement is not None
    return replacement


def opened(paths: List[str], mode: str = "r") -> Any:
    return adapted(FileOpener(IterableWrapper(paths), mode=mode))


class TestOpenedFiles(TestCase):
    """An opener notes the files it opens, with their size and modification time, until taken;
    a packed record of them refuses a file that changed since, and a damaged record."""

    def setUp(self) -> None:
        directory = tempfile.TemporaryDirectory()
        self.addCleanup(directory.cleanup)
        self.paths = [os.path.join(directory.name, f"{i}.txt") for i in range(3)]
        for i, path in enumerate(self.paths):
            with open(path, "w") as f:
                f.write(f"file {i}\n")

    def test_an_opener_notes_each_file_it_opens_until_taken(self) -> None:
        opener = opened(self.paths)
        it = iter(opener)
        next(it)
        next(it)
        self.assertEqual([o.path for o in opener.take_opened()], self.paths[:2])
        self.assertEqual(opener.take_opened(), [])
        next(it)
        self.assertEqual([o.path for o in opener.take_opened()], self.paths[2:])

    def test_a_record_of_opened_files_refuses_a_changed_one_naming_it(self) -> None:
        opener = opened(self.paths)
        list(opener)
        record = pack_opened(opener.take_opened())
        check_opened([record])  # nothing changed
        with open(self.paths[1], "a") as f:
            f.write("appended\n")
        with self.assertRaisesRegex(ChangedFileError, f"{self.paths[1]} changed since"):
            check_opened([record])
        os.remove(self.paths[1])
        with self.assertRaisesRegex(ChangedFileError, f"{self.paths[1]} .* is gone"):
            check_opened([record])

    def test_a_damaged_record_is_refused(self) -> None:
        for damaged in (b"not a pickle", pickle.dumps(("a path",))):
            with self.assertRaisesRegex(StateRestoreError, "files a checkpoint recorded cannot be read"):
                check_opened([damaged])


class TestResumableReaders(SuiteTestCase):
    @functools.cached_property
    def texts(self) -> List[str]:
        """Three text files of 4, 5 and 6 lines."""
        paths = []
        for i in range(3):
            path = self.tmp_path / f"{i}.txt"
            path.write_text("".join(f"file {i} line {j}\n" for j in range(4 + i)))
            paths.append(str(path))
        return paths

    def test_an_opened_file_knows_its_origin_and_opens_again_at_its_start(self) -> None:
        path, stream = next(iter(opened(self.texts)))
        first = stream.readline()
        again = rebuild(describe((path, stream)))
        assert again[0] == path and origin_of(again[1]) == origin_of(stream)
        assert again[1].readline() == first
        stream.close()
        again[1].close()

    def test_a_decompressed_stream_opens_again_from_its_compressed_file(self) -> None:
        (self.tmp_path / "a.txt.gz").write_bytes(gzip.compress(b"zipped line\n"))
        decompressed = adapted(opened([str(self.tmp_path / "a.txt.gz")], "b").decompress())
        path, stream = next(iter(decompressed))
        again = rebuild(describe(stream))
        assert again.read() == stream.read() == b"zipped line\n"

    def test_a_stream_that_cannot_be_opened_again_is_not_captured(self) -> None:
        with pytest.raises(StateCaptureError, match="cannot be opened again"):
            describe(("path", StreamWrapper(io.BytesIO(b"x"))))

    @parametrize("k", [0, 1, 4, 9, 11])
    def test_a_reader_loaded_with_its_state_after_k_lines_yields_the_rest(self, k: int) -> None:
        everything = list(adapted(opened(self.texts).readlines()))
        reader = adapted(opened(self.texts).readlines())
        assert isinstance(reader, ResumableReader)
        it = iter(reader)
        head = [next(it) for _ in range(k)]
        state = reader.state_dict()
        # The source is where it was after the element in progress: a FileOpener over the rest.
        started = len({path for path, _ in head})
        fresh = adapted(opened(self.texts[started:]).readlines())
        fresh.load_state_dict(state)
        assert head + list(fresh) == everything

    def test_archive_members_know_their_origin(self) -> None:
        with tarfile.open(self.tmp_path / "a.tar", "w") as tar:
            for name in ("x.txt", "y.txt"):
                info = tarfile.TarInfo(name)
                info.size = 1
                tar.addfile(info, io.BytesIO(name[:1].encode()))
        members = adapted(opened([str(self.tmp_path / "a.tar")], "b").load_from_tar())
        got = []
        for path, stream in members:
            again = rebuild(describe(stream))  # held: a StreamWrapper closes its file when collected
            got.append((os.path.basename(path), stream.read(), again.read()))
        assert got == [("x.txt", b"x", b"x"), ("y.txt", b"y", b"y")]

    def test_a_file_changed_since_the_state_is_refused_when_it_is_loaded(self) -> None:
        reader = adapted(opened(self.texts).readlines())
        it = iter(reader)
        next(it)
        state = reader.state_dict()
        with open(self.texts[0], "a") as f:
            f.write("one more line\n")
        with pytest.raises(ChangedFileError, match=self.texts[0]):
            adapted(opened(self.texts).readlines()).load_state_dict(state)

    def test_openers_hold_nothing_at_a_yield_point(self) -> None:
        maker = opened(self.texts)
        assert isinstance(maker, StreamMaker) and not hasattr(maker, "state_dict")

    @parametrize("name", ["enumerate", "add_index", "lines_to_paragraphs", "webdataset"])
    def test_what_accumulates_or_counts_becomes_resumable_in_place(self, name: str) -> None:
        """Those whose generator holds a count or what it accumulated become their resumable
        subclass, keeping their configuration; a copy restored after each item yields the rest."""
        lines = [("a.txt", "x"), ("a.txt", ""), ("a.txt", "y"), ("b.txt", "z")]
        members = [("s/1.jpg", "p"), ("s/1.cls", "q"), ("s/2.jpg", "r"), ("s/3.jpg", "t")]
        build = {
            "enumerate": lambda: IterableWrapper("abcd").enumerate(starting_index=5),
            "add_index": lambda: IterableWrapper([{"v": i} for i in range(4)]).add_index("at"),
            "lines_to_paragraphs": lambda: IterableWrapper(lines).lines_to_paragraphs(),
            "webdataset": lambda: IterableWrapper(members).webdataset(),
        }[name]
        everything, dp = list(build()), build()
        kind, configuration = type(dp), dict(vars(dp))
        assert resumable(dp) is dp and isinstance(dp, kind) and isinstance(dp, Resumable)
        assert type(dp) is kind or "__init__" not in vars(type(dp))
        assert {k: v for k, v in vars(dp).items() if k in configuration} == configuration
        source = dp.source_datapipe
        for k in range(len(everything) + 1):
            it = iter(dp)
            head = [next(it) for _ in range(k)]
            state, taken = dp.state_dict(), samples_yielded(source)
            again = resumable(build())
            again.source_datapipe = IterableWrapper(list(source)[taken:])
            again.load_state_dict(state)
            assert head + list(again) == everything, f"restored after {k}"


instantiate_parametrized_tests(TestResumableReaders)


if __name__ == "__main__":
    unittest.main()
