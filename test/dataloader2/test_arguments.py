"""The constructor arguments a checkpoint records (``_arguments``): for every reader, parser,
opener and lister DataPipe (and the others that keep their arguments under other names), an
argument that changes the data is refused naming the DataPipe and the argument, before any worker
starts; the spellings of one setting that give the same data restore."""

from __future__ import annotations

import csv
import decimal
import io
import multiprocessing
import os
import pickle
import tempfile
import warnings
from typing import Any, Callable, Dict, List, Tuple

import pytest
from conftest import START_METHODS
from pipelines import moved_onto, rs, take
from torch.testing._internal.common_utils import TestCase, instantiate_parametrized_tests, parametrize
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torch.utils.data.datapipes.utils.decoder import basichandlers, extension_extract_fn, imagehandler
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import (
    Bz2FileLoader,
    CSVDictParser,
    CSVParser,
    Decompressor,
    Dropper,
    Enumerator,
    FileLister,
    FileOpener,
    Flattener,
    FSSpecFileLister,
    FSSpecFileOpener,
    Grouper,
    HttpReader,
    IndexAdder,
    IterableWrapper,
    JsonParser,
    LineReader,
    ParagraphAggregator,
    RoutedDecoder,
    SampleMultiplexer,
    ShardingFilter,
    StreamReader,
    TarArchiveLoader,
    ThreadPoolMapper,
    WebDataset,
    XzFileLoader,
    ZipArchiveLoader,
)
from torchdata.datapipes.iter.util.decompressor import CompressionType

from torchdata_snapshot import IncompatibleCheckpointError
from torchdata_snapshot._checkpoint import (
    Checkpoint,
    GraphIdentity,
    graph_arguments,
    graph_fingerprint,
    graph_identity,
)


def joined_by_spaces(lines: List[str]) -> str:
    return " ".join(lines)


def first_letter(path: str) -> str:
    return os.path.basename(path)[:1]


def double(x: int) -> int:
    return 2 * x


def paths() -> Any:
    return IterableWrapper(["a.txt"])


def streams() -> Any:  # built, never read: the tests here compare arguments
    return IterableWrapper([("a.txt", io.BytesIO())])


