"""Every resumable DataPipe, alone and in compositions, restored from a captured state at any
position, continues exactly as the uninterrupted run: item by item, to the end of the epoch and
through the next one. This is what a worker does on a stateful restore (see the docs' design
page), run in this process so that the property tests can try many positions and shardings
(helpers/draws.py).

``COMPOSITIONS`` must use every DataPipe type stateful restore knows (its adapters, the types it
treats as stateless and the sharding filter, which has built-in state functions): a type cannot
be made resumable without being covered here (``test_every_registered_datapipe_is_covered``).
"""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import json
import lzma
import random
import tarfile
import unittest
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch
from draws import SeededDraw, examples
from pipelines import CountingStateful, double, not_multiple_of_3, split
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES, ShardingFilterIterDataPipe
from torchdata.dataloader2.graph import set_graph_random_seed
from torchdata.dataloader2.random import SeedGenerator
from torchdata.datapipes.iter import FileLister, FileOpener, IterableWrapper, IterDataPipe

from torchdata_snapshot.core.catalogue import types_where
from torchdata_snapshot.core.graph import graph_datapipes
from torchdata_snapshot.graph_state.graph_state import RESUMABLE_ADAPTERS, RESUMABLE_STATELESS, GraphState

Build = Callable[[], IterDataPipe]


def noisy(x: Any) -> Any:
    return (x, random.random(), int(torch.randint(0, 1000, ())))


def total(batch: List[int]) -> int:
    return sum(batch)


def basename(path: str) -> str:
    return Path(path).name


def read_streams(item: Any) -> Any:
    """An item with each stream in it read (streams do not compare)."""
    if hasattr(item, "read"):
        return item.read()
    if isinstance(item, (tuple, list)):
        return type(item)(read_streams(v) for v in item)
    if isinstance(item, dict):
        return {k: read_streams(v) for k, v in item.items()}
    return item


