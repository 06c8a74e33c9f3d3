"""A consumer over in-process worker loops, each in a thread of this process: for the tests of
the consumer and of what restores its streams."""

import threading
from typing import Any, Callable, Iterator, List, Optional, Sequence, Type

from torchdata.dataloader2.random import SeedGenerator
from torchdata.dataloader2.utils import WorkerInfo
from torchdata.datapipes.iter import IterDataPipe

from torchdata_snapshot.core.main.consumer import WorkerConsumer
from torchdata_snapshot.core.options import BatchingOptions, WorkerOptions
from torchdata_snapshot.core.transport.channel import make_pipe_pair
from torchdata_snapshot.core.worker.loop import WorkerLoop

#: Worker processes serve their requests each on its own; these workers share one process, in
#: which torch's graph traversal (an epoch's reset, a snapshot) sets a process-wide pickling
#: hook: two at once fail ("Attempt to override existing reduce_ex_hook"). They take turns.
_SERVING = threading.Lock()


def _in_turn(loop: Type[WorkerLoop]) -> Type[WorkerLoop]:
    """``loop``, serving one request at a time across every loop of this process."""

    def handle(self: Any, request: Any) -> None:
        with _SERVING:
            loop._handle(self, request)

    return type(f"InTurn{loop.__name__}", (loop,), {"_handle": handle})


class Running:
    """A consumer over in-process worker loops (of the class ``loop``), each running in its own
    thread; ``stream_log`` makes the log of each stream."""

    def __init__(
        self,
        datapipes: Sequence[IterDataPipe],
        window: int = 3,
        max_items: int = 64,
        max_delay_s: float = 0.001,
        positions: Any = None,
        loop: Type[WorkerLoop] = WorkerLoop,
        stream_log: Optional[Callable[[], Any]] = None,
    ) -> None:
        channels, self.loops, self.threads = [], [], []
        for worker_id, dp in enumerate(datapipes):
            channel, endpoint, _ = make_pipe_pair()
            options = WorkerOptions(batching=BatchingOptions(max_items=max_items, max_delay_s=max_delay_s))
            served = _in_turn(loop)(dp, endpoint, WorkerInfo(len(datapipes), worker_id), options=options)
            thread = threading.Thread(target=served.run, daemon=True)
            thread.start()
            channels.append(channel.bind(f"worker {worker_id}"))
            self.loops.append(served)
            self.threads.append(thread)
        self.consumer = WorkerConsumer(
            channels,
            window,
            control_timeout_s=30,
            data_timeout_s=30,
            positions=positions,
            stream_log=stream_log,
        )
        self.epoch = -1

    def start_epoch(self, seed: int = 0) -> Iterator[Any]:
        self.epoch += 1
        seeds = [SeedGenerator(seed).spawn(i) for i in range(len(self.loops))]
        self.consumer.reset_epoch(self.epoch, seeds, None)
        self.consumer.start_epoch()
        return iter(self.consumer)

    def close(self) -> None:
        self.consumer.request_terminate(timeout_s=10)
        for thread in self.threads:
            thread.join(10)
            assert not thread.is_alive()


def round_robin(streams: Sequence[Sequence[Any]]) -> List[Any]:
    """The contract's order: one item per live worker in turn, ended workers skipped."""
    out, positions = [], [0] * len(streams)
    while any(p < len(s) for p, s in zip(positions, streams)):
        for i, s in enumerate(streams):
            if positions[i] < len(s):
                out.append(s[positions[i]])
                positions[i] += 1
    return out
