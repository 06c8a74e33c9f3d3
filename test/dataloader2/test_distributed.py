"""Inside SequentialReadingService(DistributedReadingService(), ours), on 2 gloo ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

from distributed import run_ranks


def _loader(num_workers: int, n: int, prefetch: int) -> Any:
    from pipelines import rs, tiny
    from torchdata.dataloader2 import DataLoader2, DistributedReadingService, SequentialReadingService

    service = SequentialReadingService(
        DistributedReadingService(),
        rs(num_workers, worker_prefetch_cnt=prefetch, main_prefetch_cnt=prefetch),
    )
    dl = DataLoader2(tiny(n), reading_service=service)
    dl.seed(3)
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
    import torch

    dl = _loader(num_workers=2, n=80, prefetch=10)
    list(dl)  # the first epoch
    it = iter(dl)
    head = [next(it) for _ in range(k)]
    torch.save(dl.state_dict(), f"{path}/rank{rank}.pt")
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
