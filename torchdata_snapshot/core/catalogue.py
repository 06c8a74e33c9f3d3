"""The one catalogue of what the package knows about each DataPipe type torch and torchdata ship.

Each entry says, for one type (by exact type: a subclass may behave otherwise and is not in the
catalogue), what the rest of the package relies on:

- ``per_element``: how it hands on what it takes from its source, for elastic resume
  (:class:`~torchdata_snapshot.graph_state.worker_loop.ElasticWorker`): ``"one"`` item per element, holding
  nothing at a yield point; ``"several"`` items per element, the same ones each time for the same
  element (an *expander*); ``"holds_one"``: after an expander, it holds at most the item it took
  last when it yields; ``None``: none of these.
- ``stateless``: it holds no state at a yield point, so that stateful restore keeps it as it is
  (:mod:`torchdata_snapshot.graph_state.graph_state`).
- ``adapted``: its state lives in a generator frame, and stateful restore makes it resumable, in
  place or wrapped (the adapter tables of :mod:`torchdata_snapshot.graph_state.equivalents` and
  :mod:`~torchdata_snapshot.graph_state.readers` name how, for a class that does not keep its
  state itself; a test checks that those tables and this catalogue agree).
- ``main_tail``: in the main process, after the workers, it hands on exactly one item per item it
  takes, in order, so that the user's position maps onto the workers' streams
  (:mod:`torchdata_snapshot.core.main.positions`).
- ``after_sharding``: it may stand between the sharding point and the user in an elastic graph:
  when it yields, it holds no element it took (a batch yields once full, and is empty then;
  see :data:`~torchdata_snapshot.checkpoint.restore_plan.ElasticStart`).

How a checkpoint reads each type's constructor arguments is a table of its own
(``checkpoint.arguments.READINGS``): those are functions, not traits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Literal, Optional, Tuple

from torch.utils.data.datapipes.iter.callable import CollatorIterDataPipe, MapperIterDataPipe
from torch.utils.data.datapipes.iter.combinatorics import ShufflerIterDataPipe
from torch.utils.data.datapipes.iter.combining import (
    ConcaterIterDataPipe,
    MultiplexerIterDataPipe,
    ZipperIterDataPipe,
)
from torch.utils.data.datapipes.iter.filelister import FileListerIterDataPipe
from torch.utils.data.datapipes.iter.fileopener import FileOpenerIterDataPipe
from torch.utils.data.datapipes.iter.grouping import BatcherIterDataPipe, UnBatcherIterDataPipe
from torch.utils.data.datapipes.iter.routeddecoder import RoutedDecoderIterDataPipe
from torch.utils.data.datapipes.iter.selecting import FilterIterDataPipe
from torch.utils.data.datapipes.iter.streamreader import StreamReaderIterDataPipe
from torch.utils.data.datapipes.iter.utils import IterableWrapperIterDataPipe
from torchdata.datapipes.iter import (
    Bz2FileLoader,
    CSVDictParser,
    CSVParser,
    Cycler,
    Decompressor,
    Enumerator,
    FlatMapper,
    FSSpecFileOpener,
    FullSync,
    Header,
    IndexAdder,
    JsonParser,
    LineReader,
    ParagraphAggregator,
    PinMemory,
    Prefetcher,
    TarArchiveLoader,
    WebDataset,
    XzFileLoader,
    ZipArchiveLoader,
)

__all__ = ["CATALOGUE", "PerElement", "Traits", "types_where"]

PerElement = Optional[Literal["one", "several", "holds_one"]]


@dataclass(frozen=True)
class Traits:
    """What the package relies on of one DataPipe type (see the module docstring)."""

    per_element: PerElement = None
    stateless: bool = False
    adapted: bool = False
    main_tail: bool = False
    after_sharding: bool = False


_ONE_READER = Traits(per_element="one", adapted=True)  # the file openers: a stream per file name
_EXPANDING_READER = Traits(per_element="several", adapted=True)

#: DataPipe type -> its traits. The order is the order messages list them in.
CATALOGUE: Dict[type, Traits] = {
    MapperIterDataPipe: Traits(per_element="one", stateless=True, main_tail=True, after_sharding=True),
    FilterIterDataPipe: Traits(stateless=True, after_sharding=True),
    BatcherIterDataPipe: Traits(stateless=True, after_sharding=True),
    CollatorIterDataPipe: Traits(stateless=True, main_tail=True, after_sharding=True),
    ZipperIterDataPipe: Traits(stateless=True),
    FullSync: Traits(main_tail=True),
    Prefetcher: Traits(main_tail=True),
    PinMemory: Traits(main_tail=True),
    FileOpenerIterDataPipe: _ONE_READER,
    FSSpecFileOpener: _ONE_READER,
    Decompressor: _ONE_READER,
    XzFileLoader: _ONE_READER,
    Bz2FileLoader: _ONE_READER,
    JsonParser: Traits(per_element="one", stateless=True),
    RoutedDecoderIterDataPipe: Traits(per_element="one", stateless=True),
    LineReader: _EXPANDING_READER,
    CSVParser: _EXPANDING_READER,
    CSVDictParser: _EXPANDING_READER,
    StreamReaderIterDataPipe: _EXPANDING_READER,
    TarArchiveLoader: _EXPANDING_READER,
    ZipArchiveLoader: _EXPANDING_READER,
    FlatMapper: Traits(per_element="several", adapted=True),
    UnBatcherIterDataPipe: Traits(per_element="several", adapted=True),
    WebDataset: Traits(per_element="holds_one", adapted=True),
    ParagraphAggregator: Traits(per_element="holds_one", adapted=True),
    IterableWrapperIterDataPipe: Traits(adapted=True),
    ShufflerIterDataPipe: Traits(adapted=True),
    Header: Traits(adapted=True),
    Cycler: Traits(adapted=True),
    ConcaterIterDataPipe: Traits(adapted=True),
    MultiplexerIterDataPipe: Traits(adapted=True),
    FileListerIterDataPipe: Traits(adapted=True),
    Enumerator: Traits(adapted=True),
    IndexAdder: Traits(adapted=True),
}


def types_where(**traits: object) -> Tuple[type, ...]:
    """The catalogue's types whose traits have the values given, in the catalogue's order:
    ``types_where(per_element="one")``, ``types_where(stateless=True)``."""
    unknown = set(traits) - set(Traits.__dataclass_fields__)
    if unknown:
        raise TypeError(
            f"no trait {', '.join(sorted(unknown))} (the traits: {', '.join(Traits.__dataclass_fields__)})"
        )
    return tuple(
        kind for kind, have in CATALOGUE.items() if all(getattr(have, k) == v for k, v in traits.items())
    )
