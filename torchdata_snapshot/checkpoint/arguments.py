r"""What a checkpoint records of each DataPipe's constructor arguments, and how a restore
compares the record with the pipeline it is loaded into.

NOTE [ Argument readings ]

A checkpoint records, per DataPipe (by ``datapipe_key``), the plain constructor arguments that
determine its data, so that a restore onto a pipeline built with other ones is refused naming
the DataPipe and the argument, before any worker starts, instead of replaying into a
``ReplayDivergenceError`` (or, worse, replaying unnoticed).

Most DataPipes keep each argument in an attribute named like its parameter
(``batch(4)``: ``dp.batch_size``): the *attribute rule* reads those. Some keep them elsewhere
(``LineReader`` in a private helper object, ``groupby`` its buffer size as ``max_buffer_size``),
or in a form that is not plain data (a set of indices, an enum, a function), or take arguments
that change only timing (a prefetcher's buffer, a timeout) or ``len()`` (a nominal ``length``),
or accept several spellings of one setting (``open_files(mode="r")`` and ``"rt"``).
:data:`READINGS` says, by exact type (a subclass may mean something else by the same names),
how to read such a type: the arguments the attribute rule cannot see (``read``), the form each
argument is compared in (``forms``: equivalent spellings become one value) and the arguments
left out (``ignored``). Every other type is read by the attribute rule alone.

A record is the compared form, so a restore normalises only the checkpoint's side, with the
reading of the DataPipe now at that key (the fingerprint, compared first, says that it has the
same type). That also reads records written before a reading existed: their values take the
compared form (``"r"`` becomes ``"rt"``, a nominal ``length`` is dropped), and an argument of
``read`` they lack (the attribute rule could not see it) is not a difference: the checkpoint
cannot say what it was.
"""

from __future__ import annotations

import codecs
import csv
import enum
import functools
import inspect
import json
import os
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional

from torch.utils.data.datapipes.iter.utils import IterableWrapperIterDataPipe
from torchdata.dataloader2.graph import DataPipe
from torchdata.datapipes.iter import (
    Bz2FileLoader,
    CSVDictParser,
    CSVParser,
    Decompressor,
    Dropper,
    FileLister,
    FileOpener,
    Flattener,
    FSSpecFileLister,
    FSSpecFileOpener,
    FullSync,
    GDriveReader,
    Grouper,
    HttpReader,
    JsonParser,
    LineReader,
    OnlineReader,
    ParagraphAggregator,
    Prefetcher,
    RoutedDecoder,
    SampleMultiplexer,
    ShardingFilter,
    StreamReader,
    TarArchiveLoader,
    ThreadPoolMapper,
    XzFileLoader,
    ZipArchiveLoader,
)
from torchdata.datapipes.iter.util.randomsplitter import _RandomSplitterIterDataPipe

from torchdata_snapshot._compat.datapipes import text_reader_setting
from torchdata_snapshot._constants import ARGUMENT_MAX_CHARS
from torchdata_snapshot.checkpoint.function_digest import function_digest, same_computation
from torchdata_snapshot.core.graph import FUNCTION_ATTRIBUTES, NOT_PLAIN, function_name, plain_data

__all__ = [
    "CODE",
    "READINGS",
    "Arguments",
    "Reading",
    "argument_changes",
    "datapipe_arguments",
    "reading_of",
    "structure_change",
]

#: Per DataPipe of a graph, by ``datapipe_key``: its plain constructor arguments by name.
Arguments = Dict[str, Dict[str, Any]]

#: How to read one argument from a DataPipe.
Read = Callable[[DataPipe], Any]


#: The suffix of a function's record of what it computes with (``fn.code``, beside ``fn``).
CODE = ".code"


