#!/usr/bin/env bash
# Chaos runs (docs/reliability.rst): 20 workers SIGKILLed at random moments under a 4-worker,
# multi-epoch job with restart_dead_workers, then 20 training processes SIGKILLed at random steps
# and resumed from their last checkpoint. Every batch is compared with an uninterrupted run; the
# summary ends in "chaos: passed" (exit code 0). Extra arguments go to scripts/chaos.py, e.g.
# --start-method forkserver, --kills 100, --seed 1234 (printed by every run, to replay a schedule).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${EXTRAS:-test}" "$root/scripts/setup_env.sh" >/dev/null
exec "${VENV:-$root/.venv}/bin/python" "$root/scripts/chaos.py" all "$@"
