"""``ShardingShifts``: the state of torchdata's ``ShardingFilter`` in a resumable graph.

The filter stays in the graph (``DataLoader2`` finds it by its exact type when seeding); its
state is how many items it yielded, from which follows how many it took from its source. A
resumed epoch shifts its ``instance_id`` so that a fresh enumeration of the resumed source picks
the right items, until the next iteration that starts afresh.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from torch.utils.data.datapipes.iter.sharding import ShardingFilterIterDataPipe

from torchdata_snapshot._compat.datapipes import samples_yielded
from torchdata_snapshot.graph_state.resumable import expect_state

__all__ = ["ShardingShifts"]


class ShardingShifts:
    """The state functions of torchdata's ``ShardingFilter``, which stays in a resumable graph
    (``DataLoader2`` finds it by its exact type when seeding), for the filters of one graph.

    A filter's state is how many items it yielded this epoch. Resumed from one, it runs with a
    shifted ``instance_id`` until the next fresh iteration (:meth:`reset`), and counts the items
    it yielded before the current iteration started (:meth:`taken_before`).
    """

    def __init__(self) -> None:
        #: ``id(sf)`` -> ``(sf, its instance_id before a loaded state shifted it, the items it
        #: yielded before the current iteration started)``, while a resumed epoch runs. The entry
        #: holds ``sf``: its id cannot be reused meanwhile (DataPipes need not be hashable).
        self._shifted: Dict[int, Tuple[ShardingFilterIterDataPipe, int, int]] = {}

    def taken(self, sf: ShardingFilterIterDataPipe) -> int:
        """How many items the filter yielded this epoch (torch's iterator hook counts them), also
        across a resume from a loaded state."""
        return self.taken_before(sf) + samples_yielded(sf)

    def taken_before(self, sf: ShardingFilterIterDataPipe) -> int:
        """How many items the filter yielded this epoch before its current iteration started (those
        of a loaded state): :meth:`taken` minus what torch's hook counts."""
        shifted = self._shifted.get(id(sf))
        return shifted[2] if shifted is not None else 0

    def state_dict(self, sf: ShardingFilterIterDataPipe) -> Dict[str, Any]:
        return {"yielded": self.taken(sf)}

    def load_state_dict(self, sf: ShardingFilterIterDataPipe, state: Dict[str, Any]) -> None:
        """Resume the filter over a source resumed where it stood.

        Suspended right after its ``j``-th item, the filter had taken ``i + 1`` items from its
        source, where ``i = instance_id + (j - 1) * num_of_instances`` is the index of that item. A
        fresh enumeration over the resumed source must therefore pick the indices ``k`` with
        ``(k + i + 1) % n == instance_id``, i.e. ``k % n == n - 1``.
        """
        yielded = expect_state(state, "ShardingFilter", yielded=int)["yielded"]
        shifted = self._shifted.get(id(sf))
        original = shifted[1] if shifted is not None else sf.instance_id
        self._shifted[id(sf)] = (sf, original, yielded)
        if yielded:
            consumed = original + (yielded - 1) * sf.num_of_instances + 1
            sf.instance_id = (original - consumed) % sf.num_of_instances

    def reset(self, sf: ShardingFilterIterDataPipe) -> None:
        """Back to the original ``instance_id``, for an iteration that starts afresh."""
        shifted = self._shifted.pop(id(sf), None)
        if shifted is not None:
            sf.instance_id = shifted[1]
