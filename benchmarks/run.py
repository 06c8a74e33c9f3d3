"""Benchmarks: our MultiProcessingReadingService against its peers, side by side, in one run.

    python benchmarks/run.py [--quick] [--repeats 5] [--workers 0 1 2 4] [--out benchmarks/results]
                             [--update-readme]

For each workload (tiny items, CPU-heavy items, large tensors; text shards and WebDataset-style
image shards, made on the fly: see ``formats``) and worker count, every peer
(upstream MPRS, ours, torch.utils.data.DataLoader, torchdata's StatefulDataLoader, and the
in-process ceiling) runs the same pipeline, in alternation, ``--repeats`` times; the report gives
median items/s and the ratios ours / peer. With ``num_workers=0`` ours runs twice, in its default
mode (each item when the user asks for it) and with ``read_ahead=True``: two rows. Then:
``state_dict()`` and ``snapshot()`` latency while prefetching, restore time against the position
``k`` (relative to ``k = 0``; an elastic restore from 2 to 3 workers also relative to the exact
one at the same ``k``; over files, against the bound 1.5 x ``k = 0`` plus one file's time), the
time from ``iter()`` to the first item of epochs 0 and 1 against upstream's (on upstream's
``train_loop_reading_service.py`` pipeline and on text files), and memory across many
snapshots. ``--sections`` measures some of these only. Results go to ``latest.json``,
``latest.md`` and (with matplotlib) ``latest.png`` in ``--out``.

These machines are shared and noisy: read medians, never single runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import platform
import statistics
import sys
import time
import warnings
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple

warnings.filterwarnings("ignore")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torchdata  # noqa: E402
from peers import IN_PROCESS_ONLY, TENSORS_ONLY, Peer, peers  # noqa: E402
from torchdata.dataloader2 import DataLoader2, InProcessReadingService  # noqa: E402
from torchdata.dataloader2 import MultiProcessingReadingService as UpstreamMPRS  # noqa: E402
from workloads import Workload, calibrate_burn, restore_workloads, startup_workloads, workloads  # noqa: E402

from torchdata_snapshot import MultiProcessingReadingService  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

#: What a run measures, in order (``--sections`` picks some).
SECTIONS = ("throughput", "latency", "restore", "startup", "memory")


def rss_bytes(pid: object = "self") -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def throughput(peer: Peer, workload: Workload, num_workers: int) -> float:
    """Items per second after the first item (workers started, pipeline warm)."""
    items = workload.slow_items if peer.name == "upstream_mprs" else workload.items
    loader = peer.make(workload.build(items), num_workers)
    try:
        it = iter(loader)
        next(it)
        count = 0
        start = time.perf_counter()
        for _ in it:
            count += 1
        return count / (time.perf_counter() - start)
    finally:
        peer.close(loader)
        del loader
        gc.collect()


def run_throughput(
    args: argparse.Namespace, loads: Dict[str, Workload], all_peers: Dict[str, Peer]
) -> List[Dict]:
    rows = []
    for workload in loads.values():
        for num_workers in args.workers:
            measured = [
                p
                for p in all_peers.values()
                if (num_workers == 0 or p.name not in IN_PROCESS_ONLY)
                and (p.name not in TENSORS_ONLY or (num_workers > 0 and workload.item_bytes > 0))
            ]
            samples: Dict[str, List[float]] = {peer.name: [] for peer in measured}
            for _ in range(args.repeats):
                for peer in measured:  # alternate: A B C D, A B C D, ...
                    samples[peer.name].append(throughput(peer, workload, num_workers))
            medians = {name: statistics.median(values) for name, values in samples.items()}
            rows += throughput_rows(workload.name, num_workers, medians, samples, workload.item_bytes)
            print(f"  {workload.name:13s} workers={num_workers}: "
                  + "  ".join(f"{n}={v:,.0f}/s" for n, v in medians.items()), flush=True)  # fmt: skip
    return rows


#: Our variants, each a row of the table (``read_ahead`` where it was measured: ``num_workers=0``;
#: ``no_tensor_pool`` on tensor workloads with workers). The table lists the default rows first.
VARIANTS = {"default": "ours", "read_ahead": "ours_read_ahead", "no_tensor_pool": "ours_no_tensor_pool"}


def throughput_rows(
    workload: str,
    num_workers: int,
    medians: Dict[str, float],
    samples: Dict[str, List[float]],
    item_bytes: int = 0,
) -> List[Dict]:
    """One row per variant of ours that was measured, its median as ``ours`` beside the peers'
    (and, for tensor workloads, ours in GB/s)."""
    others = {name: value for name, value in medians.items() if name not in VARIANTS.values()}
    rows = []
    for variant, name in VARIANTS.items():
        if name in medians:
            rows.append(
                {
                    "workload": workload,
                    "num_workers": num_workers,
                    "variant": variant,
                    "median_items_per_s": {"ours": medians[name], **others},
                    "samples": samples,
                    "ratios": {peer: medians[name] / value for peer, value in others.items()},
                    "ours_gb_per_s": medians[name] * item_bytes / 1e9 if item_bytes else None,
                }
            )
    return rows


def workers_label(row: Dict) -> str:
    """The table's workers cell: ``0, read_ahead`` for that variant (rows of older results have none)."""
    variant = row.get("variant", "default")
    return f"{row['num_workers']}" + ("" if variant == "default" else f", {variant}")


