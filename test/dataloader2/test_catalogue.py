"""The one catalogue of DataPipe types: what each is, and every table of the package read from it."""

from __future__ import annotations

import unittest
from unittest import TestCase

import pytest
from torch.utils.data.datapipes.iter.callable import CollatorIterDataPipe, MapperIterDataPipe
from torch.utils.data.datapipes.iter.grouping import BatcherIterDataPipe, UnBatcherIterDataPipe
from torch.utils.data.datapipes.iter.selecting import FilterIterDataPipe
from torchdata.datapipes.iter import FlatMapper, FullSync, LineReader, PinMemory, Prefetcher, WebDataset

from torchdata_snapshot.core.catalogue import CATALOGUE, types_where


class TestCatalogue(TestCase):
    def test_no_type_is_both_kept_as_stateless_and_replaced(self) -> None:
        assert not set(types_where(stateless=True)) & set(types_where(adapted=True))

    def test_a_type_that_hands_on_several_items_per_element_holds_state(self) -> None:
        for kind in (*types_where(per_element="several"), *types_where(per_element="holds_one")):
            assert not CATALOGUE[kind].stateless, kind.__name__

    def test_the_catalogue_holds_types_torch_and_torchdata_ship(self) -> None:
        for kind in CATALOGUE:
            assert kind.__module__.split(".")[0] in ("torch", "torchdata"), kind

    def test_the_tables_read_from_the_catalogue_in_its_order(self) -> None:
        """Refusals list these types in this order (see test_elastic.py)."""
        assert types_where(main_tail=True) == (
            MapperIterDataPipe,
            CollatorIterDataPipe,
            FullSync,
            Prefetcher,
            PinMemory,
        )
        assert types_where(after_sharding=True) == (
            MapperIterDataPipe,
            FilterIterDataPipe,
            BatcherIterDataPipe,
            CollatorIterDataPipe,
        )
        several = types_where(per_element="several")
        assert several[0] is LineReader and several[-2:] == (FlatMapper, UnBatcherIterDataPipe)
        assert WebDataset in types_where(per_element="holds_one")

    def test_an_unknown_trait_is_refused_naming_the_traits(self) -> None:
        with pytest.raises(TypeError, match="no trait one_to_one .*the traits: per_element, stateless"):
            types_where(one_to_one=True)


if __name__ == "__main__":
    unittest.main()
