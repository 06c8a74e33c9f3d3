"""``MultiProcessingReadingService.snapshot()``: one state per worker, taken at one consistent point."""

import dataclasses
import os
from typing import List

from torchdata.dataloader2 import communication
from torchdata.dataloader2.worker_snapshot import WorkerSnapshot

TARGET = "torchdata/dataloader2/reading_service.py"

#: Statements that end MultiProcessingReadingService's methods (before their ``return``): the consumer's waits check
#: the processes that answer them, the pause a snapshot must not undo, and the epoch the workers' snapshots are of.
AT_END = (
    (
        "MultiProcessingReadingService.initialize",
        "self._worker_consumer_datapipe.check_alive = self._check_workers  # type: ignore[union-attr]",
    ),
    ("MultiProcessingReadingService.initialize_iteration", "self._epoch += 1"),
    ("MultiProcessingReadingService._pause", "self._paused = True"),
    ("MultiProcessingReadingService._resume", "self._paused = False"),
)


class MultiProcessingReadingService:
    _epoch: int = -1
    _paused: bool = False

    def snapshot(self) -> List[WorkerSnapshot]:
        r"""
        One :class:`~torchdata.dataloader2.worker_snapshot.WorkerSnapshot` per worker process, in
        the order of their ids, then the dispatching process's if the graph has one.

        Every process is paused (unless ``DataLoader2`` paused it already) and answers a
        ``GetStateRequest``; what a worker had sent before it paused is kept in the main process
        for the iteration, so no item is lost or repeated, and the counts of the snapshots add up.
        With ``num_workers=0``, the single snapshot describes the graph in the main process.
        """
        if self._end_datapipe is None:
            raise RuntimeError("`snapshot()` needs a running reading service: create an iterator of the DataLoader2 first")
        if not self._mp:
            return [_in_process_snapshot(self._end_datapipe, self._epoch)]
        assert self._worker_consumer_datapipe is not None
        self._check_processes()
        paused = self._paused
        if not paused:
            self._pause()
        try:
            responses = self._worker_consumer_datapipe.request_get_state()
        finally:
            if not paused:
                self._resume()
        snapshots = []
        for response, buffered in zip(responses, self._worker_consumer_datapipe.res_buffers):
            worker = response.snapshot
            in_main = sum(isinstance(r, communication.messages.GetNextResponse) for r in buffered)
            snapshots.append(
                dataclasses.replace(
                    worker,
                    epoch=self._epoch,
                    paused=paused,
                    received=worker.sent,
                    handed_on=worker.sent - in_main,
                    buffered_in_main=in_main,
                )
            )
        loops = [loop for response in responses for loop in response.dispatcher]
        if loops:
            snapshots.append(_dispatcher_snapshot(loops, self._epoch, paused))
        return snapshots

    def _check_workers(self) -> None:
        """Raise ``RuntimeError`` naming the first worker process that has exited: it would never
        answer the request the main process waits for."""
        for worker_id, (process, _, _) in enumerate(self._worker_processes):
            _check_alive(f"worker {worker_id}", process)

    def _check_processes(self) -> None:
        """:meth:`_check_workers`, and the dispatching process, which answers the workers' requests."""
        self._check_workers()
        if self._dispatch_process is not None:
            _check_alive("dispatching process", self._dispatch_process[0])


def _check_alive(name: str, process) -> None:
    if not process.is_alive():
        raise RuntimeError(f"{name} (pid {process.pid}) exited unexpectedly with exit code {process.exitcode}")


def _dispatcher_snapshot(loops: List[WorkerSnapshot], epoch: int, paused: bool) -> WorkerSnapshot:
    """The dispatching process's snapshot, from those of its loops (one per worker)."""
    sent_per_worker = tuple(sum(counts) for counts in zip(*(loop.sent_per_worker for loop in loops)))
    return dataclasses.replace(
        loops[0],
        epoch=epoch,
        paused=paused,
        produced=sum(sent_per_worker),
        sent=sum(sent_per_worker),
        batches=sum(sent_per_worker),
        sent_per_worker=sent_per_worker,
    )


def _in_process_snapshot(end_datapipe, epoch: int) -> WorkerSnapshot:
    """The snapshot of a graph that runs in the main process (``num_workers=0``)."""
    produced = getattr(end_datapipe, "_number_of_samples_yielded", 0)  # a MapDataPipe keeps no count
    return WorkerSnapshot(
        worker_id=0,
        role="in_process",
        pid=os.getpid(),
        epoch=epoch,
        produced=produced,
        sent=produced,
        buffered=0,
        received=produced,
        handed_on=produced,
    )
