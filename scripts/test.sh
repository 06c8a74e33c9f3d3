#!/usr/bin/env bash
# Set up the environment and run the whole test suite. Extra arguments go to pytest,
# e.g. `scripts/test.sh --full-matrix` or `scripts/test.sh -k snapshot`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${EXTRAS:-test}" "$root/scripts/setup_env.sh"
cd "$root"
# pytest exits with 5 when it collected no test: that is a failure here, never a pass.
exec "${VENV:-$root/.venv}/bin/python" -m pytest "$@"
