"""The points where optional features plug into the reading service (see the docs' design page):
a feature is found by its module's name, a missing one is ``None`` and its option is refused
naming the module, the tensor pool's default follows what is installed and what the platform has,
and the processes the reading service starts itself are told from the user's forks."""

from __future__ import annotations

import threading
import unittest
from typing import Any, List, Optional

import pytest
from suite_case import SuiteTestCase

from torchdata_snapshot.core import plugins


class Pool:
    """A tensor pool feature whose platform says ``reason`` (``None``: it has a pool)."""

    reason: Optional[str] = None

    def __call__(self, options: Any) -> Any:
        raise AssertionError("not made here")

    @classmethod
    def unavailable(cls) -> Optional[str]:
        return cls.reason


class TestPluginPoints(SuiteTestCase):
    def setUp(self) -> None:
        plugins.installed.cache_clear()
        self.addCleanup(plugins.installed.cache_clear)  # the last cleanup: after the patches' undoing
        super().setUp()

    def features(self, **found: Any) -> None:
        """What :func:`plugins.installed` looks for, for this test: ``{field: (module, name)}``, or
        several, the most capable first."""
        offers = {field: value if isinstance(value[0], tuple) else (value,) for field, value in found.items()}
        self.monkeypatch.setattr(plugins, "FEATURES", {**plugins.FEATURES, **offers})
        plugins.installed.cache_clear()

    def test_a_feature_whose_module_is_missing_is_none_and_its_option_is_refused_naming_it(self) -> None:
        self.features(
            replacer=("no_such_package.healing", "WorkerReplacer"), elastic_start=("json", "nothing")
        )
        with pytest.raises(AttributeError):  # a module that is there but lacks the name is a bug, not absence
            plugins.installed()
        self.features(elastic_start=("json", "dumps"))
        assert plugins.installed().replacer is None
        import json

        assert plugins.installed().elastic_start is json.dumps
        with pytest.raises(ValueError) as refused:
            plugins.require("replacer", "restart_dead_workers")
        self.assertExpectedInline(
            str(refused.value),
            """restart_dead_workers needs no_such_package.healing, which this installation lacks""",
        )

    def test_the_most_capable_of_the_installed_offers_is_used(self) -> None:
        self.features(session=(("no_such_package.stateful", "Session"), ("json", "JSONDecoder")))
        import json

        assert plugins.installed().session is json.JSONDecoder
        self.features(session=(("json", "JSONEncoder"), ("json", "JSONDecoder")))
        assert plugins.installed().session is json.JSONEncoder
        self.features(
            session=(("no_such_package.stateful", "Session"), ("no_such_package.replay", "Session"))
        )
        assert plugins.installed().session is None
        with pytest.raises(ValueError, match=r"^restore\(\) needs no_such_package.replay, which"):
            plugins.require("session", "restore()")

    def test_the_pool_is_on_by_default_only_where_installed_and_the_platform_has_it(self) -> None:
        self.features(tensor_pool=(__name__, "Pool"))
        Pool.reason = None
        assert [plugins.uses_tensor_pool(option) for option in (None, True, False)] == [True, True, False]
        Pool.reason = "the tensor pool needs Linux (os.memfd_create), and this platform is darwin"
        try:
            assert [plugins.uses_tensor_pool(option) for option in (None, False)] == [False, False]
            with pytest.raises(ValueError, match=r"^tensor_pool=True: the tensor pool needs Linux"):
                plugins.uses_tensor_pool(True)
        finally:
            Pool.reason = None
        self.features(tensor_pool=("no_such_package.pool", "TensorPool"))
        assert [plugins.uses_tensor_pool(option) for option in (None, False)] == [False, False]
        with pytest.raises(ValueError, match=r"^tensor_pool=True needs no_such_package.pool, which"):
            plugins.uses_tensor_pool(True)

    def test_a_process_start_of_the_reading_service_is_known_to_its_thread_only(self) -> None:
        seen: List[bool] = []
        assert not plugins.starting_own_process()
        with plugins.own_process_start():
            assert plugins.starting_own_process()
            other = threading.Thread(target=lambda: seen.append(plugins.starting_own_process()))
            other.start()
            other.join(timeout=10)
        assert seen == [False], "another thread's fork is the user's"
        assert not plugins.starting_own_process()
        with pytest.raises(RuntimeError), plugins.own_process_start():
            raise RuntimeError("the start failed")
        assert not plugins.starting_own_process(), "over after a failed start too"


if __name__ == "__main__":
    unittest.main()
