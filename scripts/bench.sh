#!/usr/bin/env bash
# Set up the environment (with matplotlib) and run the benchmarks; extra arguments go to
# benchmarks/run.py (e.g. --quick, --repeats 7, --update-readme).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="test,bench" "$root/scripts/setup_env.sh" >/dev/null
exec "${VENV:-$root/.venv}/bin/python" "$root/benchmarks/run.py" "$@"