@dataclass(frozen=True)
class Reading:
    """How the checkpoint reads the arguments of one DataPipe type (NOTE [ Argument readings ])."""

    #: The arguments the attribute rule cannot see, by name: how to read each from the DataPipe
    #: (a value that is not plain data is not recorded). A record written before lacks them.
    read: Mapping[str, Read] = field(default_factory=dict)
    #: Per argument, its compared form: equivalent spellings of a setting become one value. A
    #: form takes any plain value (a checkpoint's too) and returns the others as they are.
    forms: Mapping[str, Callable[[Any], Any]] = field(default_factory=dict)
    #: Arguments that never change which items come: neither recorded nor compared.
    ignored: FrozenSet[str] = frozenset()

    def record(self, datapipe: DataPipe) -> Dict[str, Any]:
        """The DataPipe's arguments, by name, in their compared form. One of ``read`` that the
        DataPipe does not have (a torchdata release that keeps it elsewhere) is not recorded."""
        values = _attribute_values(datapipe)
        for name, read in self.read.items():
            try:
                values[name] = read(datapipe)
            except AttributeError:
                values[name] = NOT_PLAIN
        return self.compared(values)

    def compared(self, arguments: Mapping[str, Any]) -> Dict[str, Any]:
        """``arguments`` (read now, or recorded by a checkpoint) in their compared form."""
        compared = {}
        for name, value in arguments.items():
            if name in self.ignored:
                continue
            plain = plain_data(self.forms.get(name, _same)(value), ARGUMENT_MAX_CHARS)
            if plain is not NOT_PLAIN:
                compared[name] = plain
        return compared


def _same(value: Any) -> Any:
    return value


# --- the attribute rule ---------------------------------------------------------------------


def _attribute_values(datapipe: DataPipe) -> Dict[str, Any]:
    """The attributes of the instance named like a parameter of its class's constructor (the
    rule torch's own error messages use to show a DataPipe's arguments), and the functions of
    ``FUNCTION_ATTRIBUTES``. Not the first parameter: the DataPipe's input (the DataPipe the
    functional form ``dp.batch(4)`` passes, or the iterable a source such as
    ``IterableWrapper`` wraps), which is data, not a setting; nor private attributes (buffers,
    RNGs, seeds, iterator ids) and attributes no parameter is named after (the sharding
    filter's instance, which sharding sets). A function counts as its name (``fn``) and what it
    computes with (``fn.code``: see :mod:`~torchdata_snapshot.checkpoint.function_digest`); a
    ``functools.partial`` also as its arguments (``fn.args[0]``, ``fn.scale``)."""
    state = getattr(datapipe, "__dict__", {})
    values: Dict[str, Any] = {}
    for name in dict.fromkeys([*_parameters(type(datapipe)), *FUNCTION_ATTRIBUTES]):
        if name.startswith("_") or name not in state:
            continue
        value = state[name]
        if isinstance(value, functools.partial):
            values[name] = function_name(value.func)
            values[f"{name}{CODE}"] = function_digest(value)
            values.update((f"{name}.args[{i}]", v) for i, v in enumerate(value.args))
            values.update((f"{name}.{keyword}", v) for keyword, v in value.keywords.items())
        elif isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
            values[name] = function_name(value)
            values[f"{name}{CODE}"] = function_digest(value)
        else:
            values[name] = value
    return values


def _parameters(cls: type) -> List[str]:
    """The names of ``cls``'s constructor parameters after the first (its input)."""
    try:
        parameters = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a class implemented in C)
        return []
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in parameters[1:] if p.kind not in variadic]


# --- reading what the attribute rule cannot see -----------------------------------------------


def _text_settings(*names: str) -> Dict[str, Read]:
    """torchdata's text readers keep their arguments in a private helper object."""
    return {name: functools.partial(text_reader_setting, name=name) for name in names}


def _attribute(name: str, form: Callable[[Any], Any] = _same) -> Read:
    """Read attribute ``name`` (kept under another name, or in another form) as ``form`` of it."""
    return functools.partial(_read_attribute, name, form)


def _read_attribute(name: str, form: Callable[[Any], Any], datapipe: DataPipe) -> Any:
    return form(getattr(datapipe, name))


def _lister_roots(datapipe: DataPipe) -> Any:
    """The roots a ``FileLister`` lists, as the strings it lists them by, when it was given them
    (``FileLister("data")``, ``FileLister(["a", "b"])``: an ``IterableWrapper`` over paths); not
    plain data when they come from another DataPipe. Recorded, other roots are another pipeline,
    unless a restore finds there the files it reads again (a data directory that moved)."""
    source = datapipe.datapipe
    roots = source.iterable if type(source) is IterableWrapperIterDataPipe else None
    if isinstance(roots, (list, tuple)) and all(isinstance(root, (str, os.PathLike)) for root in roots):
        return [os.fspath(root) for root in roots]
    return NOT_PLAIN


def _decoder_handlers(datapipe: DataPipe) -> Any:
    return [_called(handler) for handler in datapipe.decoder.handlers]


