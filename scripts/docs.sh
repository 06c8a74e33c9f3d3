#!/usr/bin/env bash
# Set up the environment (with Sphinx) and build the documentation site into docs/_build/html,
# with warnings as errors and nitpicky cross-references. Extra arguments go to sphinx-build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="test,docs" "$root/scripts/setup_env.sh" >/dev/null
exec "${VENV:-$root/.venv}/bin/python" -m sphinx -W --keep-going -n -b html "$@" "$root/docs" "$root/docs/_build/html"
