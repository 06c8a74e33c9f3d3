"""Resumable readers, on their own: streams that know their origin and open again, a reader
loaded with the state it reported after k items yields the rest exactly, and a file that
changed is refused when the state is loaded."""

from __future__ import annotations

import functools
import gzip
import io
import os
import tarfile
import unittest
from typing import Any, List

import pytest
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize
from torchdata.datapipes.iter import FileOpener, IterableWrapper

from torchdata_snapshot._errors import ChangedFileError
from torchdata_snapshot.graph_state.file_origins import (
    describe,
    origin_of,
    rebuild,
)
from torchdata_snapshot.graph_state.readers import READER_ADAPTERS, ResumableReader, StreamMaker
from torchdata_snapshot.graph_state.resumable import as_resumable


def adapted(dp: Any) -> Any:
    return as_resumable(dp, READER_ADAPTERS)


def opened(paths: List[str], mode: str = "r") -> Any:
    return adapted(FileOpener(IterableWrapper(paths), mode=mode))


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

    def test_an_opener_notes_each_file_it_opens_until_taken(self) -> None:
        opener = opened(self.texts)
        it = iter(opener)
        next(it)
        next(it)
        assert [o.path for o in opener.take_opened()] == self.texts[:2]
        assert opener.take_opened() == []
        next(it)
        assert [o.path for o in opener.take_opened()] == self.texts[2:]

    def test_openers_hold_nothing_at_a_yield_point(self) -> None:
        maker = opened(self.texts)
        assert isinstance(maker, StreamMaker) and not hasattr(maker, "state_dict")


instantiate_parametrized_tests(TestResumableReaders)


if __name__ == "__main__":
    unittest.main()
