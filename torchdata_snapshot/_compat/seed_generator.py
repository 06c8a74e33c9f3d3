"""The two Philox engines of a ``SeedGenerator`` as plain fields, read and set in place: what a
checkpoint records so that an epoch restarts with the seeds it had."""

from __future__ import annotations

from typing import Any, Dict

from torchdata.dataloader2.random import SeedGenerator

#: The two Philox engines of a ``SeedGenerator``: its shared stream and its per-process stream.
_SEED_ENGINES = (("shared", "_shared_rng"), ("worker", "_worker_rng"))


def seed_engine_states(generator: SeedGenerator) -> Dict[str, Dict[str, Any]]:
    """``{"shared": fields, "worker": fields}``: each engine's ``seed``, ``ctr``, ``generated``
    (cached draws, or ``None``) and ``spawn_seed``, as ``SeedGenerator`` keeps them."""
    states = {}
    for key, name in _SEED_ENGINES:
        engine = getattr(generator, name)
        states[key] = {
            "seed": engine._seed,
            "ctr": engine._ctr,
            "generated": engine._generated_seeds,
            "spawn_seed": engine._spawn_seed,
        }
    return states


def load_seed_engine_states(generator: SeedGenerator, states: Dict[str, Dict[str, Any]]) -> None:
    """Set ``generator``'s engines, in place, to fields as :func:`seed_engine_states` returns them."""
    for key, name in _SEED_ENGINES:
        engine, fields = getattr(generator, name), states[key]
        engine._seed = tuple(fields["seed"])
        engine._ctr = list(fields["ctr"])
        engine._generated_seeds = None if fields["generated"] is None else list(fields["generated"])
        engine._spawn_seed = tuple(fields["spawn_seed"])
