"""The constructor arguments a checkpoint records (``_arguments``): for every reader, parser,
opener and lister DataPipe (and the others that keep their arguments under other names), an
argument that changes the data is a difference naming the DataPipe and the argument; the
spellings of one setting that give the same data are none. (Through ``DataLoader2.from_state``:
``test_restore.py``.)"""

from __future__ import annotations

import csv
import decimal
import io
import json
import os
import pickle
import warnings
from typing import Any, Callable, Dict, List, Tuple

from torch.testing._internal.common_utils import TestCase, instantiate_parametrized_tests, parametrize
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torch.utils.data.datapipes.utils.decoder import basichandlers, extension_extract_fn, imagehandler
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

from torchdata_snapshot.checkpoint.arguments import (
    Arguments,
    Reading,
    argument_changes,
    datapipe_arguments,
    reading_of,
)
from torchdata_snapshot.core.graph import graph_datapipes


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
    with warnings.catch_warnings():  # RoutedDecoder is deprecated in torchdata
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


def handlers(imagespec: str) -> List[str]:
    return [f"{_DECODER}.basichandlers", f"{_DECODER}.ImageHandler(imagespec={imagespec!r})"]


_JOINER = "torchdata.datapipes.iter.util.paragraphaggregator._default_line_join"
_PIL = (basichandlers, imagehandler("pil"))

#: Per DataPipe: the arguments a checkpoint is taken with, other ones that change the data, and
#: the argument a restore names, with its value then and now (as compared).
CHANGES: Dict[str, List[Tuple[Dict[str, Any], Dict[str, Any], str, Any, Any]]] = {
    "FileLister": [
        ({"root": "data"}, {"root": ["data", "more"]}, "root", ["data"], ["data", "more"]),
        ({"masks": "*.txt"}, {"masks": ["*.txt", "*.csv"]}, "masks", ["*.txt"], ["*.csv", "*.txt"]),
        ({}, {"recursive": True}, "recursive", False, True),
        ({}, {"non_deterministic": True}, "non_deterministic", False, True),
    ],
    "FileOpener": [
        ({"mode": "r"}, {"mode": "b"}, "mode", "rt", "rb"),
        ({}, {"encoding": "utf-8"}, "encoding", None, "utf-8"),  # None is the locale's encoding
    ],
    "FSSpecFileLister": [({"masks": "*.txt"}, {"masks": "*.csv"}, "masks", ["*.txt"], ["*.csv"])],
    "FSSpecFileOpener": [({"mode": "r"}, {"mode": "rb"}, "mode", "rt", "rb")],
    "LineReader": [
        ({}, {"strip_newline": False}, "strip_newline", True, False),
        ({}, {"skip_lines": 1}, "skip_lines", 0, 1),
        ({}, {"decode": True}, "decode", False, True),
        ({"decode": True}, {"decode": True, "encoding": "latin-1"}, "encoding", "utf-8", "iso8859-1"),
        ({}, {"errors": "strict"}, "errors", "ignore", "strict"),
        ({}, {"return_path": False}, "return_path", True, False),
    ],
    "CSVParser": [
        ({}, {"delimiter": ";"}, "fmtparams.delimiter", ",", ";"),
        ({}, {"dialect": "excel-tab"}, "fmtparams.delimiter", ",", "\t"),
        ({}, {"as_tuple": True}, "as_tuple", False, True),
        ({}, {"skip_lines": 2}, "skip_lines", 0, 2),
    ],
    "CSVDictParser": [
        ({}, {"fieldnames": ("a", "b")}, "fmtparams.fieldnames", None, ["a", "b"]),
        ({}, {"quoting": csv.QUOTE_NONE}, "fmtparams.quoting", csv.QUOTE_MINIMAL, csv.QUOTE_NONE),
    ],
    "JsonParser": [
        ({}, {"parse_float": decimal.Decimal}, "kwargs.parse_float", None, "decimal.Decimal"),
        ({}, {"strict": False}, "kwargs.strict", True, False),
    ],
    "StreamReader": [({}, {"chunk": 4}, "chunk", None, 4)],
    "Decompressor": [
        ({"file_type": "gzip"}, {"file_type": "bz2"}, "file_type", "gzip", "bz2"),
        ({}, {"file_type": "lzma"}, "file_type", None, "lzma"),
    ],
    "TarArchiveLoader": [({}, {"mode": "r:"}, "mode", "r:*", "r:")],
    "ParagraphAggregator": [
        ({}, {"joiner": joined_by_spaces}, "joiner", _JOINER, f"{__name__}.joined_by_spaces")
    ],
    "RoutedDecoder": [
        ({}, {"handlers": _PIL}, "handlers", handlers("torch"), handlers("pil")),
        (
            {},
            {"key_fn": first_letter},
            "key_fn",
            f"{_DECODER}.extension_extract_fn",
            f"{__name__}.first_letter",
        ),
    ],
    "Enumerator": [({}, {"starting_index": 1}, "starting_index", 0, 1)],
    "IndexAdder": [({}, {"index_name": "i"}, "index_name", "index", "i")],
    "Grouper": [({}, {"buffer_size": 2}, "buffer_size", 10000, 2)],
    "Dropper": [({"indices": 0}, {"indices": [0, 2]}, "indices", [0], [0, 2])],
    "Flattener": [({}, {"indices": 1}, "indices", [], [1])],
    "SampleMultiplexer": [({"weights": (1, 1)}, {"weights": (1, 3)}, "weights", [0.5, 0.5], [0.25, 0.75])],
    "RandomSplitter": [
        (
            {"weights": {"a": 1, "b": 1}},
            {"weights": {"a": 1, "b": 3}},
            "weights",
            [["a", 10.0], ["b", 10.0]],
            [["a", 5.0], ["b", 15.0]],
        )
    ],
    "ShardingFilter": [
        (
            {},
            {"sharding_group_filter": SHARDING_PRIORITIES.MULTIPROCESSING},
            "sharding_group_filter",
            None,
            "MULTIPROCESSING",
        )
    ],
}