def gb_per_s(row: Dict) -> str:
    """Ours in GB/s, for tensor workloads (rows of older results have none)."""
    value = row.get("ours_gb_per_s")
    return "" if value is None else f"{value:.2f}"


def percentile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_latency(args: argparse.Namespace, loads: Dict[str, Workload], all_peers: Dict[str, Peer]) -> Dict:
    """state_dict() (and snapshot()) latency with 4 workers while prefetching, in ms."""
    out: Dict[str, Any] = {}
    calls = 20 if args.smoke else 300 if args.quick else 1000
    for workload_name in ("tiny",) if args.smoke else ("tiny", "large_tensors"):
        workload = loads[workload_name]
        for peer_name in ("ours", "stateful_dataloader"):
            if peer_name not in all_peers:
                continue
            peer = all_peers[peer_name]
            loader = peer.make(workload.build(10**7), 4)
            try:
                it = iter(loader)
                timings: Dict[str, List[float]] = {"state_dict": [], "snapshot": []}
                for _ in range(calls):
                    for _ in range(3):
                        next(it)
                    start = time.perf_counter()
                    peer.state_dict(loader)  # type: ignore[misc]
                    timings["state_dict"].append((time.perf_counter() - start) * 1e3)
                    if peer_name == "ours":
                        start = time.perf_counter()
                        loader.reading_service.snapshot()
                        timings["snapshot"].append((time.perf_counter() - start) * 1e3)
            finally:
                peer.close(loader)
            for what, values in timings.items():
                if values:
                    key = f"{peer_name}.{what}.{workload_name}"
                    out[key] = {"p50_ms": percentile(values, 0.5), "p99_ms": percentile(values, 0.99)}
                    print(
                        f"  {key}: p50 {out[key]['p50_ms']:.3f} ms  p99 {out[key]['p99_ms']:.3f} ms",
                        flush=True,
                    )
    return out


def restore_time(
    build: Callable[[int], Any], k: int, source_items: int, options: Dict, restore_workers: int = 2
) -> Tuple[float, int]:
    """Seconds from ``DataLoader2.from_state()`` to the first item after position ``k`` (taken
    with 2 workers, restored with ``restore_workers``: elastically if they differ), and the size
    of the reading-service state."""
    dl = DataLoader2(build(source_items), reading_service=MultiProcessingReadingService(2, **options))
    dl.seed(0)
    it = iter(dl)
    for _ in range(k):
        next(it)
    state = dl.state_dict()
    size = len(pickle.dumps(state["reading_service_state"]))
    dl.shutdown()
    start = time.perf_counter()
    elastic = restore_workers != 2
    again = DataLoader2.from_state(
        state, MultiProcessingReadingService(restore_workers, elastic=elastic, **options)
    )
    next(iter(again))
    elapsed = time.perf_counter() - start
    again.shutdown()
    return elapsed, size


