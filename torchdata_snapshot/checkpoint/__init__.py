"""The checkpoint: its format, positions, running digests, replay, seeds, RNG states, restore plans
(and a data directory that moved)."""
