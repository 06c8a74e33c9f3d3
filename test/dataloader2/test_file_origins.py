"""Where a stream came from: a file's origin opens it again at its start, a described element
(streams as origins) is rebuilt, and a record of opened files refuses a file that changed."""

from __future__ import annotations

import io
import os
import pickle
import tempfile

from torch.testing._internal.common_utils import TestCase
from torch.utils.data.datapipes.utils.common import StreamWrapper

from torchdata_snapshot._errors import ChangedFileError, StateCaptureError, StateRestoreError
from torchdata_snapshot.graph_state.file_origins import (
    check_described,
    check_opened,
    describe,
    file_origin,
    origin_of,
    pack_opened,
    rebuild,
    with_origin,
)


class TestFileOrigins(TestCase):
    def setUp(self) -> None:
        directory = tempfile.TemporaryDirectory()
        self.addCleanup(directory.cleanup)
        self.paths = [os.path.join(directory.name, f"{i}.txt") for i in range(3)]
        for i, path in enumerate(self.paths):
            with open(path, "w") as f:
                f.write(f"file {i}\nsecond line\n")

    def opened(self, path: str) -> StreamWrapper:
        file = open(path)  # noqa: SIM115 (the stream owns it)
        stream = StreamWrapper(file)
        self.addCleanup(stream.close)
        return with_origin(stream, file_origin(path, "r", None, file))

    def test_a_described_element_is_rebuilt_with_its_streams_opened_again_at_their_start(self) -> None:
        stream = self.opened(self.paths[0])
        stream.readline()
        element = {"path": self.paths[0], "streams": [stream], "n": 3}
        described = describe(element)
        pickle.dumps(described)  # plain data: it travels in a checkpoint
        again = rebuild(described)
        self.addCleanup(again["streams"][0].close)
        assert again["path"] == self.paths[0] and again["n"] == 3
        assert origin_of(again["streams"][0]) == origin_of(stream)
        assert again["streams"][0].readline() == "file 0\n"

    def test_a_described_element_whose_file_changed_is_refused_naming_it(self) -> None:
        described = describe((self.paths[1], self.opened(self.paths[1])))
        check_described(described)
        with open(self.paths[1], "a") as f:
            f.write("appended\n")
        with self.assertRaisesRegex(ChangedFileError, f"{self.paths[1]} changed since"):
            check_described(described)

    def test_a_stream_that_cannot_be_opened_again_is_not_captured(self) -> None:
        with self.assertRaisesRegex(StateCaptureError, "cannot be opened again"):
            describe(("path", StreamWrapper(io.BytesIO(b"x"))))

    def test_a_record_of_opened_files_refuses_a_changed_one_naming_it(self) -> None:
        record = pack_opened([origin_of(self.opened(path)) for path in self.paths])  # type: ignore[misc]
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
