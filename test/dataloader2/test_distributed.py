"""Inside SequentialReadingService(DistributedReadingService(), ours), on 2 gloo ranks; and
``fullsync()`` tails, which need a process group, on one."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
from distributed import run_ranks


def _loader(num_workers: int, n: int, prefetch: int, seed: Optional[int] = 3) -> Any:
    from pipelines import rs, tiny
    from torchdata.dataloader2 import DataLoader2, DistributedReadingService, SequentialReadingService

    service = SequentialReadingService(
        DistributedReadingService(),
        rs(num_workers, worker_prefetch_cnt=prefetch, main_prefetch_cnt=prefetch),
    )
    dl = DataLoader2(tiny(n), reading_service=service)
    if seed is not None:
        dl.seed(seed)
    return dl


def two_epochs(rank: int, world_size: int, num_workers: int) -> Dict[str, Any]:
    dl = _loader(num_workers, n=41, prefetch=10)
    epochs = [list(dl), list(dl)]
    dl.shutdown()
    return {"epochs": epochs}


def break_out_and_shut_down(rank: int, world_size: int) -> List[int]:
    dl = _loader(num_workers=2, n=400, prefetch=10)
    it = iter(dl)
    got = [next(it) for _ in range(5)]
    dl.shutdown()  # with prefetching on, mid-epoch, while fullsync's thread is running
    return got


def test_each_rank_gets_its_shard_and_every_epoch_is_complete(tmp_path: Path) -> None:
    ranks = run_ranks(two_epochs, tmp_path, num_workers=2)
    for epoch in range(2):
        per_rank = [r["epochs"][epoch] for r in ranks]
        assert len(per_rank[0]) == len(per_rank[1]) == 20, "fullsync stops both ranks at the shorter shard"
        assert not set(per_rank[0]) & set(per_rank[1]), "ranks never share an item"
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]


def test_shutdown_mid_epoch_with_prefetching_does_not_hang(tmp_path: Path) -> None:
    got = run_ranks(break_out_and_shut_down, tmp_path)
    assert all(len(g) == 5 for g in got)


def save_mid_epoch(rank: int, world_size: int, path: str, k: int) -> Dict[str, Any]:
    import warnings

    import torch

    dl = _loader(num_workers=2, n=80, prefetch=10)
    list(dl)  # the first epoch
    it = iter(dl)
    head = [next(it) for _ in range(k)]
    with warnings.catch_warnings(record=True) as caught:  # (the filters as they are)
        state = dl.state_dict()
    assert not [w for w in caught if "support `checkpoint`" in str(w.message)], "a complete checkpoint"
    torch.save(state, f"{path}/rank{rank}.pt")
    rest = list(it)
    following = list(dl)
    dl.shutdown()
    return {"head": head, "rest": rest, "following": following}


def resume_mid_epoch(rank: int, world_size: int, path: str) -> Dict[str, Any]:
    import torch
    from pipelines import rs
    from torchdata.dataloader2 import DataLoader2, DistributedReadingService, SequentialReadingService

    state = torch.load(f"{path}/rank{rank}.pt", weights_only=True)
    service = SequentialReadingService(DistributedReadingService(), rs(2))
    dl = DataLoader2.from_state(state, service)
    rest, following = list(dl), list(dl)
    dl.shutdown()
    return {"rest": rest, "following": following}


def test_every_rank_resumes_mid_epoch_exactly(tmp_path: Path) -> None:
    saved = run_ranks(save_mid_epoch, tmp_path, path=str(tmp_path), k=13)
    resumed = run_ranks(resume_mid_epoch, tmp_path, path=str(tmp_path))
    for rank in range(2):
        assert len(saved[rank]["head"]) == 13 and saved[rank]["rest"]
        assert resumed[rank] == {"rest": saved[rank]["rest"], "following": saved[rank]["following"]}
    assert saved[0]["rest"] != saved[1]["rest"], "each rank resumed its own shard"


def unseeded_save_in_the_first_epoch(rank: int, world_size: int, path: str) -> Dict[str, Any]:
    """The script seeds torch, not the loader, as the script that restores it will: both draw
    the same generator at ``iter()``, so the resumed epoch starts from the saved epoch's."""
    import torch

    torch.manual_seed(7)
    dl = _loader(num_workers=2, n=80, prefetch=10, seed=None)
    it = iter(dl)
    head = [next(it) for _ in range(9)]
    torch.save(dl.state_dict(), f"{path}/rank{rank}.pt")
    rest = list(it)
    dl.shutdown()
    return {"head": head, "rest": rest}


