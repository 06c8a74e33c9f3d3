"""The dispatching process: round-robin dealing, epochs, errors, state — driven in-process."""

import threading
import unittest
from typing import Any, List, Tuple

import pytest
from suite_case import SuiteTestCase
from torchdata._utils import ExceptionWrapper
from torchdata.dataloader2.random import SeedGenerator
from torchdata.datapipes.iter import IterableWrapper

from torchdata_snapshot._errors import ProtocolError, ReadingServiceError
from torchdata_snapshot.core import messages as m
from torchdata_snapshot.core.transport.channel import Channel, make_pipe_pair
from torchdata_snapshot.core.worker.dispatcher import DispatchedSource, DispatcherLoop


class Dispatching:
    """A dispatcher loop in a thread, its control channel, and one source per worker."""

    def __init__(self, datapipe: Any, num_workers: int, window: int = 4, max_pending: int = 10_000) -> None:
        self.control, control_endpoint, _ = make_pipe_pair()
        links = [make_pipe_pair() for _ in range(num_workers)]
        self.loop = DispatcherLoop(
            datapipe, control_endpoint, [e for _, e, _ in links], max_pending=max_pending
        )
        self.sources = [DispatchedSource(c.bind(f"link {i}"), window) for i, (c, _, _) in enumerate(links)]
        self.thread = threading.Thread(target=self.loop.run, daemon=True)
        self.thread.start()
        self.epoch = -1

    def ask(self, request: Any) -> Any:
        self.control.send(request)
        return self.control.recv(timeout_s=30)

    def reset(self, seed: int = 0) -> None:
        self.epoch += 1
        for source in self.sources:
            source.reset_epoch(self.epoch)
        request = m.ResetEpochRequest(SeedGenerator(seed), None, epoch=self.epoch)
        assert self.ask(request) == m.ResetEpochResponse(self.epoch)

    def close(self) -> None:
        assert isinstance(self.ask(m.TerminateRequest()), m.TerminateResponse)
        self.thread.join(10)
        assert not self.thread.is_alive()


def _fail_at_5(x: int) -> int:
    if x == 5:
        raise ValueError("bad record 5")
    return x


