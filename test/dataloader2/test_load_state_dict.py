"""``load_state_dict(dl, state)`` as users resume: a training script saved
``dl.state_dict()`` and a *new process* builds its pipeline from code and loads the state into
it. The pipeline it was built with is the one that runs (the one pickled in the state is not):
the same pipeline continues the uninterrupted run exactly, also from a data directory that was
moved; a change that would change the data is refused, naming it, before any worker starts.

Every resume runs in a fresh Python process (:data:`RESUME`, one per restore), over 0, 1 and 2
workers and the fork and spawn start methods.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import unittest
from pathlib import Path
from typing import Any, Dict, List

import pytest
from conftest import requires_fork
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize

from torchdata_snapshot import ReadingServiceError, load_state_dict

#: The pipeline of the scripts: CSV shards of ``(shard, row)`` records, listed, shuffled and
#: sharded, parsed and batched; ``ROOT`` and ``BATCH`` come from the command line.
PIPELINE = """
import json
import multiprocessing
import sys
import warnings

warnings.filterwarnings("ignore", message=r"(?s).*'dataloader2' modules are deprecated")
warnings.filterwarnings("ignore", message="Please use `InProcessReadingService`")

import torch
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import FileLister

from SERVICE_MODULE import MultiProcessingReadingService, load_state_dict
from ERRORS_MODULE import ReadingServiceError


def record(row):
    return [int(value) for value in row]


def pipeline(root, batch):
    files = FileLister(root, masks="*.csv").shuffle().sharding_filter()
    return files.open_files().parse_csv().map(record).batch(batch)


def reading_service(workers, context):
    return MultiProcessingReadingService(
        num_workers=workers, multiprocessing_context=context
    )
"""

#: Writes the shards into ``data/`` and, for each number of workers, runs two epochs
#: uninterrupted and one taking ``dl.state_dict()`` after ``TAKEN`` batches of epoch 0.
TRAIN = (
    PIPELINE
    + """
import os

os.makedirs("data")
for shard in range(8):
    with open(f"data/shard_{shard:02d}.csv", "w") as f:
        f.writelines(f"{shard},{row}\\n" for row in range(10))
report = {}
for workers in (0, 1, 2):
    dl = DataLoader2(pipeline("data", 4), reading_service=reading_service(workers, "fork"))
    dl.seed(0)
    epochs = [list(dl), list(dl)]
    dl.shutdown()
    dl = DataLoader2(pipeline("data", 4), reading_service=reading_service(workers, "fork"))
    dl.seed(0)
    it = iter(dl)
    head = [next(it) for _ in range(int(sys.argv[1]))]
    torch.save(dl.state_dict(), f"state_{workers}.pt")
    dl.shutdown()
    report[workers] = {"epochs": epochs, "head": head}
print(json.dumps(report))
"""
)

#: Resumes ``STATE`` with the pipeline built on ``ROOT`` with ``BATCH`` and reports the rest of
#: the epoch and the next one, or the refusal: its type, message and cause, where it was raised
#: (by the ``load_state_dict`` call, or by ``iter()``) and how many processes had started.
RESUME = (
    PIPELINE
    + """
state_path, root, context = sys.argv[1], sys.argv[2], sys.argv[5]
batch, workers = int(sys.argv[3]), int(sys.argv[4])
dl = DataLoader2(pipeline(root, batch), reading_service=reading_service(workers, context))
where = "load_state_dict"
try:
    load_state_dict(dl, torch.load(state_path, weights_only=True))
    where = "iter"
    epochs = [list(dl), list(dl)]
    print(json.dumps({"epochs": epochs}))
except ReadingServiceError as e:
    cause = e.__cause__
    print(json.dumps({
        "error": type(e).__name__,
        "message": str(e),
        "cause": None if cause is None else [type(cause).__name__, str(cause)],
        "where": where,
        "children": len(multiprocessing.active_children()),
    }))
finally:
    dl.shutdown()
