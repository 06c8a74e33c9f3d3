"""Render the design's diagrams to SVG: ``python docs/diagrams/make_diagrams.py``.

The diagrams are data (``DIAGRAMS``, sequence diagrams of the protocol, ``STRUCTURE``, the
processes with their classes and the messages between them, and ``LAYERS``, the package's
folders in the order they may import one another); the committed SVGs are generated from them,
and tests check that they are up to date and that ``LAYERS`` is the order the code keeps. No
Graphviz or Mermaid needed: plain SVG.
"""

from __future__ import annotations

import html
import sys
from pathlib import Path
from typing import List, Sequence, Tuple

HERE = Path(__file__).resolve().parent

# A diagram: participants, then steps. A step is ("msg", src, dst, label), ("note", text) or
# ("self", who, label) (something a participant does on its own).
Step = Tuple[str, ...]

DIAGRAMS = {
    "snapshot": (
        "snapshot(): the RFC's GetState, answered between two items",
        ["user", "main process", "worker 0", "worker 1"],
        [
            ("msg", "user", "main process", "rs.snapshot()"),
            ("self", "main process", "pause() threaded main-process DataPipes"),
            ("msg", "main process", "worker 0", "GetStateRequest"),
            ("msg", "main process", "worker 1", "GetStateRequest"),
            ("msg", "worker 0", "main process", "ItemsResponse (items produced before)"),
            ("self", "worker 0", "pause threaded DataPipes, capture, resume"),
            ("msg", "worker 0", "main process", "GetStateResponse(WorkerSnapshot)"),
            ("msg", "worker 1", "main process", "GetStateResponse(WorkerSnapshot)"),
            ("note", "items read on the way are buffered: received == produced at each answer"),
            ("self", "main process", "resume() main-process DataPipes"),
            ("msg", "main process", "user", "[WorkerSnapshot, WorkerSnapshot]"),
        ],
    ),
    "restore": (
        "from_state(): restart the epoch with its seeds, each worker replays inside itself",
        ["user", "main process", "worker 0", "worker 1"],
        [
            ("msg", "user", "main process", "DataLoader2.from_state(state, rs); iter(dl)"),
            ("self", "main process", "validate state; start workers; put seeds back"),
            ("msg", "main process", "worker 0", "ResetEpochRequest(epoch, seeds)"),
            ("msg", "main process", "worker 1", "ResetEpochRequest(epoch, seeds)"),
            ("msg", "worker 0", "main process", "ResetEpochResponse"),
            ("msg", "worker 1", "main process", "ResetEpochResponse"),
            ("msg", "main process", "worker 0", "ReplayRequest(skip=D0, digest, state)"),
            ("msg", "main process", "worker 1", "ReplayRequest(skip=D1, digest, state)"),
            ("self", "worker 0", "load state; produce and drop; check running digest"),
            ("msg", "worker 0", "main process", "ReplayResponse"),
            ("msg", "worker 1", "main process", "ReplayResponse"),
            ("msg", "main process", "worker 0", "GetNextRequest(credit)"),
            ("msg", "main process", "worker 1", "GetNextRequest(credit)"),
            ("msg", "worker 0", "main process", "ItemsResponse(items D0+1 ...)"),
            ("msg", "main process", "user", "the item after the last one received"),
        ],
    ),
}

COLUMN_W, ROW_H, TOP, LEFT = 230, 34, 70, 20

# The structure: a process is a box of classes (a class is (name, what it does)); a link is an
# arrow between two processes, labelled with the messages that travel on it.
STRUCTURE = (
    "Processes, classes, messages",
    [
        (
            "main process (training loop)",
            [
                ("DataLoader2", "upstream: iterates, saves, restores"),
                ("MultiProcessingReadingService", "answers DataLoader2's calls"),
                ("Session", "the running graph, the epoch in progress"),
                ("Outlet", "last DataPipe: what the user received"),
                ("UserPositions", "the user's position in each stream"),
                ("Checkpoint", "versioned plain-data state"),
                ("InProcess | WorkerProcesses", "the Runtime: num_workers=0 | > 0"),
                ("PendingRestore", "a restore's plan, for the next epoch"),
                ("ProcessLauncher", "starts, restarts, stops processes"),
                ("WorkerConsumer", "round-robin DataPipe, epochs, control"),
                ("WorkerLinks", "every exchange, bounded waits"),
                ("WorkerRecord (one per worker)", "buffer, counts, credit, digests, states"),
                ("WorkerReplacer", "self-healing: a new worker, same stream"),
                ("DispatcherClient", "control of the dispatching process"),
            ],
        ),
        (
            "worker process (one per worker)",
            [
                ("WorkerLoop (ServingLoop)", "serves requests, produces under credit"),
                ("the replicable graph", "sharded, resumable when it can be"),
                ("Outbox (a thread)", "writes items and answers, in order"),
                ("CapturePacer", "when to capture the graph's state"),
                ("DispatchedSource", "reads the dispatching process"),
            ],
        ),
        (
            "dispatching process (optional)",
            [
                ("DispatcherLoop (ServingLoop)", "sharding_round_robin_dispatch: runs once"),
                ("the non-replicable graph", "deals item j to worker j % N"),
            ],
        ),
    ],
    [
        (0, 1, "ResetEpoch, Replay, GetNext (credit), Pause, Resume, Limit, GetState, Terminate"),
        (1, 0, "Items (+ running digests), StateMark, StopIteration, WorkerException, answers"),
        (0, 2, "ResetEpoch, Pause, Resume, Limit, GetState, Terminate"),
        (2, 1, "Items, StopIteration, WorkerException (GetNext credit from the worker)"),
    ],
)