def routed_decoder(*handlers: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():  # RoutedDecoder is deprecated upstream
        warnings.simplefilter("ignore", FutureWarning)
        return RoutedDecoder(streams(), *handlers, **kwargs)


def multiplexer(weights: Tuple[float, float]) -> Any:
    return SampleMultiplexer(
        {IterableWrapper(range(3)): weights[0], IterableWrapper(range(5)): weights[1]}, seed=0
    )


def splitter(weights: Dict[str, float]) -> Any:
    return IterableWrapper(range(20)).random_split(total_length=20, weights=weights, seed=0, target="a")


#: How each DataPipe is built from the keyword arguments a case gives.
BUILD: Dict[str, Callable[..., Any]] = {
    "FileLister": lambda **kw: FileLister(**{"root": "data", **kw}),
    "FileOpener": lambda **kw: FileOpener(paths(), **kw),
    "FSSpecFileLister": lambda **kw: FSSpecFileLister(**{"root": "data", **kw}),
    "FSSpecFileOpener": lambda **kw: FSSpecFileOpener(paths(), **kw),
    "LineReader": lambda **kw: LineReader(streams(), **kw),
    "CSVParser": lambda **kw: CSVParser(streams(), **kw),
    "CSVDictParser": lambda **kw: CSVDictParser(streams(), **kw),
    "JsonParser": lambda **kw: JsonParser(streams(), **kw),
    "StreamReader": lambda **kw: StreamReader(streams(), **kw),
    "Decompressor": lambda **kw: Decompressor(streams(), **kw),
    "TarArchiveLoader": lambda **kw: TarArchiveLoader(streams(), **kw),
    "ZipArchiveLoader": lambda **kw: ZipArchiveLoader(streams(), **kw),
    "XzFileLoader": lambda **kw: XzFileLoader(streams(), **kw),
    "Bz2FileLoader": lambda **kw: Bz2FileLoader(streams(), **kw),
    "WebDataset": lambda **kw: WebDataset(streams(), **kw),
    "ParagraphAggregator": lambda **kw: ParagraphAggregator(streams(), **kw),
    "RoutedDecoder": lambda handlers=(), **kw: routed_decoder(*handlers, **kw),
    "Enumerator": lambda **kw: Enumerator(paths(), **kw),
    "IndexAdder": lambda **kw: IndexAdder(IterableWrapper([{"a": 1}]), **kw),
    "Grouper": lambda **kw: Grouper(paths(), first_letter, **kw),
    "Dropper": lambda **kw: Dropper(IterableWrapper([(1, 2, 3)]), **kw),
    "Flattener": lambda **kw: Flattener(IterableWrapper([(1, (2, 3))]), **kw),
    "SampleMultiplexer": lambda weights: multiplexer(weights),
    "RandomSplitter": lambda weights: splitter(weights),
    "ShardingFilter": lambda **kw: ShardingFilter(paths(), **kw),
    "ThreadPoolMapper": lambda **kw: ThreadPoolMapper(paths(), double, **kw),
    "HttpReader": lambda **kw: HttpReader(paths(), **kw),
}

_DECODER = "torch.utils.data.datapipes.utils.decoder"

#: A DataPipe, the arguments a checkpoint is taken with, other arguments that change the data,
#: and what the refusal says about them.
CHANGES: Dict[str, Tuple[str, Dict[str, Any], Dict[str, Any], str]] = {
    "FileLister_masks": (
        "FileLister",
        {"masks": "*.txt"},
        {"masks": ["*.txt", "*.csv"]},
        "DataPipe 0:FileListerIterDataPipe: masks was ['*.txt'] in the checkpoint, is ['*.csv', '*.txt'] now",
    ),
    "FileLister_recursive": ("FileLister", {}, {"recursive": True}, "recursive was False in the checkpoint"),
    "FileLister_order": ("FileLister", {}, {"non_deterministic": True}, "non_deterministic was False"),
    "FileOpener_mode": (
        "FileOpener",
        {"mode": "r"},
        {"mode": "b"},
        "DataPipe 0:FileOpenerIterDataPipe: mode was 'rt' in the checkpoint, is 'rb' now",
    ),
    "FileOpener_encoding": (  # None is the locale's encoding, not "utf-8"
        "FileOpener",
        {},
        {"encoding": "utf-8"},
        "DataPipe 0:FileOpenerIterDataPipe: encoding was None in the checkpoint, is 'utf-8' now",
    ),
    "FSSpecFileLister_masks": (
        "FSSpecFileLister",
        {"masks": "*.txt"},
        {"masks": "*.csv"},
        "masks was ['*.txt']",
    ),
    "FSSpecFileOpener_mode": (
        "FSSpecFileOpener",
        {"mode": "r"},
        {"mode": "rb"},
        "mode was 'rt' in the checkpoint",
    ),
    "LineReader_strip_newline": (
        "LineReader",
        {"strip_newline": True},
        {"strip_newline": False},
        "DataPipe 0:LineReaderIterDataPipe: strip_newline was True in the checkpoint, is False now",
    ),
    "LineReader_skip_lines": (
        "LineReader",
        {},
        {"skip_lines": 1},
        "skip_lines was 0 in the checkpoint, is 1 now",
    ),
    "LineReader_decode": (
        "LineReader",
        {},
        {"decode": True},
        "decode was False in the checkpoint, is True now",
    ),
    "LineReader_encoding": (
        "LineReader",
        {"decode": True},
        {"decode": True, "encoding": "latin-1"},
        "encoding was 'utf-8' in the checkpoint, is 'iso8859-1' now",
    ),
    "LineReader_errors": ("LineReader", {}, {"errors": "strict"}, "errors was 'ignore' in the checkpoint"),
    "LineReader_return_path": (
        "LineReader",
        {},
        {"return_path": False},
        "return_path was True in the checkpoint",
    ),
    "CSVParser_delimiter": (
        "CSVParser",
        {},
        {"delimiter": ";"},
        "DataPipe 0:CSVParserIterDataPipe: fmtparams.delimiter was ',' in the checkpoint, is ';' now",
    ),
    "CSVParser_dialect": (
        "CSVParser",
        {},
        {"dialect": "excel-tab"},
        "fmtparams.delimiter was ',' in the checkpoint",
    ),
    "CSVParser_as_tuple": (
        "CSVParser",
        {},
        {"as_tuple": True},
        "as_tuple was False in the checkpoint, is True",
    ),
    "CSVParser_skip_lines": (
        "CSVParser",
        {},
        {"skip_lines": 2},
        "skip_lines was 0 in the checkpoint, is 2 now",
    ),
    "CSVDictParser_fieldnames": (
        "CSVDictParser",
        {},
        {"fieldnames": ("a", "b")},
        "fmtparams.fieldnames was None in the checkpoint, is ['a', 'b'] now",
    ),
    "CSVDictParser_quoting": (
        "CSVDictParser",
        {},
        {"quoting": csv.QUOTE_NONE},
        f"fmtparams.quoting was {csv.QUOTE_MINIMAL} in the checkpoint, is {csv.QUOTE_NONE} now",
    ),
    "JsonParser_parse_float": (
        "JsonParser",
        {},
        {"parse_float": decimal.Decimal},
        "DataPipe 0:JsonParserIterDataPipe: kwargs.parse_float was None in the checkpoint, "
        "is 'decimal.Decimal' now",
    ),
    "JsonParser_strict": ("JsonParser", {}, {"strict": False}, "kwargs.strict was True in the checkpoint"),
    "StreamReader_chunk": ("StreamReader", {}, {"chunk": 4}, "chunk was None in the checkpoint, is 4 now"),
    "Decompressor_file_type": (
        "Decompressor",
        {"file_type": "gzip"},
        {"file_type": "bz2"},
        "DataPipe 0:DecompressorIterDataPipe: file_type was 'gzip' in the checkpoint, is 'bz2' now",
    ),
    "Decompressor_detected": (
        "Decompressor",
        {},
        {"file_type": "lzma"},
        "file_type was None in the checkpoint",
    ),
    "TarArchiveLoader_mode": ("TarArchiveLoader", {}, {"mode": "r:"}, "mode was 'r:*' in the checkpoint"),
    "ParagraphAggregator_joiner": (
        "ParagraphAggregator",
        {},
        {"joiner": joined_by_spaces},
        "DataPipe 0:ParagraphAggregatorIterDataPipe: joiner was "
        "'torchdata.datapipes.iter.util.paragraphaggregator._default_line_join' in the checkpoint, "
        f"is '{__name__}.joined_by_spaces' now",
    ),
    "RoutedDecoder_handlers": (
        "RoutedDecoder",
        {},
        {"handlers": (basichandlers, imagehandler("pil"))},
        f"""handlers was ['{_DECODER}.basichandlers', "{_DECODER}.ImageHandler(imagespec='torch')"] in the """
        f"""checkpoint, is ['{_DECODER}.basichandlers', "{_DECODER}.ImageHandler(imagespec='pil')"] now""",
    ),
    "RoutedDecoder_key_fn": (
        "RoutedDecoder",
        {},
        {"key_fn": first_letter},
        f"is '{__name__}.first_letter' now",
    ),
    "Enumerator_starting_index": ("Enumerator", {}, {"starting_index": 1}, "starting_index was 0"),
    "IndexAdder_index_name": ("IndexAdder", {}, {"index_name": "i"}, "index_name was 'index'"),
    "Grouper_buffer_size": (
        "Grouper",
        {},
        {"buffer_size": 2},
        "DataPipe 0:GrouperIterDataPipe: buffer_size was 10000 in the checkpoint, is 2 now",
    ),
    "Dropper_indices": ("Dropper", {"indices": 0}, {"indices": [0, 2]}, "indices was [0] in the checkpoint"),
    "Flattener_indices": ("Flattener", {}, {"indices": 1}, "indices was [] in the checkpoint, is [1] now"),
    "SampleMultiplexer_weights": (
        "SampleMultiplexer",
        {"weights": (1, 1)},
        {"weights": (1, 3)},
        "DataPipe 0:SampleMultiplexerDataPipe: weights was [0.5, 0.5] in the checkpoint, is [0.25, 0.75] now",
    ),
    "RandomSplitter_weights": (
        "RandomSplitter",
        {"weights": {"a": 1, "b": 1}},
        {"weights": {"a": 1, "b": 3}},
        "DataPipe 1:_RandomSplitterIterDataPipe: weights was [['a', 10.0], ['b', 10.0]] in the checkpoint, "
        "is [['a', 5.0], ['b', 15.0]] now",
    ),
    "ShardingFilter_group": (
        "ShardingFilter",
        {},
        {"sharding_group_filter": SHARDING_PRIORITIES.MULTIPROCESSING},
        "sharding_group_filter was None in the checkpoint, is 'MULTIPROCESSING' now",
    ),
}

#: A DataPipe and two spellings of its arguments that give the same data.
EQUIVALENTS: Dict[str, Tuple[str, Dict[str, Any], Dict[str, Any]]] = {
    "FileOpener_r_rt": ("FileOpener", {"mode": "r"}, {"mode": "rt"}),
    "FileOpener_t_rt": ("FileOpener", {"mode": "t"}, {"mode": "rt"}),
    "FileOpener_b_rb": ("FileOpener", {"mode": "b"}, {"mode": "rb"}),
    "FileOpener_default_mode": ("FileOpener", {}, {"mode": "rt"}),
    "FileOpener_encoding_name": ("FileOpener", {"encoding": "utf-8"}, {"encoding": "UTF8"}),
    "FileOpener_length": ("FileOpener", {}, {"length": 12}),
    "FileLister_one_mask": ("FileLister", {"masks": "*.txt"}, {"masks": ["*.txt"]}),
    "FileLister_mask_order": ("FileLister", {"masks": ["*.a", "*.b"]}, {"masks": ("*.b", "*.a", "*.b")}),
    "FileLister_no_mask": ("FileLister", {}, {"masks": []}),
    "FileLister_one_root": ("FileLister", {"root": "data"}, {"root": ["data"]}),
    "FileLister_length": ("FileLister", {"length": 3}, {}),
    "FSSpecFileLister_one_mask": ("FSSpecFileLister", {"masks": "*.txt"}, {"masks": ["*.txt"]}),
    "FSSpecFileOpener_r_rt": ("FSSpecFileOpener", {"mode": "r"}, {"mode": "rt"}),
    "LineReader_defaults": ("LineReader", {}, {"strip_newline": True, "skip_lines": 0, "errors": "ignore"}),
    "LineReader_encoding_name": ("LineReader", {"encoding": "utf-8"}, {"encoding": "utf_8"}),
    "CSVParser_defaults": (
        "CSVParser",
        {},
        {"delimiter": ",", "quoting": csv.QUOTE_MINIMAL, "dialect": "excel"},
    ),
    "CSVParser_dialect_class": ("CSVParser", {"delimiter": "\t"}, {"dialect": csv.excel_tab}),
    "CSVParser_line_terminator": ("CSVParser", {}, {"lineterminator": "\n"}),  # the reader ignores it
    "CSVDictParser_defaults": ("CSVDictParser", {}, {"fieldnames": None, "restval": None, "delimiter": ","}),
    "CSVDictParser_fieldnames": ("CSVDictParser", {"fieldnames": ["a", "b"]}, {"fieldnames": ("a", "b")}),
    "JsonParser_defaults": ("JsonParser", {}, {"strict": True, "parse_float": None, "cls": None}),
    "StreamReader_whole": ("StreamReader", {}, {"chunk": -1}),
    "Decompressor_enum": ("Decompressor", {"file_type": "gzip"}, {"file_type": CompressionType.GZIP}),
    "Decompressor_case": ("Decompressor", {"file_type": "GZIP"}, {"file_type": "gzip"}),
    "TarArchiveLoader_length": ("TarArchiveLoader", {"mode": "r:*"}, {"length": 4}),
    "ZipArchiveLoader_length": ("ZipArchiveLoader", {}, {"length": 4}),
    "XzFileLoader_length": ("XzFileLoader", {}, {"length": 4}),
    "Bz2FileLoader_length": ("Bz2FileLoader", {}, {"length": 4}),
    "RoutedDecoder_defaults": (
        "RoutedDecoder",
        {},
        {"handlers": (basichandlers, imagehandler("torch")), "key_fn": extension_extract_fn},
    ),
    "Dropper_one_index": ("Dropper", {"indices": 1}, {"indices": [1]}),
    "Dropper_index_order": ("Dropper", {"indices": [2, 0]}, {"indices": [0, 2, 0]}),
    "Flattener_one_index": ("Flattener", {"indices": 1}, {"indices": [1]}),
    "Grouper_guaranteed_size": ("Grouper", {"group_size": 2}, {"group_size": 2, "guaranteed_group_size": 2}),
    "SampleMultiplexer_scaled": ("SampleMultiplexer", {"weights": (1, 3)}, {"weights": (2, 6)}),
    "RandomSplitter_scaled": ("RandomSplitter", {"weights": {"a": 1, "b": 3}}, {"weights": {"a": 2, "b": 6}}),
    "ThreadPoolMapper_threads": ("ThreadPoolMapper", {}, {"max_workers": 2, "scheduled_tasks": 4}),
    "HttpReader_timeout": ("HttpReader", {}, {"timeout": 5}),
}


def taken_then_checked(taken_with: Any, checked_with: Any) -> None:
    """A checkpoint of a pipeline built as ``taken_with``, read back as a restore reads it
    (plain data), checked against the pipeline ``checked_with``."""
    state = Checkpoint.from_plain(Checkpoint(num_workers=0, graph=graph_identity(taken_with)).to_plain())
    state.check_graph(graph_identity(checked_with))


@instantiate_parametrized_tests
class TestReaderArguments(TestCase):
    """What the checkpoint compares of a reader's arguments: what determines its data, each
    setting in one form."""

    @parametrize("case", sorted(CHANGES))
    def test_an_argument_that_changes_the_data_is_refused_naming_it(self, case: str) -> None:
        name, old, new, message = CHANGES[case]
        with self.assertRaisesRegex(
            IncompatibleCheckpointError, "other arguments of its DataPipes"
        ) as raised:
            taken_then_checked(BUILD[name](**old), BUILD[name](**new))
        self.assertIn(message, str(raised.exception))

    @parametrize("case", sorted(EQUIVALENTS))
    def test_spellings_that_give_the_same_data_are_accepted(self, case: str) -> None:
        name, one, other = EQUIVALENTS[case]
        taken_then_checked(BUILD[name](**one), BUILD[name](**other))
        taken_then_checked(BUILD[name](**other), BUILD[name](**one))

    def test_the_whole_refusal_of_a_changed_reader(self) -> None:
        taken = FileOpener(paths(), mode="b").readlines(strip_newline=True, decode=True)
        with self.assertRaises(IncompatibleCheckpointError) as raised:
            taken_then_checked(taken, FileOpener(paths(), mode="r").readlines(strip_newline=False))
        self.assertExpectedInline(
            str(raised.exception),
            """the checkpoint was taken with other arguments of its DataPipes (DataPipe 0:LineReaderIterDataPipe: strip_newline was True in the checkpoint, is False now; DataPipe 0:LineReaderIterDataPipe: decode was True in the checkpoint, is False now; DataPipe 1:FileOpenerIterDataPipe: mode was 'rb' in the checkpoint, is 'rt' now): restore it with the arguments it was taken with""",  # noqa: E501
        )

    def test_the_whole_refusal_of_changed_csv_format_parameters(self) -> None:
        with self.assertRaises(IncompatibleCheckpointError) as raised:
            taken_then_checked(CSVParser(streams()), CSVParser(streams(), delimiter="\t", quotechar="'"))
        self.assertExpectedInline(
            str(raised.exception),
            """the checkpoint was taken with other arguments of its DataPipes (DataPipe 0:CSVParserIterDataPipe: fmtparams.delimiter was ',' in the checkpoint, is '\\t' now; DataPipe 0:CSVParserIterDataPipe: fmtparams.quotechar was '"' in the checkpoint, is "'" now): restore it with the arguments it was taken with""",  # noqa: E501
        )

    @parametrize("case", sorted(CHANGES))
    def test_the_record_is_the_same_for_a_pickled_copy(self, case: str) -> None:
        """Read from what a DataPipe keeps, not from addresses or set order: the copy
        ``DataLoader2`` pickles (and a worker unpickles) reads the same."""
        name, _, new, _ = CHANGES[case]
        datapipe = BUILD[name](**new)
        self.assertEqual(graph_arguments(pickle.loads(pickle.dumps(datapipe))), graph_arguments(datapipe))

    @parametrize("name", ["XzFileLoader", "Bz2FileLoader", "ZipArchiveLoader", "WebDataset"])
    def test_a_reader_whose_arguments_do_not_change_the_data_records_none(self, name: str) -> None:
        datapipe = BUILD[name](**({} if name == "WebDataset" else {"length": 5}))
        self.assertEqual(graph_arguments(datapipe)[f"0:{type(datapipe).__name__}"], {})


#: A pipeline of readers, and the arguments the checkpoints of the format's first release
#: recorded for it: only the attributes named like a constructor parameter, as given.
EARLIER_RECORD = {
    "0:PrefetcherIterDataPipe": {},
    "1:GrouperIterDataPipe": {
        "keep_key": False,
        "group_size": 2,
        "guaranteed_group_size": 2,
        "drop_remaining": False,
    },
    "2:LineReaderIterDataPipe": {},
    "3:FileOpenerIterDataPipe": {"mode": "r", "encoding": None, "length": -1},
    "4:ShardingFilterIterDataPipe": {"sharding_group_filter": None},
    "5:FileListerIterDataPipe": {
        "masks": "*.txt",
        "recursive": False,
        "abspath": False,
        "non_deterministic": False,
        "length": -1,
    },
    "6:IterableWrapperIterDataPipe": {"deepcopy": True},
}


def readers(mode: str = "r", length: int = -1, strip_newline: bool = True) -> Any:
    files = FileLister("data", masks="*.txt").sharding_filter().open_files(mode=mode, length=length)
    return files.readlines(strip_newline=strip_newline).groupby(len, group_size=2).prefetch(4)


class TestEarlierRecords(TestCase):
    """A checkpoint whose arguments were recorded before the readers' arguments were read as
    they are now still restores: its values are compared in today's form, and an argument it
    could not record is not a difference."""

    def _check(self, datapipe: Any) -> None:
        graph = GraphIdentity(graph_fingerprint(datapipe), EARLIER_RECORD)
        state = Checkpoint.from_plain(Checkpoint(num_workers=0, graph=graph).to_plain())
        state.check_graph(graph_identity(datapipe))

    def test_the_pipeline_it_was_taken_with_restores(self) -> None:
        self._check(readers())

    def test_values_are_compared_in_todays_form(self) -> None:
        self._check(readers(mode="rt", length=10))
        with self.assertRaisesRegex(
            IncompatibleCheckpointError,
            r"3:FileOpenerIterDataPipe: mode was 'rt' in the checkpoint, is 'rb' now",
        ):
            self._check(readers(mode="b"))

    def test_an_argument_it_could_not_record_is_not_a_difference(self) -> None:
        self._check(readers(strip_newline=False))  # the record cannot say: the replay's digest will


def _write_files(root: str) -> None:
    for shard in range(3):
        with open(os.path.join(root, f"shard{shard}.txt"), "w") as f:
            f.writelines(f"line {i} of shard {shard}\n" for i in range(20))


@instantiate_parametrized_tests
class TestArgumentsOfARestore(TestCase):
    """Through ``DataLoader2.from_state`` with two workers: a reader's changed argument is refused
    before any worker starts, an equivalent spelling resumes exactly."""

    @pytest.fixture(autouse=True)
    def _loaders(self, make_dl: Any) -> None:
        self.make_dl = make_dl

    def setUp(self) -> None:
        directory = tempfile.TemporaryDirectory()
        self.addCleanup(directory.cleanup)
        self.root = directory.name
        _write_files(self.root)

    def _pipeline(self, mode: str = "r", strip_newline: bool = True) -> Any:
        files = FileLister(self.root, masks="*.txt").sharding_filter().open_files(mode=mode)
        return files.readlines(strip_newline=strip_newline, return_path=False)

    def _restored(self, state: Dict[str, Any], service: Any) -> List[Any]:
        dl = DataLoader2.from_state(state, service)
        self.addCleanup(dl.shutdown)
        return list(dl)

    def test_a_changed_strip_newline_is_refused_before_any_worker_starts(self) -> None:
        dl = self.make_dl(self._pipeline(strip_newline=True), rs(2))
        it = iter(dl)
        take(it, 7)
        state = moved_onto(dl.state_dict(), self._pipeline(strip_newline=False))
        children = set(multiprocessing.active_children())
        with self.assertRaises(IncompatibleCheckpointError) as raised:  # not ReplayDivergenceError
            self._restored(state, rs(2))
        self.assertIn(
            "DataPipe 0:LineReaderIterDataPipe: strip_newline was True in the checkpoint, is False now",
            str(raised.exception),
        )
        self.assertEqual(set(multiprocessing.active_children()), children, "no worker started")

    @parametrize("context", START_METHODS)
    def test_another_spelling_of_the_open_mode_resumes_exactly(self, context: str) -> None:
        dl = self.make_dl(self._pipeline(mode="rt"), rs(2, multiprocessing_context=context))
        it = iter(dl)
        take(it, 7)
        state = dl.state_dict()
        rest = list(it)
        self.assertEqual(len(rest), 60 - 7)
        restored = self._restored(
            moved_onto(state, self._pipeline(mode="r")), rs(2, multiprocessing_context=context)
        )
        self.assertEqual(restored, rest)
