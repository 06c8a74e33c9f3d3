"""The checkpoint format: plain data, versioned, validated before use, fitting one pipeline only."""

from __future__ import annotations

import io
import pickle
import unittest
from dataclasses import replace
from typing import Any, Callable, Dict

import pytest
import torch
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize
from torchdata.dataloader2.random import SeedGenerator
from torchdata.datapipes.iter import FileOpener, IterableWrapper

from torchdata_snapshot._errors import IncompatibleCheckpointError, InvalidCheckpointError
from torchdata_snapshot.checkpoint.format import FORMAT, FORMAT_VERSION, Checkpoint, WorkerPosition
from torchdata_snapshot.checkpoint.identity import GraphIdentity, graph_fingerprint, graph_identity
from torchdata_snapshot.checkpoint.seeds import seed_state
from torchdata_snapshot.core.messages import Level

GRAPH = GraphIdentity(
    "0123456789abcdef",
    {
        "0:BatcherIterDataPipe": {"batch_size": 4, "drop_last": False},
        "1:MapperIterDataPipe": {"fn": "pipelines.scaled", "fn.factor": 2.5, "input_col": None},
        "2:IterableWrapperIterDataPipe": {"deepcopy": True},
    },
)


def example(**changes: Any) -> Checkpoint:
    fields: Dict[str, Any] = dict(
        num_workers=2,
        graph=GRAPH,
        epoch=3,
        status="in_epoch",
        seed=seed_state(SeedGenerator(1)),
        delivered=7,
        workers=(
            WorkerPosition(4, "00ff00ff00ff00ff", (2, b"\x80\x05}.", "0123456789abcdef"), 9, 2, (b"f",)),
            WorkerPosition(3, None, None, 6, 0),
        ),
        next_worker=0,
        sharding=(2, 1),
        remaining=(Level((3, 0, 5), (0, 4, 0)),),
    )
    gathered = changes.pop("gathered", True)
    fields.update(changes)
    own = Checkpoint(**fields)
    if not gathered:
        return own
    rank0 = replace(
        own, sharding=(2, 0), delivered=8, workers=(WorkerPosition(5, taken=8), WorkerPosition(3))
    )
    return replace(own, ranks=(rank0, own))  # as gather_elastic_state makes it on rank 1


PLAIN_TYPES = (dict, list, str, bytes, int, float, bool, type(None))


