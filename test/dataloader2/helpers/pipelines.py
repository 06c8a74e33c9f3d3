"""Pipelines and helpers shared by the tests (importable by spawned workers and fresh processes)."""

from __future__ import annotations

import functools
import multiprocessing
import os
import random
import time
from typing import Any, Callable, Dict, Iterator, List, Tuple

import numpy
import torch
from torch.utils.data import IterDataPipe
from torch.utils.data.datapipes.iter.callable import MapperIterDataPipe
from torchdata.datapipes.iter import IterableWrapper

#: Start method of the tests that do not choose one (``pytest --mp-context spawn`` sets it);
#: fork where the platform has it, as DataLoader2's default on Linux.
_DEFAULT_CONTEXT = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
CONTEXT = os.environ.get("TORCHDATA_SNAPSHOT_TEST_CONTEXT", _DEFAULT_CONTEXT)
#: ``pytest --tensor-pool`` / ``--no-tensor-pool``: the reading services of the tests that do not
#: choose ask for the pool / turn it off; else they have the default (on where the platform has it).
TENSOR_POOL = {"1": True, "0": False}.get(os.environ.get("TORCHDATA_SNAPSHOT_TEST_TENSOR_POOL", ""))


def rs(num_workers: int = 2, **kwargs: Any) -> Any:
    """Our reading service with the test suite's default start method."""
    from torchdata_snapshot import MultiProcessingReadingService

    kwargs.setdefault("multiprocessing_context", CONTEXT)
    kwargs.setdefault("tensor_pool", TENSOR_POOL)
    return MultiProcessingReadingService(num_workers=num_workers, **kwargs)


def double(x: int) -> int:
    return 2 * x


def scaled(x: int, factor: int = 1) -> int:
    return factor * x


def is_even(x: int) -> bool:
    return x % 2 == 0


def not_multiple_of_3(x: int) -> bool:
    return x % 3 != 0


def with_global_randomness(x: int) -> tuple:
    """Uses the three global RNGs DataLoader2 seeds per worker."""
    return (
        x,
        random.randint(0, 10**6),
        int(torch.randint(0, 10**6, ())),
        int(numpy.random.randint(0, 10**6)),
    )


def random_delay(x: Any) -> Any:
    """Sleeps 0-2 ms from an RNG that is *not* the pipeline's: timing only, never data."""
    time.sleep(random.SystemRandom().random() * 0.002)
    return x


def fail_at_7(x: int) -> int:
    if x == 7:
        raise ValueError(f"sample {x} is corrupt")
    return x


def split(x: int) -> List[int]:
    return [x, x + 1000]


class NonReplicable(IterDataPipe):
    """A pass-through that must stay in the main process (like torchdata's fullsync/pin_memory)."""

    def __init__(self, source: IterDataPipe) -> None:
        self.source = source

    def __iter__(self) -> Iterator[Any]:
        yield from self.source

    def is_replicable(self) -> bool:
        return False


class SwappedPairs(MapperIterDataPipe):
    """``map(fn)`` handing on its items in swapped pairs (``fn(b), fn(a)`` for ``a, b``): a
    subclass of torchdata's ``Mapper`` that, unlike it, holds an item across its outputs."""

    def __iter__(self) -> Iterator[Any]:
        held: List[Any] = []
        for x in self.datapipe:
            if held:
                yield self.fn(x)
                yield self.fn(held.pop())
            else:
                held.append(x)
        for x in held:
            yield self.fn(x)


class CountingWithState(IterDataPipe):
    """Counts what it yields and reports it through ``state_dict()``."""

    def __init__(self, source: IterDataPipe) -> None:
        self.source = source
        self.seen = 0

    def __iter__(self) -> Iterator[Any]:
        self.seen = 0
        for x in self.source:
            self.seen += 1
            yield x

    def state_dict(self) -> Dict[str, int]:
        return {"seen": self.seen}


def tiny(n: int = 40) -> IterDataPipe:
    return IterableWrapper(range(n)).shuffle().sharding_filter().map(double)


#: The shapes the contract tests run, by name.
PIPELINES: Dict[str, Any] = {}

#: Shapes whose graph cannot resume from captured states, only by replay: a dispatched source,
#: and the user's Mapper subclasses without state functions (one of them holds an item).
REPLAYED_ONLY = frozenset({"dispatch", "swapped_pairs_after_sharding", "declared_elastic_subclass"})

#: Shapes built with elastic resume's ``register_elastic``: test_elastic.py runs their contract,
#: so that the other tests need nothing of elastic resume.
ELASTIC_DECLARED = frozenset({"declared_elastic_subclass"})