"""
)

#: Batches of epoch 0 received before the state is taken.
TAKEN = 5

#: How long a script may take (spawned workers import torch).
SCRIPT_LIMIT_S = 240


def run(cwd: Path, script: str, *args: Any) -> Dict[str, Any]:
    """Run ``script`` in a new Python process in ``cwd``; what it printed last, as JSON."""
    path = cwd / "script.py"
    modules = {"SERVICE_MODULE": load_state_dict.__module__, "ERRORS_MODULE": ReadingServiceError.__module__}
    for name, module in modules.items():
        script = script.replace(name, module)
    path.write_text(script)
    done = subprocess.run(
        [sys.executable, str(path), *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=SCRIPT_LIMIT_S,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def job(trained: Dict[str, Any], tmp_path: Path, data: str = "data") -> Path:
    """A resumed job's directory: the training job's data at ``data`` (copied with the files'
    modification times, as a move keeps them) and its states."""
    shutil.copytree(trained["dir"] / "data", tmp_path / data)
    for state in trained["dir"].glob("state_*.pt"):
        shutil.copy(state, tmp_path)
    return tmp_path


def resume(where: Path, root: str, workers: int, context: str = "fork", batch: int = 4) -> Dict[str, Any]:
    return run(where, RESUME, f"state_{workers}.pt", root, batch, workers, context)


def expected(trained: Dict[str, Any], workers: int) -> List[Any]:
    epochs = trained["report"][workers]["epochs"]
    return [epochs[0][TAKEN:], epochs[1]]


#: ``(num_workers, start method)`` of the resumes (the start method means nothing to 0 workers).
LAYOUTS = [(0, "fork"), (1, "fork"), (1, "spawn"), (2, "fork"), (2, "spawn")]


#: Which file is missing: one the user had records of (the restore reads it again: the main
#: process names it before any worker starts), or one the listers had listed before their
#: position but nobody read yet (a worker's lister finds its listing changed).
MISSING = {
    "read": lambda received, listed: min(received),
    "listed": lambda received, listed: min(set(listed) - set(received)),
}


@requires_fork  # the training script runs without a main guard, as many do: its workers are forked
class TestLoadStateDict(SuiteTestCase):
    #: The training job's directory (its data/ and its states, by workers) and its report.
    trained: Dict[str, Any]

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        where = cls.class_directory("train")
        report = run(where, TRAIN, TAKEN)
        cls.trained = {"dir": where, "report": {int(workers): runs for workers, runs in report.items()}}

    @pytest.mark.slow
    @parametrize("workers, context", LAYOUTS)
    def test_the_pipeline_built_again_resumes_the_uninterrupted_run(self, workers: int, context: str) -> None:
        report = self.trained["report"][workers]
        assert report["head"] == report["epochs"][0][:TAKEN], "taking the state changed nothing"
        resumed = resume(job(self.trained, self.tmp_path), "data", workers, context)
        assert resumed == {"epochs": expected(self.trained, workers)}

    @pytest.mark.slow
    @parametrize("workers, context", [(0, "fork"), (1, "fork"), (2, "fork"), (2, "spawn")])
    def test_a_data_directory_that_moved_resumes_there(self, workers: int, context: str) -> None:
        where = job(self.trained, self.tmp_path, data="elsewhere/data")  # the old data/ is not there
        assert not (where / "data").exists()
        resumed = resume(where, "elsewhere/data", workers, context)
        assert resumed == {"epochs": expected(self.trained, workers)}

    @pytest.mark.slow
    @parametrize("workers", [0, 2])
    def test_another_batch_size_is_refused_naming_it_before_any_worker_starts(self, workers: int) -> None:
        refused = resume(job(self.trained, self.tmp_path), "data", workers, batch=8)
        assert refused == {
            "error": "IncompatibleCheckpointError",
            "message": "the checkpoint was taken with other arguments of its DataPipes (DataPipe "
            "0:BatcherIterDataPipe: batch_size was 4 in the checkpoint, is 8 now): restore it with the "
            "arguments it was taken with "
            "(troubleshooting: docs/troubleshooting.rst#incompatiblecheckpointerror)",
            "cause": None,
            "where": "load_state_dict",
            "children": 0,
        }

    @pytest.mark.slow
    @parametrize("missing", sorted(MISSING))
    @parametrize("workers", [0, 1, 2])
    def test_files_missing_where_the_data_moved_are_refused_with_a_typed_error(
        self, workers: int, missing: str
    ) -> None:
        """Every shard was listed before the position (the shuffle holds the whole listing): one
        missing changes what the restore relies on. With workers, the files and listings are checked
        and the refusal is one short message naming the file or the directory, raised in the main
        process (a worker's with its traceback as the cause); ``num_workers=0`` replays in the main
        process, whose check of the data refuses it."""
        where = job(self.trained, self.tmp_path, data="elsewhere/data")
        received = {record[0] for batch in self.trained["report"][workers]["head"] for record in batch}
        shard = MISSING[missing](received, range(8))
        os.remove(where / "elsewhere" / "data" / f"shard_{shard:02d}.csv")
        refused = resume(where, "elsewhere/data", workers)
        assert "\n" not in refused["message"], "one short message"
        if workers == 0:
            assert (refused["error"], refused["cause"]) == ("ReplayDivergenceError", None), refused
        elif missing == "read":
            assert (refused["error"], refused["where"], refused["cause"], refused["children"]) == (
                "ChangedFileError",
                "load_state_dict",
                None,
                0,  # no worker started
            ), refused
            assert f"elsewhere/data/shard_{shard:02d}.csv is missing" in refused["message"]
        else:
            assert (refused["error"], refused["where"]) == ("ChangedFileError", "iter"), refused
            assert refused["message"].startswith(
                "elsewhere/data lists other files than when the state was taken"
            )
            kind, traceback = refused["cause"]
            assert kind == "RemoteTraceback" and "Traceback (most recent call last)" in traceback


instantiate_parametrized_tests(TestLoadStateDict)


if __name__ == "__main__":
    unittest.main()