def _decoder_key_fn(datapipe: DataPipe) -> Any:
    return _called(datapipe.decoder.key_fn)


def _multiplexer_weights(datapipe: DataPipe) -> Any:
    """``SampleMultiplexer``'s weights, as it draws with them: scaled to sum to 1."""
    return [weight for _, weight in datapipe.pipes_and_weights]


def _splitter_weights(datapipe: DataPipe) -> Any:
    """``random_split``'s weights by key, as it draws with them: scaled to ``total_length``. (Its
    ``weights`` attribute holds those left in the epoch, which change as it draws.)"""
    return [[key, weight] for key, weight in zip(datapipe.keys, datapipe.norm_weights)]


def _called(fn: Any) -> Any:
    """A function argument as compared: its name (``module.qualname``) and, for a
    ``functools.partial`` or a callable object, the values it holds (``imagehandler("pil")``
    holds its ``imagespec``), as ``name('pil', key=2)``; a value that is not plain data shows
    as ``?``, so that no address gets in."""
    if not callable(fn):
        return fn
    if isinstance(fn, functools.partial):
        name, args, keywords = function_name(fn.func), fn.args, sorted(fn.keywords.items())
    elif inspect.isroutine(fn) or inspect.isclass(fn):
        return function_name(fn)
    else:
        name, args = function_name(fn), ()
        keywords = sorted((k, v) for k, v in getattr(fn, "__dict__", {}).items() if not k.startswith("_"))
    shown = [_shown_value(value) for value in args]
    shown += [f"{key}={_shown_value(value)}" for key, value in keywords]
    return f"{name}({', '.join(shown)})"


def _shown_value(value: Any) -> str:
    return "?" if plain_data(value, ARGUMENT_MAX_CHARS) is NOT_PLAIN else repr(value)


