#!/usr/bin/env bash
# Set up the environment and run the demo: a 4-worker pipeline is checkpointed mid-epoch, the
# process is killed (SIGKILL), a new process resumes, and the result is checked against an
# uninterrupted run. Extra arguments go to examples/resume_demo.py.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${EXTRAS:-test}" "$root/scripts/setup_env.sh" >/dev/null
exec "${VENV:-$root/.venv}/bin/python" "$root/examples/resume_demo.py" "$@"
