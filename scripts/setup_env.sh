#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install what the commands need.
#
#   VENV=.venv              where the environment lives (default: .venv in the repository)
#   TORCHDATA_VERSION=0.9.0 pin torchdata (any release from 0.7.1 to 0.9.x); default: newest < 0.10
#   EXTRAS=test             which optional dependencies of pyproject.toml to install
#
# torch is installed as 2.13.0 only when the environment has no torch: it is the release the
# suite is tested with, and pinning it keeps the set-up from pulling whatever torch is newest (on
# Linux, a multi-GB CUDA build). Install another torch into the environment first to use it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$root/.venv}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
  "${pip[@]}" install "torch==2.13.0"
fi
torchdata_spec="torchdata>=0.7.1,<0.10"
if [ -n "${TORCHDATA_VERSION:-}" ]; then
  torchdata_spec="torchdata==${TORCHDATA_VERSION}"
fi
"${pip[@]}" install "$torchdata_spec" -e "$root[${EXTRAS:-test}]"
echo "environment ready: $venv ($("$venv/bin/python" -c 'import torch, torchdata; print("torch", torch.__version__, "torchdata", torchdata.__version__)'))"