# The layers of the package, bottom first: (name, the modules and folders in it, what they do).
# A module imports only its own layer and the layers below (test/dataloader2/test_layering.py).
LAYERS = (
    "Layers: each imports only those below it",
    [
        ("the base", ("_errors", "_constants", "_compat", "_worker_snapshot"),
         "exceptions, time bounds, the one door to torchdata's private APIs, WorkerSnapshot"),
        ("the protocol", ("core.messages", "core.options", "core.traversal", "core.graph", "core.catalogue",
                          "core.plugins"),
         "request/response dataclasses, options, traversing and describing a graph, what each DataPipe "
         "type is, plug-ins"),
        ("the transport", ("core.transport", "core.serving"),
         "items pickled one by one, pipes with bounded waits, the outbox, the request table"),
        ("the worker loop", ("core.worker",),
         "the worker and dispatching loops: stream under credit, answer GetState between two items"),
        ("the main process", ("core.main", "core.session", "core.seeding"),
         "the consumer, the outlet, the runtimes and the worker pool, the session"),
        ("the reading service", ("core.reading_service",),
         "MultiProcessingReadingService: DataLoader2's calls, snapshot(); the core ends here"),
        ("the checkpoint", ("checkpoint",),
         "format, identity, digests, replay: the replaying worker loop and session; load_state_dict"),
        ("restores without replay", ("graph_state",),
         "resumable DataPipes and readers, captured graph states: the stateful worker loop and session"),
        ("the optional features", ("elastic", "healing", "tensor_pool"),
         "plug in through core.plugins; nothing outside a feature's folder imports it"),
        ("the package", ("__init__",), "the public names"),
    ],
)  # fmt: skip


def render_layers(title: str, layers: Sequence[Tuple[str, Sequence[str], str]]) -> str:
    """A stack of boxes, the first layer at the bottom, each with its folders and their job."""
    width, row_h, top = 860, 46, 44
    height = top + row_h * len(layers) + 16
    out = svg_start(width, height, title, title_y=24)
    for row, (name, parts, what) in enumerate(reversed(layers)):
        y = top + row * row_h
        out.append(
            f'<rect x="{LEFT}" y="{y}" width="{width - 2 * LEFT}" height="{row_h - 8}" rx="4" '
            'fill="#e8eef7" stroke="#4a6fa5"/>'
        )
        out.append(f'<text x="{LEFT + 10}" y="{y + 16}" font-weight="bold">{html.escape(name)}</text>')
        folders = ", ".join(parts)
        out.append(
            f'<text x="{LEFT + 190}" y="{y + 16}" font-family="monospace">{html.escape(folders)}</text>'
        )
        out.append(
            f'<text x="{LEFT + 190}" y="{y + 31}" font-size="10" fill="#444">{html.escape(what)}</text>'
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def svg_start(width: float, height: float, title: str, title_y: int) -> List[str]:
    """The opening lines of a diagram: canvas, arrow head, white background, centred title."""
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        '<defs><marker id="arrow" markerWidth="10" markerHeight="8" refX="9" refY="4" orient="auto">'
        '<path d="M0,0 L10,4 L0,8 z" fill="#333"/></marker></defs>',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2}" y="{title_y}" text-anchor="middle" font-size="14" font-weight="bold">'
        f"{html.escape(title)}</text>",
    ]


