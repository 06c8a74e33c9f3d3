"""The optional features plug in: with a feature's folder deleted the package imports and runs,
and only asking for that feature fails, naming the folder (see the docs' design page)."""

from __future__ import annotations

import importlib
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import pytest

import torchdata_snapshot
from torchdata_snapshot.core import plugins

PACKAGE = Path(torchdata_snapshot.__file__).parent

#: The optional features: their folder, and the field of ``Plugins`` each one fills.
FEATURES = {"healing": "replacer"}

#: Run in a fresh process against a copy of the package without some feature folders: a whole
#: epoch through two workers, then each feature option asked for.
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
dp = IterableWrapper(range(20)).sharding_filter().map(operator.neg)
dl = DataLoader2(dp, reading_service=MultiProcessingReadingService(num_workers=2))
print("epoch", sorted(dl) == sorted(-i for i in range(20)))
dl.shutdown()
for option in {options}:
    try:
        MultiProcessingReadingService(num_workers=1, **{{option: 1}})
    except ValueError as e:
        print("refused", option, e)
"""

#: The option that asks for each feature.
OPTIONS = {"healing": "restart_dead_workers"}


def run_without(tmp_path: Path, missing: Sequence[str]) -> str:
    copy = tmp_path / "site" / "torchdata_snapshot"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", *missing))
    code = SCRIPT.format(options=[OPTIONS[folder] for folder in missing])
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
    return done.stdout


@pytest.mark.parametrize("folder", sorted(FEATURES))
def test_without_a_feature_folder_the_package_runs_and_refuses_only_that_feature(
    tmp_path: Path, folder: str
) -> None:
    out = run_without(tmp_path, [folder])
    assert "epoch True" in out
    assert f"'{FEATURES[folder]}'" not in out.splitlines()[0], "the deleted feature is not installed"
    assert f"refused {OPTIONS[folder]} {OPTIONS[folder]} needs torchdata_snapshot.{folder}," in out


def test_without_every_feature_folder_the_package_runs(tmp_path: Path) -> None:
    out = run_without(tmp_path, sorted(FEATURES))
    assert out.splitlines()[0] == "installed []"
    assert "epoch True" in out
    assert out.count("refused") == len(FEATURES)


def test_each_feature_is_found_where_the_core_looks_for_it() -> None:
    for field, (module, name) in plugins.FEATURES.items():
        assert module.split(".")[1] in FEATURES, f"{module} is not an optional folder"
        assert getattr(plugins.installed(), field) is getattr(importlib.import_module(module), name)
