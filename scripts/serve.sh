#!/usr/bin/env bash
# Start Sluice: scripts/serve.sh [--model DIR] [--endpoint E] [--http-port P] [--pid-file F] [engine options]
# Sets up .venv on first use, prepares the embedded default model when no --model is given,
# then runs the frontend, which spawns the scheduler and prints the ZMQ endpoint, the scheduler pid
# and the HTTP endpoint (OpenAI API, http://127.0.0.1:8000 by default).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/setup_env.sh"
cd "$SLUICE_ROOT"

for arg in "$@"; do  # every option, grouped, with defaults; no torch is imported, so it answers at once
    if [ "$arg" = "--help" ] || [ "$arg" = "-h" ]; then exec "$SLUICE_PY" -m frontend --help; fi
done
model_given=0
for arg in "$@"; do
    case "$arg" in --model|--model=*) model_given=1 ;; esac
done
if [ $model_given = 0 ]; then
    echo "preparing the embedded default model (once; later starts reuse it) ..." >&2
    model=$("$SLUICE_PY" scripts/prepare_default_model.py)
    set -- --model "$model" "$@"
fi
exec "$SLUICE_PY" -m frontend "$@"