#: Shapes that need a process group (``fullsync``): only the distributed tests build them.
PROCESS_GROUP_PIPELINES: Dict[str, Any] = {}


def pipeline(name: str, n: int = 40, **kwargs: Any) -> IterDataPipe:
    """Build a named pipeline shape (see ``PIPELINES`` and ``PROCESS_GROUP_PIPELINES``)."""
    return {**PIPELINES, **PROCESS_GROUP_PIPELINES}[name](n, **kwargs)


def _register(name: str, needs_process_group: bool = False):  # type: ignore[no-untyped-def]
    def deco(fn):  # type: ignore[no-untyped-def]
        (PROCESS_GROUP_PIPELINES if needs_process_group else PIPELINES)[name] = fn
        return fn

    return deco


@_register("shuffle_before_sharding")
def _shuffle_before(n: int) -> IterDataPipe:
    return IterableWrapper(range(n)).shuffle().sharding_filter().map(double)


@_register("shuffle_after_sharding")
def _shuffle_after(n: int) -> IterDataPipe:
    return IterableWrapper(range(n)).sharding_filter().shuffle(buffer_size=8).map(double)


@_register("batch")
def _batch(n: int) -> IterDataPipe:
    return IterableWrapper(range(n)).shuffle().sharding_filter().batch(3)


@_register("unbatch")
def _unbatch(n: int) -> IterDataPipe:
    return IterableWrapper(range(n)).shuffle().sharding_filter().flatmap(split)


@_register("unbatch_batch")
def _unbatch_batch(n: int) -> IterDataPipe:
    return IterableWrapper(range(n)).shuffle().sharding_filter().map(split).unbatch().batch(3)


@_register("uneven_filter")
def _uneven(n: int) -> IterDataPipe:
    return IterableWrapper(range(n)).sharding_filter().filter(not_multiple_of_3).filter(is_even)


@_register("map_filter_batch")
def _map_filter_batch(n: int) -> IterDataPipe:
    return (
        IterableWrapper(range(n)).shuffle().sharding_filter().map(double).filter(not_multiple_of_3).batch(3)
    )


@_register("global_rng")
def _global_rng(n: int) -> IterDataPipe:
    return IterableWrapper(range(n)).sharding_filter().map(with_global_randomness)


@_register("random_delays")
def _random_delays(n: int) -> IterDataPipe:
    return IterableWrapper(range(n)).shuffle().sharding_filter().map(random_delay).map(with_global_randomness)


@_register("sharding_under_cycle")
def _sharding_under_cycle(n: int) -> IterDataPipe:
    return IterableWrapper(range(n)).sharding_filter().cycle(2).map(double)


@_register("non_replicable_tail")
def _tail(n: int) -> IterDataPipe:
    return NonReplicable(IterableWrapper(range(n)).shuffle().sharding_filter().map(double)).map(double)


@_register("swapped_pairs_after_sharding")
def _swapped_after(n: int) -> IterDataPipe:
    return SwappedPairs(IterableWrapper(range(n)).shuffle().sharding_filter(), double)


@_register("swapped_pairs_tail", needs_process_group=True)
def _swapped_tail(n: int) -> IterDataPipe:
    """A ``Mapper`` subclass holding items, in the main process (after ``fullsync``: needs a
    process group)."""
    return SwappedPairs(IterableWrapper(range(n)).shuffle().sharding_filter().map(double).fullsync(), double)


@_register("filtering_tail", needs_process_group=True)
def _filtering_tail(n: int) -> IterDataPipe:
    """A ``filter`` in the main process (after ``fullsync``: needs a process group)."""
    source = IterableWrapper(range(n)).shuffle().sharding_filter().map(double)
    return source.fullsync().filter(not_multiple_of_3)


@_register("declared_elastic_subclass")
def _declared_elastic(n: int) -> IterDataPipe:
    from elastic_pipelines import ElasticDoubling

    return ElasticDoubling(IterableWrapper(range(n)).shuffle().sharding_filter())


@_register("dispatch")
def _dispatch(n: int) -> IterDataPipe:
    from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES

    return (
        IterableWrapper(range(n))
        .shuffle()
        .sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
        .map(with_global_randomness)
    )


# --- files on disk, opened and parsed after sharding ---------------------------------------------


def _written_once(path: str, write: Callable[[str], None]) -> str:
    """``path``, written by ``write(tmp)`` if it does not exist yet (atomically: processes that
    build the same pipeline share it, and a file must not change once read)."""
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        write(tmp)
        os.replace(tmp, path)
    return path


def _write_lines(shard: int, records: range, path: str) -> None:
    with open(path, "w") as f:
        f.writelines(f"record {r} of shard {shard}\n" for r in records)


