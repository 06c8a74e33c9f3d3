"""A pytest plugin (``-p spawn_start``): spawn is multiprocessing's default start method, as on
macOS and Windows, where upstream's CI runs too. The exporter's check runs upstream's tests with it."""

import multiprocessing


def pytest_configure(config: object) -> None:
    multiprocessing.set_start_method("spawn", force=True)
