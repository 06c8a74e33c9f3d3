#!/usr/bin/env bash
# Create (or reuse) the environment holding the linters torchdata's CI pins (pyupgrade, ufmt with
# black 21.12b0 and usort 1.0.0, flake8 4.0.1, mypy 1.8.0): the upstream series is formatted and
# checked with them. Its own environment, because black 21.12b0 needs an older click than the
# project's tools.
#
#   UPSTREAM_TOOLS_VENV=.venv-upstream-lint   where it lives (default: in the repository)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${UPSTREAM_TOOLS_VENV:-$root/.venv-upstream-lint}"
requirements="$root/tools/export_upstream/requirements-upstream-lint.txt"
stamp="$venv/.requirements"
if [ -x "$venv/bin/ufmt" ] && cmp -s "$requirements" "$stamp"; then
  exit 0
fi
"${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip --disable-pip-version-check -q install -r "$requirements"
cp "$requirements" "$stamp"
echo "upstream tools ready: $venv"
