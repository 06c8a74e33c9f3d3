"""Compositions of every DataPipe type stateful restore knows, by name, over files of a directory
(lines, CSV, JSON, tar, zip, compressed streams, WebDataset), for the tests of captured graph
states (test_stateful_equivalence.py)."""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import json
import lzma
import random
import tarfile
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch
from pipelines import CountingStateful, double, not_multiple_of_3, split
from torchdata.datapipes.iter import FileLister, FileOpener, IterableWrapper, IterDataPipe

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


#: The files the reader compositions read, by kind (written once per module, see ``write_files``).
Files = Dict[str, Any]


def write_files(root: Path) -> Files:
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


def compositions(files: Files) -> Dict[str, Build]:
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


NAMES = sorted(compositions({}))