def _write_samples(shard: int, records: range, path: str) -> None:
    import io
    import tarfile

    with tarfile.open(path, "w") as tar:
        for r in records:
            for suffix, data in ((".txt", f"record {r}"), (".cls", str(r % 10))):
                info = tarfile.TarInfo(f"sample{r:06d}{suffix}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data.encode()))


def shard_files(kind: str, n: int, shards: int = 4) -> str:
    """A directory of ``shards`` files of ``kind`` ("txt": lines; "tar": WebDataset-style
    samples of a ``.txt`` and a ``.cls`` member) holding ``n`` records in all."""
    import tempfile

    root = os.path.join(tempfile.gettempdir(), f"dataloader2-test-{kind}-{n}-{shards}")
    os.makedirs(root, exist_ok=True)
    write = _write_lines if kind == "txt" else _write_samples
    for shard in range(shards):
        path = os.path.join(root, f"shard{shard}.{kind}")
        _written_once(path, functools.partial(write, shard, range(shard, n, shards)))
    return root


def line_and_length(line: str) -> Tuple[str, int]:
    return line, len(line)


def read_sample(sample: Dict[str, Any]) -> Tuple[str, bytes, int]:
    """A WebDataset sample with its members read: ``(key, text, class)``."""
    return sample["__key__"], sample[".txt"].read(), int(sample[".cls"].read())


@_register("lines_after_sharding")
def _lines_after_sharding(n: int) -> IterDataPipe:
    from torchdata.datapipes.iter import FileLister

    files = FileLister(shard_files("txt", n), masks="*.txt").shuffle().sharding_filter()
    return files.open_files().readlines(return_path=False).map(line_and_length)


@_register("webdataset_after_sharding")
def _webdataset_after_sharding(n: int) -> IterDataPipe:
    from torchdata.datapipes.iter import FileLister

    files = FileLister(shard_files("tar", n), masks="*.tar").shuffle().sharding_filter()
    return files.open_files("b").load_from_tar().webdataset().map(read_sample)


def take(iterator: Iterator[Any], k: int) -> List[Any]:
    return [next(iterator) for _ in range(k)]


def moved_onto(state: Dict[str, Any], datapipe: IterDataPipe) -> Dict[str, Any]:
    """``state`` with ``datapipe`` in place of the pipeline it was taken with: what a user who
    builds the pipeline again from code, and restores the positions only, gets."""
    from torchdata.dataloader2 import DataLoader2

    dl = DataLoader2(datapipe)
    try:
        return {**state, "serialized_datapipe": dl.state_dict()["serialized_datapipe"]}
    finally:
        dl.shutdown()


def hash_tokens(text: str) -> List[int]:
    """A tokenizer built on ``hash()``: its ids depend on the process's hash salt, fixed only
    by ``PYTHONHASHSEED`` (the classic pipeline that does not replay in a new process)."""
    return [hash(word) % 50_000 for word in text.split()]


class CountingStateful(IterDataPipe):
    """A user DataPipe with its own state_dict()/load_state_dict(): a position in ``range(n)``.

    ``pulled`` counts the items it produced since it was created or loaded: after a stateful
    restore it shows how much of the stream was recomputed.
    """

    #: Set on an instance, its ``load_state_dict`` refuses every state, as a DataPipe whose data
    #: changed since the state was taken does (its data, not one of its constructor arguments).
    fail_on_load = False

    def __init__(self, n: int) -> None:
        self.n = n
        self.position = 0
        self.pulled = 0
        self._loaded: Any = None

    def __iter__(self) -> Iterator[int]:
        start, self._loaded = (self._loaded or 0), None
        self.position = start
        while self.position < self.n:
            self.position += 1
            self.pulled += 1
            yield self.position - 1

    def state_dict(self) -> Dict[str, int]:
        return {"position": self.position, "pulled": self.pulled}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        if self.fail_on_load:
            raise ValueError("this state belongs to another dataset")
        self._loaded = state["position"]
        self.pulled = 0


def failing_counter(n: int) -> CountingStateful:
    """A ``CountingStateful(n)`` whose ``load_state_dict`` fails."""
    dp = CountingStateful(n)
    dp.fail_on_load = True
    return dp


@_register("stateful_source")
def _stateful_source(n: int) -> IterDataPipe:
    return CountingStateful(n).shuffle(buffer_size=16).sharding_filter().map(with_global_randomness).batch(2)


# --- what tests look at inside a running reading service -------------------------------------------
# One place: a refactor of the reading service's internals is one edit here.


def started_session(datapipe: Any, num_workers: int, session: Any = None, plan: Any = None) -> Any:
    """``datapipe`` started as the reading service starts it, by a ``session`` class (default:
    the core's, which streams) with small prefetch counts and bounded waits, replaying rather
    than capturing states; ``plan``: the restore it resumes."""
    from torchdata_snapshot.core.options import FaultOptions, RestoreOptions, RuntimeOptions, WorkerOptions
    from torchdata_snapshot.core.session import Session

    options = RuntimeOptions(
        num_workers=num_workers,
        multiprocessing_context=CONTEXT,
        prefetch=(2, 2),
        worker=WorkerOptions(restore=RestoreOptions(stateful=False)),
        faults=FaultOptions(control_timeout_s=30.0, timeout_s=30.0),
    )
    return (session or Session).open(datapipe, options, plan)


def worker_processes(dl: Any) -> List[Any]:
    """The ``multiprocessing.Process`` of each worker of ``dl``'s reading service (shutdown
    closes them: read what you need before)."""
    return list(dl.reading_service._session.runtime.launcher.workers)


def worker_pools(dl: Any) -> List[Any]:
    """The tensor pool of each worker of ``dl``'s reading service (``tensor_pool=True``)."""
    return [stream.channel.pool for stream in dl.reading_service._session.runtime.consumer.streams]


#: How long a test waits for a process it forked to report or to exit.
FORK_CHILD_WAIT_S = 60.0


class ForkReader:
    """A process forked (``fork``, as an asynchronous checkpoint writer or a logging process is)
    with a tensor, which reads it only when told to: ``read()`` returns what it saw,
    ``(first element, sum)``, then joins it."""

    def __init__(self, tensor: Any) -> None:
        ctx = multiprocessing.get_context("fork")
        self._go = ctx.Event()
        self._answer, answer = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=ForkReader._run, args=(tensor, self._go, answer), daemon=True)
        self.process.start()
        answer.close()

    @staticmethod
    def _run(tensor: Any, go: Any, answer: Any) -> None:
        if go.wait(FORK_CHILD_WAIT_S):
            answer.send((int(tensor.reshape(-1)[0]), int(tensor.sum())))

    def read(self) -> Tuple[int, int]:
        self._go.set()
        try:
            if not self._answer.poll(FORK_CHILD_WAIT_S):
                raise TimeoutError(f"the forked reader (pid {self.process.pid}) did not answer")
            return self._answer.recv()
        finally:
            self.join()

    def join(self) -> None:
        self._go.set()
        self.process.join(FORK_CHILD_WAIT_S)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join(FORK_CHILD_WAIT_S)
        self._answer.close()


