"""The tests' SuiteTestCase (helpers/suite_case.py): what a test made or changed is undone after it,
whatever the test did."""

from __future__ import annotations

import logging
import os
import unittest
from typing import Any, Callable, Dict
from unittest import TestCase

from suite_case import SuiteTestCase
from torchdata.datapipes.iter import IterableWrapper

#: A module attribute the tests patch.
PATCHED = "original"


def run_as_a_test(body: Callable[[SuiteTestCase], None]) -> Dict[str, Any]:
    """Run ``body`` as the test of a SuiteTestCase, cleanups included; what it saw and the result."""
    seen: Dict[str, Any] = {}

    class Case(SuiteTestCase):
        def test_body(self) -> None:
            seen["case"] = self
            body(self)

    result = unittest.TestResult()
    Case("test_body").run(result)
    seen["result"] = result
    return seen


class TestSuiteTestCase(TestCase):
    def test_the_loaders_it_made_are_shut_down_after_the_test_even_when_it_fails(self) -> None:
        def body(case: SuiteTestCase) -> None:
            case.made = case.make_dl(IterableWrapper(range(3)), None)  # type: ignore[attr-defined]
            assert list(case.made) == [0, 1, 2]  # type: ignore[attr-defined]
            raise AssertionError("the test failed")

        seen = run_as_a_test(body)
        self.assertEqual(len(seen["result"].failures), 1)
        self.assertTrue(seen["case"].made._terminated, "shut down after the failed test")

    def test_its_temporary_directory_is_removed_after_the_test(self) -> None:
        seen = run_as_a_test(lambda case: (case.tmp_path / "file").write_text("x"))
        self.assertTrue(seen["result"].wasSuccessful())
        self.assertFalse(os.path.exists(seen["case"].tmp_path), "removed")

    def test_its_patches_are_undone_after_the_test(self) -> None:
        def body(case: SuiteTestCase) -> None:
            case.monkeypatch.setattr(f"{__name__}.PATCHED", "patched")
            assert PATCHED == "patched"

        self.assertTrue(run_as_a_test(body)["result"].wasSuccessful())
        self.assertEqual(PATCHED, "original")

    def test_it_captures_what_is_logged_during_the_test_and_restores_the_levels(self) -> None:
        logger = logging.getLogger("suite_case_test")

        def body(case: SuiteTestCase) -> None:
            case.caplog.set_level(logging.INFO, logger="suite_case_test")
            logger.info("an info record")
            assert [r.getMessage() for r in case.caplog.records] == ["an info record"]

        level = logger.level
        self.assertTrue(run_as_a_test(body)["result"].wasSuccessful())
        self.assertEqual(logger.level, level)
        root_handlers = [type(h).__name__ for h in logging.getLogger().handlers]
        self.assertNotIn("LogCapture", root_handlers, "the capture is removed after the test")

    def test_a_class_directory_lasts_for_the_class_and_is_removed_after_it(self) -> None:
        seen: Dict[str, Any] = {}

        class Case(SuiteTestCase):
            @classmethod
            def setUpClass(cls) -> None:
                super().setUpClass()
                seen["directory"] = cls.class_directory("class_")

            def test_a(self) -> None:
                (seen["directory"] / "a").write_text("a")

            def test_b(self) -> None:
                assert (seen["directory"] / "a").exists(), "what test_a wrote is still there"

        result = unittest.TestResult()
        unittest.TestSuite([Case("test_a"), Case("test_b")]).run(result)
        self.assertTrue(result.wasSuccessful(), result.failures)
        self.assertFalse(seen["directory"].exists(), "removed after the class")


if __name__ == "__main__":
    unittest.main()
