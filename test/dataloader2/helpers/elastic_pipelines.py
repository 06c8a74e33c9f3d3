"""A DataPipe declared elastic with ``register_elastic``, apart from ``pipelines`` so that the
pipelines the other tests share import nothing of the reading service."""

from __future__ import annotations

from pipelines import double
from torch.utils.data import IterDataPipe
from torch.utils.data.datapipes.iter.callable import MapperIterDataPipe

from torchdata_snapshot import register_elastic


@register_elastic
class ElasticDoubling(MapperIterDataPipe):
    """``map(double)`` as a subclass of torchdata's ``Mapper``: one item per item, holding none,
    declared elastic where it is defined (a restored graph that holds it imports this module)."""

    def __init__(self, source: IterDataPipe) -> None:
        super().__init__(source, double)