def gone(pids: List[int]) -> bool:
    """Whether none of the processes ``pids`` exists any more (reaped, not even a zombie)."""
    import psutil

    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def kept_per_worker(dl: Any) -> List[int]:
    """Per worker, how many batches of digests and graph states the main process keeps."""
    return [stream.log.kept_entries for stream in dl.reading_service._session.runtime.consumer.streams]


def credit_outstanding(dl: Any) -> List[int]:
    """Per worker, the credit the main process granted beyond what it handed on: how far the
    worker may run ahead of the user right now."""
    return [s.credit.granted - s.handed_on for s in dl.reading_service._session.runtime.consumer.streams]


def snapshot_when(dl: Any, done: Callable[[List[Any]], bool], timeout_s: float = 30) -> List[Any]:
    """``dl``'s snapshot once ``done`` holds for it, or the last one after ``timeout_s`` (a
    worker reaches what its credit allows in its own time; each snapshot is a round trip)."""
    deadline = time.monotonic() + timeout_s
    while True:
        snaps = dl.reading_service.snapshot()
        if done(snaps) or time.monotonic() > deadline:
            return snaps


def credit_window_of(dl: Any) -> int:
    """The credit kept outstanding per worker (items a worker may send ahead of the user)."""
    return int(dl.reading_service._session.runtime.consumer.window)


def megabyte(x: int) -> Any:
    """A 1 MB tensor: it travels through shared memory."""
    import torch

    return torch.full((262144,), float(x))


def five_milliseconds(x: int) -> int:
    """An item that takes 5 ms to produce, waiting (I/O-like)."""
    import time

    time.sleep(0.005)
    return x


def tokens(numel: int, x: int) -> Any:
    """``numel`` int64 tokens (8,192 of them: a 64 KB item), counting up from ``x``."""
    import torch

    return torch.arange(x, x + numel, dtype=torch.int64)


def tensor_items(n: int = 40, numel: int = 8192) -> IterDataPipe:
    """Items of one ``numel``-element int64 tensor each, with a shuffle before the sharding."""
    from functools import partial

    return IterableWrapper(range(n)).shuffle().sharding_filter().map(partial(tokens, numel))
