"""The checkpoint format: plain data, versioned, validated before use, with a pipeline fingerprint."""

from __future__ import annotations

import io
import pickle
from dataclasses import replace
from typing import Any, Callable, Dict

import pytest
import torch
from pipelines import double, is_even
from torchdata.dataloader2.random import SeedGenerator
from torchdata.datapipes.iter import IterableWrapper

from torchdata_snapshot._checkpoint import (
    FORMAT,
    FORMAT_VERSION,
    Checkpoint,
    WorkerPosition,
    graph_fingerprint,
)
from torchdata_snapshot._errors import IncompatibleCheckpointError, InvalidCheckpointError
from torchdata_snapshot._seeds import seed_state


def example(**changes: Any) -> Checkpoint:
    fields: Dict[str, Any] = dict(
        num_workers=2,
        fingerprint="0123456789abcdef",
        epoch=3,
        status="in_epoch",
        seed=seed_state(SeedGenerator(1)),
        delivered=7,
        workers=(
            WorkerPosition(4, "00ff00ff00ff00ff", (2, b"\x80\x05}.", "0123456789abcdef"), 9),
            WorkerPosition(3, None, None, 6),
        ),
        next_worker=0,
        sharding=(2, 1),
        remaining=((3, 0, 5),),
        ranks=((8, None), (9, 6)),
    )
    fields.update(changes)
    return Checkpoint(**fields)


PLAIN_TYPES = (dict, list, str, bytes, int, bool, type(None))