def restore_and_maybe_restart(rank: int, world_size: int, path: str, restart: bool) -> List[int]:
    import torch
    from pipelines import rs
    from torchdata.dataloader2 import DataLoader2, DistributedReadingService, SequentialReadingService

    torch.manual_seed(7)
    state = torch.load(f"{path}/rank{rank}.pt", weights_only=True)
    dl = DataLoader2.from_state(state, SequentialReadingService(DistributedReadingService(), rs(2)))
    if restart:
        dl._restore_checkpoint_beginning_of_epoch()
    items = list(dl)
    dl.shutdown()
    return items


def test_an_unseeded_loader_in_fresh_processes_resumes_mid_epoch(tmp_path: Path) -> None:
    saved = run_ranks(unseeded_save_in_the_first_epoch, tmp_path, path=str(tmp_path))
    resumed = run_ranks(restore_and_maybe_restart, tmp_path, path=str(tmp_path), restart=False)
    assert resumed == [saved[rank]["rest"] for rank in range(2)]


def test_restore_checkpoint_beginning_of_epoch_replays_the_saved_epoch_on_every_rank(tmp_path: Path) -> None:
    saved = run_ranks(save_mid_epoch, tmp_path, path=str(tmp_path), k=13)
    restarted = run_ranks(restore_and_maybe_restart, tmp_path, path=str(tmp_path), restart=True)
    assert restarted == [saved[rank]["head"] + saved[rank]["rest"] for rank in range(2)]


def restore_at(rank: int, world_size: int, shape: str, ks: List[int]) -> Dict[str, Any]:
    """An epoch of pipeline ``shape`` with 2 workers, and for each ``k`` of ``ks`` the first ``k``
    items followed by what an exact restore from there delivers."""
    from pipelines import pipeline, rs, take
    from torchdata.dataloader2 import DataLoader2

    def loader() -> Any:
        dl = DataLoader2(pipeline(shape, 40), reading_service=rs(2))
        dl.seed(0)
        return dl

    reference = loader()
    epoch = list(reference)
    reference.shutdown()
    resumed = []
    for k in ks:
        dl = loader()
        head = take(iter(dl), k)
        state = dl.state_dict()
        dl.shutdown()
        restored = DataLoader2.from_state(state, rs(2))
        resumed.append(head + list(restored))
        restored.shutdown()
    return {"epoch": epoch, "resumed": resumed}


def test_a_main_process_map_subclass_that_holds_items_restores_exactly(tmp_path: Path) -> None:
    """``fullsync()`` then a ``Mapper`` subclass handing on its items in swapped pairs: the
    subclass runs in the main process and keeps an item back, so the user's count does not tell
    the workers' positions. Taken for a one-to-one ``map``, the restore repeated one element and
    lost another; the position is replayed in the main process instead."""
    (result,) = run_ranks(restore_at, tmp_path, world_size=1, shape="swapped_pairs_tail", ks=[1, 3])
    assert sorted(result["epoch"]) == sorted(4 * x for x in range(40))
    for k, got in zip([1, 3], result["resumed"]):
        assert got == result["epoch"], f"restored after {k} items"


def elastic_refusal_at(rank: int, world_size: int, shape: str, k: int) -> str:
    """The message refusing to resume pipeline ``shape``, checkpointed with 2 workers after ``k``
    items, with 3 workers and ``elastic=True`` (empty if it resumes)."""
    from pipelines import pipeline, rs, take
    from torchdata.dataloader2 import DataLoader2

    from torchdata_snapshot import IncompatibleCheckpointError

    dl = DataLoader2(pipeline(shape, 40), reading_service=rs(2))
    take(iter(dl), k)
    state = dl.state_dict()
    dl.shutdown()
    restored = DataLoader2.from_state(state, rs(3, elastic=True))
    try:
        iter(restored)
    except IncompatibleCheckpointError as e:
        return str(e)
    finally:
        restored.shutdown()
    return ""