def _enum_value(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def _enum_name(value: Any) -> Any:
    return value.name if isinstance(value, enum.Enum) else value


def _sorted_plain(values: Any) -> Any:
    """A set of plain values as a list in one order (that of their JSON), else :data:`NOT_PLAIN`."""
    items = [plain_data(value, ARGUMENT_MAX_CHARS) for value in values]
    if any(item is NOT_PLAIN for item in items):
        return NOT_PLAIN
    return sorted({_canonical(item): item for item in items}.values(), key=_canonical)


#: The ``csv`` dialect attributes that shape what a reader reads (not ``lineterminator``: the
#: reader recognises ``\r`` and ``\n`` whatever it is).
_DIALECT = ("delimiter", "quotechar", "escapechar", "doublequote", "skipinitialspace", "quoting", "strict")

#: What ``csv.DictReader`` takes before the reader's format parameters, with their defaults.
_DICT_READER = {"fieldnames": None, "restkey": None, "restval": None}


def _dialect(name: str, datapipe: DataPipe) -> Any:
    """Dialect attribute ``name`` of the reader the CSV parser's ``fmtparams`` make: a dialect
    by name, a class, or single parameters, given or left at their defaults, all read as the
    reader sees them."""
    fmtparams = {key: value for key, value in datapipe.fmtparams.items() if key not in _DICT_READER}
    try:
        return getattr(csv.reader([], **fmtparams).dialect, name)
    except (TypeError, csv.Error):  # parameters the reader refuses: the pipeline fails anyway
        return NOT_PLAIN


def _dict_reader(name: str, datapipe: DataPipe) -> Any:
    return datapipe.fmtparams.get(name, _DICT_READER[name])


def _csv_settings(*dict_reader: str) -> Dict[str, Read]:
    """A CSV parser's format parameters, as ``fmtparams.NAME``: the reader's dialect and, for
    ``parse_csv_as_dict``, what ``csv.DictReader`` takes."""
    settings: Dict[str, Read] = {f"fmtparams.{name}": functools.partial(_dialect, name) for name in _DIALECT}
    settings.update((f"fmtparams.{name}", functools.partial(_dict_reader, name)) for name in dict_reader)
    return settings


#: What ``json.loads`` takes besides the text, with its defaults (those of ``json.JSONDecoder``).
_JSON_LOADS = {
    "cls": None,
    **{
        name: parameter.default
        for name, parameter in inspect.signature(json.JSONDecoder.__init__).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    },
}


def _json_loads(name: str, datapipe: DataPipe) -> Any:
    return _called(datapipe.kwargs.get(name, _JSON_LOADS[name]))


def _json_settings() -> Dict[str, Read]:
    """``parse_json_files``'s keyword arguments of ``json.loads``, as ``kwargs.NAME``."""
    return {f"kwargs.{name}": functools.partial(_json_loads, name) for name in _JSON_LOADS}


# --- forms ----------------------------------------------------------------------------------


def _file_mode(mode: Any) -> Any:
    """``open()``'s reading modes as ``FileOpener`` takes them: ``"r"`` and ``"t"`` are ``"rt"``,
    ``"b"`` is ``"rb"`` (the readers prefix the last two with ``"r"``)."""
    return {"r": "rt", "t": "rt", "b": "rb"}.get(mode, mode) if isinstance(mode, str) else mode


def _fsspec_mode(mode: Any) -> Any:
    """fsspec opens ``"r"`` as text, like ``"rt"``; its ``"t"`` and ``"b"`` are not reading modes."""
    return "rt" if mode == "r" else mode


def _encoding(encoding: Any) -> Any:
    """A codec by its canonical name (``"UTF8"`` and ``"utf_8"`` are ``"utf-8"``). ``None`` stays:
    it is the locale's encoding, whatever that is where the pipeline runs."""
    if not isinstance(encoding, str):
        return encoding
    try:
        return codecs.lookup(encoding).name
    except LookupError:
        return encoding


def _masks(masks: Any) -> Any:
    """File name masks as the listers match them: any of them matches, so their order and
    repeats do not count; one mask is a list of one, and no mask (``""``) matches every name,
    as ``[]`` does."""
    if isinstance(masks, str):
        return [masks] if masks else []
    if isinstance(masks, (list, tuple)) and all(isinstance(mask, str) for mask in masks):
        return sorted(set(masks))
    return masks


def _chunk(chunk: Any) -> Any:
    """``read(None)`` and ``read(-n)`` read a stream whole."""
    return None if isinstance(chunk, int) and not isinstance(chunk, bool) and chunk < 0 else chunk


_LENGTH = frozenset({"length"})  # a nominal length: what len() says, not what comes

_TEXT = ("skip_lines", "decode", "encoding", "errors", "return_path")

#: How the checkpoint reads the arguments of each DataPipe type that the attribute rule alone
#: misreads (NOTE [ Argument readings ]), by exact type.
READINGS: Dict[type, Reading] = {
    # files: listers, openers, archives
    FileLister: Reading(read={"root": _lister_roots}, forms={"masks": _masks}, ignored=_LENGTH),
    FileOpener: Reading(forms={"mode": _file_mode, "encoding": _encoding}, ignored=_LENGTH),
    FSSpecFileLister: Reading(forms={"masks": _masks}),  # its connection options (credentials) are not read
    FSSpecFileOpener: Reading(forms={"mode": _fsspec_mode}),
    TarArchiveLoader: Reading(ignored=_LENGTH),  # "r" is not "r:*": it cannot read a stream
    ZipArchiveLoader: Reading(ignored=_LENGTH),
    XzFileLoader: Reading(ignored=_LENGTH),
    Bz2FileLoader: Reading(ignored=_LENGTH),
    Decompressor: Reading(read={"file_type": _attribute("file_type", _enum_value)}),
    StreamReader: Reading(forms={"chunk": _chunk}),
    # parsers
    LineReader: Reading(read=_text_settings("strip_newline", *_TEXT), forms={"encoding": _encoding}),
    CSVParser: Reading(
        read={**_text_settings("as_tuple", *_TEXT), **_csv_settings()}, forms={"encoding": _encoding}
    ),
    CSVDictParser: Reading(
        read={**_text_settings(*_TEXT), **_csv_settings(*_DICT_READER)}, forms={"encoding": _encoding}
    ),
    JsonParser: Reading(read=_json_settings()),
    ParagraphAggregator: Reading(read={"joiner": _attribute("joiner", _called)}),
    RoutedDecoder: Reading(read={"handlers": _decoder_handlers, "key_fn": _decoder_key_fn}),
    # arguments kept under other names or in other forms
    Grouper: Reading(read={"buffer_size": _attribute("max_buffer_size")}),
    Dropper: Reading(read={"indices": _attribute("indices", _sorted_plain)}),
    Flattener: Reading(read={"indices": _attribute("indices", _sorted_plain)}),
    SampleMultiplexer: Reading(read={"weights": _multiplexer_weights}),
    _RandomSplitterIterDataPipe: Reading(read={"weights": _splitter_weights}),
    ShardingFilter: Reading(read={"sharding_group_filter": _attribute("sharding_group_filter", _enum_name)}),
    # arguments that change only when items come (they come in order)
    Prefetcher: Reading(ignored=frozenset({"buffer_size"})),
    FullSync: Reading(ignored=frozenset({"timeout"})),
    ThreadPoolMapper: Reading(ignored=frozenset({"scheduled_tasks", "max_workers"})),
    HttpReader: Reading(ignored=frozenset({"timeout"})),
    GDriveReader: Reading(ignored=frozenset({"timeout"})),
    OnlineReader: Reading(ignored=frozenset({"timeout"})),
}

#: The reading of every other type: the attribute rule.
_ATTRIBUTES = Reading()


def reading_of(datapipe: DataPipe) -> Reading:
    """How the checkpoint reads ``datapipe``'s arguments (by its exact type)."""
    return READINGS.get(type(datapipe), _ATTRIBUTES)


def datapipe_arguments(datapipe: DataPipe) -> Dict[str, Any]:
    """The DataPipe's constructor arguments that determine its data, by name, in their compared
    form: what a checkpoint compares with the pipeline it is restored on (besides the graph's
    structure). An argument counts when its value is plain data (``None``, bools, ints, floats,
    strings, and lists, tuples and string-keyed dicts of those; tuples become lists) of at most
    ``ARGUMENT_MAX_CHARS`` as JSON. Nothing depends on addresses or set order: the result is the
    same in every process that builds the same pipeline."""
    return reading_of(datapipe).record(datapipe)


def argument_changes(
    recorded: Optional[Arguments], current: Optional[Arguments], readings: Mapping[str, Reading]
) -> List[str]:
    """What differs between the arguments a state recorded and the graph's (read with
    ``readings``, by key), one phrase each; nothing if either was not recorded."""
    if recorded is None or current is None:
        return []
    changes = []
    for key in dict.fromkeys([*recorded, *current]):
        if key not in recorded or key not in current:
            where = "the checkpoint" if key in recorded else "this pipeline"
            changes.append(f"DataPipe {key} is only in {where}")
            continue
        reading = readings.get(key, _ATTRIBUTES)
        old, new = reading.compared(recorded[key]), reading.compared(current[key])
        for name in dict.fromkeys([*old, *new]):
            if name not in old and (name in reading.read or name.endswith(CODE) or f"{name}{CODE}" in new):
                continue  # recorded before the reading (or functions) were: the checkpoint cannot say
            if name.endswith(CODE) and name in old and name in new:
                if not same_computation(old[name], new[name]):
                    function = name[: -len(CODE)]
                    changes.append(
                        f"DataPipe {key}: its function {function} ({new.get(function, '?')}) computes "
                        "otherwise than in the checkpoint: its code, defaults, or the values it captures "
                        "or reads changed"
                    )
                continue
            if name not in old or name not in new or _canonical(old[name]) != _canonical(new[name]):
                was, now = _shown(old, name), _shown(new, name)
                changes.append(f"DataPipe {key}: {name} was {was} in the checkpoint, is {now} now")
    return changes


def structure_change(recorded: Optional[Arguments], current: Optional[Arguments], changes: List[str]) -> str:
    """What differs between two graphs whose structures do (by their arguments' keys, output
    first): the first DataPipe of another type, or else the first argument change (a function
    renamed), or else their connections."""
    if recorded is not None and current is not None:
        for old, new in zip(recorded, current):
            if old != new:
                return f"the first DataPipe that differs is {new}, where the checkpoint has {old}"
        if len(recorded) != len(current):
            return (
                f"{'the checkpoint' if len(recorded) > len(current) else 'this pipeline'} has more DataPipes"
            )
        if changes:
            return changes[0]
    return "the same DataPipes, connected otherwise or with other functions"


def _canonical(value: Any) -> str:
    """A plain value as compared: JSON tells 1 from 1.0 and True, and NaN equals itself."""
    return json.dumps(value, sort_keys=True)


def _shown(arguments: Dict[str, Any], name: str) -> str:
    return repr(arguments[name]) if name in arguments else "not recorded"
