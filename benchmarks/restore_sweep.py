"""Restore time over files at evenly spaced positions across the whole epoch, exact and elastic.

    python benchmarks/restore_sweep.py [--positions 12] [--repeats 3] [--out benchmarks/results]

``run.py`` measures a restore at a few chosen positions; a reader's cost depends on where in its
file the position falls, so this sweeps ``--positions`` positions from the epoch's first batch
to its last, for the text and image shards of ``formats``. Each position is restored with 2
workers (exact) and elastically with 3, from ``DataLoader2.from_state()`` to the first item, and
held to the bound a restore over files may take: 1.5 x the exact restore at ``k = 0`` plus the
time to read and process one file. Results go to ``restore_sweep.json`` and ``restore_sweep.md``.

These machines are shared and noisy: read medians, never single runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from functools import partial
from pathlib import Path
from typing import Dict, List

warnings.filterwarnings("ignore")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import RESULTS, one_epoch, one_file_s, restore_time  # noqa: E402
from workloads import RestoreWorkload, restore_workloads  # noqa: E402

STRATEGIES = {"stateful": 2, "elastic 2->3": 3}  # strategy -> workers restored with


def positions(workload: RestoreWorkload, count: int) -> List[int]:
    """``count`` positions from the epoch's first batch to its last, evenly spaced."""
    assert workload.epoch_items is not None
    last = workload.epoch_items // workload.items_per_k - 1
    return sorted({round(i * last / (count - 1)) for i in range(count)})


def sweep(workload: RestoreWorkload, count: int, repeats: int) -> List[Dict]:
    """One row per strategy and position: median restore time, and the bound it is held to."""
    assert workload.epoch_items is not None
    build = partial(one_epoch, workload.build, workload.epoch_items)
    one_file = one_file_s(build, workload.files)
    rows: List[Dict] = []
    for strategy, workers in STRATEGIES.items():
        bound = None
        for k in positions(workload, count):
            samples = [restore_time(build, k, workload.epoch_items, {}, workers)[0] for _ in range(repeats)]
            median = statistics.median(samples)
            if bound is None:
                bound = 1.5 * median + one_file
            row = {"workload": workload.name, "strategy": strategy, "k": k, "median_s": median,
                   "samples": samples, "bound_s": bound, "within": median <= bound}  # fmt: skip
            rows.append(row)
            print(
                f"  {workload.name:12s} {strategy:12s} k={k:>6,}: {median * 1000:7.1f} ms "
                f"(bound {bound * 1000:.1f} ms{'' if row['within'] else ', OVER'})",
                flush=True,
            )
    return rows


def markdown(rows: List[Dict], repeats: int) -> str:
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')}; medians of {repeats} restores; bound = 1.5 x the "
        "restore at k=0 (same strategy) + one file's time.",
        "",
        "| workload | strategy | k | from_state to first item | bound | |",
        "|---|---|---:|---:|---:|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['workload']} | {row['strategy']} | {row['k']:,} | {row['median_s'] * 1000:.1f} ms "
            f"| {row['bound_s'] * 1000:.1f} ms | {'within' if row['within'] else 'OVER'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=12, help="first and last batch included")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=["text_shards", "image_shards"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.positions < 2:
        parser.error("--positions must be at least 2: the epoch's first batch and its last")
    files = {name: w for name, w in restore_workloads(burn_loops=1).items() if w.files}
    unknown = sorted(set(args.workloads) - set(files))
    if unknown:
        parser.error(f"not a workload over files: {', '.join(unknown)} (choose from {', '.join(files)})")
    rows = [row for name in args.workloads for row in sweep(files[name], args.positions, args.repeats)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "restore_sweep.json").write_text(json.dumps(rows, indent=2))
    table = markdown(rows, args.repeats)
    (args.out / "restore_sweep.md").write_text(table)
    print()
    print(table)
    print(f"wrote {args.out / 'restore_sweep.json'}, {args.out / 'restore_sweep.md'}")


if __name__ == "__main__":
    main()
