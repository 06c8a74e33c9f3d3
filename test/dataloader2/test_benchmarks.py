"""The benchmark command runs end to end (a seconds-long smoke run) and writes its reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

RUN = Path(__file__).resolve().parents[2] / "benchmarks" / "run.py"


def test_benchmark_smoke_run_writes_table_and_json(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(RUN), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((tmp_path / "latest.json").read_text())
    rows = results["throughput"]
    assert [(r["num_workers"], r["variant"]) for r in rows] == [
        (0, "default"),
        (0, "read_ahead"),
        (2, "default"),
    ]
    for row in rows:
        assert set(row["median_items_per_s"]) == {
            "ours",
            "upstream_mprs",
            "dataloader",
            "stateful_dataloader",
            "in_process",
        }
        assert row["ratios"]["dataloader"] > 0 and row["ratios"]["in_process"] > 0
    assert rows[0]["median_items_per_s"]["ours"] != rows[1]["median_items_per_s"]["ours"]
    restores = results["restore"]
    assert {r["workload"] for r in restores} >= {"tiny_batched", "1ms_items", "20ms_items", "buffer_10k"}
    assert all(r["ratio_to_k0"] == 1.0 for r in restores if r["k"] == 0)
    elastic = [r for r in restores if r["strategy"] == "elastic 2->3"]
    assert {r["workload"] for r in elastic} == {"tiny_batched", "1ms_items", "text_shards", "image_shards"}
    assert all(r["ratio_to_exact"] > 0 for r in elastic)
    files = [r for r in restores if r["workload"] in ("text_shards", "image_shards")]
    assert all(r["bound_s"] > 0 for r in files), "restores over files are held to their bound, elastic too"
    table = (tmp_path / "latest.md").read_text()
    assert (
        "| tiny | 0 |" in table
        and "| tiny | 0, read_ahead |" in table
        and "| tiny | 2 |" in table
        and "ours.state_dict.tiny" in table
        and "| 20ms_items | stateful |" in table
        and "| tiny_batched | elastic 2->3 | 100 |" in table
        and "| text_shards | elastic 2->3 | 100 |" in table
    )
    assert table.index("| tiny | 2 |") < table.index("| tiny | 0, read_ahead |"), "the default rows first"
    startup = results["startup"]
    assert [(r["workload"], r["epoch"]) for r in startup] == [
        ("upstream_example", 0), ("upstream_example", 1), ("text_shards", 0), ("text_shards", 1),
    ]  # fmt: skip
    assert all(set(r["median_s"]) == {"ours", "upstream_mprs"} for r in startup)
    assert all(r["ratio_to_upstream"] > 0 for r in startup)
    assert "| upstream_example | 0 |" in table and "| text_shards | 1 |" in table
    memory = results["memory"]
    assert memory["state_dict_calls"] == 10 * memory["snapshots"] > 0
    assert len(memory["worker_rss_before_mb"]) == len(memory["worker_rss_after_mb"]) == 4
    assert "`snapshot()` calls (4 workers" in table


def test_a_run_of_some_sections_reports_those_and_leaves_the_readme_alone(tmp_path: Path) -> None:
    run = [sys.executable, str(RUN), "--smoke", "--sections", "startup", "--out", str(tmp_path)]
    refused = subprocess.run([*run, "--update-readme"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--update-readme needs every section" in refused.stderr
    done = subprocess.run(run, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((tmp_path / "latest.json").read_text())
    assert "startup" in results and not {"throughput", "latency", "restore", "memory"} & set(results)
    table = (tmp_path / "latest.md").read_text()
    assert "| start-up (2 workers) |" in table and "| latency" not in table


SWEEP = RUN.with_name("restore_sweep.py")


def test_restore_sweep_runs_from_the_epochs_first_batch_to_its_last(tmp_path: Path) -> None:
    arguments = ["--positions", "2", "--repeats", "1", "--workloads", "image_shards", "--out", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, str(SWEEP), *arguments],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads((tmp_path / "restore_sweep.json").read_text())
    last = 4_000 // 8 - 1  # the image shards' epoch: 4,000 JPEGs in batches of 8
    assert [(r["strategy"], r["k"]) for r in rows] == [
        (strategy, k) for strategy in ("stateful", "elastic 2->3") for k in (0, last)
    ]
    for strategy in ("stateful", "elastic 2->3"):
        own = [r for r in rows if r["strategy"] == strategy]
        assert own[0]["bound_s"] > 1.5 * own[0]["median_s"], "the bound adds one file's time to 1.5 x k=0"
        assert {r["bound_s"] for r in own} == {own[0]["bound_s"]}
        assert all(r["within"] == (r["median_s"] <= r["bound_s"]) for r in own)
    assert "| image_shards | elastic 2->3 | 499 |" in (tmp_path / "restore_sweep.md").read_text()


def test_restore_sweep_refuses_what_it_cannot_measure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(SWEEP.parent))
    import restore_sweep

    refusals = [
        (["--positions", "1"], "--positions must be at least 2"),
        (["--workloads", "tiny_batched"], "not a workload over files: tiny_batched"),
    ]
    for arguments, named in refusals:
        monkeypatch.setattr(sys, "argv", [str(SWEEP), *arguments, "--out", str(tmp_path)])
        with pytest.raises(SystemExit) as exited:
            restore_sweep.main()
        assert exited.value.code == 2 and named in capsys.readouterr().err
    assert not list(tmp_path.iterdir()), "nothing is written when the arguments are refused"