def one_epoch(build: Callable[[int], Any], epoch_items: int, source_items: int) -> Any:
    """A pipeline over files: one epoch of ``epoch_items`` records, whatever was asked."""
    return build(epoch_items)


def one_file_s(build: Callable[[int], Any], files: int) -> float:
    """Seconds the pipeline takes to read and process one file, on average (the whole epoch in
    this process, divided by the number of files): the bound a restore may add to ``k = 0``."""
    dl = DataLoader2(build(0), reading_service=InProcessReadingService())
    start = time.perf_counter()
    for _ in dl:
        pass
    elapsed = time.perf_counter() - start
    dl.shutdown()
    return elapsed / files


def run_restore(args: argparse.Namespace, burn_loops: int) -> List[Dict]:
    """Restore time against the position ``k``, relative to restoring at ``k = 0``: from
    captured states for several pipelines (early positions, slow items, a large shuffle buffer),
    by replay for tiny items (which grows with ``k``), and elastically from 2 to 3 workers
    (relative to the exact restore at the same ``k`` too; for files, against the same bound as
    the exact restore: a new worker reads at most the file it resumes in again)."""
    cases: List[Tuple[str, str, Callable[[int], Any], int, Sequence[int], Dict]] = []
    elastic_cases = []
    per_file: Dict[str, float] = {}
    for w in restore_workloads(burn_loops).values():
        ks = (0, 100) if args.smoke else w.quick_ks if args.quick else w.ks
        build = w.build if w.epoch_items is None else partial(one_epoch, w.build, w.epoch_items)
        cases.append((w.name, "stateful", build, w.items_per_k, ks, {}))
        if w.files:
            per_file[w.name] = one_file_s(build, w.files)
        if w.name in ("tiny_batched", "1ms_items") or w.files:
            elastic_cases.append((w.name, "elastic 2->3", build, w.items_per_k, ks, {}))
    cases += elastic_cases
    tiny = workloads(1)["tiny"]
    replay_ks = (
        (0, 100) if args.smoke else (0, 10**3, 10**5) if args.quick else (0, 10**3, 10**4, 10**5, 10**6)
    )
    cases.append(("tiny", "replay", tiny.build, 1, replay_ks, {"stateful": False}))
    repeats = 1 if args.smoke else 3 if args.quick else args.repeats
    rows: List[Dict] = []
    for name, strategy, build, per_k, ks, options in cases:
        base = None
        elastic = strategy.startswith("elastic")
        for k in ks:
            source_items = 2 * k * per_k + 20_000  # beyond k, whatever the sharding and buffers
            samples, size = [], 0
            for _ in range(repeats):
                elapsed, size = restore_time(build, k, source_items, options, 3 if elastic else 2)
                samples.append(elapsed)
            median = statistics.median(samples)
            base = median if base is None else base
            row = {"workload": name, "strategy": strategy, "k": k, "median_s": median,
                   "ratio_to_k0": median / base, "samples": samples, "state_bytes": size}  # fmt: skip
            if name in per_file:  # files: restore(k) <= 1.5 x restore(0) + one file's time
                row["bound_s"] = 1.5 * base + per_file[name]
            exact = [r for r in rows if (r["workload"], r["strategy"], r["k"]) == (name, "stateful", k)]
            if elastic and exact:
                row["ratio_to_exact"] = median / exact[0]["median_s"]
            rows.append(row)
            versus = f", {row['ratio_to_exact']:.2f}x exact" if "ratio_to_exact" in row else ""
            if "bound_s" in row:
                versus += f", bound {row['bound_s'] * 1000:.1f} ms"
            print(
                f"  restore {name:12s} {strategy:12s} k={k:>9,}: {median * 1000:7.1f} ms "
                f"({median / base:.2f}x k=0{versus}), reading-service state {size:,} bytes",
                flush=True,
            )
    return rows


