#!/usr/bin/env bash
# Set up the environment (with the lint tools) and run ruff and mypy as CI does.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="test,lint" "$root/scripts/setup_env.sh" >/dev/null
bin="${VENV:-$root/.venv}/bin"
cd "$root"
dirs=()
for d in torchdata_snapshot test benchmarks examples docs tools; do
  [ -d "$d" ] && dirs+=("$d")
done
"$bin/ruff" check "${dirs[@]}"
"$bin/ruff" format --check "${dirs[@]}"
"$bin/mypy"
