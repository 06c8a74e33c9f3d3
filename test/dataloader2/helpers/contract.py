"""The exact-resume contract (the docs' contract page, docs/contract.rst) as a reusable helper.

``check_contract(config, positions)`` does what a training job does on a bad day:

1. runs the pipeline uninterrupted (the reference ``S_1, S_2, ...``);
2. runs it again in this process and takes ``DataLoader2.state_dict()`` at every position of
   ``positions`` in epoch ``config.epoch`` (and checks that doing so changed nothing);
3. for every state, in a *fresh process* that never ran the pipeline, restores a DataLoader2
   (``from_state`` or ``load_state_dict``, the state passed through ``torch.save``/``torch.load``
   or ``pickle``) and checks that it yields ``S_e[k:]`` and then ``S_{e+1}``.

Fresh processes come from a :class:`Resumer`: one spawned Python process that imports
everything once and never runs a pipeline; each restore runs in a process forked from it.
"""

from __future__ import annotations

import functools
import io
import itertools
import multiprocessing
import os
import pickle
import re
import traceback
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

AFTER_END = "after_end"  # a position: after StopIteration reached the user
Position = Union[int, str]

#: The contract's parameter matrix: the number of workers, the prefetch counts, the positions.
WORKERS = [0, 1, 2, 4]
PREFETCH = [0, 1, 10]
POSITIONS = ["first", "one", "middle", "last", AFTER_END]

RESUME_TIMEOUT_S = 180.0


def _caches_loaded_state() -> bool:
    """torchdata >= 0.8's DataLoader2.state_dict() returns the loaded state until an iterator is
    created; 0.7.1's asks the reading service, which is only restored by iter() (see the docs).
    Probed on a DataLoader2 without a reading service (a source tree has no version)."""
    from torchdata.dataloader2 import DataLoader2
    from torchdata.datapipes.iter import IterableWrapper

    state = DataLoader2(IterableWrapper([0])).state_dict()
    loaded = DataLoader2(IterableWrapper([0]))
    loaded.load_state_dict(state)
    return loaded.state_dict() is state


DATALOADER2_CACHES_LOADED_STATE = _caches_loaded_state()


#: The start method of a configuration that names none, and of the processes restores run in.
DEFAULT_CONTEXT = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"

#: ``--full-matrix``: every combination of the matrix (the suite's options set it before the tests
#: are imported; CI's workflow runs it).
FULL_MATRIX = os.environ.get("TORCHDATA_SNAPSHOT_FULL_MATRIX") == "1"


def case_name(config: Any) -> str:
    """A configuration as the name of a test case: ``shuffle_after_sharding_w2_p1_10_fork``."""
    return re.sub(r"\W+", "_", str(config)).strip("_")


@dataclass(frozen=True)
class Config:
    """One configuration of the contract matrix (docs/contract.rst, "What it is tested over")."""

    pipeline: str
    num_workers: int
    worker_prefetch_cnt: int = 10
    main_prefetch_cnt: int = 10
    context: str = DEFAULT_CONTEXT
    n: int = 40
    seed: Optional[int] = 0
    epoch: int = 1  # the epoch (0-based) in which states are taken
    rs_options: Tuple[Tuple[str, Any], ...] = field(default=())

    def reading_service(self, **overrides: Any) -> Any:
        from pipelines import TENSOR_POOL

        from torchdata_snapshot import MultiProcessingReadingService

        kwargs: Dict[str, Any] = dict(
            num_workers=self.num_workers,
            worker_prefetch_cnt=self.worker_prefetch_cnt,
            main_prefetch_cnt=self.main_prefetch_cnt,
            multiprocessing_context=self.context,
            tensor_pool=TENSOR_POOL,  # pytest --tensor-pool / --no-tensor-pool; else the default
        )
        kwargs.update(self.rs_options)
        kwargs.update(overrides)
        return MultiProcessingReadingService(**kwargs)

    def datapipe(self) -> Any:
        from pipelines import pipeline

        return pipeline(self.pipeline, self.n)

    def loader(self) -> Any:
        from torchdata.dataloader2 import DataLoader2

        dl = DataLoader2(self.datapipe(), reading_service=self.reading_service())
        if self.seed is not None:
            dl.seed(self.seed)
        return dl

    def __str__(self) -> str:
        return (
            f"{self.pipeline}-w{self.num_workers}-p{self.worker_prefetch_cnt}/{self.main_prefetch_cnt}"
            f"-{self.context}"
        )

    def __hash__(self) -> int:  # rs_options is a tuple of pairs: hashable, for the reference cache
        return hash((self.pipeline, self.num_workers, self.worker_prefetch_cnt, self.main_prefetch_cnt,
                     self.context, self.n, self.seed, self.epoch, self.rs_options))  # fmt: skip