#: The reading services whose epoch start is compared, with 2 workers and their default options.
STARTUP_PEERS: Dict[str, Callable[[], Any]] = {
    "ours": lambda: MultiProcessingReadingService(num_workers=2),
    "upstream_mprs": lambda: UpstreamMPRS(num_workers=2),
}


def startup_times(build: Callable[[], Any], make_rs: Callable[[], Any]) -> List[float]:
    """Seconds from ``iter()`` to the first item in epochs 0 (the workers start) and 1 (they
    reset), on a new ``DataLoader2`` seeded per epoch as upstream's example is."""
    dl = DataLoader2(build(), reading_service=make_rs())
    times = []
    try:
        for epoch in range(2):
            torch.manual_seed(epoch)
            start = time.perf_counter()
            it = iter(dl)
            next(it)
            times.append(time.perf_counter() - start)
            for _ in it:
                pass
    finally:
        dl.shutdown()
    return times


def run_startup(args: argparse.Namespace) -> List[Dict]:
    """Time to the first item of epochs 0 and 1, ours against upstream's, in alternation."""
    repeats = 1 if args.smoke else max(3, args.repeats)  # medians of 3 at least
    rows = []
    for load in startup_workloads(args.smoke).values():
        samples: Dict[str, List[List[float]]] = {name: [] for name in STARTUP_PEERS}
        for _ in range(repeats):
            for name, make_rs in STARTUP_PEERS.items():
                samples[name].append(startup_times(load.build, make_rs))
        for epoch in range(2):
            medians = {name: statistics.median(s[epoch] for s in runs) for name, runs in samples.items()}
            row = {"workload": load.name, "epoch": epoch, "median_s": medians, "repeats": repeats,
                   "ratio_to_upstream": medians["ours"] / medians["upstream_mprs"]}  # fmt: skip
            rows.append(row)
            print(
                f"  start-up {load.name:16s} epoch {epoch}: ours {medians['ours']:.2f} s, "
                f"upstream {medians['upstream_mprs']:.2f} s ({row['ratio_to_upstream']:.2f}x)",
                flush=True,
            )
    return rows


def run_memory(args: argparse.Namespace, loads: Dict[str, Workload]) -> Dict:
    """RSS of the main process and of every worker across ``calls`` ``state_dict()`` calls (one per
    item) and ``calls / 10`` full ``snapshot()`` calls, after as many to warm up (a worker's RSS
    grows over its first ~10^5 items as the allocator settles, then stays flat)."""
    calls = 1_000 if args.smoke else 20_000 if args.quick else 100_000

    def run(count: int) -> None:
        for i in range(count):
            next(it)
            dl.state_dict()
            if i % 10 == 0:
                dl.reading_service.snapshot()

    dl = DataLoader2(loads["tiny"].build(10**7), reading_service=MultiProcessingReadingService(num_workers=4))
    try:
        it = iter(dl)
        run(calls)
        pids = [s.pid for s in dl.reading_service.snapshot()]
        gc.collect()
        before = [rss_bytes(), *map(rss_bytes, pids)]
        run(calls)
        gc.collect()
        after = [rss_bytes(), *map(rss_bytes, pids)]
    finally:
        dl.shutdown()
    mb = [[value / 2**20 for value in values] for values in (before, after)]
    result = {
        "state_dict_calls": calls,
        "snapshots": calls // 10,
        "rss_before_mb": mb[0][0],
        "rss_after_mb": mb[1][0],
        "worker_rss_before_mb": mb[0][1:],
        "worker_rss_after_mb": mb[1][1:],
    }
    growth = max(a - b for a, b in zip(mb[1][1:], mb[0][1:]))
    print(
        f"  memory: {calls} state_dict(), {calls // 10} snapshot(): main RSS {mb[0][0]:.1f} -> "
        f"{mb[1][0]:.1f} MB, workers grew {growth:+.1f} MB at most",
        flush=True,
    )
    return result