def render_structure(
    title: str,
    processes: Sequence[Tuple[str, Sequence[Tuple[str, str]]]],
    links: Sequence[Tuple[int, int, str]],
) -> str:
    box_w, row_h, gap = 330, 34, 170
    xs = [LEFT + i * (box_w + gap) for i in range(len(processes))]
    heights = [44 + row_h * len(classes) for _, classes in processes]
    width = xs[-1] + box_w + LEFT
    top = 50
    height = top + max(heights) + 40 + 22 * len(links)
    out = svg_start(width, height, title, title_y=24)
    for (name, classes), x, h in zip(processes, xs, heights):
        out.append(
            f'<rect x="{x}" y="{top}" width="{box_w}" height="{h}" rx="6" fill="#f7f7f7" stroke="#666"/>'
        )
        title_at = f'x="{x + box_w / 2}" y="{top + 20}" text-anchor="middle"'
        out.append(f'<text {title_at} font-weight="bold">{html.escape(name)}</text>')
        for row, (cls, what) in enumerate(classes):
            y = top + 34 + row * row_h
            cell = f'x="{x + 10}" y="{y}" width="{box_w - 20}" height="{row_h - 6}" rx="3"'
            out.append(f'<rect {cell} fill="#e8eef7" stroke="#4a6fa5"/>')
            out.append(f'<text x="{x + 18}" y="{y + 12}" font-weight="bold">{html.escape(cls)}</text>')
            out.append(
                f'<text x="{x + 18}" y="{y + 24}" font-size="10" fill="#444">{html.escape(what)}</text>'
            )
    arrows_top = top + max(heights) + 24
    for i, (src, dst, label) in enumerate(links):
        y = arrows_top + 22 * i
        x1 = xs[src] + box_w / 2
        x2 = xs[dst] + box_w / 2
        out.append(f'<line x1="{x1}" y1="{y}" x2="{x2}" y2="{y}" stroke="#333" marker-end="url(#arrow)"/>')
        label_at = f'x="{(x1 + x2) / 2}" y="{y - 4}" text-anchor="middle" font-size="10"'
        out.append(f"<text {label_at}>{html.escape(label)}</text>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def render(title: str, participants: Sequence[str], steps: Sequence[Step]) -> str:
    x = {name: LEFT + COLUMN_W // 2 + i * COLUMN_W for i, name in enumerate(participants)}
    width = LEFT * 2 + COLUMN_W * len(participants)
    height = TOP + ROW_H * (len(steps) + 1) + 20
    out = svg_start(width, height, title, title_y=22)
    for name, cx in x.items():
        out.append(
            f'<rect x="{cx - 75}" y="34" width="150" height="24" rx="4" fill="#e8eef7" stroke="#4a6fa5"/>'
        )
        out.append(f'<text x="{cx}" y="50" text-anchor="middle">{html.escape(name)}</text>')
        out.append(
            f'<line x1="{cx}" y1="58" x2="{cx}" y2="{height - 10}" stroke="#999" stroke-dasharray="4 3"/>'
        )
    for row, step in enumerate(steps, start=1):
        y = TOP + row * ROW_H
        kind = step[0]
        if kind == "msg":
            _, src, dst, label = step
            line = f'x1="{x[src]}" y1="{y}" x2="{x[dst]}" y2="{y}"'
            out.append(f'<line {line} stroke="#333" marker-end="url(#arrow)"/>')
            mid = (x[src] + x[dst]) / 2
            out.append(f'<text x="{mid}" y="{y - 5}" text-anchor="middle">{html.escape(label)}</text>')
        elif kind == "self":
            _, who, label = step
            box = f'x="{x[who] - 6}" y="{y - 10}" width="12" height="16"'
            out.append(f'<rect {box} fill="#f5d48b" stroke="#b58a1b"/>')
            out.append(f'<text x="{x[who] + 12}" y="{y + 3}" font-style="italic">{html.escape(label)}</text>')
        elif kind == "note":
            (_, text) = step
            box = f'x="{LEFT}" y="{y - 13}" width="{width - 2 * LEFT}" height="20"'
            out.append(f'<rect {box} fill="#f3f3f3" stroke="#ccc"/>')
            out.append(f'<text x="{width / 2}" y="{y + 1}" text-anchor="middle">{html.escape(text)}</text>')
        else:
            raise ValueError(f"unknown step kind {kind!r}")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(check: bool = False) -> int:
    stale = []
    svgs = {name: render(*diagram) for name, diagram in DIAGRAMS.items()}
    svgs["structure"] = render_structure(*STRUCTURE)
    svgs["layers"] = render_layers(*LAYERS)
    for name, svg in svgs.items():
        path = HERE / f"{name}.svg"
        if check:
            if not path.exists() or path.read_text() != svg:
                stale.append(path.name)
        else:
            path.write_text(svg)
    if stale:
        print(f"out of date: {', '.join(stale)} (run python docs/diagrams/make_diagrams.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(check="--check" in sys.argv))