#: Where the changed DataPipe is in the graph BUILD makes, if not at its end (random_split's
#: output shares a DataPipe that holds the weights).
CHANGED_AT = {"RandomSplitter": 1}

#: The cases of CHANGES by name: ``(DataPipe, taken with, checked with, argument, was, is)``.
CASES = {
    f"{name}_{argument.replace('.', '_')}_{i}": (name, *case)
    for name, cases in CHANGES.items()
    for i, case in enumerate(cases)
    for argument in [case[2]]
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


def read(datapipe: Any) -> Tuple[Arguments, Dict[str, Reading]]:
    """The record of every DataPipe of the graph and their readings, by key, as a checkpoint
    holds the record (plain data, through JSON) and a restore reads it."""
    graph = graph_datapipes(datapipe)
    record = {key: datapipe_arguments(dp) for key, dp in graph}
    return json.loads(json.dumps(record)), {key: reading_of(dp) for key, dp in graph}


def changes(taken_with: Any, checked_with: Any) -> str:
    """What a restore finds different between a checkpoint of the pipeline ``taken_with`` and
    the pipeline ``checked_with`` (what ``IncompatibleCheckpointError`` says), "" if nothing."""
    return "; ".join(argument_changes(read(taken_with)[0], *read(checked_with)))


@instantiate_parametrized_tests
class TestReaderArguments(TestCase):
    """What the checkpoint compares of a reader's arguments: what determines its data, each
    setting in one form."""

    @parametrize("case", sorted(CASES))
    def test_an_argument_that_changes_the_data_is_refused_naming_it(self, case: str) -> None:
        name, old, new, argument, was, now = CASES[case]
        taken, checked = BUILD[name](**old), BUILD[name](**new)
        key = graph_datapipes(checked)[CHANGED_AT.get(name, 0)][0]
        phrase = f"DataPipe {key}: {argument} was {was!r} in the checkpoint, is {now!r} now"
        self.assertIn(phrase, changes(taken, checked))
        self.assertEqual(changes(checked, BUILD[name](**new)), "", "the same pipeline, built again")

    @parametrize("case", sorted(EQUIVALENTS))
    def test_spellings_that_give_the_same_data_are_accepted(self, case: str) -> None:
        name, one, other = EQUIVALENTS[case]
        self.assertEqual(changes(BUILD[name](**one), BUILD[name](**other)), "")
        self.assertEqual(changes(BUILD[name](**other), BUILD[name](**one)), "")

    def test_every_change_of_a_reader_is_named(self) -> None:
        taken = FileOpener(paths(), mode="b").readlines(strip_newline=True, decode=True)
        self.assertExpectedInline(
            changes(taken, FileOpener(paths(), mode="r").readlines(strip_newline=False)),
            """DataPipe 0:LineReaderIterDataPipe: strip_newline was True in the checkpoint, is False now; DataPipe 0:LineReaderIterDataPipe: decode was True in the checkpoint, is False now; DataPipe 1:FileOpenerIterDataPipe: mode was 'rb' in the checkpoint, is 'rt' now""",  # noqa: E501
        )

    @parametrize("case", sorted(CASES))
    def test_the_record_is_the_same_for_a_pickled_copy(self, case: str) -> None:
        """Read from what a DataPipe keeps, not from addresses or set order: the copy
        ``DataLoader2`` pickles (and a worker unpickles) reads the same."""
        name, _, new, *_ = CASES[case]
        datapipe = BUILD[name](**new)
        self.assertEqual(read(pickle.loads(pickle.dumps(datapipe)))[0], read(datapipe)[0])

    @parametrize("name", ["XzFileLoader", "Bz2FileLoader", "ZipArchiveLoader", "WebDataset"])
    def test_a_reader_whose_arguments_do_not_change_the_data_records_none(self, name: str) -> None:
        datapipe = BUILD[name](**({} if name == "WebDataset" else {"length": 5}))
        self.assertEqual(datapipe_arguments(datapipe), {})


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

    def test_the_pipeline_it_was_taken_with_restores(self) -> None:
        self.assertEqual(argument_changes(EARLIER_RECORD, *read(readers())), [])

    def test_values_are_compared_in_todays_form(self) -> None:
        self.assertEqual(argument_changes(EARLIER_RECORD, *read(readers(mode="rt", length=10))), [])
        self.assertEqual(
            argument_changes(EARLIER_RECORD, *read(readers(mode="b"))),
            ["DataPipe 3:FileOpenerIterDataPipe: mode was 'rt' in the checkpoint, is 'rb' now"],
        )

    def test_an_argument_it_could_not_record_is_not_a_difference(self) -> None:
        # The record cannot say; the replay's digest checks the items.
        self.assertEqual(argument_changes(EARLIER_RECORD, *read(readers(strip_newline=False))), [])