THROUGHPUT_HEADER = [
    "| workload | workers | ours items/s | upstream MPRS | DataLoader | StatefulDataLoader "
    "| in-process (ceiling) | ours/upstream | ours/DataLoader | ours/StatefulDataLoader "
    "| ours/ceiling | ours GB/s |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
]


def throughput_line(row: Dict) -> str:
    nan = float("nan")
    m, r = row["median_items_per_s"], row["ratios"]
    return (
        f"| {row['workload']} | {workers_label(row)} | {m['ours']:,.0f} | {m['upstream_mprs']:,.0f} "
        f"| {m['dataloader']:,.0f} | {m.get('stateful_dataloader', nan):,.0f} "
        f"| {m.get('in_process', nan):,.0f} | {r['upstream_mprs']:.1f}x | {r['dataloader']:.2f}x "
        f"| {r.get('stateful_dataloader', nan):.2f}x | {r.get('in_process', nan):.2f}x "
        f"| {gb_per_s(row)} |"
    )


def throughput_lines(rows: List[Dict]) -> List[str]:
    """What the default options give first, then the rows of options set."""
    default = [row for row in rows if row.get("variant", "default") == "default"]
    options = [row for row in rows if row.get("variant", "default") != "default"]
    lines = ["Default options (the tensor pool on, where the platform has it):", "", *THROUGHPUT_HEADER]
    lines += map(throughput_line, default)
    if options:
        lines += ["", "With an option set (`read_ahead=True`; `tensor_pool=False`):", "", *THROUGHPUT_HEADER]
        lines += map(throughput_line, options)
    return lines


def latency_lines(latency: Dict) -> List[str]:
    lines = ["| latency (4 workers, prefetching) | p50 | p99 |", "|---|---:|---:|"]
    for key, value in latency.items():
        lines.append(f"| {key} | {value['p50_ms']:.3f} ms | {value['p99_ms']:.3f} ms |")
    return lines


