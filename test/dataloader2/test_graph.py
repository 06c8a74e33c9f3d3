"""Describing a graph's DataPipes: their keys, counts and states, pausing those with threads,
plain data for messages, and the one sharding filter."""

import threading
import unittest
from enum import IntEnum
from typing import Any, Dict, Iterator, List

from torch.testing._internal.common_utils import TestCase
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.datapipes.iter import IterableWrapper, IterDataPipe
from torchdata.datapipes.map import SequenceWrapper

from torchdata_snapshot._errors import StateCaptureError
from torchdata_snapshot.core.graph import (
    NOT_PLAIN,
    datapipe_state_dicts,
    datapipe_yields,
    graph_datapipes,
    pausable,
    paused,
    plain_data,
    sharding_layout,
    sharding_point,
)


def _double(x: int) -> int:
    return 2 * x


class Pausing(IterDataPipe):
    """Records its pauses and resumes in ``log`` (as a DataPipe running a thread would pause)."""

    def __init__(self, source: IterDataPipe, name: str, log: List[str]) -> None:
        self.source, self.name, self.log = source, name, log

    def __iter__(self) -> Iterator[Any]:
        yield from self.source

    def pause(self) -> None:
        self.log.append(f"pause {self.name}")

    def resume(self) -> None:
        self.log.append(f"resume {self.name}")


class WithState(IterDataPipe):
    def __init__(self, source: IterDataPipe, state: Any) -> None:
        self.source, self.state = source, state

    def __iter__(self) -> Iterator[Any]:
        yield from self.source

    def state_dict(self) -> Dict[str, Any]:
        if isinstance(self.state, Exception):
            raise self.state
        return {"held": self.state}


class Level(IntEnum):
    LOW = 1


class TestGraph(TestCase):
    def test_each_datapipe_is_keyed_by_its_place_from_the_output_and_its_type(self) -> None:
        graph = graph_datapipes(IterableWrapper(range(5)).map(_double).batch(2))
        self.assertEqual(
            [key for key, _ in graph],
            ["0:BatcherIterDataPipe", "1:MapperIterDataPipe", "2:IterableWrapperIterDataPipe"],
        )

    def test_the_yield_counts_are_torchdatas_own(self) -> None:
        end = IterableWrapper(range(5)).map(_double).batch(2)
        list(end)
        self.assertEqual(list(datapipe_yields(graph_datapipes(end)).values()), [3, 5, 5])

    def test_a_map_style_datapipe_keeps_no_yield_count(self) -> None:
        end = SequenceWrapper(range(5)).map(_double).to_iter_datapipe()
        list(end)
        self.assertEqual(datapipe_yields(graph_datapipes(end)), {"0:MapToIterConverterIterDataPipe": 5})

    def test_datapipes_with_threads_are_paused_output_first_and_resumed_in_reverse(self) -> None:
        log: List[str] = []
        end = Pausing(IterableWrapper(range(3)).map(_double), "outer", log)
        end = Pausing(end, "last", log)
        found = pausable(dp for _, dp in graph_datapipes(end))
        self.assertEqual([dp.name for dp in found], ["last", "outer"])
        with paused(found):
            log.append("inside")
        self.assertEqual(log, ["pause last", "pause outer", "inside", "resume outer", "resume last"])

    def test_a_prefetcher_whose_source_ended_is_paused_without_waiting(self) -> None:
        end = IterableWrapper(range(3)).prefetch(2)
        it = iter(end)
        self.assertEqual(list(it), [0, 1, 2])
        done = threading.Event()

        def pause_it() -> None:
            with paused(pausable([end])):
                done.set()

        thread = threading.Thread(target=pause_it, daemon=True)
        thread.start()
        self.assertTrue(done.wait(10), "a prefetcher that produces nothing more counts as paused")
        thread.join(10)

    def test_states_are_gathered_and_a_failing_or_unpicklable_one_is_named(self) -> None:
        end = WithState(IterableWrapper(range(3)), 7)
        self.assertEqual(datapipe_state_dicts(graph_datapipes(end)), {"0:WithState": {"held": 7}})
        with self.assertRaisesRegex(StateCaptureError, r"state_dict\(\) of DataPipe 0:WithState .* raised"):
            datapipe_state_dicts(graph_datapipes(WithState(IterableWrapper([]), KeyError("gone"))))
        with self.assertRaisesRegex(
            StateCaptureError, r"0:WithState .* cannot be pickled \(attribute 'held'\)"
        ):
            datapipe_state_dicts(graph_datapipes(WithState(IterableWrapper([]), threading.Lock())))

    def test_plain_data_is_jsons_types_within_a_length(self) -> None:
        self.assertEqual(plain_data({"a": (1, 2.5, None, "x")}, 100), {"a": [1, 2.5, None, "x"]})
        for value in ({1: "int key"}, Level.LOW, {"a": object()}, "x" * 200):
            self.assertIs(plain_data(value, 100), NOT_PLAIN, value)
        looped: List[Any] = []
        looped.append(looped)
        self.assertIs(plain_data(looped, 100), NOT_PLAIN, "a value that contains itself runs out of budget")

    def test_the_graphs_one_sharding_filter_and_its_ranks(self) -> None:
        once = IterableWrapper(range(10)).sharding_filter()
        self.assertIs(sharding_point(once.map(_double)), once)
        self.assertEqual(sharding_layout(once), (1, 0))
        once.apply_sharding(4, 2, SHARDING_PRIORITIES.DISTRIBUTED)
        self.assertEqual(sharding_layout(once), (4, 2))
        self.assertIsNone(sharding_point(IterableWrapper(range(3))))
        self.assertIsNone(sharding_point(once.sharding_filter()), "two filters: no one point")


if __name__ == "__main__":
    unittest.main()
