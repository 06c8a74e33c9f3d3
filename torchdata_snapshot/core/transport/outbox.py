"""The worker's outbox: one thread that writes the worker's responses to its pipe, in order.

Why a thread: a single-threaded worker that batches items must hold produced items back until
it decides to send them; when the next item is slow (a large image, a stuck read) the items
already produced wait with it, and the main process stalls on data that exists. With an
outbox, the loop hands every item over as soon as it is produced and goes on producing; the
sending thread writes whatever has accumulated in one message. Batching then adapts by itself:
one item per message when items are slow, up to ``max_items`` / ``max_bytes`` per message when
they are produced faster than they can be sent. A full pipe (a main process busy training)
blocks only the sending thread, so the worker keeps producing up to its credit.

Order: control responses go through the same queue as items, so an answer still marks an exact
position in the worker's stream. Items are pickled and digested by the producing loop (so a
pickling error names the item, and an item changed after it was yielded is digested as it was
yielded); the thread only concatenates and writes.

Counters (``sent``, ``batches``) are the thread's; read them with :meth:`Outbox.counters`.

Failure: if the thread fails for any other reason than a parent that is gone, it sends the
error to the main process (where it is raised at the worker's position in the stream) and
breaks the outbox: the next ``put`` raises :class:`ParentGone`, so the worker loop exits
instead of producing into a queue nobody writes.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable, Deque, Optional, Tuple

from torchdata_snapshot._constants import LIVENESS_CHECK_INTERVAL_S, NO_EPOCH, OUTBOX_CLOSE_TIMEOUT_S
from torchdata_snapshot._errors import ExceptionWrapper
from torchdata_snapshot.core.messages import WorkerExceptionResponse
from torchdata_snapshot.core.options import BatchingOptions
from torchdata_snapshot.core.transport.batches import QueuedItem, items_message, take_batch
from torchdata_snapshot.core.transport.channel import Endpoint, ParentGone

__all__ = ["Outbox"]


class _Stop:
    pass


class Outbox:
    """An ordered queue of outgoing messages, written to ``endpoint`` by one daemon thread.

    Counters for the current epoch, updated by the thread after each write: ``sent`` items and
    ``batches`` messages. Always ``produced == sent + pending`` where ``pending`` counts the
    items handed over but not yet written (see :meth:`counters`).
    """

    def __init__(
        self,
        endpoint: Endpoint,
        batching: BatchingOptions,
        name: str = "worker",
        discard: Optional[Callable[[QueuedItem], None]] = None,
    ) -> None:
        self.endpoint = endpoint
        self.name = name
        self.discard = discard  # told of every item dropped unsent (its tensor pool slot is freed)
        self.batching = batching
        self._queue: Deque[Any] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._busy = False  # the thread holds entries taken from the queue
        self._waiting = False  # the thread may be waiting for an entry: a put must notify it
        self._epoch = NO_EPOCH
        self._sent = 0
        self._batches = 0
        self.broken: Optional[BaseException] = None  # set when the parent is gone or the thread failed
        self._thread = threading.Thread(target=self._run, name="DataLoader2 worker outbox", daemon=True)
        self._thread.start()

    # --- producer side --------------------------------------------------------------------------

    def put(self, entry: Any) -> None:
        """Queue a message, or a pickled item (a :class:`QueuedItem`, with what travels beside
        it), after everything queued before it.

        It appends without the lock (a deque's appends and pops are atomic) and wakes the thread
        only if it waits. The thread says so before it looks at the queue, under the lock:
        either it sees the entry, or this sees it waiting and notifies once it waits (the lock
        is free only then)."""
        self.check()
        self._queue.append(entry)
        if self._waiting:
            with self._cond:
                self._cond.notify()

    def check(self) -> None:
        """Raise :class:`ParentGone` if nothing can be written any more: the parent is gone, or
        the thread failed (after reporting why)."""
        if self.broken is not None:
            raise ParentGone from self.broken

    def start_epoch(self, epoch: int, sent: int = 0) -> None:
        """A new epoch: drop the items of the old one not written yet, wait for a write in
        progress, and count from ``sent`` (items a restore replayed without sending them)."""
        with self._cond:
            dropped = [entry for entry in self._queue if isinstance(entry, QueuedItem)]
            self._queue = deque(entry for entry in self._queue if not isinstance(entry, QueuedItem))
        if self.discard is not None:
            for entry in dropped:
                self.discard(entry)
        self.drain()
        with self._cond:
            self._epoch, self._sent, self._batches = epoch, sent, 0

    def counters(self) -> Tuple[int, int]:
        """``(sent, batches)`` of the current epoch so far."""
        with self._cond:
            return self._sent, self._batches

    def drain(self) -> None:
        """Block until everything queued so far has been written.

        The wait wakes up every ``LIVENESS_CHECK_INTERVAL_S`` to check that the training process
        still exists (a write blocks while the main process does not read): if it is gone,
        :class:`ParentGone` is raised instead of waiting for a reader that will never come.
        """
        with self._cond:
            while (self._queue or self._busy) and self.broken is None:
                if not self._cond.wait(LIVENESS_CHECK_INTERVAL_S):
                    self.endpoint.check_parent()

    def close(self, timeout_s: float = OUTBOX_CLOSE_TIMEOUT_S) -> None:
        """Write what is queued, then stop the thread (at once if the parent is gone)."""
        if self.broken is None:
            with self._cond:
                self._queue.append(_Stop())
                self._cond.notify()
        self._thread.join(timeout_s)

    # --- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._waiting = True
                    while not self._queue:
                        self._cond.wait()
                    self._waiting = False
                    if isinstance(self._queue[0], QueuedItem):
                        batch: Any = take_batch(self._queue, self.batching.max_items, self.batching.max_bytes)
                        head = batch[0]
                    else:
                        batch, head = None, self._queue.popleft()
                    self._busy = True
                if isinstance(head, _Stop):
                    return
                if batch is not None:
                    self._write_batch(batch)
                else:
                    self.endpoint.send(head)
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
        except ParentGone as e:
            self._break(e)
        except Exception as e:
            where = f"in the outbox thread of {self.name}"
            report = WorkerExceptionResponse(ExceptionWrapper(where=where), epoch=None)
            try:
                self.endpoint.send(report)
            except Exception:
                pass  # the pipe itself failed: the main process sees the worker exit instead
            self._break(e)

    def _break(self, cause: BaseException) -> None:
        with self._cond:
            self.broken = cause
            self._busy = False
            self._cond.notify_all()

    def _write_batch(self, batch: Any) -> None:
        # Always of the current epoch: start_epoch() drops older items.
        self.endpoint.send(items_message(batch))
        with self._cond:
            self._sent += len(batch)
            self._batches += 1