def assert_plain(value: Any, where: str = "state") -> None:
    assert isinstance(value, PLAIN_TYPES), f"{where} is a {type(value).__name__}"
    if isinstance(value, dict):
        for k, v in value.items():
            assert isinstance(k, str), f"{where} has key {k!r}"
            assert_plain(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            assert_plain(v, f"{where}[{i}]")


def corrupt(edit: Callable[[Dict[str, Any]], Any], keep_checksum: bool = False) -> Dict[str, Any]:
    """Edit a valid state; unless ``keep_checksum``, recompute the checksum so that only the
    schema check stands between the edit and use."""
    from torchdata_snapshot.checkpoint.format import _checksum

    plain = example().to_plain()
    edit(plain)
    if not keep_checksum and "checksum" in plain:
        plain["checksum"] = _checksum(plain)
    return plain


def with_argument(key: str, **arguments: Any) -> GraphIdentity:
    """``GRAPH`` with other values of the arguments of DataPipe ``key``."""
    assert GRAPH.arguments is not None
    return replace(GRAPH, arguments={**GRAPH.arguments, key: {**GRAPH.arguments[key], **arguments}})


class TestCheckpoint(SuiteTestCase):
    def test_the_state_is_plain_data_with_format_and_version(self) -> None:
        plain = example().to_plain()
        assert_plain(plain)
        assert plain["format"] == FORMAT and plain["version"] == FORMAT_VERSION

    def test_round_trip(self) -> None:
        assert Checkpoint.from_plain(example().to_plain()) == example()

    def test_the_state_survives_torch_save_with_weights_only_and_pickle(self) -> None:
        plain = example().to_plain()
        buffer = io.BytesIO()
        torch.save({"reading_service_state": plain}, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)["reading_service_state"]
        assert Checkpoint.from_plain(loaded) == example()
        assert Checkpoint.from_plain(pickle.loads(pickle.dumps(plain))) == example()

    @parametrize(
        "state, match",
        [
            (b"\x80\x04...", "is bytes, not the plain dict"),
            ([1, 2], "must be a dict, got list"),
            (
                corrupt(lambda s: s.update(format="something else")),
                "not a checkpoint of this reading service",
            ),
            (
                corrupt(lambda s: s.update(version=FORMAT_VERSION + 1)),
                f"format version {FORMAT_VERSION + 1}; this reading service reads version {FORMAT_VERSION}",
            ),
            (corrupt(lambda s: s.update(version=[1])), "format version \\[1\\]; this reading service"),
            (corrupt(lambda s: s.update(version=True)), "format version True; this reading service"),
            (corrupt(lambda s: s.pop("workers")), "truncated: missing workers"),
            (corrupt(lambda s: s.pop("checksum")), "truncated: missing checksum"),
            (corrupt(lambda s: s.update(extra=1)), "unknown fields: extra"),
            (corrupt(lambda s: s.update(delivered=8), keep_checksum=True), "checksum does not match"),
            (
                corrupt(lambda s: s["workers"][0].update(delivered=-1)),
                "'delivered' of workers\\[0\\] must be a non-negative",
            ),
            (corrupt(lambda s: s["workers"].pop()), "'workers' must list 2 positions"),
            (
                corrupt(lambda s: s["workers"][0].update(opened=["f"])),
                "'opened' of workers\\[0\\] must be a list of bytes",
            ),
            (
                corrupt(lambda s: s["workers"][1].update(opened=None)),
                "'opened' of workers\\[1\\] must be a list of bytes",
            ),
            (
                corrupt(lambda s: s["workers"][1].update(digest=[0, "00ff00ff00ff00ff"])),
                "digest of workers\\[1\\]",
            ),
            (corrupt(lambda s: s["workers"][1].update(digest="xyz")), "digest of workers\\[1\\]"),
            (
                corrupt(lambda s: s["workers"][0]["state"].update(digest=7)),
                "digest of the state of workers\\[0\\]",
            ),
            (
                corrupt(lambda s: s["workers"][0]["state"].update(position=5)),
                "state of workers\\[0\\] is ahead",
            ),
            (
                corrupt(lambda s: s["workers"][0].pop("digest")),
                "workers\\[0\\] must have 'delivered', 'digest'",
            ),
            (corrupt(lambda s: s.update(status="paused")), "'status' must be one of"),
            (corrupt(lambda s: s.update(epoch="3")), "'epoch' must be an int"),
            (corrupt(lambda s: s.update(next_worker=2)), "'next_worker' must be < num_workers"),
            (corrupt(lambda s: s.update(seed=None)), "must record the epoch's seed"),
            (
                corrupt(lambda s: s["seed"]["shared"].update(ctr=[1])),
                "shared.ctr must be a list of 4 32-bit integers",
            ),
            (corrupt(lambda s: s.update(replay_in_main=1)), "'replay_in_main' must be a bool"),
            (corrupt(lambda s: s.update(arguments=[])), "'arguments' must map each DataPipe"),
            (
                corrupt(lambda s: s["arguments"]["0:BatcherIterDataPipe"].update(batch_size=b"4")),
                "'arguments' must map each DataPipe to a dict of its arguments \\(plain data\\)",
            ),
            (
                corrupt(lambda s: s.update(delivered=9)),
                "'delivered' \\(9\\) must be what the workers' streams delivered, 7",
            ),
            (
                corrupt(lambda s: s["ranks"].pop()),
                "'ranks' must list the state of every rank of the job's 2 ranks or be None",
            ),
            (corrupt(lambda s: s["ranks"][0].update(epoch=4)), "ranks\\[0\\]: the checkpoint's checksum"),
            (corrupt(lambda s: s["ranks"].reverse()), "ranks\\[0\\] must be rank 0's own state"),
            (
                corrupt(lambda s: s["ranks"].__setitem__(0, example(gathered=False, epoch=4).to_plain())),
                "ranks\\[0\\] must be rank 0's own state, of the same epoch",
            ),
            (
                corrupt(
                    lambda s: s["ranks"].__setitem__(1, example(gathered=False, next_worker=1).to_plain())
                ),
                "ranks\\[1\\] must be this rank's own state",
            ),
        ],
    )
    def test_invalid_states_are_refused_with_the_reason(self, state: Any, match: str) -> None:
        with pytest.raises(InvalidCheckpointError, match=match):
            Checkpoint.from_plain(state)

    def test_a_state_for_another_num_workers_world_size_or_pipeline_does_not_fit(self) -> None:
        state = example()
        state.check_fits(2, GRAPH, (2, 1))
        with pytest.raises(
            IncompatibleCheckpointError,
            match="num_workers=2, this reading service has num_workers=4.*elastic=True.* resumes",
        ):
            state.check_fits(4, GRAPH, (2, 1))
        with pytest.raises(
            IncompatibleCheckpointError, match="world_size=2, this job has world_size=3.*elastic=True"
        ):
            state.check_fits(2, GRAPH, (3, 1))
        with pytest.raises(IncompatibleCheckpointError, match="another pipeline"):
            state.check_fits(2, replace(GRAPH, fingerprint="fedcba9876543210"), (2, 1))

    def test_a_state_taken_on_another_rank_does_not_fit_and_names_both(self) -> None:
        with pytest.raises(
            IncompatibleCheckpointError,
            match="taken on rank 1 of 2, this is rank 0: .*gather_elastic_state\\(dl.state_dict\\(\\)\\)",
        ):
            example(gathered=False).check_fits(2, GRAPH, (2, 0))

    def test_a_gathered_state_resumes_each_rank_of_its_world_size_from_that_ranks_own_state(self) -> None:
        state = example()
        rank0, rank1 = state.ranks
        assert state.for_rank((2, 1)) == state
        assert state.for_rank((2, 0)) == replace(rank0, ranks=state.ranks), "rank 0's own, still gathered"
        state.for_rank((2, 0)).check_fits(2, GRAPH, (2, 0))
        assert state.for_rank((3, 0)) == state, "another world size resumes elastically, from every rank"
        assert example(gathered=False).for_rank((2, 0)) == example(gathered=False)

    @parametrize(
        "graph, match",
        [
            (
                with_argument("0:BatcherIterDataPipe", batch_size=5),
                "DataPipe 0:BatcherIterDataPipe: batch_size was 4 in the checkpoint, is 5 now",
            ),
            (
                with_argument("1:MapperIterDataPipe", **{"fn.factor": 3}),
                "1:MapperIterDataPipe: fn.factor was 2.5 in the checkpoint, is 3 now",
            ),
            (
                with_argument("1:MapperIterDataPipe", fn="pipelines.shift"),
                "fn was 'pipelines.scaled' in the checkpoint, is 'pipelines.shift' now",
            ),
            (
                with_argument("0:BatcherIterDataPipe", drop_last=0),
                "drop_last was False in the checkpoint, is 0 now",  # a bool is not an int here
            ),
            (
                with_argument("2:IterableWrapperIterDataPipe", wrapper_class="list"),
                "wrapper_class was not recorded in the checkpoint, is 'list' now",
            ),
        ],
    )
    def test_a_state_for_other_arguments_does_not_fit_and_says_which(
        self, graph: GraphIdentity, match: str
    ) -> None:
        with pytest.raises(IncompatibleCheckpointError, match=f"other arguments of its DataPipes.*{match}"):
            example().check_fits(2, graph, (2, 1))

    def test_arguments_compare_as_plain_data(self) -> None:
        nan = GraphIdentity(
            "0123456789abcdef", {"0:X": {"ratio": float("nan"), "sizes": [1, 2], "by": {"a": 1}}}
        )
        state = example(graph=nan)
        state.check_graph(
            GraphIdentity(nan.fingerprint, {"0:X": {"by": {"a": 1}, "sizes": [1, 2], "ratio": float("nan")}})
        )
        with pytest.raises(
            IncompatibleCheckpointError, match=r"sizes was \[1, 2\] in the checkpoint, is \[2, 1\]"
        ):
            state.check_graph(
                GraphIdentity(nan.fingerprint, {"0:X": {**nan.arguments["0:X"], "sizes": [2, 1]}})
            )

    def test_a_state_without_arguments_checks_the_structure_only(self) -> None:
        state = example(graph=GraphIdentity(GRAPH.fingerprint))
        state.check_fits(2, with_argument("0:BatcherIterDataPipe", batch_size=5), (2, 1))
        assert Checkpoint.from_plain(state.to_plain()) == state

    def test_a_record_is_read_with_the_readings_of_the_pipeline_restored_onto(self) -> None:
        """A state of the current format recorded the opener's arguments as given (and the reader's
        not at all): it fits the pipeline it was taken with and its other spellings, not another mode."""
        earlier = {
            "0:LineReaderIterDataPipe": {},
            "1:FileOpenerIterDataPipe": {"mode": "r", "encoding": None, "length": -1},
            "2:IterableWrapperIterDataPipe": {"deepcopy": True},
        }

        text_file = self.tmp_path / "lines.txt"
        text_file.write_text("a\nb\nc\n")

        def lines(mode: str) -> Any:
            return FileOpener(IterableWrapper([str(text_file)]), mode=mode, length=3).readlines()

        state = Checkpoint.from_plain(
            example(graph=GraphIdentity(graph_fingerprint(lines("r")), earlier)).to_plain()
        )
        state.check_fits(2, graph_identity(lines("r")), (2, 1))
        state.check_fits(2, graph_identity(lines("rt")), (2, 1))
        with pytest.raises(
            IncompatibleCheckpointError,
            match="1:FileOpenerIterDataPipe: mode was 'rt' in the checkpoint, is 'rb'",
        ):
            state.check_fits(2, graph_identity(lines("b")), (2, 1))

    @parametrize("version", range(1, FORMAT_VERSION))
    def test_a_state_of_an_earlier_format_version_is_refused_naming_both(self, version: int) -> None:
        """The earlier versions were written by development builds, before the first release."""
        from torchdata_snapshot.checkpoint.format import _checksum

        old = {key: value for key, value in example().to_plain().items() if key != "checksum"}
        old["version"] = version
        old["checksum"] = _checksum(old)
        with pytest.raises(
            InvalidCheckpointError,
            match=f"format version {version}; this reading service reads version {FORMAT_VERSION} \\(trouble",
        ):
            Checkpoint.from_plain(old)


instantiate_parametrized_tests(TestCheckpoint)


if __name__ == "__main__":
    unittest.main()