def routed_decode(dp: IterDataPipe) -> IterDataPipe:
    """``dp.routed_decode()``, which torch deprecates (with a warning) but still ships."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return dp.routed_decode()


def _lines(i: int) -> str:
    """A text file of ``i``: paragraphs of a few lines, separated by empty lines."""
    return "".join(f"file {i} line {j}\n" if j % 4 else "\n" for j in range(1, 3 + 5 * i))


def _member_bytes(name: str, data: bytes) -> Tuple[tarfile.TarInfo, io.BytesIO]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, io.BytesIO(data)


#: The files the reader compositions read, by kind (written once per module, see ``files``).
Files = Dict[str, Any]


def _files(root: Path) -> Files:
    roots = []
    for d in ("a", "b", "c"):
        (root / d).mkdir(exist_ok=True)
        for i in range(5):
            (root / d / f"{i}.txt").write_text(str(i))
        roots.append(str(root / d))
    files: Files = {"roots": roots}
    for kind in ("text", "csv", "json", "tar", "zip", "compressed"):
        (root / kind).mkdir()
        files[kind] = str(root / kind)
    for i in range(7):
        (root / "text" / f"{i}.txt").write_text(_lines(i))
        with open(root / "csv" / f"{i}.csv", "w", newline="") as f:
            csv.writer(f).writerows([["n", "square"], *([j, j * j] for j in range(i * 3))])
        (root / "json" / f"{i}.json").write_text(json.dumps({"file": i, "values": list(range(i))}))
        (root / "compressed" / f"{i}.txt.gz").write_bytes(gzip.compress(_lines(i).encode()))
        (root / "compressed" / f"{i}.txt.xz").write_bytes(lzma.compress(_lines(i).encode()))
        (root / "compressed" / f"{i}.txt.bz2").write_bytes(bz2.compress(_lines(i).encode()))
    for shard in range(4):
        with tarfile.open(root / "tar" / f"shard{shard}.tar", "w") as tar:
            for k in range(shard + 2):
                key = f"sample{shard}_{k}"
                tar.addfile(*_member_bytes(f"{key}.txt", f"text {shard} {k}".encode()))
                tar.addfile(*_member_bytes(f"{key}.cls", str(k % 3).encode()))
        with zipfile.ZipFile(root / "zip" / f"archive{shard}.zip", "w") as archive:
            for k in range(shard + 3):
                archive.writestr(f"dir/member{k}.txt", f"zip {shard} {k}")
    import fsspec

    memory = fsspec.filesystem("memory")
    files["memory"] = [f"memory://{root.name}/{i}.txt" for i in range(7)]
    for i, uri in enumerate(files["memory"]):
        with memory.open(uri[len("memory://") :], "w") as f:
            f.write(_lines(i))
    return files


def _compositions(files: Files) -> Dict[str, Build]:
    def iw(*args: int) -> IterDataPipe:
        return IterableWrapper(range(*args))

    def listed(kind: str, mask: str = "*") -> IterDataPipe:
        return FileLister(files[kind], masks=mask)

    return {
        # the sharding filter under a re-iterating DataPipe (a loaded position is for one pass)
        "sharding_under_cycle": lambda: iw(40).sharding_filter().cycle(2),
        "cycle_before_sharding": lambda: iw(23).cycle(2).sharding_filter(),
        "shuffle_sharding_cycle": lambda: iw(30).shuffle(buffer_size=7).sharding_filter().cycle(3),
        "cycle_of_cycles": lambda: iw(5).cycle(2).sharding_filter().cycle(2),
        "header_over_endless_cycle": lambda: iw(7).shuffle().cycle().sharding_filter().header(30),
        # one-to-many and many-to-one after the sharding point
        "shuffle_then_batch": lambda: iw(50).sharding_filter().shuffle(buffer_size=5).batch(3),
        "batch_then_unbatch": lambda: iw(41).sharding_filter().batch(4).unbatch(),
        "unbatch_all_levels": lambda: (
            IterableWrapper([[[1, 2], [3]], [[4]], [[5, 6, 7]]] * 4).sharding_filter().unbatch(-1)
        ),
        "flatmap_then_header": lambda: iw(30).sharding_filter().flatmap(split).header(25),
        "collate_batches": lambda: iw(31).sharding_filter().batch(4, drop_last=True).collate(total),
        "filter_and_map": lambda: iw(60).sharding_filter().filter(not_multiple_of_3).map(double),
        "header_under_cycle": lambda: iw(30).sharding_filter().header(7).cycle(3),
        # several sources: concat, zip and mux, alone and under cycle
        "concat_under_cycle": lambda: iw(5).concat(iw(10, 18)).sharding_filter().cycle(2),
        "sharded_concat_under_cycle": lambda: iw(12).sharding_filter().concat(iw(100, 109)).cycle(2),
        "zip_under_cycle": lambda: iw(20).sharding_filter().zip(iw(100, 107)).cycle(2),
        "batch_inside_zip": lambda: iw(30).batch(3).zip(iw(10)).sharding_filter(),
        "mux_under_cycle": lambda: iw(9).mux(iw(100, 120)).sharding_filter().cycle(2),
        "mux_of_shuffles": lambda: iw(20).shuffle().mux(iw(100, 113).shuffle()).sharding_filter(),
        # global RNGs drawn by a map function, and a DataPipe with its own state methods
        "global_rng": lambda: iw(30).shuffle(buffer_size=4).sharding_filter().map(noisy),
        "own_state_methods": lambda: CountingStateful(30).sharding_filter().map(double),
        "files": lambda: FileLister(files["roots"], masks="*.txt").sharding_filter().map(basename).cycle(2),
        # readers: files opened and parsed after sharding, and before it
        "lines_after_sharding": lambda: (
            listed("text").shuffle().sharding_filter().open_files().readlines().batch(5)
        ),
        "lines_before_sharding": lambda: (
            FileOpener(listed("text")).readlines(return_path=False).sharding_filter().cycle(2)
        ),
        "paragraphs_enumerated": lambda: (
            listed("text").sharding_filter().open_files().readlines().lines_to_paragraphs().enumerate()
        ),
        "csv_rows_zipped": lambda: (
            listed("csv").sharding_filter().open_files().parse_csv(skip_lines=1).zip(iw(1000))
        ),
        "csv_dicts_indexed_in_mux": lambda: (
            listed("csv").sharding_filter().open_files().parse_csv_as_dict().add_index().mux(iw(100, 130))
        ),
        "json_files": lambda: listed("json").sharding_filter().open_files().parse_json_files(),
        "tar_webdataset": lambda: (
            listed("tar")
            .shuffle()
            .sharding_filter()
            .open_files("b")
            .load_from_tar()
            .webdataset()
            .map(read_streams)
        ),
        "zip_members_under_cycle": lambda: (
            listed("zip").sharding_filter().open_files("b").load_from_zip().map(read_streams).cycle(2)
        ),
        "decompressed_lines": lambda: (
            listed("compressed").sharding_filter().open_files("b").decompress().readlines().batch(3)
        ),
        "xz_and_bz2_loaders": lambda: (
            listed("compressed", "*.xz")
            .open_files("b")
            .load_from_xz()
            .readlines()
            .concat(listed("compressed", "*.bz2").open_files("b").load_from_bz2().readlines())
            .sharding_filter()
        ),
        "stream_chunks": lambda: listed("text").sharding_filter().open_files("b").read_from_stream(chunk=11),
        "routed_decode": lambda: routed_decode(listed("json").sharding_filter().open_files("b")),
        "fsspec_memory": lambda: (
            IterableWrapper(files["memory"]).sharding_filter().open_files_by_fsspec().readlines().batch(4)
        ),
    }


NAMES = sorted(_compositions({}))


#: A worker's graph and the graph state that keeps its states.
Graph = Tuple[IterDataPipe, GraphState]


def sharded(build: Build, num_instances: int, instance_id: int) -> IterDataPipe:
    """The graph a worker receives: sharded for worker ``instance_id``."""
    dp = build()
    torch.utils.data.graph_settings.apply_sharding(
        dp, num_instances, instance_id, SHARDING_PRIORITIES.MULTIPROCESSING
    )
    return dp


def worker_graph(build: Build, num_instances: int, instance_id: int, adapt: bool = True) -> Graph:
    """The graph a worker runs: sharded for worker ``instance_id``, then made resumable."""
    state = GraphState()
    dp = sharded(build, num_instances, instance_id)
    return (state.make_resumable(dp) if adapt else dp), state


def start_epoch(graph: Graph, epoch: int) -> Iterator[Any]:
    """Seed the graph for ``epoch`` as a worker does (graph seeds, then its global RNGs) and make
    its iterator."""
    dp, state = graph
    state.reset(graph_datapipes(dp))
    set_graph_random_seed(dp, SeedGenerator(epoch))
    random.seed(epoch)
    torch.manual_seed(epoch)
    return iter(dp)


def run_epochs(graph: Graph, count: int) -> List[List[Any]]:
    return [list(start_epoch(graph, epoch)) for epoch in range(count)]


def restored(build: Build, sharding: Tuple[int, int], epoch: int, blob: bytes) -> Tuple[Graph, Any]:
    """A new graph brought to ``blob`` the way a worker's restore does: reset to the epoch (an
    iterator is made and never advanced), load the state, iterate afresh."""
    graph = worker_graph(build, *sharding)
    start_epoch(graph, epoch)
    random.seed(12345)  # whatever the global RNGs hold: the state brings the pipeline's back
    torch.manual_seed(12345)
    dp, state = graph
    state.load(graph_datapipes(dp), blob)
    return graph, iter(dp)


def state_of(graph: Graph) -> bytes:
    """The graph's state, captured as a worker does."""
    dp, state = graph
    return state.capture(graph_datapipes(dp))


