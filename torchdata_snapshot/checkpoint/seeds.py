"""The state of a ``SeedGenerator`` as plain data, and back.

A checkpoint must not contain pickled objects, yet it has to record the seeds of the epoch in
progress exactly. A ``SeedGenerator`` is two Philox engines (a shared stream and a per-process
stream); each engine's state is a handful of integers (key, counter, cached draws, spawn key).
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional

import torch
from torchdata.dataloader2.random import SeedGenerator

from torchdata_snapshot._compat.seed_generator import load_seed_engine_states, seed_engine_states
from torchdata_snapshot._errors import InvalidCheckpointError

__all__ = [
    "check_seed_state",
    "drawn_by_unseeded_dataloader2",
    "load_seed_state",
    "own_seed_generator",
    "rank_seed_state",
    "seed_state",
]

_UINT32 = 2**32


def _plain_engine(fields: Dict[str, Any]) -> Dict[str, Any]:
    generated = fields["generated"]
    return {
        "seed": [int(x) for x in fields["seed"]],
        "ctr": [int(x) for x in fields["ctr"]],
        "generated": None if generated is None else [int(x) for x in generated],
        "spawn_seed": [int(x) for x in fields["spawn_seed"]],
    }


def seed_state(generator: SeedGenerator) -> Dict[str, Dict[str, Any]]:
    """``generator``'s full state: ``{"shared": engine, "worker": engine}`` of ints and lists."""
    return {key: _plain_engine(fields) for key, fields in seed_engine_states(generator).items()}


def _ints(value: Any, length: Optional[int], where: str) -> List[int]:
    if (
        not isinstance(value, list)
        or (length is not None and len(value) != length)
        or not all(isinstance(x, int) and not isinstance(x, bool) and -1 <= x < _UINT32 for x in value)
    ):
        raise InvalidCheckpointError(
            f"seed state: {where} must be a list of {length or 'some'} 32-bit integers, got {value!r}"
        )
    return value


def own_seed_generator(seed_generator: SeedGenerator) -> SeedGenerator:
    """A generator for what a pipeline seeds beside its DataPipes (its own global RNG states with
    ``num_workers=0``), drawn from a copy of ``seed_generator``, which is left as it was: another
    state of either of its streams gives other seeds."""
    drawn = copy.deepcopy(seed_generator)
    return drawn.spawn(drawn.generate_seed() ^ drawn.generate_shared_seed())


def check_seed_state(state: Any) -> Dict[str, Dict[str, Any]]:
    """Validate the plain data of :func:`seed_state`; raise :class:`InvalidCheckpointError` if it is not."""
    if not isinstance(state, dict) or set(state) != {"shared", "worker"}:
        raise InvalidCheckpointError(f"seed state must have keys 'shared' and 'worker', got {state!r}")
    for key in ("shared", "worker"):
        engine_state = state[key]
        if not isinstance(engine_state, dict) or set(engine_state) != {
            "seed",
            "ctr",
            "generated",
            "spawn_seed",
        }:
            raise InvalidCheckpointError(f"seed state {key!r} has unexpected fields: {engine_state!r}")
        _ints(engine_state["seed"], 2, f"{key}.seed")
        _ints(engine_state["ctr"], 4, f"{key}.ctr")
        if engine_state["generated"] is not None:
            _ints(engine_state["generated"], 4, f"{key}.generated")
        _ints(engine_state["spawn_seed"], 2, f"{key}.spawn_seed")
    return state


def load_seed_state(generator: SeedGenerator, state: Any) -> None:
    """Set ``generator`` (in place: DataLoader2 and other reading services hold it) to ``state``."""
    check_seed_state(state)
    load_seed_engine_states(generator, state)


def rank_seed_state(state: Dict[str, Dict[str, Any]], rank: int) -> Dict[str, Dict[str, Any]]:
    """``state`` (a generator's at the start of an epoch) as rank ``rank`` of a distributed job
    gets it: ``DistributedReadingService`` seeds both streams alike and then replaces the
    per-process one by its spawn for the rank, which only the shared stream's spawn seed decides.
    An elastic resume gives a rank of the new job the seeds a fresh job would give it, not those
    of the rank whose state it loaded."""
    generator = SeedGenerator(0)
    load_seed_state(generator, {"shared": state["shared"], "worker": state["shared"]})
    generator.spawn(rank, inplace=True)
    return seed_state(generator)


def drawn_by_unseeded_dataloader2(generator: SeedGenerator) -> bool:
    """Whether ``generator`` holds what an unseeded DataLoader2's ``iter()`` just gave it.

    DataLoader2 does not tell a reading service whether ``dl.seed()`` was called. Unseeded, it
    re-seeds its generator at every ``iter()`` with ``SeedGenerator()``'s draw from the global
    ``torch`` RNG, which (torchdata >= 0.8) does not advance that RNG: the same draw, made here
    right after, gives the same state. A ``DistributedReadingService`` in front of this one
    re-seeds the generator from its shared stream first; its shared engine then matches that
    keyed by the draw's shared seed. (torchdata 0.7.1's draw advances the RNG, so there this
    is always ``False``.)
    """
    with torch.random.fork_rng(devices=[]):
        drawn = SeedGenerator()
    state = seed_state(generator)
    if state == seed_state(drawn):
        return True
    # Its shared engine's key, not its counter: the DistributedReadingService seeds the graph's
    # random DataPipes from that engine after re-seeding it.
    reseeded = seed_state(SeedGenerator(drawn.generate_shared_seed()))["shared"]
    return all(state["shared"][field] == reseeded[field] for field in ("seed", "spawn_seed"))
