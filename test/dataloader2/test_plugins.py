"""What is beyond the core plugs in: with an optional feature's folder deleted the package imports
and runs (an epoch, a mid-epoch checkpoint and its exact resume), and only asking for that feature
fails, naming the folder; without restores from captured states it resumes by replay; without the
checkpoint either, it streams and snapshots, and a restored loader starts its epoch over, as
torchdata's own reading service (see the docs' design page)."""

from __future__ import annotations

import importlib
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence

import pytest

import torchdata_snapshot
from torchdata_snapshot.core import plugins

PACKAGE = Path(torchdata_snapshot.__file__).parent

#: The optional features: their folder -> the fields of ``Plugins`` it fills.
FEATURES: Dict[str, List[str]] = {
    "elastic": ["elastic_start", "elastic_worker"],
    "healing": ["replacer"],
    "tensor_pool": ["tensor_pool"],
}
#: The layers above the core: their folder -> the fields of ``Plugins`` it fills (each extends
#: the one below it: the most capable installed is used).
LAYERS: Dict[str, List[str]] = {
    "checkpoint": ["session", "worker_loop"],
    "graph_state": ["session", "worker_loop"],
}

#: The option of the reading service that asks for each feature, and a value that does.
OPTIONS = {
    "elastic": "elastic",
    "graph_state": "stateful",
    "healing": "restart_dead_workers",
    "tensor_pool": "tensor_pool",
}
VALUES = {"elastic": True, "restart_dead_workers": 1, "stateful": True, "tensor_pool": True}

#: Run in a fresh process against a copy of the package without some feature folders: a whole
#: epoch through two workers, a checkpoint after 7 items resumed in a new DataLoader2, then each
#: missing feature's option asked for.
SCRIPT = """
import operator, sys, warnings
warnings.simplefilter("ignore")
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper
import torchdata_snapshot
from torchdata_snapshot import MultiProcessingReadingService
from torchdata_snapshot.core.plugins import installed

assert torchdata_snapshot.__file__.startswith(sys.argv[1]), torchdata_snapshot.__file__
print("installed", sorted(k for k, v in vars(installed()).items() if v is not None))
runs = (getattr(installed(), field) for field in ("session", "worker_loop"))
print("runs", *(getattr(runs_class, "__name__", None) for runs_class in runs))
dp = IterableWrapper(range(20)).shuffle().sharding_filter().map(operator.neg)

def loader():
    dl = DataLoader2(dp, reading_service=MultiProcessingReadingService(num_workers=2))
    dl.seed(3)
    return dl

dl = loader()
reference = list(dl)
print("epoch", sorted(reference) == sorted(-i for i in range(20)))
dl.shutdown()
dl = loader()
it = iter(dl)
head = [next(it) for _ in range(7)]
state = dl.state_dict()
dl.shutdown()
resumed = DataLoader2.from_state(state, MultiProcessingReadingService(num_workers=2))
rest = list(resumed)
print("resume", head + rest == reference, "restart" if sorted(rest) == sorted(reference) else "")
resumed.shutdown()
print("elastic names", hasattr(torchdata_snapshot, "register_elastic"))
from torchdata_snapshot.core.plugins import uses_tensor_pool
print("pool by default", uses_tensor_pool(None), uses_tensor_pool(False))
for option, value in {options}:
    try:
        MultiProcessingReadingService(num_workers=1, **{{option: value}})
    except ValueError as e:
        print("refused", option, e)
"""


def run_without(tmp_path: Path, missing: Sequence[str]) -> List[str]:
    """The script's lines, run against a copy of the package without the folders ``missing``."""
    copy = tmp_path / "site" / "torchdata_snapshot"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", *missing))
    asked = [OPTIONS[folder] for folder in missing if folder in OPTIONS]
    code = SCRIPT.format(options=[(option, VALUES[option]) for option in asked])
    # -S: no site hooks, so no editable install's finder hands out the repository's modules;
    # the copy and then the site directories (torch, torchdata) are the whole path.
    path = os.pathsep.join([str(copy.parent), *site.getsitepackages()])
    done = subprocess.run(
        [sys.executable, "-S", "-c", code, str(copy)],
        cwd=tmp_path,
        env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


@pytest.mark.parametrize("folder", sorted(FEATURES))
def test_without_a_feature_folder_the_package_runs_and_refuses_only_that_feature(
    tmp_path: Path, folder: str
) -> None:
    out = run_without(tmp_path, [folder])
    kept = sorted(
        {field for other, fields in {**FEATURES, **LAYERS}.items() if other != folder for field in fields}
    )
    assert out[:4] == [f"installed {kept}", RUNS_STATEFUL, "epoch True", "resume True "]
    assert out[4] == f"elastic names {folder != 'elastic'}"
    # The pool is on by default where it can be: without its folder the default quietly means off.
    assert out[5] == f"pool by default {folder != 'tensor_pool'} False"
    assert len(out) == 7 and out[6].startswith(f"refused {OPTIONS[folder]} "), out
    ((module, _),) = plugins.FEATURES[FEATURES[folder][0]]
    assert module.startswith(f"torchdata_snapshot.{folder}.")
    assert out[6].endswith(f" needs {module}, which this installation lacks"), out[6]


RUNS_STATEFUL = "runs StatefulSession StatefulWorkerLoop"


def test_without_every_feature_folder_the_package_runs(tmp_path: Path) -> None:
    out = run_without(tmp_path, sorted(FEATURES))
    assert out[:5] == [
        "installed ['session', 'worker_loop']",
        RUNS_STATEFUL,
        "epoch True",
        "resume True ",
        "elastic names False",
    ]
    assert out[5] == "pool by default False False"
    assert [line.split()[1] for line in out[6:]] == [OPTIONS[folder] for folder in sorted(FEATURES)]


def test_without_restores_from_captured_states_a_checkpoint_resumes_by_replay(tmp_path: Path) -> None:
    """Elastic resume works on the graph's captured states: it goes with them."""
    out = run_without(tmp_path, ["elastic", "graph_state"])
    assert out[:4] == [
        "installed ['replacer', 'session', 'tensor_pool', 'worker_loop']",
        "runs CheckpointSession ReplayingWorkerLoop",
        "epoch True",
        "resume True ",
    ]
    assert out[-1] == (
        "refused stateful stateful=True needs torchdata_snapshot.graph_state.worker_loop, which this "
        "installation lacks"
    )


def test_without_the_checkpoint_the_core_streams_and_a_restore_starts_the_epoch_over(tmp_path: Path) -> None:
    """Self-healing replays a dead worker's stream: it goes with the checkpoint."""
    out = run_without(tmp_path, ["checkpoint", "elastic", "graph_state", "healing"])
    assert out[:4] == ["installed ['tensor_pool']", "runs None None", "epoch True", "resume False restart"]
    assert out[4:6] == ["elastic names False", "pool by default True False"]


def test_each_feature_and_layer_is_found_where_the_core_looks_for_it() -> None:
    found = {**FEATURES, **LAYERS}
    assert sorted(plugins.FEATURES) == sorted({field for fields in found.values() for field in fields})
    for field, offers in plugins.FEATURES.items():
        for module, _ in offers:
            assert field in found[module.split(".")[1]], f"{module} is not the folder of {field}"
        module, name = offers[0]
        assert getattr(plugins.installed(), field) is getattr(importlib.import_module(module), name)
