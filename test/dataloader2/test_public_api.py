"""The public API changes only on purpose: this list is the contract of `import torchdata_snapshot`."""

from test_public_names import LAYER_NAMES, PUBLIC_NAMES

import torchdata_snapshot

#: The names of test_public_names, plus ProtocolError (public here; not in torchdata's tree) and the
#: elastic names, which the package has whenever its elastic/ folder is there (test_elastic.py).
EXPECTED_PUBLIC_NAMES = sorted(
    [*PUBLIC_NAMES, *LAYER_NAMES, "ProtocolError", "gather_elastic_state", "register_elastic"]
)


def test_all_is_exactly_the_public_api() -> None:
    # Sorted, exported and documented: test_public_names.py; ProtocolError is public here only.
    assert torchdata_snapshot.__all__ == EXPECTED_PUBLIC_NAMES


def test_the_package_says_it_is_typed() -> None:
    from importlib import resources

    assert resources.files("torchdata_snapshot").joinpath("py.typed").is_file()
