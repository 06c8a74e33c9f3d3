#!/usr/bin/env bash
# Set up the environment and run the demo (extra arguments go to the demo script).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${EXTRAS:-test}" "$root/scripts/setup_env.sh" >/dev/null
exec "${VENV:-$root/.venv}/bin/python" "$root/examples/snapshot_demo.py" "$@"
