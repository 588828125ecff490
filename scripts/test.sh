#!/usr/bin/env bash
# Set up the environment (once) and run the test suite: scripts/test.sh [pytest args]
set -euo pipefail
SLUICE_EXTRA=dev source "$(dirname "$0")/setup_env.sh"
cd "$SLUICE_ROOT"
exec "$SLUICE_PY" -m pytest -q "$@"
