#!/usr/bin/env bash
# Set up the environments and run the whole test suite. Extra arguments go to pytest,
# e.g. `scripts/test.sh --full-matrix` or `scripts/test.sh -k snapshot`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${EXTRAS:-test}" "$root/scripts/setup_env.sh"
# The upstream series' tests format and lint with torchdata's pinned tools (their own venv, about
# 1 GB): built only for a run that selects them (`-m upstream_series`, as .ci/run does).
if [[ " $* " == *upstream_series* ]]; then
    "$root/scripts/setup_upstream_tools.sh"
fi
export UPSTREAM_TOOLS="${UPSTREAM_TOOLS_VENV:-$root/.venv-upstream-lint}/bin"
cd "$root"
# pytest exits with 5 when it collected no test: that is a failure here, never a pass.
exec "${VENV:-$root/.venv}/bin/python" -m pytest "$@"
