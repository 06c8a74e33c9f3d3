"""Which pipeline a state belongs to: the fingerprint of its structure and the constructor
arguments that determine its data, the same wherever and whenever they are read."""

from __future__ import annotations

import functools
import json
import os
import pickle
import subprocess
import sys
import unittest
from pathlib import Path
from typing import Any, Dict

from faults import kill_always_at
from pipelines import double, is_even, pipeline, scaled, split
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize
from torch.utils.data.graph_settings import apply_sharding
from torchdata.datapipes.iter import FileOpener, IterableWrapper

from torchdata_snapshot.checkpoint.function_digest import DIGEST_VERSION
from torchdata_snapshot.checkpoint.identity import graph_arguments, graph_fingerprint, graph_identity

#: In ``COMMON``: the digest of what the function computes with (see test_function_digest.py).
CODE = object()


def build(fn: Any = double) -> Any:
    return IterableWrapper(range(10)).shuffle().sharding_filter().map(fn)


def source(n: int = 20) -> Any:
    return IterableWrapper(range(n))


#: DataPipes users build, and the arguments a checkpoint records for the outermost one.
COMMON: Dict[str, Any] = {
    "IterableWrapper": (lambda: IterableWrapper([3, 1, 2]), {"deepcopy": True}),
    "batch": (lambda: source().batch(4, drop_last=True), {"batch_size": 4, "drop_last": True}),
    "shuffle": (lambda: source().shuffle(buffer_size=7), {"buffer_size": 7}),
    "bucketbatch": (
        lambda: source().bucketbatch(3, batch_num=2, bucket_num=2),
        {"batch_size": 3, "drop_last": False},
    ),
    "header": (lambda: source().header(5), {"limit": 5}),
    "cycle": (lambda: source().cycle(2), {"count": 2}),
    "map_partial": (
        lambda: source().map(functools.partial(scaled, factor=2)),
        {"fn": "pipelines.scaled", "fn.factor": 2, "input_col": None, "output_col": None, "fn.code": CODE},
    ),
    "filter": (
        lambda: source().filter(is_even),
        {"filter_fn": "pipelines.is_even", "filter_fn.code": CODE, "input_col": None},
    ),
    "sharding_filter": (lambda: source().sharding_filter(), {"sharding_group_filter": None}),
    "mux": (lambda: source().mux(source(5)), {}),
    "zip": (lambda: source().zip(source()), {}),
    "unbatch": (lambda: source().batch(3).unbatch(), {"unbatch_level": 1}),
    "flatmap": (
        lambda: source().flatmap(split),
        {"fn": "pipelines.split", "fn.code": CODE, "input_col": None},
    ),
    "collate": (  # torch's function: its name only
        lambda: source().batch(3).collate(),
        {"fn": "torch.utils.data._utils.collate.default_collate", "fn.code": None},
    ),
    "prefetch": (lambda: source().prefetch(3), {}),  # how far it reads ahead is not compared
    "fork": (lambda: source().fork(2)[1], {"instance_id": 1}),
    "random_split": (
        lambda: source().random_split(total_length=20, weights={"a": 1, "b": 1}, seed=0, target="a"),
        {"target": "a"},
    ),
    "groupby": (
        lambda: source().groupby(double, group_size=2, guaranteed_group_size=2),
        {
            "group_key_fn": "pipelines.double",
            "group_key_fn.code": CODE,
            "keep_key": False,
            "group_size": 2,
            "guaranteed_group_size": 2,
            "drop_remaining": False,
            "buffer_size": 10000,  # kept as max_buffer_size
        },
    ),
}


def partial_pipeline() -> Any:
    return pipeline("stateful_source", 30).map(functools.partial(kill_always_at, 99))


class TestIdentity(SuiteTestCase):
    @functools.cached_property
    def text_file(self) -> str:
        path = self.tmp_path / "lines.txt"
        path.write_text("a\nb\nc\n")
        return str(path)

    def test_the_fingerprint_follows_the_structure_of_the_pipeline(self) -> None:
        assert graph_fingerprint(build()) == graph_fingerprint(build())
        assert graph_fingerprint(build()) != graph_fingerprint(build(is_even)), "another map function"
        assert graph_fingerprint(build()) != graph_fingerprint(build().batch(2)), "another DataPipe"
        shorter = IterableWrapper(range(10)).sharding_filter().map(double)
        assert graph_fingerprint(build()) != graph_fingerprint(shorter)
        assert graph_fingerprint(IterableWrapper(range(5))) == graph_fingerprint(IterableWrapper(range(9))), (
            "the data is not part of the structure"
        )
        assert graph_fingerprint(build()) == "9b2a7a7734b0f0d9", (
            "states of format 3 and older hold this digest"
        )

    @parametrize("name", sorted(COMMON))
    def test_the_arguments_are_the_plain_constructor_arguments(self, name: str) -> None:
        make, expected = COMMON[name]
        datapipe = make()
        got = graph_arguments(datapipe)[f"0:{type(datapipe).__name__}"]
        assert got == {key: got.get(key) if value is CODE else value for key, value in expected.items()}
        codes = [key for key, value in expected.items() if value is CODE]
        assert all(got[key].startswith(f"{DIGEST_VERSION}:") for key in codes), (
            "what its function computes with"
        )

    def test_the_arguments_of_files_and_lines(self) -> None:
        lines = FileOpener(IterableWrapper([self.text_file]), mode="r").readlines(strip_newline=False)
        assert list(graph_arguments(lines).values()) == [
            {  # kept in a helper object
                "strip_newline": False,
                "skip_lines": 0,
                "decode": False,
                "encoding": "utf-8",
                "errors": "ignore",
                "return_path": True,
            },
            {"mode": "rt", "encoding": None},  # "r" is "rt"; the nominal length is not the data
            {"deepcopy": True},  # the file names are its data
        ]

    @parametrize("name", sorted(COMMON))
    def test_the_arguments_do_not_change_as_the_graph_runs_or_travels(self, name: str) -> None:
        datapipe = COMMON[name][0]()
        fresh = graph_identity(datapipe)
        apply_sharding(datapipe, 2, 1)  # what sharding (DistributedReadingService too) sets
        iterator = iter(datapipe)
        for _ in zip(range(7), iterator):
            pass
        assert graph_identity(datapipe) == fresh
        assert graph_identity(pickle.loads(pickle.dumps(datapipe))) == fresh

    def test_the_data_and_long_values_are_not_arguments(self) -> None:
        assert graph_arguments(IterableWrapper(list(range(10_000)))) == graph_arguments(IterableWrapper([1]))
        long = source().map(functools.partial(scaled, factor=list(range(1000))))
        assert "fn.factor" not in graph_arguments(long)["0:MapperIterDataPipe"]

    def test_the_fingerprint_and_arguments_are_the_same_in_a_fresh_process(self) -> None:
        """No address, id or hash order: another interpreter, with another hash seed, agrees."""
        code = (
            "import json, warnings; warnings.simplefilter('ignore'); import test_identity as t; "
            "g = t.graph_identity(t.partial_pipeline()); print(json.dumps([g.fingerprint, g.arguments]))"
        )
        here = Path(__file__).parent
        env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": os.pathsep.join([str(here), *sys.path])}
        output = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True
        ).stdout
        ours = graph_identity(partial_pipeline())
        assert json.loads(output) == [ours.fingerprint, ours.arguments]
        assert ours.arguments is not None and ours.arguments["0:MapperIterDataPipe"]["fn.args[0]"] == 99


instantiate_parametrized_tests(TestIdentity)


if __name__ == "__main__":
    unittest.main()