def at_epoch(build: Build, sharding: Tuple[int, int], epoch: int) -> Tuple[Graph, Iterator[Any]]:
    """A worker's graph run through the epochs before ``epoch``, and its iterator of ``epoch``."""
    graph = worker_graph(build, *sharding)
    for e in range(epoch):
        list(start_epoch(graph, e))
    return graph, start_epoch(graph, epoch)


def check_restore_at(build: Build, sharding: Tuple[int, int], epoch: int, positions: List[int]) -> None:
    """Capture at every position of ``positions`` in ``epoch``; each restore yields exactly the
    rest of the epoch, then the next epoch."""
    reference = run_epochs(worker_graph(build, *sharding), epoch + 2)
    graph, it = at_epoch(build, sharding, epoch)
    blobs: List[Tuple[int, bytes]] = []
    head: List[Any] = []
    for k in sorted(positions):
        head.extend(next(it) for _ in range(k - len(head)))
        blobs.append((k, state_of(graph)))
    assert head + list(it) == reference[epoch], "capturing states changed the data"
    for k, blob in blobs:
        again, rest = restored(build, sharding, epoch, blob)
        assert list(rest) == reference[epoch][k:], f"the rest of epoch {epoch} after item {k}"
        assert list(start_epoch(again, epoch + 1)) == reference[epoch + 1], "the next epoch"


