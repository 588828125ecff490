#!/usr/bin/env bash
# Set up the environment (once) and run the test suite: scripts/test.sh [pytest args]
set -euo pipefail
source "$(dirname "$0")/setup_env.sh" dev
cd "$SLUICE_ROOT"
exec "$SLUICE_PY" -m pytest -q "$@"
