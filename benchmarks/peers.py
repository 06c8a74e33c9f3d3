"""One adapter per loader compared: build it for a datapipe and a worker count, iterate, checkpoint.

Every peer prefetches with its defaults scaled the same way: DataLoader2 with 10 items per
worker and 10 in the main process; ``DataLoader``/``StatefulDataLoader`` with
``prefetch_factor=10`` (items per worker). Workers are started before timing starts. ``in_process``
(upstream's ``InProcessReadingService``, whatever the worker count) is the ceiling.
``ours`` has the default options (the tensor pool on, where the platform has it).
``ours_read_ahead`` is ours with ``read_ahead=True``, which only changes ``num_workers=0``: it
runs there only (see :data:`IN_PROCESS_ONLY`). ``ours_no_tensor_pool`` is ours with
``tensor_pool=False``, on tensor workloads with workers only (see :data:`TENSORS_ONLY`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Dict, Optional

from torch.utils.data import DataLoader
from torchdata.dataloader2 import DataLoader2, InProcessReadingService
from torchdata.dataloader2 import MultiProcessingReadingService as UpstreamMPRS

from torchdata_snapshot import MultiProcessingReadingService

PREFETCH = 10

#: Peers measured with ``num_workers=0`` only (the same as another peer with workers).
IN_PROCESS_ONLY = frozenset({"ours_read_ahead"})

#: Peers measured with workers on tensor workloads only (``tensor_pool=False`` changes nothing else).
TENSORS_ONLY = frozenset({"ours_no_tensor_pool"})


@dataclass(frozen=True)
class Peer:
    name: str
    make: Callable[[Any, int], Any]  # (datapipe, num_workers) -> loader
    close: Callable[[Any], None]
    state_dict: Optional[Callable[[Any], Any]] = None


def _dl2(rs_class: Any) -> Callable[[Any, int], Any]:
    def make(datapipe: Any, num_workers: int) -> Any:
        rs = rs_class(num_workers=num_workers, worker_prefetch_cnt=PREFETCH, main_prefetch_cnt=PREFETCH)
        dl = DataLoader2(datapipe, reading_service=rs)
        dl.seed(0)
        return dl

    return make


def _in_process(datapipe: Any, num_workers: int) -> Any:
    """The ceiling: the pipeline in the training process, no worker, no isolation (upstream's
    InProcessReadingService). On 2 cores a sharded pipeline can at best reach about this."""
    dl = DataLoader2(datapipe, reading_service=InProcessReadingService())
    dl.seed(0)
    return dl


def _torch_loader(cls: Any) -> Callable[[Any, int], Any]:
    def make(datapipe: Any, num_workers: int) -> Any:
        return cls(
            datapipe,
            batch_size=None,
            num_workers=num_workers,
            prefetch_factor=PREFETCH if num_workers else None,
            persistent_workers=num_workers > 0,
        )

    return make


def _shutdown_dl2(dl: Any) -> None:
    dl.shutdown()


def _drop_torch_loader(loader: Any) -> None:
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


def peers() -> Dict[str, Peer]:
    out = {
        "upstream_mprs": Peer("upstream_mprs", _dl2(UpstreamMPRS), _shutdown_dl2),
        "ours": Peer("ours", _dl2(MultiProcessingReadingService), _shutdown_dl2, lambda dl: dl.state_dict()),
        "ours_read_ahead": Peer(
            "ours_read_ahead", _dl2(partial(MultiProcessingReadingService, read_ahead=True)), _shutdown_dl2
        ),
        "ours_no_tensor_pool": Peer(
            "ours_no_tensor_pool",
            _dl2(partial(MultiProcessingReadingService, tensor_pool=False)),
            _shutdown_dl2,
        ),
        "dataloader": Peer("dataloader", _torch_loader(DataLoader), _drop_torch_loader),
        "in_process": Peer("in_process", _in_process, _shutdown_dl2),
    }
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader

        out["stateful_dataloader"] = Peer(
            "stateful_dataloader",
            _torch_loader(StatefulDataLoader),
            _drop_torch_loader,
            lambda dl: dl.state_dict(),
        )
    except ImportError:  # torchdata 0.7 does not ship it
        pass
    return out
