"""Which pipeline a checkpoint belongs to: the fingerprint of its structure and the constructor
arguments that determine its data, as a state records them and a restore checks them.

Computed in the main process from the pipeline the user hands to ``DataLoader2`` (before any
worker starts), and stored in the checkpoint beside the positions (``checkpoint.format``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from torchdata.dataloader2.graph import DataPipe, DataPipeGraph

from torchdata_snapshot.checkpoint.arguments import Arguments, Reading, datapipe_arguments, reading_of
from torchdata_snapshot.core.graph import (
    FUNCTION_ATTRIBUTES,
    describe_datapipe,
    function_name,
    graph_datapipes,
)
from torchdata_snapshot.core.traversal import traverse

__all__ = ["GraphIdentity", "graph_arguments", "graph_fingerprint", "graph_identity"]


@dataclass(frozen=True)
class GraphIdentity:
    """Which pipeline a state belongs to: the ``fingerprint`` of its structure and the plain
    constructor ``arguments`` of its DataPipes (``None``: not recorded, as before a reading
    service ran). A pipeline's own identity also has the ``readings`` its arguments were read
    with, by key, which read a checkpoint's record of them (NOTE [ Argument readings ]); a
    state's has none, and they are not part of what identifies the pipeline."""

    fingerprint: str
    arguments: Optional[Arguments] = None
    readings: Mapping[str, Reading] = field(default_factory=dict, compare=False, repr=False)


def _describe_node(dp: DataPipe) -> str:
    words = [describe_datapipe(dp)]
    for attribute in FUNCTION_ATTRIBUTES:
        fn = getattr(dp, attribute, None)
        if callable(fn):
            words.append(f"{attribute}={function_name(fn)}")
    return " ".join(words)


def graph_identity(datapipe: DataPipe, graph: Optional[DataPipeGraph] = None) -> GraphIdentity:
    """The graph's fingerprint and arguments, as a state records them and a restore checks them,
    and the readings of its arguments (NOTE [ Argument readings ]); ``graph``: ``datapipe``'s,
    if the caller traversed it already."""
    graph = traverse(datapipe) if graph is None else graph
    keyed = graph_datapipes(datapipe, graph)
    readings = {key: reading_of(dp) for key, dp in keyed}
    arguments = {key: readings[key].record(dp) for key, dp in keyed}
    return GraphIdentity(graph_fingerprint(datapipe, graph), arguments, readings)


def graph_arguments(datapipe: DataPipe) -> Arguments:
    """The constructor arguments of every DataPipe of the graph that determine its data (see
    :func:`~torchdata_snapshot.checkpoint.arguments.datapipe_arguments`), by ``datapipe_key``."""
    return {key: datapipe_arguments(dp) for key, dp in graph_datapipes(datapipe)}


def graph_fingerprint(datapipe: DataPipe, graph: Optional[DataPipeGraph] = None) -> str:
    """A digest of the graph's structure: DataPipe types, their map/filter functions, the edges.

    Two pipelines built by the same code have the same fingerprint; a pipeline with another
    DataPipe, another function or another shape has another one. Constructor arguments (batch
    sizes, buffer sizes, the values a ``functools.partial`` binds) are not part of it: a state
    records them beside it (:func:`graph_arguments`), so that a mismatch names the DataPipe and
    the argument; a ``functools.partial`` counts here as ``functools.partial``, there as its
    function's name. The data itself is part of neither. It has not changed since the
    first format version.
    """
    seen: Dict[int, int] = {}
    lines: List[str] = []

    def visit(graph: Dict[int, Any], depth: int) -> None:
        for dp_id, (dp, parents) in graph.items():
            if dp_id in seen:
                lines.append(f"{depth} ref {seen[dp_id]}")
                continue
            seen[dp_id] = len(seen)
            lines.append(f"{depth} {_describe_node(dp)}")
            visit(parents, depth + 1)

    visit(traverse(datapipe) if graph is None else graph, 0)
    return hashlib.blake2b("\n".join(lines).encode(), digest_size=8).hexdigest()