def assert_plain(value: Any, where: str = "state") -> None:
    assert isinstance(value, PLAIN_TYPES), f"{where} is a {type(value).__name__}"
    if isinstance(value, dict):
        for k, v in value.items():
            assert isinstance(k, str), f"{where} has key {k!r}"
            assert_plain(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            assert_plain(v, f"{where}[{i}]")


def test_the_state_is_plain_data_with_format_and_version() -> None:
    plain = example().to_plain()
    assert_plain(plain)
    assert plain["format"] == FORMAT and plain["version"] == FORMAT_VERSION


def test_round_trip() -> None:
    assert Checkpoint.from_plain(example().to_plain()) == example()


def test_the_state_survives_torch_save_with_weights_only_and_pickle() -> None:
    plain = example().to_plain()
    buffer = io.BytesIO()
    torch.save({"reading_service_state": plain}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["reading_service_state"]
    assert Checkpoint.from_plain(loaded) == example()
    assert Checkpoint.from_plain(pickle.loads(pickle.dumps(plain))) == example()


def corrupt(edit: Callable[[Dict[str, Any]], Any], keep_checksum: bool = False) -> Dict[str, Any]:
    """Edit a valid state; unless ``keep_checksum``, recompute the checksum so that only the
    schema check stands between the edit and use."""
    from torchdata_snapshot._checkpoint import _checksum

    plain = example().to_plain()
    edit(plain)
    if not keep_checksum and "checksum" in plain:
        plain["checksum"] = _checksum(plain)
    return plain


@pytest.mark.parametrize(
    "state, match",
    [
        (b"\x80\x04...", "is bytes, not the plain dict"),
        ([1, 2], "must be a dict, got list"),
        (corrupt(lambda s: s.update(format="something else")), "not a torchdata_snapshot checkpoint"),
        (
            corrupt(lambda s: s.update(version=4)),
            "format version 4; this torchdata_snapshot reads versions 1, 2, 3",
        ),
        (corrupt(lambda s: s.update(version=[1])), "format version \\[1\\]; this torchdata_snapshot"),
        (corrupt(lambda s: s.update(version=True)), "format version True; this torchdata_snapshot"),
        (corrupt(lambda s: s.pop("workers")), "truncated: missing workers"),
        (corrupt(lambda s: s.pop("checksum")), "truncated: missing checksum"),
        (corrupt(lambda s: s.update(extra=1)), "unknown fields: extra"),
        (corrupt(lambda s: s.update(delivered=8), keep_checksum=True), "checksum does not match"),
        (
            corrupt(lambda s: s["workers"][0].update(delivered=-1)),
            "'delivered' of workers\\[0\\] must be a non-negative",
        ),
        (corrupt(lambda s: s["workers"].pop()), "'workers' must list 2 positions"),
        (
            corrupt(lambda s: s["workers"][1].update(digest=[0, "00ff00ff00ff00ff"])),
            "digest of workers\\[1\\]",
        ),
        (corrupt(lambda s: s["workers"][1].update(digest="xyz")), "digest of workers\\[1\\]"),
        (
            corrupt(lambda s: s["workers"][0]["state"].update(digest=7)),
            "digest of the state of workers\\[0\\]",
        ),
        (corrupt(lambda s: s["workers"][0]["state"].update(position=5)), "state of workers\\[0\\] is ahead"),
        (corrupt(lambda s: s["workers"][0].pop("digest")), "workers\\[0\\] must have 'delivered', 'digest'"),
        (corrupt(lambda s: s.update(status="paused")), "'status' must be one of"),
        (corrupt(lambda s: s.update(epoch="3")), "'epoch' must be an int"),
        (corrupt(lambda s: s.update(next_worker=2)), "'next_worker' must be < num_workers"),
        (corrupt(lambda s: s.update(seed=None)), "must record the epoch's seed"),
        (
            corrupt(lambda s: s["seed"]["shared"].update(ctr=[1])),
            "shared.ctr must be a list of 4 32-bit integers",
        ),
        (corrupt(lambda s: s.update(replay_in_main=1)), "'replay_in_main' must be a bool"),
        (
            corrupt(lambda s: s.update(delivered=9)),
            "'delivered' \\(9\\) must be what the workers' streams delivered, 7",
        ),
    ],
)
def test_invalid_states_are_refused_with_the_reason(state: Any, match: str) -> None:
    with pytest.raises(InvalidCheckpointError, match=match):
        Checkpoint.from_plain(state)


def test_a_state_for_another_num_workers_world_size_or_pipeline_does_not_fit() -> None:
    state = example()
    state.check_fits(2, "0123456789abcdef", (2, 0))
    with pytest.raises(
        IncompatibleCheckpointError,
        match="num_workers=2, this reading service has num_workers=4.*elastic=True.* resumes",
    ):
        state.check_fits(4, "0123456789abcdef", (2, 1))
    with pytest.raises(
        IncompatibleCheckpointError, match="world_size=2, this job has world_size=3.*elastic=True"
    ):
        state.check_fits(2, "0123456789abcdef", (3, 1))
    with pytest.raises(IncompatibleCheckpointError, match="another pipeline"):
        state.check_fits(2, "fedcba9876543210", (2, 1))


def build(fn: Any = double) -> Any:
    return IterableWrapper(range(10)).shuffle().sharding_filter().map(fn)


def test_the_fingerprint_follows_the_structure_of_the_pipeline() -> None:
    assert graph_fingerprint(build()) == graph_fingerprint(build())
    assert graph_fingerprint(build()) != graph_fingerprint(build(is_even)), "another map function"
    assert graph_fingerprint(build()) != graph_fingerprint(build().batch(2)), "another DataPipe"
    shorter = IterableWrapper(range(10)).sharding_filter().map(double)
    assert graph_fingerprint(build()) != graph_fingerprint(shorter)
    assert graph_fingerprint(IterableWrapper(range(5))) == graph_fingerprint(IterableWrapper(range(9))), (
        "the data is not part of the structure"
    )


def version_1(plain: Dict[str, Any]) -> Dict[str, Any]:
    """``plain`` as the first format wrote it: one mark (position, item digest) instead of digests."""
    from torchdata_snapshot._checkpoint import _checksum

    dropped = ("digest", "checksum", "sharding", "remaining", "ranks")
    old = {key: value for key, value in plain.items() if key not in dropped}
    old["version"] = 1
    old["mark"] = None
    old["workers"] = [
        {
            "delivered": w["delivered"],
            "mark": [w["delivered"], "00ff00ff00ff00ff"] if w["delivered"] else None,
            "state": None
            if w["state"] is None
            else {"position": w["state"]["position"], "blob": w["state"]["blob"]},
        }
        for w in plain["workers"]
    ]
    old["checksum"] = _checksum(old)
    return old


def test_a_version_1_state_is_upgraded_without_digests() -> None:
    upgraded = Checkpoint.from_plain(version_1(example().to_plain()))
    assert upgraded.digest is None
    assert [w.digest for w in upgraded.workers] == [None, None], "version 1's marks digest one item only"
    assert upgraded.workers[0].state == (2, b"\x80\x05}.", None)
    assert upgraded.delivered == 7 and upgraded.seed == example().seed
    assert upgraded.sharding is None and upgraded.ranks is None and upgraded.remaining == ()
    assert [w.taken for w in upgraded.workers] == [None, None]
    tampered = version_1(example().to_plain())
    tampered["delivered"] = 8
    with pytest.raises(InvalidCheckpointError, match="checksum does not match"):
        Checkpoint.from_plain(tampered)


def version_2(plain: Dict[str, Any]) -> Dict[str, Any]:
    """``plain`` as the second format wrote it: no sharding positions."""
    from torchdata_snapshot._checkpoint import _checksum

    old = {
        key: value
        for key, value in plain.items()
        if key not in ("checksum", "sharding", "remaining", "ranks")
    }
    old["version"] = 2
    old["workers"] = [{key: value for key, value in w.items() if key != "taken"} for w in plain["workers"]]
    old["checksum"] = _checksum(old)
    return old


def test_a_version_2_state_is_upgraded_without_sharding_positions() -> None:
    upgraded = Checkpoint.from_plain(version_2(example().to_plain()))
    assert upgraded.workers == tuple(replace(w, taken=None) for w in example().workers)
    assert upgraded.sharding is None and upgraded.ranks is None and upgraded.remaining == ()
    assert upgraded.digest == example().digest and upgraded.delivered == 7
    upgraded.check_fits(2, "0123456789abcdef", (5, 3)), "the world size of a version-2 state is unknown"
