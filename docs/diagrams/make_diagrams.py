"""Render the protocol's sequence diagrams to SVG: ``python docs/diagrams/make_diagrams.py``.

The diagrams are data (``DIAGRAMS`` below); the committed SVGs are generated from them, and a
test checks that they are up to date. No Graphviz or Mermaid needed: plain SVG.
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
            ("msg", "main process", "worker 0", "ReplayRequest(skip=D0, mark, state)"),
            ("msg", "main process", "worker 1", "ReplayRequest(skip=D1, mark, state)"),
            ("self", "worker 0", "load state; produce and drop; check mark"),
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


def render(title: str, participants: Sequence[str], steps: Sequence[Step]) -> str:
    x = {name: LEFT + COLUMN_W // 2 + i * COLUMN_W for i, name in enumerate(participants)}
    width = LEFT * 2 + COLUMN_W * len(participants)
    height = TOP + ROW_H * (len(steps) + 1) + 20
    out: List[str] = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        '<defs><marker id="arrow" markerWidth="10" markerHeight="8" refX="9" refY="4" orient="auto">'
        '<path d="M0,0 L10,4 L0,8 z" fill="#333"/></marker></defs>',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="14" font-weight="bold">'
        f"{html.escape(title)}</text>",
    ]
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
    for name, (title, participants, steps) in DIAGRAMS.items():
        path = HERE / f"{name}.svg"
        svg = render(title, participants, steps)
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