class TestDispatch(SuiteTestCase):
    def dispatching(self, *args: Any, **kwargs: Any) -> Dispatching:
        """A dispatcher loop in a thread, closed after the test."""
        dispatching = Dispatching(*args, **kwargs)
        self.addCleanup(dispatching.close)
        return dispatching

    def test_item_j_goes_to_worker_j_mod_n(self) -> None:
        d = self.dispatching(IterableWrapper(range(10)), num_workers=3)
        d.reset()
        assert [list(s) for s in d.sources] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]

    def test_the_shuffle_is_seeded_once_for_all_workers(self) -> None:
        d = self.dispatching(IterableWrapper(range(20)).shuffle(), num_workers=2)
        d.reset(seed=1)
        first: List[Tuple[int, ...]] = [tuple(s) for s in d.sources]
        d.reset(seed=1)
        assert [tuple(s) for s in d.sources] == first
        assert sorted(first[0] + first[1]) == list(range(20)) and list(first[0]) != list(range(0, 20, 2))

    def test_a_new_epoch_drops_what_was_in_flight(self) -> None:
        d = self.dispatching(IterableWrapper(range(100)), num_workers=2, window=8)
        d.reset()
        it = iter(d.sources[0])
        assert [next(it) for _ in range(3)] == [0, 2, 4]
        d.reset()
        assert list(d.sources[0]) == list(range(0, 100, 2))

    def test_an_error_in_the_dispatched_graph_reaches_every_worker(self) -> None:
        d = self.dispatching(IterableWrapper(range(10)).map(_fail_at_5), num_workers=2)
        d.reset()
        for source, before in zip(d.sources, [[0, 2, 4], [1, 3]]):
            got = []
            with pytest.raises(
                ValueError, match="(?s)Caught ValueError in dispatching process.*bad record 5"
            ):
                for x in source:
                    got.append(x)
            assert got == before

    def test_a_worker_that_never_asks_cannot_grow_the_buffer_forever(self) -> None:
        d = self.dispatching(IterableWrapper(range(1000)), num_workers=2, max_pending=10)
        d.reset()
        with pytest.raises(ReadingServiceError, match="holds 10 items for worker 1 that it does not ask for"):
            list(d.sources[0])

    def test_state_counts_add_up_and_pause_stops_sending(self) -> None:
        d = self.dispatching(IterableWrapper(range(50)), num_workers=2, window=4)
        d.reset()
        it = iter(d.sources[0])
        next(it)
        paused = d.ask(m.PauseRequest())
        assert isinstance(paused, m.PauseResponse) and paused.snapshot.paused
        state = d.ask(m.GetStateRequest()).snapshot
        assert state.role == "dispatcher" and state.worker_id == -1 and state.epoch == 0
        assert state.produced == state.sent + state.buffered
        assert state.sent == sum(state.sent_per_worker) and state.sent_per_worker[1] == 0
        d.sources[0].drain_until(state.sent_per_worker[0])
        assert d.sources[0].received == state.sent_per_worker[0]
        assert isinstance(d.ask(m.ResumeRequest()), m.ResumeResponse)
        assert [next(it) for _ in range(3)] == [2, 4, 6]

    def test_unknown_requests_get_an_error_response(self) -> None:
        d = self.dispatching(IterableWrapper(range(4)), num_workers=1)
        response = d.ask(m.GetNextRequest(0))  # a worker's request, sent on the control pipe
        assert isinstance(response, m.ErrorResponse)
        with pytest.raises(ProtocolError, match="does not handle request 'GetNextRequest'"):
            response.exc.reraise()
        d.reset()
        assert list(d.sources[0]) == [0, 1, 2, 3]

    def test_a_control_request_on_a_worker_link_gets_an_error_response(self) -> None:
        d = self.dispatching(IterableWrapper(range(4)), num_workers=1)
        d.reset()
        d.sources[0].channel.send(m.PauseRequest())  # only the main process may pause the dispatcher
        with pytest.raises(ProtocolError, match="does not serve 'PauseRequest' from workers"):
            list(d.sources[0])

    def test_the_dispatched_graph_answers_torchs_child_checks_once(self) -> None:
        """Its DataPipes fail no ``_is_child_datapipe`` lookup per item (see test_child_checks)."""
        from torch.utils.data import IterDataPipe
        from torchdata.dataloader2.graph import list_dps, traverse_dps

        graph = IterableWrapper(range(30)).shuffle().map(int)
        failed: List[Any] = []
        fallback = IterDataPipe.__getattr__

        def recording(dp: Any, name: str) -> Any:
            if name == "_is_child_datapipe":
                failed.append(dp)
            return fallback(dp, name)

        self.monkeypatch.setattr(IterDataPipe, "__getattr__", recording)
        d = self.dispatching(graph, num_workers=2)
        d.reset()
        assert sorted(x for s in d.sources for x in s) == list(range(30))
        dispatched = list_dps(traverse_dps(d.loop.datapipe))
        assert dispatched and not [dp for dp in failed if any(dp is x for x in dispatched)]

    def test_sources_are_leaves_for_graph_traversal(self) -> None:
        from torchdata.dataloader2.graph import traverse_dps

        channel, _endpoint, _ = make_pipe_pair()
        source = DispatchedSource(channel)
        ((_, (_, parents)),) = traverse_dps(source.map(int)).items()
        ((_, (found, grand_parents)),) = parents.items()
        assert found is source and grand_parents == {}
        assert isinstance(channel, Channel)

    def test_an_exception_from_an_older_epoch_is_dropped_like_its_items(self) -> None:
        channel, endpoint, _ = make_pipe_pair()
        source = DispatchedSource(channel.bind("link"), window=4)
        source.reset_epoch(1)
        try:
            raise ValueError("epoch 0 failed after the user broke out of it")
        except ValueError:
            stale = ExceptionWrapper(where="in the dispatching process")
        endpoint.send(m.WorkerExceptionResponse(stale, epoch=0))  # still in flight when epoch 1 began
        endpoint.send(m.StopIterationResponse(1))
        assert list(source) == []


if __name__ == "__main__":
    unittest.main()