def restore_lines(rows: List[Dict]) -> List[str]:
    lines = [
        "| restore (2 workers) | strategy | k | from_state to first item | vs k=0 | vs exact, or bound "
        "| reading-service state |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        versus = f"{row['ratio_to_exact']:.2f}x" if "ratio_to_exact" in row else ""
        if "bound_s" in row:
            within = "within" if row["median_s"] <= row["bound_s"] else "OVER"
            versus = f"{within} bound {row['bound_s'] * 1000:.1f} ms"
        lines.append(
            f"| {row['workload']} | {row['strategy']} | {row['k']:,} | {row['median_s'] * 1000:.1f} ms "
            f"| {row['ratio_to_k0']:.2f}x | {versus} | {row['state_bytes']:,} B |"
        )
    return lines


def startup_lines(rows: List[Dict]) -> List[str]:
    lines = [
        "| start-up (2 workers) | epoch | iter() to first item, ours | upstream MPRS | ours / upstream |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        m = row["median_s"]
        lines.append(
            f"| {row['workload']} | {row['epoch']} | {m['ours']:.2f} s | {m['upstream_mprs']:.2f} s "
            f"| {row['ratio_to_upstream']:.2f}x |"
        )
    return lines


def memory_lines(mem: Dict) -> List[str]:
    workers = zip(mem["worker_rss_before_mb"], mem["worker_rss_after_mb"])
    return [
        f"Memory over {mem['state_dict_calls']:,} `state_dict()` and {mem['snapshots']:,} `snapshot()` "
        f"calls (4 workers, after as many to warm up): main-process RSS {mem['rss_before_mb']:.1f} MB "
        f"-> {mem['rss_after_mb']:.1f} MB; workers "
        + ", ".join(f"{b:.1f} -> {a:.1f} MB" for b, a in workers)
        + ".",
    ]


#: The report's part for each section measured, in order.
SECTION_LINES: Dict[str, Callable[[Any], List[str]]] = {
    "throughput": throughput_lines,
    "latency": latency_lines,
    "restore": restore_lines,
    "startup": startup_lines,
    "memory": memory_lines,
}


def markdown(results: Dict) -> str:
    """The report: each section measured, in order (the throughput's default options first)."""
    lines = [
        f"Measured {results['date']} on {results['machine']} (torch {results['torch']}, "
        f"torchdata {results['torchdata']}); medians of {results['repeats']} runs.",
    ]
    for section, section_lines in SECTION_LINES.items():
        if section in results:
            lines += ["", *section_lines(results[section])]
    return "\n".join(lines) + "\n"


def plot(results: Dict, path: Path) -> bool:
    if "throughput" not in results:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = ["ours", "upstream_mprs", "dataloader", "stateful_dataloader", "in_process"]
    loads = sorted({row["workload"] for row in results["throughput"]})
    fig, axes = plt.subplots(1, len(loads), figsize=(5 * len(loads), 4))
    for ax, load in zip(axes if len(loads) > 1 else [axes], loads):
        rows = [row for row in results["throughput"] if row["workload"] == load]
        width = 0.16
        for i, name in enumerate(names):
            xs = [j + i * width for j in range(len(rows))]
            ys = [row["median_items_per_s"].get(name, 0) for row in rows]
            ax.bar(xs, ys, width, label=name)
        ax.set_xticks([j + 2 * width for j in range(len(rows))])
        ax.set_xticklabels([f"{workers_label(row)} workers" for row in rows])
        ax.set_yscale("log")
        ax.set_title(load)
        ax.set_ylabel("items/s (median)")
    axes_list = axes if len(loads) > 1 else [axes]
    axes_list[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def update_readme(table: str) -> None:
    readme = Path(__file__).resolve().parent.parent / "README.md"
    text = readme.read_text()
    begin, end = "<!-- benchmark-table:begin -->", "<!-- benchmark-table:end -->"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        readme.write_text(f"{head}{begin}\n{table}{end}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer items and repeats")
    parser.add_argument("--smoke", action="store_true", help="seconds-long run that only checks the plumbing")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--workloads", nargs="+", default=list(workloads(1)))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--update-readme", action="store_true", help="write the table into README.md")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS),
                        help="measure only these (the report lists the others as not measured)")  # fmt: skip
    args = parser.parse_args()
    if args.update_readme and set(args.sections) != set(SECTIONS):
        parser.error("--update-readme needs every section: the README's table is a whole run's")
    if args.smoke:
        args.quick = True
        args.repeats, args.workers, args.workloads = 1, [0, 2], ["tiny"]
    if args.quick:
        args.repeats = min(args.repeats, 2)
    burn_loops = calibrate_burn()
    loads = {name: w for name, w in workloads(burn_loops).items() if name in args.workloads}
    if args.quick:
        scale = 100 if args.smoke else 10
        loads = {name: replace(w, items=w.items // scale, slow_items=w.slow_items // scale)
                 for name, w in loads.items()}  # fmt: skip
    all_peers = peers()
    results: Dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "torch": torch.__version__,
        "torchdata": torchdata.__version__,
        "repeats": args.repeats,
        "workloads": {name: w.description for name, w in loads.items()},
    }
    measure: Dict[str, Callable[[], Any]] = {
        "throughput": lambda: run_throughput(args, loads, all_peers),
        "latency": lambda: run_latency(args, workloads(1), all_peers),
        "restore": lambda: run_restore(args, burn_loops),
        "startup": lambda: run_startup(args),
        "memory": lambda: run_memory(args, workloads(1)),
    }
    for section in args.sections:
        print(f"{section}:", flush=True)
        results[section] = measure[section]()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latest.json").write_text(json.dumps(results, indent=2))
    table = markdown(results)
    (args.out / "latest.md").write_text(table)
    plotted = plot(results, args.out / "latest.png")
    print()
    print(table)
    print(f"wrote {args.out / 'latest.json'}, {args.out / 'latest.md'}" + (", latest.png" if plotted else ""))
    if args.update_readme:
        update_readme(table)


if __name__ == "__main__":
    main()
