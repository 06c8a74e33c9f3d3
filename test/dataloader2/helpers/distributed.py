"""Run a function on several ranks of a gloo process group (127.0.0.1), each in a fresh process."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List

RANK_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, out: str, kwargs: Dict[str, Any]
) -> None:
    import torch.distributed as dist

    result: Dict[str, Any]
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        try:
            result = {"ok": fn(rank=rank, world_size=world_size, **kwargs)}
        finally:
            dist.destroy_process_group()
    except BaseException:
        result = {"error": traceback.format_exc()}
    Path(out).write_text(json.dumps(result))
    os._exit(0)  # skip interpreter teardown: a hung atexit must not hang the test


def run_ranks(fn: Callable[..., Any], tmp_path: Path, world_size: int = 2, **kwargs: Any) -> List[Any]:
    """``fn(rank=, world_size=, **kwargs)`` on every rank; returns the JSON-able results by rank.

    Every rank runs in a fresh spawned process; the call fails (and kills what is left) if a
    rank raises or does not finish within ``RANK_TIMEOUT_S``.
    """
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    outs = [str(tmp_path / f"rank{rank}.json") for rank in range(world_size)]
    procs = [
        ctx.Process(target=_rank_main, args=(fn, rank, world_size, port, outs[rank], kwargs))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(RANK_TIMEOUT_S)
        hung = [rank for rank, p in enumerate(procs) if p.exitcode is None]
        assert not hung, f"ranks {hung} did not finish within {RANK_TIMEOUT_S} s"
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
                p.join(10)
    results = [json.loads(Path(out).read_text()) for out in outs]
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, "\n".join(errors)
    return [r["ok"] for r in results]