def check_chained_restore(build: Build, sharding: Tuple[int, int], epoch: int, k: int, more: int) -> None:
    """Capture after ``k`` items, restore, take ``more`` items, capture again and restore from that:
    the rest of the epoch is exactly the uninterrupted run's. (Right after a restore a reader or
    ``unbatch`` finishes its element before it pulls from its source, whose loaded state the
    second capture must carry.)"""
    reference = run_epochs(worker_graph(build, *sharding), epoch + 1)[epoch]
    graph, it = at_epoch(build, sharding, epoch)
    head = [next(it) for _ in range(k)]
    again, rest = restored(build, sharding, epoch, state_of(graph))
    head += [next(rest) for _ in range(more)]
    _, rest = restored(build, sharding, epoch, state_of(again))
    assert head + list(rest) == reference, f"restored after {k}, then after {more} more"


def draw_sharding(draw: SeededDraw) -> Tuple[int, int]:
    """``(num_instances, instance_id)``: 1 to 3 instances, and one of them."""
    num_instances = draw.integer(1, 3)
    return num_instances, draw.integer(0, num_instances - 1)


class TestStatefulEquivalence(SuiteTestCase):
    compositions: Dict[str, Build]  # over files of a directory of the class's own

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls.compositions = _compositions(_files(cls.class_directory("files")))

    def test_every_registered_datapipe_is_covered(self) -> None:
        covered = {type(dp) for build in self.compositions.values() for _, dp in graph_datapipes(build())}
        registered = set(RESUMABLE_ADAPTERS) | set(RESUMABLE_STATELESS) | {ShardingFilterIterDataPipe}
        missing = sorted(kind.__name__ for kind in registered - covered)
        assert not missing, f"resumable DataPipes without an equivalence test: {missing}"

    @parametrize("name", NAMES)
    def test_each_composition_is_resumable_and_yields_what_the_original_yields(self, name: str) -> None:
        build = self.compositions[name]
        for sharding in [(1, 0), (3, 1)]:
            assert GraphState().unresumable(sharded(build, *sharding)) is None
            adapted = run_epochs(worker_graph(build, *sharding), 3)
            assert adapted == run_epochs(worker_graph(build, *sharding, adapt=False), 3), sharding

    @parametrize("name", NAMES)
    def test_each_composition_restores_exactly_at_its_start_middle_and_end(self, name: str) -> None:
        build = self.compositions[name]
        for sharding in [(1, 0), (2, 0), (3, 2)]:
            length = len(run_epochs(worker_graph(build, *sharding), 2)[1])
            check_restore_at(build, sharding, 1, [0, 1, length // 2, max(0, length - 1), length])

    @examples(200)
    def test_any_composition_restores_exactly_at_random_positions(self, draw: SeededDraw) -> None:
        build, sharding, epoch = (
            self.compositions[draw.choice(NAMES)],
            draw_sharding(draw),
            draw.integer(0, 1),
        )
        length = len(run_epochs(worker_graph(build, *sharding), epoch + 1)[epoch])
        check_restore_at(build, sharding, epoch, draw.distinct_integers(0, length, min_size=1, max_size=3))

    @parametrize("name", NAMES)
    def test_each_composition_restores_exactly_from_a_state_captured_after_a_restore(self, name: str) -> None:
        build = self.compositions[name]
        for sharding in [(1, 0), (3, 2)]:
            length = len(run_epochs(worker_graph(build, *sharding), 2)[1])
            for k, more in [
                (1, 1),
                (length // 2, 1),
                (length // 3, length // 3),
                (length - 1, 1),
                (length, 0),
            ]:
                k = max(0, min(k, length))
                check_chained_restore(build, sharding, 1, k, min(more, length - k))

    @examples(150)
    def test_any_composition_restores_exactly_from_states_captured_after_restores(
        self, draw: SeededDraw
    ) -> None:
        build, sharding = self.compositions[draw.choice(NAMES)], draw_sharding(draw)
        length = len(run_epochs(worker_graph(build, *sharding), 1)[0])
        k = draw.integer(0, length)
        check_chained_restore(build, sharding, 0, k, draw.integer(0, length - k))

    def test_the_types_stateful_restore_replaces_are_the_catalogues_adapted_ones(self) -> None:
        assert set(RESUMABLE_ADAPTERS) == set(types_where(adapted=True))
        assert set(RESUMABLE_STATELESS) == set(types_where(stateless=True))


instantiate_parametrized_tests(TestStatefulEquivalence)


if __name__ == "__main__":
    unittest.main()