@dataclass(frozen=True)
class ResumeTask:
    """What a fresh process does with a state: restore, then run ``epochs`` epochs (or take
    ``take`` items and checkpoint again, for chained resumes)."""

    config: Config
    state: bytes  # pickle or torch.save of DataLoader2.state_dict()
    through: str = "pickle"  # "pickle" or "torch"
    via: str = "from_state"  # or "load_state_dict"
    epochs: int = 2
    take: Optional[int] = None
    prefetch: Optional[Tuple[int, int]] = None  # restore with other prefetch counts
    options: Tuple[Tuple[str, Any], ...] = ()  # more reading-service keywords (elastic=True)


def encode_state(state: Dict[str, Any], through: str) -> bytes:
    if through == "torch":
        import torch

        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.getvalue()
    return pickle.dumps(state)


def decode_state(data: bytes, through: str) -> Dict[str, Any]:
    if through == "torch":
        import torch

        return torch.load(io.BytesIO(data), weights_only=True)
    return pickle.loads(data)


def resume(task: ResumeTask) -> Dict[str, Any]:
    """Run in a fresh process: restore a DataLoader2 from ``task.state`` and report what it yields."""
    from torchdata.dataloader2 import DataLoader2

    config = task.config
    state = decode_state(task.state, task.through)
    overrides = dict(task.options)
    if task.prefetch is not None:
        overrides.update(worker_prefetch_cnt=task.prefetch[0], main_prefetch_cnt=task.prefetch[1])
    rs = config.reading_service(**overrides)
    if task.via == "from_state":
        dl = DataLoader2.from_state(state, rs)
    else:
        dl = DataLoader2(config.datapipe(), reading_service=rs)
        dl.load_state_dict(state)
    result: Dict[str, Any] = {"state_unchanged": dl.state_dict() == state}
    try:
        it = iter(dl)
        result["rs_state_after_iter"] = dl.state_dict()["reading_service_state"]
        if task.take is not None:
            result["taken"] = [next(it) for _ in range(task.take)]
            result["state"] = encode_state(dl.state_dict(), task.through)
            return result
        epochs = [list(it)]
        for _ in range(task.epochs - 1):
            epochs.append(list(dl))
        result["epochs"] = epochs
        return result
    finally:
        dl.shutdown()


