#!/usr/bin/env bash
# Start Sluice: scripts/serve.sh [--model DIR] [--endpoint E] [--http-port P] [--pid-file F] [engine options]
# Sets up .venv on first use, prepares the embedded default model when no --model is given,
# then runs the frontend, which spawns the scheduler and prints the ZMQ endpoint, the scheduler pid
# and the HTTP endpoint (OpenAI API, http://127.0.0.1:8000 by default).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/setup_env.sh"
cd "$SLUICE_ROOT"

print_help() {
    "$SLUICE_PY" -m frontend --help
    echo
    echo "engine options (passed through to the scheduler):"
    "$SLUICE_PY" -m scheduler --help | sed -n '/^options:/,$p' | tail -n +2 \
        | grep -v -e '-h, --help' -e '--frontend-to-scheduler' -e '--scheduler-to-frontend' \
        | grep -v -e 'ZMQ endpoint to P' -e '^ *(default: None)$'
}

# The scheduler's options need torch imported (seconds): the help text is kept until the code
# changes, and written in the background at each start, so that --help answers at once.
help_cache="$(dirname "$SLUICE_PY")/../.sluice-help"
help_stale() {
    [ ! -s "$help_cache" ] || [ -n "$(find frontend scheduler worker scripts/serve.sh -newer "$help_cache" \
        \( -name '*.py' -o -name serve.sh \) -print -quit)" ]
}
write_help() { print_help > "$help_cache.$$" && mv "$help_cache.$$" "$help_cache"; }
for arg in "$@"; do
    if [ "$arg" = "--help" ] || [ "$arg" = "-h" ]; then
        if help_stale; then write_help; fi
        cat "$help_cache"
        exit 0
    fi
done
if help_stale; then (write_help >/dev/null 2>&1 &); fi
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