def test_an_elastic_resume_refused_for_a_main_process_filter_names_it_and_why(tmp_path: Path) -> None:
    (refusal,) = run_ranks(elastic_refusal_at, tmp_path, world_size=1, shape="filtering_tail", k=5)
    assert "FilterIterDataPipe" in refusal and "not known to hand on one item per item" in refusal, refusal
    assert "how far the user got into each worker's stream" in refusal, refusal


def _elastic_loader(num_workers: int, n: int, elastic: bool = False, shape: str = "tiny") -> Any:
    from pipelines import pipeline, tiny
    from torchdata.dataloader2 import DataLoader2

    datapipe = tiny(n) if shape == "tiny" else pipeline(shape, n)
    dl = DataLoader2(datapipe, reading_service=_elastic_service(num_workers, elastic))
    dl.seed(5)
    return dl


def _elastic_service(num_workers: int, elastic: bool) -> Any:
    from pipelines import rs
    from torchdata.dataloader2 import DistributedReadingService, SequentialReadingService

    return SequentialReadingService(DistributedReadingService(), rs(num_workers, elastic=elastic))


def save_gathered(rank: int, world_size: int, path: str, n: int, k: int, shape: str) -> Dict[str, Any]:
    """Epoch 0, then ``k`` items of epoch 1: save this rank's state, gathered and not."""
    import torch

    from torchdata_snapshot import gather_elastic_state

    dl = _elastic_loader(2, n, shape=shape)
    list(dl)
    it = iter(dl)
    head = [next(it) for _ in range(k)]
    state = dl.state_dict()
    torch.save(state, f"{path}/own{rank}.pt")
    torch.save(gather_elastic_state(state), f"{path}/gathered{rank}.pt")
    epoch = head + list(it)
    dl.shutdown()
    return {"head": head, "epoch": epoch}


def resume_gathered(rank: int, world_size: int, path: str, old_world_size: int) -> Dict[str, Any]:
    """Resume epoch 1 with ``world_size`` ranks of one worker, from another rank's state."""
    import torch
    from torchdata.dataloader2 import DataLoader2

    from torchdata_snapshot import IncompatibleCheckpointError

    source = (rank + 1) % old_world_size  # any rank's gathered state resumes any new rank
    own = torch.load(f"{path}/own{source}.pt", weights_only=True)
    refused = ""
    dl = DataLoader2.from_state(own, _elastic_service(1, elastic=True))
    try:
        iter(dl)
    except IncompatibleCheckpointError as e:
        refused = str(e)
    finally:
        dl.shutdown()
    gathered = torch.load(f"{path}/gathered{source}.pt", weights_only=True)
    dl = DataLoader2.from_state(gathered, _elastic_service(1, elastic=True))
    it = iter(dl)
    seed = dl.reading_service.reading_services[1].checkpoint()["seed"]
    rest, following = list(it), list(dl)
    dl.shutdown()
    return {"refused": refused, "rest": rest, "following": following, "seed": seed}


def fresh_three_epochs(rank: int, world_size: int, n: int, shape: str) -> Dict[str, Any]:
    dl = _elastic_loader(1, n, shape=shape)
    first = list(dl)
    it = iter(dl)
    seed = dl.reading_service.reading_services[1].checkpoint()["seed"]  # the seeds of epoch 1
    epochs = [first, list(it), list(dl)]
    dl.shutdown()
    return {"epochs": epochs, "seed": seed}


#: The items of an epoch of each shape of ``test_a_gathered_state_resumes_...``, given ``n``.
EPOCH_ITEMS = {
    "tiny": lambda n: [2 * x for x in range(n)],
    "unbatch": lambda n: [*range(n), *range(1000, 1000 + n)],
}