def _resume_in_child(task: ResumeTask, conn: Any) -> None:
    try:
        conn.send(("ok", resume(task)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    conn.close()


def _serve(conn: Any) -> None:
    import warnings

    warnings.filterwarnings("ignore", message=r"(?s).*'dataloader2' modules are deprecated")
    import pipelines  # noqa: F401  (import everything once, before forking)
    import torchdata.dataloader2  # noqa: F401

    import torchdata_snapshot  # noqa: F401

    # Forked from a process that imported everything: a restore starts in milliseconds. Where
    # there is no fork (Windows), each restore is a spawned process, slower but as fresh.
    fork = multiprocessing.get_context(DEFAULT_CONTEXT)
    while True:
        task = conn.recv()
        if task is None:
            return
        receiver, sender = fork.Pipe(duplex=False)
        child = fork.Process(target=_resume_in_child, args=(task, sender))
        child.start()
        sender.close()
        if receiver.poll(RESUME_TIMEOUT_S):
            try:
                conn.send(receiver.recv())
            except EOFError:
                child.join(10)
                conn.send(("error", f"the resuming process died with exit code {child.exitcode}"))
        else:
            child.kill()
            conn.send(("error", f"the resuming process did not finish within {RESUME_TIMEOUT_S} s"))
        child.join(30)
        if child.exitcode is None:
            child.kill()
            child.join(10)
        receiver.close()


class Resumer:
    """A spawned process that restores states, each in a fresh process forked from it."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child_conn,), daemon=False)
        self.process.start()
        child_conn.close()

    def run(self, task: ResumeTask) -> Dict[str, Any]:
        self.conn.send(task)
        if not self.conn.poll(RESUME_TIMEOUT_S + 60):
            raise AssertionError("the resumer process did not answer")
        status, value = self.conn.recv()
        if status != "ok":
            raise AssertionError(f"resuming in a fresh process failed:\n{value}")
        return value

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(30)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join(10)


@functools.cache
def reference(config: Config, epochs: int) -> Tuple[Tuple[Any, ...], ...]:
    """``S_1 .. S_epochs`` of an uninterrupted run (cached: it is deterministic when seeded)."""
    dl = config.loader()
    try:
        return tuple(tuple(dl) for _ in range(epochs))
    finally:
        dl.shutdown()


def expected_after(ref: Sequence[Sequence[Any]], epoch: int, position: Position) -> List[List[Any]]:
    if position == AFTER_END:
        return [list(ref[epoch + 1]), list(ref[epoch + 2])]
    return [list(ref[epoch][position:]), list(ref[epoch + 1])]  # type: ignore[index]


def take_states(
    config: Config, positions: Sequence[Position]
) -> Tuple[List[List[Any]], List[Tuple[Position, Any]]]:
    """Run ``config`` for ``epoch + 3`` epochs, taking ``state_dict()`` at each position of epoch
    ``config.epoch``; return what the run yielded (its own uninterrupted sequence) and the states."""
    dl = config.loader()
    states: List[Tuple[Position, Dict[str, Any]]] = []
    try:
        run = [list(dl) for _ in range(config.epoch)]
        it = iter(dl)
        epoch: List[Any] = []
        for position in sorted(p for p in positions if p != AFTER_END):  # type: ignore[type-var]
            while len(epoch) < position:  # type: ignore[operator]
                epoch.append(next(it))
            states.append((position, dl.state_dict()))
        epoch.extend(it)
        if AFTER_END in positions:
            states.append((AFTER_END, dl.state_dict()))
        run.append(epoch)
        run.extend(list(dl) for _ in range(2))
    finally:
        dl.shutdown()
    return run, states


def check_contract(
    resumer: Resumer,
    config: Config,
    positions: Sequence[Position],
    through: str = "pickle",
    via: str = "from_state",
) -> None:
    """No perturbation and exact resume in a fresh process (docs/contract.rst, items 1 and 2), for
    ``config`` at every position.

    Without a seed (``config.seed is None``) epochs are random, so the run that took the states
    is its own reference: the resumed epoch must still continue it exactly (item 4); the
    epochs after it draw new seeds.
    """
    run, states = take_states(config, positions)
    if config.seed is not None:
        ref = reference(config, config.epoch + 3)
        assert run == [list(e) for e in ref], "taking state_dict() changed the data"
    for position, state in states:
        result = resumer.run(ResumeTask(config, encode_state(state, through), through, via))
        if DATALOADER2_CACHES_LOADED_STATE:
            assert result["state_unchanged"], "state_dict() right after a restore must be the state loaded"
        if position != AFTER_END:  # (after the end, iter() starts the next epoch: another state)
            assert result["rs_state_after_iter"] == state["reading_service_state"], (
                "the reading-service state right after a restore (before any item) must be the one loaded"
            )
        expected = expected_after(run, config.epoch, position)
        if config.seed is None:  # later epochs draw new random seeds: only the resumed one is fixed
            result["epochs"], expected = result["epochs"][:1], expected[:1]
        assert result["epochs"] == expected, (
            f"{config} resumed at {position} of epoch {config.epoch} did not continue exactly"
        )


def resolve_positions(config: Config, named: Sequence[str]) -> List[Position]:
    """Named positions ("first", "one", "middle", "last", "after_end") for ``config``'s epoch."""
    length = len(reference(config, config.epoch + 3)[config.epoch])
    table: Dict[str, Position] = {
        "first": 0,
        "one": min(1, length),
        "middle": length // 2,
        "last": length,
        "after_end": AFTER_END,
    }
    return sorted({table[name] for name in named}, key=lambda p: (p == AFTER_END, p if p != AFTER_END else 0))


def with_options(config: Config, **changes: Any) -> Config:
    return replace(config, **changes)


def matrix(shapes: Sequence[str], full: bool) -> List[Config]:
    """The contract's configurations of ``shapes``: every number of workers, with the prefetch
    counts' diagonal (``full``: every pair); in-process, the prefetch counts do nothing."""
    cases = []
    prefetches = list(itertools.product(PREFETCH, PREFETCH)) if full else [(p, p) for p in PREFETCH]
    for shape, workers, (wp, mp) in itertools.product(shapes, WORKERS, prefetches):
        if workers == 0 and (wp, mp) != (0, 0) and not full:
            continue
        cases.append(Config(shape, workers, wp, mp))
    return cases