@pytest.mark.parametrize(
    "old, new, n, k, shape", [(2, 3, 84, 6, "tiny"), (3, 2, 84, 6, "tiny"), (2, 4, 84, 6, "unbatch")]
)
def test_a_gathered_state_resumes_with_another_world_size_each_element_once(
    tmp_path: Path, old: int, new: int, n: int, k: int, shape: str
) -> None:
    """2 -> 3, 3 -> 2 and 2 -> 4 ranks, 2 -> 1 workers each: over all new ranks, the rest of the
    epoch holds every item no old rank had delivered, once, with each rank's own seeds; the next
    epoch is a fresh new job's. Through ``flatmap``, each old worker had delivered 1.5 elements:
    the half element's other item comes from a new rank.
    (``n`` and ``k`` leave every shard even, so that fullsync cuts nothing: see the docs.)"""
    saved = run_ranks(save_gathered, tmp_path, world_size=old, path=str(tmp_path), n=n, k=k, shape=shape)
    resumed = run_ranks(resume_gathered, tmp_path, world_size=new, path=str(tmp_path), old_world_size=old)
    fresh = run_ranks(fresh_three_epochs, tmp_path, world_size=new, n=n, shape=shape)
    epoch = sorted(x for r in saved for x in r["epoch"])
    assert epoch == sorted(EPOCH_ITEMS[shape](n)), "the uninterrupted epoch covers every element once"
    delivered = [x for r in saved for x in r["head"]] + [x for r in resumed for x in r["rest"]]
    assert sorted(delivered) == epoch, "each element exactly once over the old and the new ranks"
    assert all(r["following"] == f["epochs"][2] for r, f in zip(resumed, fresh)), (
        "the next epoch: a fresh job's"
    )
    assert all("gather_elastic_state" in r["refused"] for r in resumed), "an ungathered state is refused"
    assert [r["seed"] for r in resumed] == [f["seed"] for f in fresh], (
        "each new rank's workers are seeded as a fresh job's rank, not as the rank whose state it loaded"
    )


def save_own_and_gathered(rank: int, world_size: int, path: str, n: int, k: int) -> Dict[str, Any]:
    """Epoch 0, then ``k`` items of epoch 1 with 2 workers: save this rank's state, gathered and
    not; then the rest of epoch 1 and epoch 2 uninterrupted."""
    import torch

    from torchdata_snapshot import gather_elastic_state

    dl = _elastic_loader(2, n)
    list(dl)
    it = iter(dl)
    for _ in range(k):
        next(it)
    state = dl.state_dict()
    torch.save(state, f"{path}/own{rank}.pt")
    torch.save(gather_elastic_state(state), f"{path}/gathered{rank}.pt")
    rest, following = list(it), list(dl)
    dl.shutdown()
    return {"rest": rest, "following": following}


def resume_every_source(rank: int, world_size: int, path: str, elastic: bool) -> Dict[str, Any]:
    """Load, on this rank of a job of the same layout, every old rank's gathered state, then the
    next rank's own state, as ``load_state_dict`` does: what each resumed, or why it was refused
    (every rank does the same, so that the ranks' collectives stay in step)."""
    import torch

    from torchdata_snapshot import IncompatibleCheckpointError, load_state_dict

    got: Dict[str, Any] = {}
    for name in [f"gathered{source}" for source in range(world_size)] + [f"own{(rank + 1) % world_size}"]:
        dl = _elastic_loader(2, 84, elastic=elastic)
        try:
            load_state_dict(dl, torch.load(f"{path}/{name}.pt", weights_only=True))
            got[name] = {"rest": list(dl), "following": list(dl)}
        except IncompatibleCheckpointError as e:
            got[name] = {"refused": str(e)}
        finally:
            dl.shutdown()
    return got


@pytest.mark.parametrize("world_size, elastic", [(2, True), (3, False)])
def test_any_ranks_gathered_state_resumes_every_rank_of_the_same_world_size_exactly(
    tmp_path: Path, world_size: int, elastic: bool
) -> None:
    """Every rank of the new job loads every old rank's gathered state in turn: each resumes its
    own rest of the epoch and its own next epoch, batch for batch as the uninterrupted run.
    Another rank's state that was not gathered is refused naming both ranks."""
    saved = run_ranks(save_own_and_gathered, tmp_path, world_size=world_size, path=str(tmp_path), n=84, k=5)
    resumed = run_ranks(
        resume_every_source, tmp_path, world_size=world_size, path=str(tmp_path), elastic=elastic
    )
    assert all(saved[rank]["rest"] for rank in range(world_size)), "the epoch was saved mid-way"
    for rank, got in enumerate(resumed):
        for source in range(world_size):
            assert got[f"gathered{source}"] == saved[rank], f"rank {rank} from rank {source}'s gathered state"
        source = (rank + 1) % world_size
        assert (
            f"taken on rank {source} of {world_size}, this is rank {rank}" in got[f"own{source}"]["refused"]
        )
